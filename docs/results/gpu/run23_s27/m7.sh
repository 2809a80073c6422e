#!/usr/bin/env bash
# s27 call m7 (issue 19): decode attention's query heads split over spare threads. m6: our full
# cache 691-903 tok/s at 16 threads against llama.cpp f16's 805-1052 (8 threads: 1142 against
# 848); at 2K a decode call's attention was 2 units (2 KV heads, one part each), so 2 threads
# attended while the rest waited. bench_e2e_main = 8d4ec72; bench_e2e_hs = the same with each
# unit's 3 query heads split into groups when the threads outnumber the units (same bits).
# Alternated at 16 / 12 / 8 threads, then llama.cpp f16.
root=$(pwd)
o=$OUT/m7.txt
exec >"$o" 2>&1
h=$root/carry-m7/host
export LD_LIBRARY_PATH=$h/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
python3 tools/llama_cpp/hf_to_gguf.py models/vq-mini-llama /tmp/vq.gguf --gguf-py $h/gguf-py >/dev/null 2>&1
uptime
for t in 16 12 8 16; do
  for v in main hs; do
    timeout 25 $h/bench_e2e_$v --prefill-step 2048 --contexts 2048 --methods "full;skvq:bits_key=4:bits_value=4" \
      --threads $t --repeats 2 --decode 48 --no-bandwidth 2>&1 | grep -E "^\| [28]" | sed "s/^/$v t$t /"
  done
done
for t in 16 12 8; do
  timeout 30 $h/llama-bench -m /tmp/vq.gguf -t $t -r 3 -fa 1 -ctk f16 -ctv f16 -p 0 -n 32 -d 2048 -o md \
    2>&1 | grep tg32 | sed "s/^/llama t$t /"
done
uptime
