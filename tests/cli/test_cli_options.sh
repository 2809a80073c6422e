#!/usr/bin/env bash
# CLI-only behaviour of the veloxquant tool (registered as the ctest `cli_options`): bad option
# values are refused with exit status 2 and a message naming the option and the allowed range
# (no crash, no hang, no saturation); a directory as --prompt-file, a prompt past the model's
# max_position_embeddings and an over-large --prefill-step are handled; the generate summary
# reports peak memory with its parts. Usage: test_cli_options.sh path/to/veloxquant SOURCE_DIR
# (the repository root: the shipped model models/vq-mini-llama). Also --device (cuda refused
# without a device), --prompts-file (JSONL / JSON array, errors naming the line) and bench.
set -u
VQ="$1"
SRC="$2"
MODEL="$SRC/models/vq-mini-llama"
fails=0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# expect STATUS NEEDLE -- ARGS...: runs veloxquant ARGS (60 s at most), checks the exit status and
# that stderr+stdout contain NEEDLE.
expect() {
  local want="$1" needle="$2"
  shift 3
  local out rc
  out=$(timeout 60 "$VQ" "$@" 2>&1)
  rc=$?
  local cmd="veloxquant $*"
  cmd="${cmd:0:120}"
  if [[ $rc -ne $want ]] || [[ "$out" != *"$needle"* ]]; then
    echo "FAIL: $cmd -> exit $rc (want $want), output:"
    echo "$out" | tail -5 | cut -c1-400
    echo "  (expected to contain: $needle)"
    fails=$((fails + 1))
  else
    echo "ok: $cmd"
  fi
}

# Thread counts bounded by the machine; negative refused.
expect 2 "--threads: expected an integer in [0, " -- generate --prompt-ids 1,2 --threads 100000
expect 2 "--threads: expected an integer in [0, " -- generate --prompt-ids 1,2 --threads -1
# Integer options: out of range or not an integer is refused, not saturated.
expect 2 "--max-tokens: expected an integer in [0, 2147483647] but got '99999999999999999999'" \
  -- generate --prompt-ids 1,2 --max-tokens 99999999999999999999
expect 2 "--max-tokens: expected an integer in [0, 2147483647] but got '-3'" \
  -- generate --prompt-ids 1,2 --max-tokens -3
expect 2 "--top-k: expected an integer" -- generate --prompt-ids 1,2 --top-k 1e3
expect 2 "--seed: expected an integer in [0, 18446744073709551615] but got '-1'" \
  -- generate --prompt-ids 1,2 --seed -1
expect 2 "--prefill-step: expected an integer in [1, 2147483647] but got '9223372036854775807'" \
  -- generate --prompt-ids 1,2 --prefill-step 9223372036854775807
expect 2 "--prefill-step: expected an integer in [1, 2147483647] but got '0'" \
  -- generate --prompt-ids 1,2 --prefill-step 0
expect 2 "[eval] --docs: expected an integer in [0, 2147483647] but got '99999999999999999999'" \
  -- eval ppl --methods full --docs 99999999999999999999
expect 2 "[eval] --prefill: expected an integer" -- eval kld --methods full -P 12abc
expect 2 "[eval] --lengths: expected an integer in [1, 2147483647] but got '-512'" \
  -- eval passkey --methods full --lengths 256,-512
expect 2 "[calibrate] --max-tokens: expected an integer in [1, 1048576] but got '99999999999999999999'" \
  -- calibrate --text-file x --max-tokens 99999999999999999999
expect 2 "[demo] --heads: expected an integer in [1, 64] but got '4294967297'" \
  -- demo --heads 4294967297
# A directory as the prompt file; an empty prompt file.
expect 2 "--prompt-file: expected a readable file but '$tmp' is a directory" \
  -- generate --prompt-file "$tmp" --max-tokens 1
: > "$tmp/empty.txt"
expect 2 "--prompt-file: expected a prompt but '$tmp/empty.txt' is empty" \
  -- generate --prompt-file "$tmp/empty.txt" --max-tokens 1
expect 2 "[calibrate] --text-file: expected a readable file but '$tmp' is a directory" \
  -- calibrate --text-file "$tmp"
# Positions bounded by the model: the shipped weights under a config.json whose
# max_position_embeddings is 16.
mkdir -p "$tmp/model16"
for f in "$MODEL"/*; do ln -s "$f" "$tmp/model16/"; done
rm "$tmp/model16/config.json"
sed 's/"max_position_embeddings": *[0-9]*/"max_position_embeddings": 16/' "$MODEL/config.json" \
  > "$tmp/model16/config.json"
expect 2 "expected the prompt to fit the model's max_position_embeddings 16" \
  -- generate --model "$tmp/model16" --prompt-ids "$(seq -s, 3 19)" --max-tokens 1
expect 0 "4 generated (stop: max_position)" \
  -- generate --model "$tmp/model16" --prompt-ids "$(seq -s, 3 14)" --max-tokens 100 \
  --ignore-eos --prefill-step 2147483647
expect 0 "generation stopped at the model's max_position_embeddings (16 positions" \
  -- generate --model "$tmp/model16" --prompt-ids "$(seq -s, 3 14)" --max-tokens 100 --ignore-eos
# The summary's memory parts.
expect 0 "MiB = weights " -- generate --model "$MODEL" --prompt-ids 5,6,7 --max-tokens 2 --threads 1
expect 0 "activations " -- generate --model "$MODEL" --prompt-ids 5,6,7 --max-tokens 2
expect 0 '"activation_bytes"' -- generate --model "$MODEL" --prompt-ids 5,6,7 --max-tokens 2 --json

# Devices: cuda without a CUDA build (or device) is refused with exit 2, generate, bench and eval.
if ! command -v nvidia-smi > /dev/null 2>&1; then  # no device here (and maybe no CUDA build)
  expect 2 "[generate] --device cuda: expected a" -- generate --prompt-ids 1,2 --device cuda
  expect 2 "[bench] --device cuda: expected a" -- bench --methods full --device cuda
  expect 2 "[eval] --device cuda: expected a" -- eval ppl --methods full --device cuda
  expect 2 "[eval] --device cuda: expected a" -- eval passkey --methods full --device cuda
  expect 2 "[eval attn-error] --device cuda: expected a" \
    -- eval attn-error --methods full --device cuda
fi
expect 2 "[engine] device: expected cpu or cuda but got 'gpu'" \
  -- eval ppl --methods full --device gpu
expect 2 "[engine] device: expected cpu or cuda but got 'gpu'" \
  -- generate --prompt-ids 1,2 --device gpu
# Many prompts: JSONL and a JSON array, per-prompt max_tokens, errors naming the line.
printf '{"prompt_ids": [5, 6, 7], "max_tokens": 2}\n\n{"prompt_ids": [8, 9]}\n' > "$tmp/p.jsonl"
expect 0 "--- prompt 1 (2 tokens, 3 generated" \
  -- generate --model "$MODEL" --prompts-file "$tmp/p.jsonl" --max-tokens 3 --ignore-eos
expect 0 '"max_live": 1' \
  -- generate --model "$MODEL" --prompts-file "$tmp/p.jsonl" --max-batch 1 --max-tokens 3 --json
printf '[{"prompt_ids": [5, 6]}, {"prompt_ids": [7], "max_tokens": 1}]' > "$tmp/p.json"
expect 0 "--- prompt 1 (1 tokens, 1 generated" \
  -- generate --model "$MODEL" --prompts-file "$tmp/p.json" --max-tokens 2 --ignore-eos
printf '{"prompt_ids": [5]}\n{"prompt": 3}\n' > "$tmp/bad.jsonl"
expect 2 "[generate] --prompts-file: line 2: \"prompt\": expected a string" \
  -- generate --model "$MODEL" --prompts-file "$tmp/bad.jsonl"
printf '{"prompt_ids": [5], "max_token": 3}\n' > "$tmp/bad2.jsonl"
expect 2 "expected the keys prompt, prompt_ids, max_tokens but got \"max_token\"" \
  -- generate --model "$MODEL" --prompts-file "$tmp/bad2.jsonl"
expect 2 "expected exactly one of --prompt, --prompt-file, --prompt-ids, --prompts-file but got 2" \
  -- generate --model "$MODEL" --prompts-file "$tmp/p.jsonl" --prompt-ids 1
# bench: the planner alone, and a small run.
expect 0 "| full | 8 |" -- bench --model "$MODEL" --methods full,skvq --context 64 --plan-only
expect 0 '"decode_bound_tokens_per_s"' \
  -- bench --model "$MODEL" --methods skvq --batch 2 --context 40 --gen 3 --json
expect 0 '"warm_up": false' \
  -- bench --model "$MODEL" --methods full --batch 2 --context 40 --gen 3 --json --no-warm-up
expect 2 "[memory_plan] expected a context within the model's max_position_embeddings" \
  -- bench --model "$MODEL" --methods full --context 100000 --plan-only

# --tensor-parallel: N must divide the KV heads (2); the CPU runs simulated ranks with the same
# greedy tokens as one device; eval runs N ranks too (attn-error 1 only); cuda checks the visible
# devices.
expect 2 "--tensor-parallel: expected an integer in [1, 4096] but got '0'" \
  -- generate --prompt-ids 1,2 --tensor-parallel 0
expect 2 "[generate] [tensor_parallel] expected N to divide the model's 2 KV heads (6 query heads), N in {1, 2}, but got N = 3" \
  -- generate --model "$MODEL" --prompt-ids 1,2 --tensor-parallel 3
expect 2 "[bench] [tensor_parallel] expected N to divide" \
  -- bench --model "$MODEL" --methods full --context 40 --tensor-parallel 4
expect 2 "[eval] [tensor_parallel] expected N to divide the model's 2 KV heads" \
  -- eval ppl --model "$MODEL" --methods full --tensor-parallel 3
expect 2 "[eval] --tp-simulate: expected --device cuda" \
  -- eval kld --model "$MODEL" --methods full --tensor-parallel 2 --tp-simulate
expect 2 "[eval attn-error] --tensor-parallel: expected 1 (without --tp-simulate) but got 2" \
  -- eval attn-error --model "$MODEL" --methods full --tensor-parallel 2
expect 2 "[eval] tensor_parallel 2: expected a method without scoring=external" \
  -- eval ppl --model "$MODEL" --methods snapkv:budget=8:scoring=external:evict_at=prompt_end --tensor-parallel 2 \
  --data "$SRC/data/eval/heldout_ids.u16" -P 16 -T 2 --docs 1 --quiet
expect 0 "vq-mini-llama (tensor-parallel 2)" \
  -- eval kld --model "$MODEL" --methods full,snapkv:budget=8 --tensor-parallel 2 \
  --data "$SRC/data/eval/heldout_ids.u16" -P 16 -T 2 --docs 1 --quiet
expect 2 "[generate] --tp-simulate: expected --device cuda" \
  -- generate --model "$MODEL" --prompt-ids 1,2 --tensor-parallel 2 --tp-simulate
printf '{"prompt_ids": [%s]}\n{"prompt_ids": [%s]}\n' "$(seq -s, 10 45)" "$(seq -s, 50 70)" \
  > "$tmp/tp.jsonl"
tp_tokens() {  # every prompt's generated ids (the snapkv budget evicts within the prompts)
  timeout 60 "$VQ" generate --model "$MODEL" --prompts-file "$tmp/tp.jsonl" --max-tokens 6 \
    --ignore-eos --json --cache snapkv:budget=12:obs_window=4:n_sink=2 "$@" 2>&1 |
    tr -d ' \n' | grep -o '"tokens":\[[^]]*\]'
}
tp1=$(tp_tokens --tensor-parallel 1)
tp2=$(tp_tokens --tensor-parallel 2)
if [[ -z "$tp1" || "$tp1" != "$tp2" ]]; then
  echo "FAIL: generate --tensor-parallel 2 tokens differ from 1: '$tp1' vs '$tp2'"
  fails=$((fails + 1))
else
  echo "ok: generate --tensor-parallel 2 gives --tensor-parallel 1's greedy tokens"
fi
expect 0 '"decode_bound_tokens_per_s"' \
  -- bench --model "$MODEL" --methods skvq --batch 2 --context 40 --gen 3 --json --tensor-parallel 2
if command -v nvidia-smi > /dev/null 2>&1 && [[ $(nvidia-smi -L 2> /dev/null | wc -l) -eq 1 ]]; then
  expect 2 "--tensor-parallel 2: expected at most 1 (the CUDA devices visible) but got 2" \
    -- generate --model "$MODEL" --prompt-ids 1,2 --device cuda --tensor-parallel 2
fi

# calibrate --query-moments writes the moment file (and no permutation file without --out);
# generate reads it through the cache option.
printf 'The quick brown fox jumps over the lazy dog. %.0s' $(seq 1 20) > "$tmp/calib.txt"
expect 0 "query moments of 6 layers, 2 KV heads, head_dim 64" \
  -- calibrate --model "$MODEL" --text-file "$tmp/calib.txt" --query-moments "$tmp/qm.bin"
expect 0 "peak RSS" -- generate --model "$MODEL" --prompt-ids "$(seq -s, 10 200)" --max-tokens 2 \
  --cache "skvq:key_axis=channel:key_rows=32:query_moments_file=$tmp/qm.bin"
expect 2 "skvq_query_moments_file: expected '' with skvq_key_axis=token" \
  -- generate --model "$MODEL" --prompt-ids 1,2 --cache "skvq:query_moments_file=$tmp/qm.bin"

if [[ $fails -ne 0 ]]; then
  echo "$fails case(s) failed"
  exit 1
fi
echo "all cases passed"
