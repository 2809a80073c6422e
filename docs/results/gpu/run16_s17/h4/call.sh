#!/usr/bin/env bash
# s17 call h4 (issue 14): the peers of the decode table in one call, at H_q 32 (GQA 4) and H_q 128
# (GQA 16): our decode benchmark (main with this session's kernels), PyTorch SDPA bf16
# (tools/bench_sdpa.py) and FlashInfer 0.6.18's paged decode, bf16 and fp8 e4m3, CUDA-core and
# tensor-core kernels (tools/bench_flashinfer.py; its JIT kernels built once before timing).
here=$(cd "$(dirname "$0")" && pwd)
root=$(pwd)
o=$OUT
export PATH=$PATH:/usr/local/cuda/bin
w=/tmp/h4
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-h4/h4.txz" -C $w
export LD_LIBRARY_PATH=$w/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
cd $w
exec > >(tee -a "$o/run.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
# the two wheels (flashinfer-python 0.6.18, apache-tvm-ffi 0.1.15.post2 cp312) unzipped on the
# development machine and repacked as one xz tar without CUTLASS's python/examples/test and CCCL's
# python/docs/benchmarks folders (8.7 MB against 21.7: the call carries at most 64 MiB)
rm -rf /tmp/vq-site && mkdir -p /tmp/vq-site && tar xJf "$root/carry-h4/site.txz" -C /tmp/vq-site
echo "== site rc=$? $(ls /tmp/vq-site | tr '\n' ' ')"
for hq in 32 128; do
  SECONDS=0; timeout 150 ./cuda_decode_attention --repeats 20 --no-maintenance --hq $hq \
    --csv $o/bench_hq$hq.csv >$w/decode_hq$hq.txt 2>&1
  echo "== bench hq $hq rc=$? ${SECONDS}s"
  SECONDS=0
  (cd $root && PYTHONUNBUFFERED=1 timeout 150 python3 tools/bench_sdpa.py $o/bench_hq$hq.csv --repeats 20 \
    --skip-prefill --hq $hq >$o/sdpa_hq$hq.txt 2>&1)
  echo "== sdpa hq $hq rc=$? ${SECONDS}s"
  SECONDS=0
  (cd $root && PYTHONPATH=/tmp/vq-site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 \
    FLASHINFER_WORKSPACE_BASE=/tmp/vq-fi FLASHINFER_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 \
    timeout 400 python3 tools/bench_flashinfer.py $o/bench_hq$hq.csv --repeats 20 --hq $hq \
    >$o/flashinfer_hq$hq.txt 2>&1)
  echo "== flashinfer hq $hq rc=$? ${SECONDS}s"
  grep -E "^JIT|not importable|rror" $o/flashinfer_hq$hq.txt | head -5
  grep -E "^\| (1|8) \| (4096|32768|131072) \| (torch SDPA|FlashInfer|fp16 full|skvq K2V2 g32|skvq K4V4 g32) " \
    $o/flashinfer_hq$hq.txt | head -60
  sed -n '/^## Peer targets/,$p' $o/flashinfer_hq$hq.txt | head -20
done
