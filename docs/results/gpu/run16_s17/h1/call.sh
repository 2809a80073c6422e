#!/usr/bin/env bash
# s17 call h1 (issues 14, 13): query-head groups past 8 or not a power of two as kv_rep blocks per
# KV head (DecodePlan::kv_rep; the engine no longer gathers / scatters sub-groups). The decode
# tests, the op harness's decode and prefill cases (GQA 3, 6, 12, 16, 32 decode now runs on the
# device), the engine test (the shipped model's group of 3 now takes kv_rep 3), memcheck of the
# decode harness's small table; the decode benchmark at H_q 32 and at H_q 128 (GQA 16) beside
# SDPA; ncu of K2V2 g32 at 8 x 32K (stall reasons, per-instruction SASS counters) for the next
# kernel step. Everything in run.txt; ncu's SASS page as sass_k2v2.csv.
here=$(cd "$(dirname "$0")" && pwd)
root=$(pwd)
o=$OUT
export PATH=$PATH:/usr/local/cuda/bin
w=/tmp/h1
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-h1/h1.txz" -C $w
export LD_LIBRARY_PATH=$w/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
export VQ_SOURCE_DIR=$root VQ_MODEL_DIR=$root/models/vq-mini-llama
cd $w
exec > >(tee -a "$o/run.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
t() {  # label, limit, command...
  local label=$1 limit=$2; shift 2
  SECONDS=0; timeout "$limit" "$@" >$w/log_$label.txt 2>&1; local rc=$?
  echo "== $label rc=$rc ${SECONDS}s"
  grep -E "^\[(  FAILED|  PASSED)|worst|FAILED TEST|tests ran|rep=(3|6|12|16|32)" $w/log_$label.txt | head -24
  [ $rc -eq 0 ] || grep -B3 -A25 "Failure\|rror" $w/log_$label.txt | head -80
}
t decode 120 ./test_cuda_decode
t decode_batch 120 ./test_cuda_decode_batch
t harness_decode 200 ./test_backend_ops_cuda --gtest_filter='BackendOpsCuda.DecodeAttention'
t harness_prefill 200 ./test_backend_ops_cuda --gtest_filter='BackendOpsCuda.PrefillAttention'
grep -E "decode_attention|prefill_attention" $w/log_harness_decode.txt $w/log_harness_prefill.txt | grep -E "cases" | head
t caches 200 ./test_cuda_caches
t engine 300 ./test_cuda_engine
export VQ_HARNESS=small
SECONDS=0
timeout 150 compute-sanitizer --tool memcheck --error-exitcode 86 --print-limit 20 ./test_backend_ops_cuda \
  --gtest_filter=BackendOpsCuda.DecodeAttention >$w/san.txt 2>&1
echo "== memcheck rc=$? ${SECONDS}s $(grep -E 'ERROR SUMMARY' $w/san.txt | tail -1)"
unset VQ_HARNESS
for hq in 32 128; do
  SECONDS=0; timeout 150 ./cuda_decode_attention --repeats 20 --no-maintenance --hq $hq \
    --csv $o/bench_hq$hq.csv >$w/decode_hq$hq.txt 2>&1
  echo "== bench hq $hq rc=$? ${SECONDS}s"
  SECONDS=0
  (cd $root && PYTHONUNBUFFERED=1 timeout 150 python3 tools/bench_sdpa.py $o/bench_hq$hq.csv --repeats 20 \
    --skip-prefill --hq $hq >$w/sdpa_hq$hq.txt 2>&1)
  echo "== sdpa hq $hq rc=$? ${SECONDS}s"
  sed -n '/^| batch/,$p' $w/sdpa_hq$hq.txt | head -60
done
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
SECONDS=0
timeout 120 "$ncu" --clock-control none -k regex:decode_mma_kernel -c 1 \
  --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \
  --section InstructionStats --section SourceCounters -o $w/k2v2 \
  ./cuda_decode_attention --only "skvq K2V2 g32" --batch 8 --context 32768 --repeats 3 \
  --no-maintenance >$w/ncu_run.txt 2>&1
echo "== ncu rc=$? ${SECONDS}s"
"$ncu" -i $w/k2v2.ncu-rep --page details > $w/ncu_details.txt 2>&1
grep -E "Duration|Registers Per|Issue Slots Busy|Eligible Warps|Executed Instructions  |Achieved Occ|Theoretical Occ|Warp Cycles Per|Stall|stall" $w/ncu_details.txt | head -40
"$ncu" -i $w/k2v2.ncu-rep --page raw --csv 2>/dev/null | python3 -c "
import csv,sys
rows=list(csv.reader(sys.stdin))
if len(rows)>=3:
  h,u,v=rows[0],rows[1],rows[2]
  st=[(float(v[i].replace(',','') or 0),h[i]) for i in range(len(h)) if 'pcsamp_warps_issue_stalled' in h[i] and not h[i].endswith('not_issued')]
  tot=sum(x for x,_ in st) or 1
  for x,n in sorted(st,reverse=True)[:14]: print('  %-70s %6.1f%%'%(n,100*x/tot))
" 2>&1 | head -16
"$ncu" -i $w/k2v2.ncu-rep --page source --csv --print-source sass > $o/sass_k2v2.csv 2>$w/sass_err.txt
echo "== sass page rc=$? $(wc -l < $o/sass_k2v2.csv) lines; $(head -c 300 $w/sass_err.txt)"
cp $w/ncu_details.txt $o/ 2>/dev/null
