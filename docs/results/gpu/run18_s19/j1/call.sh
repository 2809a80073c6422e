#!/usr/bin/env bash
# s19 call j1 (issue 14): the L2 flush of the decode benchmarks. Until now every repeat was timed
# after a 256 MiB memset, which leaves L2 full of dirty lines that the timed kernel writes back as
# it reads; a decode step's attention follows projections that read weights (clean lines). Ours,
# SDPA bf16 and FlashInfer 0.6.18 at H_q 32 and 128, each with --flush read and --flush write in
# the same call (ours twice per mode, interleaved), main at 9bcd726 + the flush option.
root=$(pwd)
o=$OUT
export PATH=$PATH:/usr/local/cuda/bin
w=/tmp/j1
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-j1/gpu.txz" -C $w
export LD_LIBRARY_PATH=$w/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
cd $w
exec > >(tee -a "$o/run.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
rm -rf /tmp/vq-site && mkdir -p /tmp/vq-site && tar xJf "$root/carry-j1/site.txz" -C /tmp/vq-site
for hq in 32 128; do
  for rep in 1 2; do
    for fl in read write; do
      SECONDS=0; timeout 150 ./cuda_decode_attention --repeats 20 --no-maintenance --hq $hq \
        --flush $fl --csv $o/bench_hq${hq}_${fl}_$rep.csv >$o/decode_hq${hq}_${fl}_$rep.txt 2>&1
      echo "== bench hq $hq $fl $rep rc=$? ${SECONDS}s"
    done
  done
  for fl in read write; do
    SECONDS=0
    (cd $root && PYTHONUNBUFFERED=1 timeout 150 python3 tools/bench_sdpa.py $o/bench_hq${hq}_${fl}_1.csv \
      --repeats 20 --skip-prefill --hq $hq --flush $fl >$o/sdpa_hq${hq}_$fl.txt 2>&1)
    echo "== sdpa hq $hq $fl rc=$? ${SECONDS}s"
    SECONDS=0
    (cd $root && PYTHONPATH=/tmp/vq-site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 \
      FLASHINFER_WORKSPACE_BASE=/tmp/vq-fi FLASHINFER_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 \
      timeout 300 python3 tools/bench_flashinfer.py $o/bench_hq${hq}_${fl}_1.csv --repeats 20 --hq $hq \
      --flush $fl >$o/flashinfer_hq${hq}_$fl.txt 2>&1)
    echo "== flashinfer hq $hq $fl rc=$? ${SECONDS}s"
    grep -E "^\| (1|8) \| (4096|32768|131072) \| (FlashInfer bf16 tc|FlashInfer fp8 e4m3 tc|fp16 full|skvq K2V2 g32|skvq K4V4 g32) " \
      $o/flashinfer_hq${hq}_$fl.txt | head -40
  done
done
