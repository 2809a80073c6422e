#!/bin/bash
cd /work/main
V=/work/exp/vq_vfb
export VQ_PROBE_VFB=/work/exp/vfb/vh.bin
Q=/work/exp/qm.bin
B="skvq:bits_key=2:bits_value=2:key_axis=channel:rotation=hadamard:meta=fp8_e4m3:key_rows=64:n_sink=0:query_moments_file=$Q"
R="$B:rotate_values=true:value_clip_floor=0.5"
P=":protect=0.01:protect_values=false:protect_scoring=external"
O=/work/exp/vfb
lane1() {
  $V eval passkey --threads 1 --prompts 216 --mode both --json --quiet --methods "$R$P" > $O/pk_vfb_floor_prot.json
}
lane2() {
  $V eval kld --threads 1 --docs 8 --json --quiet --methods "$B,$B:rotate_values=true,$R,$R$P" > $O/kld_vfb.json
  $V eval passkey --threads 1 --prompts 216 --mode both --json --quiet --methods "$B:rotate_values=true$P" > $O/pk_vfb_rot_prot.json
}
(time lane1) 2> $O/lane1.err &
(time lane2) 2> $O/lane2.err &
wait
