// Test helper: one layer of Llama-3-8B's shapes, the model of the memory planner's bound tests
// (tests/test_steady_decode_stores.cpp, tests/cuda/test_cuda_skvq.cpp).
#pragma once

#include "veloxquant/model.h"

namespace vq::test {

// 32 query and 8 KV heads of 128 channels, hidden 4096, MLP 14336, vocabulary 128256; 1 layer.
inline ModelConfig llama3_8b_layer() {
  ModelConfig mc;
  mc.n_layers = 1;
  mc.n_heads = 32;
  mc.n_kv_heads = 8;
  mc.head_dim = 128;
  mc.hidden_size = 4096;
  mc.intermediate_size = 14336;
  mc.vocab_size = 128256;
  return mc;
}

}  // namespace vq::test
