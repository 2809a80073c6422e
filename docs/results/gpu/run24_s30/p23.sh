#!/usr/bin/env bash
# s30: calls p2 (host CPU) and p3 (GPU) in one device call (one machine start); each writes its
# files under $OUT/p2 and $OUT/p3.
root=$(pwd)
base=$OUT
mkdir -p $base/p2 $base/p3
OUT=$base/p3 bash docs/results/gpu/run24_s30/p3/call.sh
OUT=$base/p2 bash docs/results/gpu/run24_s30/p2/call.sh
