#!/usr/bin/env bash
# Quiet-machine CPU measurements for issue 19 on a bigger host (the GPU host's CPU), from the
# bundle of tools/llama_cpp/host_bundle.sh: portable binaries (-march=x86-64-v4; the packed decode
# kernels still chosen at run time) of bench_e2e and bench_decode_attention, a static
# llama-bench (AVX-512 build, no -march=native) and the shipped model in GGUF. Run from the
# checkout's root (bench_e2e reads models/vq-mini-llama):
#   bash DIR/host_run.sh DIR OUT [SECONDS (290)]
# Steps in order of value, each with its own limit and all within SECONDS; every table goes to
# OUT/*.txt as it is printed, so a step cut short keeps its finished rows.
set -u
dir=$1
out=$2
budget=${3:-290}
export LD_LIBRARY_PATH=$dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
all=$(nproc)
t0=$(date +%s)
left() { echo $((budget - ($(date +%s) - t0))); }
# run LIMIT FILE CMD...: CMD with at most LIMIT seconds (less if the budget is nearly spent)
run() {
  local lim=$1 file=$2
  shift 2
  local l
  l=$(left)
  [ "$l" -lt "$lim" ] && lim=$l
  [ "$lim" -le 2 ] && { echo "## skipped (budget): $*" >>"$out/$file"; return; }
  {
    echo "## [$(($(date +%s) - t0)) s, limit $lim s] $*"
    timeout "$lim" "$@" 2>&1
    echo "## rc $?"
  } >>"$out/$file"
}
{
  date -u
  lscpu
  free -g
  uptime
} >"$out/host.txt" 2>&1
methods="full;skvq:bits_key=4:bits_value=4;skvq:bits_key=2:bits_value=2"
# shellcheck disable=SC2054 # the commas are bench_e2e's list syntax
e2e=("$dir/bench_e2e" --prefill-step 2048 --contexts 2048,8192 --methods "$methods")
# 1. end to end at all cores
run 45 e2e.txt "${e2e[@]}" --threads "$all" --repeats 2 --decode 48 --cpu-time
# 2. decode attention (shipped shape 2 KV heads x 64, 3 queries per KV head; and 8 x 128 x 4)
run 35 decode_attention.txt "$dir/bench_decode_attention" --contexts 2048,8192,32768 \
  --shape 2,64,3 --repeats 20 --threads "1,2,$all"
run 20 decode_attention.txt "$dir/bench_decode_attention" --contexts 32768 --repeats 8 \
  --threads "1,$all"
# 3. default vs passive wait policy with one busy loop per core running
pids=()
for _ in $(seq "$all"); do
  (while :; do :; done) &
  pids+=($!)
done
sleep 1
uptime >>"$out/wait_policy.txt"
for pol in "-u OMP_WAIT_POLICY" "OMP_WAIT_POLICY=passive"; do
  # shellcheck disable=SC2086 # pol is two words for env (unset) or one assignment
  run 25 wait_policy.txt env $pol "$dir/bench_e2e" --threads "$all" --repeats 2 \
    --decode 32 --contexts 2048 --prefill-step 2048 --no-bandwidth \
    --methods "full;skvq:bits_key=4:bits_value=4"
done
for p in "${pids[@]}"; do kill "$p"; done
wait 2>/dev/null
# 4. llama.cpp: flash attention, K/V f16 and q4_0, 32 decode tokens after a 2048-token context
for t in "$all" 2; do
  for ct in f16 q4_0; do
    run 20 llama.txt "$dir/llama-bench" -m "$dir/vq-mini-llama.bf16.gguf" -t "$t" -r 2 -fa 1 \
      -ctk "$ct" -ctv "$ct" -p 0 -n 32 -d 2048 -o md
  done
done
# 5. end to end at 2 threads, then 1 (what is left of the budget)
run 60 e2e.txt "${e2e[@]}" --threads 2 --repeats 2 --decode 48 --cpu-time
run 120 e2e.txt "${e2e[@]}" --threads 1 --repeats 1 --decode 48 --cpu-time
echo "## end at $(($(date +%s) - t0)) s" >>"$out/e2e.txt"
