#!/usr/bin/env bash
# The single device command that trains, evaluates and makes the golden data (H200 machine).
# Inputs: the working tree plus the carried token arrays in .cache/train/ (prepare_data.py).
# Outputs under $OUT (at most 8 files): the bf16 safetensors shards, train.log, golden.log and
# results.tar (model/ config + index + tokenizer, train_log.json, results.json, golden/).
# Usage (device): bash tools/train/run_device.sh [extra train.py args]
#   env TRAIN_SECONDS (default 390): wall-clock training budget in seconds.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
RUN=${RUN:-/tmp/vq_run}
OUT=${OUT:-/tmp/vq_out}
mkdir -p "$RUN" "$OUT"
pack() {
  cp "$RUN"/model/*.safetensors "$OUT"/ 2>/dev/null
  tar -C "$RUN" --exclude='*.safetensors' -cf "$OUT/results.tar" . 2>/dev/null
  ls -la "$OUT"
}
trap pack EXIT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
python3 -c 'import torch, transformers, tokenizers; print(torch.__version__, transformers.__version__, tokenizers.__version__)'
python3 tools/train/train.py --data .cache/train --out "$RUN" \
  --train-seconds "${TRAIN_SECONDS:-390}" "$@" 2>&1 | tee "$OUT/train.log"
python3 tools/train/make_golden.py --model "$RUN/model" --out "$RUN/golden" \
  --device "$(python3 -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")')" \
  2>&1 | grep -v '^Loading weights' | tee "$OUT/golden.log"
