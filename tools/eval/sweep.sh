#!/usr/bin/env bash
# The docs/RESULTS.md sweep on the shipped model: `veloxquant eval kld` over the specs of
# tools/eval/methods_text.txt (P = 1536, T = 512, DOCS documents) and `veloxquant eval passkey`
# over tools/eval/methods_passkey.txt (PROMPTS prompts, both modes). Each list is cut into JOBS
# contiguous parts run in parallel (each part recomputes the full-cache baseline; threads per
# job = cores / jobs), the parts' JSON are merged (merge_results.py) and `veloxquant eval report`
# renders the tables and charts with the peer rows of docs/results/peers_*.json.
#
#   tools/eval/sweep.sh [text|passkey|all] [JOBS (cores)] [OUT (docs/results)]
#   env: VQ (binary, build/veloxquant), DOCS (8), PROMPTS (0 = all 216), TEXT_LIST and PASSKEY_LIST
#   (other spec lists)
set -euo pipefail
cd "$(dirname "$0")/../.."
what=${1:-all}
jobs=${2:-$(nproc)}
out=${3:-docs/results}
vq=${VQ:-build/veloxquant}
docs=${DOCS:-8}
prompts=${PROMPTS:-0}
threads=$(($(nproc) / jobs))
[ "$threads" -ge 1 ] || threads=1
mkdir -p "$out/parts"

# run_list KIND LIST: parts of LIST (comments and blank lines dropped) through `eval KIND`.
run_list() {
  local kind=$1 list=$2 n i
  mapfile -t specs < <(grep -v '^\s*#' "$list" | grep -v '^\s*$')
  n=${#specs[@]}
  local parts=$((jobs < n ? jobs : n))
  for ((i = 0; i < parts; i++)); do
    local lo=$((i * n / parts)) hi=$(((i + 1) * n / parts))
    local methods
    methods=$(IFS=,; echo "${specs[*]:lo:hi-lo}")
    local extra=(--docs "$docs")
    [ "$kind" = passkey ] && extra=(--prompts "$prompts")
    OMP_NUM_THREADS=$threads "$vq" eval "$kind" --methods "$methods" "${extra[@]}" --json --quiet \
      --out "$out/parts/${kind}_$i.json" &
  done
  wait
  local files=()
  for ((i = 0; i < parts; i++)); do files+=("$out/parts/${kind}_$i.json"); done
  python3 tools/eval/merge_results.py "$out/$kind.json" "${files[@]}"
}

case $what in
  text | all) run_list kld "${TEXT_LIST:-tools/eval/methods_text.txt}" ;;&
  passkey | all) run_list passkey "${PASSKEY_LIST:-tools/eval/methods_passkey.txt}" ;;
  text) ;;
  *) echo "usage: $0 [text|passkey|all] [jobs] [out]" >&2; exit 2 ;;
esac
