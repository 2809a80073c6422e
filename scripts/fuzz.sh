#!/usr/bin/env bash
# The longer fuzz run: builds the libFuzzer targets like scripts/fuzz_smoke.sh, then runs every
# target for MINUTES each, JOBS targets at a time (one core each), on a work corpus that persists
# in <build-dir>/work/<target>/ between runs (so later runs start where earlier ones stopped).
# Crash inputs land in <build-dir>/crashes/<target>/, logs in <build-dir>/<target>.log; the exit
# status is 0 only when every target ran its time clean. Reproduce a crash with
#   <build-dir>/tools/fuzz/<target> <build-dir>/crashes/<target>/<file>
# and add the input (minimised with -minimize_crash=1) to a regression test.
#   scripts/fuzz.sh MINUTES [JOBS (1)] [build-dir (build-fuzz)]
#   e.g. scripts/fuzz.sh 10 2   # every target 10 minutes, two at a time
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ] || ! [[ $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: scripts/fuzz.sh MINUTES [JOBS] [build-dir]   (MINUTES >= 1)" >&2
  exit 2
fi
secs=$(($1 * 60))
jobs=${2:-1}
dir=${3:-build-fuzz}
source scripts/fuzz_common.sh

run_one() {
  local t=$1 minutes=$2
  mkdir -p "$dir/crashes/$t" "$dir/work/$t"
  cp -n "$corpus/$t"/* "$dir/work/$t/" 2>/dev/null || true
  if "$dir/tools/fuzz/$t" "$dir/work/$t" -max_total_time="$secs" -timeout=10 -rss_limit_mb=4096 \
       -max_len=400000 -print_final_stats=1 -artifact_prefix="$dir/crashes/$t/" \
       >"$dir/$t.log" 2>&1; then
    echo "[fuzz] $t clean for $minutes min: $(grep -E 'stat::number_of_executed_units' "$dir/$t.log" |
      awk '{print $2}') runs, $(grep -oE 'cov: [0-9]+' "$dir/$t.log" | tail -n 1)"
  else
    echo "[fuzz] $t FAILED: see $dir/$t.log and $dir/crashes/$t/" >&2
    tail -n 30 "$dir/$t.log" >&2
    return 1
  fi
}

echo "[fuzz] ${#targets[@]} targets x $1 min, $jobs at a time"
status=0
pids=()
names=()
for t in "${targets[@]}"; do
  run_one "$t" "$1" &
  pids+=($!)
  names+=("$t")
  if [ "${#pids[@]}" -ge "$jobs" ]; then
    wait "${pids[0]}" || status=1
    pids=("${pids[@]:1}")
    names=("${names[@]:1}")
  fi
done
for p in "${pids[@]}"; do wait "$p" || status=1; done
exit $status
