#!/usr/bin/env bash
# s16 call g4 (issues 14, 13): the warp-specialised wgmma prefill kernel (a producer warpgroup
# stages key and value planes by cp.async behind mbarriers, 2 consumer warpgroups pipeline
# S(j+1) and P(j) V(j) with no block barrier; setmaxnreg 56 / 224): the op harness's prefill
# cases and the prefill test, the prefill benchmark wgmma / mma.sync (VQ_PREFILL_MMA_SYNC=1)
# beside SDPA, ncu at 32K, and the engine's 1 x 32K prefill (random Llama-3-8B shapes) wgmma /
# mma.sync beside transformers'. Everything in run.txt.
here=$(cd "$(dirname "$0")" && pwd)
root=$(pwd)
o=$OUT
export PATH=$PATH:/usr/local/cuda/bin
w=/tmp/g4
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-g4/g4.txz" -C $w
export LD_LIBRARY_PATH=$w/wg/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
export VQ_SOURCE_DIR=$root VQ_MODEL_DIR=$root/models/vq-mini-llama
cd $w/wg
exec > >(tee -a "$o/run.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
t() {
  local label=$1 limit=$2; shift 2
  SECONDS=0; timeout "$limit" "$@" >$w/log_$label.txt 2>&1; local rc=$?
  echo "== $label rc=$rc ${SECONDS}s"
  grep -E "^\[(  FAILED|  PASSED)|worst|FAILED TEST|tests ran" $w/log_$label.txt | head -12
  [ $rc -eq 0 ] || grep -B3 -A25 "Failure\|rror" $w/log_$label.txt | head -80
}
t harness 150 ./test_backend_ops_cuda --gtest_filter='BackendOpsCuda.PrefillAttention'
t prefill 150 ./test_cuda_prefill
for r in 1 2; do
  for v in wg mma; do
    SECONDS=0
    case $v in
      wg) timeout 60 ./cuda_prefill_attention --repeats 5 --skip-snapkv >$w/b_$v.txt 2>&1 ;;
      mma) VQ_PREFILL_MMA_SYNC=1 timeout 60 ./cuda_prefill_attention --repeats 5 --skip-snapkv >$w/b_$v.txt 2>&1 ;;
    esac
    echo "== bench $v round $r rc=$? ${SECONDS}s"; grep -E "^\| (4096|32768)|sanity" $w/b_$v.txt
  done
done
SECONDS=0; PYTHONUNBUFFERED=1 timeout 100 python3 $root/bench/cuda_prefill_sdpa.py --repeats 5 2>&1 | tail -8
echo "== sdpa ${SECONDS}s"
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
SECONDS=0
timeout 90 "$ncu" --clock-control none -k regex:prefill_wg -s 3 -c 1 --section SpeedOfLight \
  --section Occupancy --section SchedulerStats --section WarpStateStats --section InstructionStats \
  ./cuda_prefill_attention --repeats 1 --skip-snapkv --skip-bf16 --context 32768 >$w/ncu.txt 2>&1
echo "== ncu rc=$? ${SECONDS}s"
grep -E "Duration|Registers Per|Issue Slots Busy|Eligible Warps|Executed Ipc|Compute \(SM\) Throughput|Memory Throughput|Achieved Occ|Theoretical Occ|Stall|Pipe|Tensor" $w/ncu.txt | head -30
M8=/tmp/llama8b
SECONDS=0; timeout 80 python3 "$root/tools/make_llama_shapes.py" "$M8" --preset 8b | tail -1; echo "== shapes ${SECONDS}s"
for v in wg mma wg; do
  SECONDS=0
  if [ $v = mma ]; then export VQ_PREFILL_MMA_SYNC=1; else unset VQ_PREFILL_MMA_SYNC; fi
  timeout 80 ./veloxquant bench --device cuda --model "$M8" --no-check-weights --json \
    --methods full,skvq:bits_key=2:bits_value=2 --batch 1 --context 32768 --gen 4 --prefill-step 8192 \
    >$w/e_$v.json 2>$w/e_$v.err
  echo "== engine 1x32K $v rc=$? ${SECONDS}s"
  python3 -c "
import json,sys
j=json.load(open('$w/e_$v.json'))
for m in j['methods']:
  r=m.get('run',{}); print('  %-40s prefill %8.0f tok/s decode %7.1f tok/s peak %.1f GiB'%(m['method'],r.get('prefill_tokens_per_s',0),r.get('decode_tokens_per_s',0),r.get('peak_device_bytes',0)/2**30))
" || tail -5 $w/e_$v.err
done
unset VQ_PREFILL_MMA_SYNC
cd "$root"
SECONDS=0; timeout 60 python3 tools/bench_transformers.py "$M8" --batch 1 --context 32768 --gen 4 --repeats 1 --out $w/tf.json >/dev/null 2>&1
echo "== transformers 1x32k rc=$? ${SECONDS}s"
python3 -c "
import json; j=json.load(open('$w/tf.json')); print({k:v for k,v in j.items() if 'prefill' in k or 'decode' in k})" 2>&1 | head -5
