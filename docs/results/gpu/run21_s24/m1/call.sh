#!/usr/bin/env bash
# s24 call m1 (issue 16): the CUDA SKVQ flush with the value rows' clip floor (clip_alphas' list,
# five alphas per pass) and the error-feedback key rounding of skvq_query_moments_file (a warp
# per key row, fp64). (1) correctness: the device caches against the CPU caches (new tests
# QueryMomentsMatchCpu, ValueClipFloorMatchesCpu and every old one), the op harness (the flush
# against the CPU path byte for byte, now with clip floors and feedback factors), the SKVQ and
# engine tests. (2) the session-23 2.5-bit cache end to end on the GPU (eval kld and passkey
# --device cuda, the CPU commands of docs/RESULTS.md "Where the 2-bit passkey loss lives").
root=$(pwd)
o=$OUT
w=/tmp/m1
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-m1/gpu.txz" -C $w
export LD_LIBRARY_PATH=$w/lib:$root/carry-m1/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
export VQ_SOURCE_DIR=$root VQ_MODEL_DIR=$root/models/vq-mini-llama
mkdir -p $o/res
exec > >(tee -a "$o/res/run.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
for t in test_cuda_caches test_backend_ops_cuda test_cuda_skvq test_cuda_engine; do
  SECONDS=0
  timeout 200 $w/$t >$o/res/$t.txt 2>&1
  echo "$t rc=$? ${SECONDS}s"
  grep -E "^\[(  FAILED|  PASSED)|worst|cases" $o/res/$t.txt | head -12
done
cd $root
cp carry-m1/qm.bin /tmp/qm.bin
B=skvq:bits_key=2:bits_value=2:key_axis=channel:rotation=hadamard:meta=fp8_e4m3:key_rows=64:n_sink=0:query_moments_file=/tmp/qm.bin
R=$B:rotate_values=true:value_clip_floor=0.5
P=:protect=0.01:protect_values=false:protect_scoring=external
SECONDS=0
timeout 150 $w/veloxquant eval kld --device cuda --docs 8 --json --quiet --methods "$R,$R$P" >$o/res/kld_gpu.json 2>$o/res/kld_gpu.err
echo "kld rc=$? ${SECONDS}s"; tail -3 $o/res/kld_gpu.err
SECONDS=0
timeout 300 $w/veloxquant eval passkey --device cuda --prompts 216 --mode both --json --quiet --methods "full,$R$P" >$o/res/pk_gpu.json 2>$o/res/pk_gpu.err
echo "passkey rc=$? ${SECONDS}s"; tail -3 $o/res/pk_gpu.err
python3 - "$o/res" <<'PY'
import json, sys
d = sys.argv[1]
for f in ("kld_gpu.json", "pk_gpu.json"):
    try:
        print(f, json.dumps(json.load(open(f"{d}/{f}")))[:1500])
    except Exception as e:
        print(f, "unreadable:", e)
PY
