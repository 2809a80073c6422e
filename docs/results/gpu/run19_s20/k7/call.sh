#!/usr/bin/env bash
# s20 call k7: main at aec4a9b (the session's last kernel change, be41c18): the CUDA engine,
# cache and eval tests on the shipped model.
root=$(pwd)
o=$OUT
w=/tmp/k7
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-k7/gpu.txz" -C $w
export LD_LIBRARY_PATH=$w/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
export VQ_SOURCE_DIR=$root VQ_MODEL_DIR=$root/models/vq-mini-llama
mkdir -p $w/res
exec > >(tee -a "$w/res/run.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
cd $w
for t in test_cuda_engine test_cuda_caches test_cuda_eval; do
  SECONDS=0; timeout 240 ./$t >res/$t.txt 2>&1
  echo "== $t rc=$? ${SECONDS}s"; grep -E "^\[  (PASSED|FAILED) |tests ran" res/$t.txt | head -5
done
tar czf $o/k7.tgz res
