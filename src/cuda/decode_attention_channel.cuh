// Fused decode attention over packed segments with channel-axis keys (skvq_key_axis=channel,
// packed.h "Channel-axis records"): the launcher of decode_attention_channel.cu's kernel, which
// writes the split partials of every segment with DecodeSegmentParams::packed == 2 in the layout
// of decode_attention.cuh (the combine kernel merges them with the split kernel's, which ran
// first with those segments emptied).
#pragma once

#include <cuda_runtime_api.h>

#include "cuda/decode_attention.cuh"

namespace vq::cuda {

// One grid per channel-axis segment of p (splits x H_kv x B blocks of 128 threads), queued on s.
// p: an unbatched DecodeParams (seqs == nullptr), D 64 or 128, G in {1, 2, 4, 8}; ch: the
// segments' runs and formats.
void decode_channel_launch(const DecodeParams& p, const DecodeChannelParams& ch, cudaStream_t s);

}  // namespace vq::cuda
