#!/usr/bin/env bash
# s15 call f1 (issue 14): packed key codes read in place as fp16 subnormals (one lop3 per code
# pair instead of lop3 + fp16 subtract; the 2^-24 folded into sigma's inverse) -- "kern"; the same
# with a 5-block register cap for the 2-bit packed instances -- "mb5"; main's kernels -- "main".
# The new kernels' decode test, the op harness's decode cases and memcheck over its small table;
# then the decode benchmark main / kern / mb5 interleaved (batch 8 twice, batch 1 once), SDPA on
# kern's full table, and ncu (instruction counts, occupancy) of K2V2 g32 and K4V4 g32 at 8 x 32K.
here=$(cd "$(dirname "$0")" && pwd)
root=$(pwd)
o=$OUT
export PATH=$PATH:/usr/local/cuda/bin
w=/tmp/f1
rm -rf $w && mkdir -p $w
tar xJf "$here/f1.txz" -C $w
export LD_LIBRARY_PATH=$w/kern/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
export VQ_SOURCE_DIR=$root VQ_MODEL_DIR=$root/models/vq-mini-llama
cd $w/kern
exec > >(tee -a "$o/run.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
t() {  # label, limit, command...
  local label=$1 limit=$2; shift 2
  SECONDS=0; timeout "$limit" "$@" >$w/log_$label.txt 2>&1; local rc=$?
  echo "== $label rc=$rc ${SECONDS}s"
  grep -E "^\[(  FAILED|  PASSED)|worst|FAILED TEST" $w/log_$label.txt | head -12
  [ $rc -eq 0 ] || grep -B3 -A15 "Failure" $w/log_$label.txt | head -80 > $o/fail_$label.txt
}
t decode 90 ./test_cuda_decode
t harness 150 ./test_backend_ops_cuda --gtest_filter='BackendOpsCuda.DecodeAttention*'
export VQ_HARNESS=small
SECONDS=0
timeout 120 compute-sanitizer --tool memcheck --error-exitcode 86 --print-limit 20 ./test_backend_ops_cuda \
  --gtest_filter=BackendOpsCuda.DecodeAttention >$w/san.txt 2>&1
echo "== memcheck rc=$? ${SECONDS}s $(grep -E 'ERROR SUMMARY' $w/san.txt | tail -1)"
unset VQ_HARNESS
sel='^\| (1|8) \| .*(K4V4 g32 \||K2V2 g32 \||K2V2 g128 \||fp16 full|snapkv\+skvq)'
for r in 1 2; do for v in main kern mb5; do
  SECONDS=0; timeout 80 $w/$v/cuda_decode_attention --repeats 20 --no-maintenance --batch 8 \
    --csv $w/b8_${v}_$r.csv >$o/b8_${v}_$r.txt 2>&1
  echo "== bench batch 8 $v round $r rc=$? ${SECONDS}s"; grep -E "$sel" $o/b8_${v}_$r.txt
done; done
for v in main kern mb5; do
  SECONDS=0; timeout 60 $w/$v/cuda_decode_attention --repeats 20 --no-maintenance --batch 1 \
    --context 4096 --csv $w/b1_$v.csv >$o/b1_$v.txt 2>&1
  echo "== bench 1 x 4K $v rc=$? ${SECONDS}s"; grep -E "$sel" $o/b1_$v.txt
done
SECONDS=0; timeout 100 ./cuda_decode_attention --repeats 20 --no-maintenance --csv $o/bench_kern.csv >$o/decode_kern.txt 2>&1
echo "== bench kern full rc=$? ${SECONDS}s"
SECONDS=0
PYTHONUNBUFFERED=1 timeout 70 python3 $root/tools/bench_sdpa.py $o/bench_kern.csv --repeats 20 --skip-prefill >$o/sdpa.txt 2>&1
echo "== sdpa rc=$? ${SECONDS}s"
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for vm in "main:skvq K2V2 g32" "kern:skvq K2V2 g32" "mb5:skvq K2V2 g32" "kern:skvq K4V4 g32"; do
  v=${vm%%:*} m=${vm#*:}
  n=$(echo "$m" | tr -dc 'A-Za-z0-9')
  SECONDS=0
  timeout 60 "$ncu" --clock-control none -k regex:decode_mma_kernel -c 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
    --section InstructionStats $w/$v/cuda_decode_attention --only "$m" --batch 8 --context 32768 \
    --repeats 3 --no-maintenance >$w/ncu_${v}_$n.txt 2>&1
  echo "== ncu $v $m rc=$? ${SECONDS}s"
  grep -E "Duration|DRAM Throughput|Registers Per|Issue Slots Busy|Eligible Warps|Executed Instructions  |Block Limit Reg|Block Limit Sh|Achieved Occ|Theoretical Occ" $w/ncu_${v}_$n.txt | head -12
done
