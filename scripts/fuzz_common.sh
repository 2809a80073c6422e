# Shared by scripts/fuzz_smoke.sh and scripts/fuzz.sh (sourced, with $dir set): builds the
# libFuzzer targets (tools/fuzz/fuzz_*.cpp, clang + ASan/UBSan, state checksums skipped) into
# $dir, sets targets=(...), and fills $dir/corpus/<target>/ with the seeds: the committed ones
# (tools/fuzz/corpus/<target>/) and the few this script writes (safetensors, model configs,
# shipped tokenizers).
if ! command -v clang++ >/dev/null; then
  echo "[fuzz] clang++ not found (apt-get install clang libclang-rt-14-dev)" >&2
  exit 2
fi
# -O1 with line tables (what libFuzzer and the sanitizers need for their reports) builds faster
# than RelWithDebInfo's -O2 -g.
CC=clang CXX=clang++ cmake -S . -B "$dir" -DVQ_FUZZ=ON -DVQ_BUILD_TESTS=OFF -DVQ_BUILD_BENCH=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -gline-tables-only -DNDEBUG" \
  >/dev/null
targets=()
for src in tools/fuzz/fuzz_*.cpp; do targets+=("$(basename "$src" .cpp)"); done
cmake --build "$dir" -j"$(nproc)" --target "${targets[@]}"

# Seed corpora.
corpus="$dir/corpus"
mkdir -p "$corpus"
for t in "${targets[@]}"; do
  mkdir -p "$corpus/$t"
  for d in corpus regressions; do
    if [ -d "tools/fuzz/$d/$t" ]; then cp tools/fuzz/"$d/$t"/* "$corpus/$t/"; fi
  done
done
python3 - "$corpus" <<'PY'
import json, os, struct, sys, glob
root = sys.argv[1]
def put(target, name, data):
    d = os.path.join(root, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())
def st(entries, data, meta=None):
    h = dict(entries)
    if meta: h["__metadata__"] = meta
    text = json.dumps(h).encode()
    text += b" " * ((8 - (8 + len(text)) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + data
put("fuzz_safetensors", "two.st", st({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                      "b": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [8, 16]}},
                                     bytes(range(16)), {"format": "pt"}))
put("fuzz_safetensors", "f16.st", st({"w": {"dtype": "F16", "shape": [3, 1], "data_offsets": [0, 6]}}, b"\x00\x3c" * 3))
put("fuzz_safetensors", "empty.st", st({}, b""))
put("fuzz_safetensors", "scalar.st", st({"s": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}}, b"\x00\x00\x80\x3f"))
base = {"model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 88,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": [1, 2]}
put("fuzz_model_config", "llama.json", json.dumps(base))
l3 = dict(base, head_dim=32, rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
put("fuzz_model_config", "llama3.json", json.dumps(l3))
put("fuzz_model_config", "qwen2.json", json.dumps(dict(base, model_type="qwen2", use_sliding_window=False)))
put("fuzz_model_config", "mistral.json", json.dumps(dict(base, model_type="mistral", sliding_window=4096)))
t5 = dict(base); t5.pop("rope_theta"); t5["rope_parameters"] = {"rope_theta": 5e5, "rope_type": "linear", "factor": 2.0}
put("fuzz_model_config", "t5.json", json.dumps(t5))
for cfg in glob.glob("models/*/config.json"):
    put("fuzz_model_config", "shipped_" + os.path.basename(os.path.dirname(cfg)) + ".json", open(cfg, "rb").read())
for tok in sorted(glob.glob("tests/data/tokenizers/*.json")):
    if os.path.getsize(tok) < 300_000 and not os.path.basename(tok).startswith("goldens"):
        put("fuzz_tokenizer", os.path.basename(tok), open(tok, "rb").read())
PY

