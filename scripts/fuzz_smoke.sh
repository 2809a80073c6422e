#!/usr/bin/env bash
# Builds the libFuzzer targets (tools/fuzz/fuzz_*.cpp, clang + ASan/UBSan) and runs each for a
# bounded time on its seed corpus (scripts/fuzz_common.sh). Exit status 0 when every target ran
# its time without a crash, a sanitizer report or a timeout; crash inputs are kept in
# <build-dir>/crashes/<target>/. The default (7 targets x 20 s) keeps the CI smoke near 2.5
# minutes after the build; scripts/fuzz.sh runs them longer.
#   scripts/fuzz_smoke.sh [seconds-per-target (20)] [build-dir (build-fuzz)]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-20}
dir=${2:-build-fuzz}
source scripts/fuzz_common.sh

status=0
for t in "${targets[@]}"; do
  mkdir -p "$corpus/$t" "$dir/crashes/$t" "$dir/work/$t"
  echo "[fuzz_smoke] $t for ${secs}s"
  # Copy the seeds into a work corpus so the seed folder stays small and reproducible.
  cp -n "$corpus/$t"/* "$dir/work/$t/" 2>/dev/null || true
  if ! "$dir/tools/fuzz/$t" "$dir/work/$t" -max_total_time="$secs" -timeout=10 -rss_limit_mb=4096 \
        -max_len=400000 -print_final_stats=1 -artifact_prefix="$dir/crashes/$t/" \
        >"$dir/$t.log" 2>&1; then
    echo "[fuzz_smoke] $t FAILED: see $dir/$t.log and $dir/crashes/$t/" >&2
    tail -n 30 "$dir/$t.log" >&2
    status=1
  else
    grep -E "stat::number_of_executed_units|cov:" "$dir/$t.log" | tail -n 2 | sed "s/^/  /"
  fi
done
exit $status
