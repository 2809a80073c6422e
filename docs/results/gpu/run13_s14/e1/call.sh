#!/usr/bin/env bash
# s14 call 1 (issues 13, 14): diagnosis on main's binaries (97fd7fe). ncu of the tensor-core
# packed decode kernel (K2V2 g32 and K4V4 g32 at 8 x 32K): sections, stall reasons and the SASS
# lines with the most stall samples; then the engine at 8 x 32K with --phases for snapkv and
# snapkv+skvq (their decode gap: 969 against 610 tok/s in session 12).
here=$(cd "$(dirname "$0")" && pwd)
root=$(pwd)
o=$OUT
export PATH=$PATH:/usr/local/cuda/bin
w=/tmp/e1
rm -rf $w && mkdir -p $w && tar xJf "$here/gpu.txz" -C $w
export LD_LIBRARY_PATH=$w/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
cd $w
exec > >(tee -a "$o/run.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for m in "skvq K2V2 g32" "skvq K4V4 g32"; do
  n=$(echo "$m" | tr -dc 'A-Za-z0-9')
  SECONDS=0
  timeout 150 "$ncu" --clock-control none -k regex:decode_mma_kernel -c 1 --import-source yes \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
    --section WarpStateStats --section InstructionStats --section SourceCounters \
    --metrics 'regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$' \
    -o $w/rep_$n ./cuda_decode_attention --only "$m" --batch 8 --context 32768 --repeats 3 \
    --no-maintenance >$w/ncu_run_$n.txt 2>&1
  echo "== ncu $m rc=$? ${SECONDS}s"
  "$ncu" --import $w/rep_$n.ncu-rep --print-details all >$w/ncu_$n.txt 2>&1
  grep -E "Duration|DRAM Throughput|Registers Per|Issue Slots Busy|Eligible Warps|Active Warps Per|Executed Instructions  |Block Limit Reg|Block Limit Sh|Achieved Occ" $w/ncu_$n.txt | head -14
  grep -E "smsp__average_warps_issue_stalled" $w/ncu_$n.txt | awk '{print $NF, $1}' | sort -rn | head -8
  # SASS with per-instruction samples and executed counts; the top 60 by stall samples kept.
  "$ncu" --import $w/rep_$n.ncu-rep --page source --print-source sass --csv >$w/sass_$n.csv 2>&1
  python3 - $w/sass_$n.csv $o/sass_top_$n.txt <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
out = open(sys.argv[2], "w")
hdr = None
for i, r in enumerate(rows):
    if "Source" in r and any("Sampl" in c for c in r):
        hdr = i; break
if hdr is None:
    out.write("no header found; first rows:\n"); [out.write(",".join(r) + "\n") for r in rows[:30]]; sys.exit(0)
h = rows[hdr]; out.write("columns: " + " | ".join(h) + "\n")
body = [r for r in rows[hdr + 1:] if len(r) == len(h)]
si = next(i for i, c in enumerate(h) if c.startswith("Warp Stall Sampling (All"))
ei = next((i for i, c in enumerate(h) if c.startswith("Instructions Executed")), None)
src = h.index("Source")
def num(x):
    try: return float(x.replace(",", ""))
    except: return 0.0
tot = sum(num(r[si]) for r in body); totx = sum(num(r[ei]) for r in body) if ei is not None else 0
out.write("total samples %d, executed %d, sass lines %d\n" % (tot, totx, len(body)))
# opcode histogram by executed instructions
from collections import Counter
ops, st = Counter(), Counter()
for r in body:
    op = r[src].strip().split()[0] if r[src].strip() else "?"
    if op.startswith("@"): op = r[src].strip().split()[1]
    op = op.split(".")[0]
    ops[op] += num(r[ei]) if ei is not None else 0; st[op] += num(r[si])
out.write("opcode: executed (share) / samples (share)\n")
for op, c in ops.most_common(40):
    out.write("  %-10s %12d %5.1f%%  %8d %5.1f%%\n" % (op, c, 100 * c / max(totx, 1), st[op], 100 * st[op] / max(tot, 1)))
out.write("top lines by samples:\n")
for r in sorted(body, key=lambda r: -num(r[si]))[:60]:
    out.write("  %6d %10d  %s\n" % (num(r[si]), num(r[ei]) if ei is not None else 0, r[src][:110]))
PY
  head -45 $o/sass_top_$n.txt
done
cp $w/ncu_skvqK2V2g32.txt $o/ 2>/dev/null
M8=/tmp/llama8b
timeout 60 python3 "$root/tools/make_llama_shapes.py" "$M8" --preset 8b | tail -1
export VQ_SOURCE_DIR=$root
SECONDS=0
timeout 200 ./veloxquant bench --device cuda --model "$M8" --no-check-weights --json --phases \
  --methods "snapkv:budget=1024,snapkv+skvq:budget=1024:bits_key=4:bits_value=4,skvq:bits_key=4:bits_value=4" \
  --batch 8 --context 32768 --gen 32 --prefill-step 32768 --synthetic-prefill >$o/engine_phases.json 2>$w/engine.err
echo "== engine rc=$? ${SECONDS}s"; tail -3 $w/engine.err
python3 - $o/engine_phases.json <<'PY'
import json, sys
try: j = json.load(open(sys.argv[1]))
except Exception as e: print("no JSON", e); sys.exit(0)
for m in j["methods"]:
    r = m.get("run", {})
    print("%-50s decode %7.1f steady %7.1f tok/s" % (m["method"], r.get("decode_tokens_per_s", 0), r.get("steady_decode_tokens_per_s", 0)))
    for p in m.get("phases", []):
        if p["decode"]:
            print("    %-26s device %8.3f ms host %8.3f ms steps %d" % (p["phase"], p["gpu_seconds"] / p["steps"] * 1e3, p["host_seconds"] / p["steps"] * 1e3, p["steps"]))
PY
