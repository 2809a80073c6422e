#!/usr/bin/env bash
# s30 call p3 (issue 16): the CUDA cache tests after bc1557e (skvq_layer_bits_value: the device
# cache of each layer against the CPU's, PerLayerValueBitsMatchCpu) and the engine's GPU test.
# Carry: gpu-bundle/ = scripts/gpu_engine_bundle.sh at bc1557e with VQ_BUNDLE_TESTS="test_cuda_engine
# test_cuda_eval test_cuda_caches" (portable host code, sm_90a).
root=$(pwd)
o=$OUT
w=/tmp/p3
rm -rf $w && mkdir -p $w && tar xJf "$root/gpu-bundle/gpu.txz" -C $w
export LD_LIBRARY_PATH=$w/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
export VQ_SOURCE_DIR=$root VQ_MODEL_DIR=$root/models/vq-mini-llama
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $o/rc.txt
SECONDS=0
timeout 200 $w/test_cuda_caches >$o/test_cuda_caches.txt 2>&1
echo "test_cuda_caches rc=$? ${SECONDS}s" | tee -a $o/rc.txt
grep -E "^\[(  FAILED|  PASSED)|PerLayer" $o/test_cuda_caches.txt | head -20
SECONDS=0
timeout 150 $w/test_cuda_engine >$o/test_cuda_engine.txt 2>&1
echo "test_cuda_engine rc=$? ${SECONDS}s" | tee -a $o/rc.txt
grep -E "^\[(  FAILED|  PASSED)" $o/test_cuda_engine.txt
