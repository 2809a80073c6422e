#!/usr/bin/env bash
# s21 call m5 (issues 16, 14): where the channel-axis decode kernel's instructions go (main at
# a6df323): ncu's source counters of decode_channel_kernel<128, 4, 2, 2> at 1 x 32K (K2V2
# channel, runs of 32) through the engine on a random Llama-3-8B-shaped model; the SASS lines
# with the most executed instructions and warp-stall samples.
root=$(pwd)
o=$OUT
w=/tmp/m5
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-m5/gpu.txz" -C $w
export LD_LIBRARY_PATH=$w/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
export PATH=$PATH:/usr/local/cuda/bin
mkdir -p $w/res
exec > >(tee -a "$w/res/run.txt") 2>&1
cd $w
M8=/tmp/llama8b
[ -f $M8/config.json ] || timeout 120 python3 "$root/tools/make_llama_shapes.py" "$M8" --preset 8b | tail -1
C2=skvq:bits_key=2:bits_value=2:key_axis=channel:rotation=hadamard:meta=fp8_e4m3:key_rows=32
SECONDS=0
timeout 240 ncu -k regex:decode_channel --launch-count 1 --section SourceCounters --section WarpStateStats \
  -o res/prof ./vq_new bench --device cuda --model "$M8" --no-check-weights --methods "$C2" --batch 1 \
  --context 32768 --gen 2 --prefill-step 32768 --synthetic-prefill >res/ncu_run.txt 2>&1
echo "== ncu rc=$? ${SECONDS}s"
tail -3 res/ncu_run.txt
timeout 120 ncu -i res/prof.ncu-rep --page source --csv --print-source sass > res/sass.csv 2>res/sass.err
echo "== source page rc=$? $(wc -l < res/sass.csv) lines"; head -3 res/sass.err
head -2 res/sass.csv | cut -c1-600
timeout 60 ncu -i res/prof.ncu-rep --page details > res/details.txt 2>&1
grep -iE "stall|warp cycles|issued|executed" res/details.txt | head -40
rm -f res/prof.ncu-rep
gzip -9 res/sass.csv
tar czf $o/m5.tgz res
