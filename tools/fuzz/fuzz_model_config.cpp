// libFuzzer target for config.json parsing (llama / mistral / qwen2): the input bytes are the
// config text. When it parses, the derived quantities the loader relies on are checked
// (head counts divide, head_dim even, sizes positive) and the RoPE frequencies are computed.
// The only acceptable failure is vq::Error. Seeds: scripts/fuzz_smoke.sh writes the shipped
// model's config and a few variants (llama3 scaling, qwen2, mistral, transformers 5 layout).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "veloxquant/error.h"
#include "veloxquant/model.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > (1u << 20)) return 0;
  try {
    const vq::ModelConfig c =
        vq::model_config_from_json(std::string(reinterpret_cast<const char*>(data), size));
    if (c.vocab_size <= 0 || c.hidden_size <= 0 || c.n_layers <= 0 || c.n_heads <= 0 ||
        c.n_kv_heads <= 0 || c.n_heads % c.n_kv_heads != 0 || c.head_dim <= 0 ||
        c.head_dim % 2 != 0)
      __builtin_trap();
    const auto inv = vq::rope_inv_freq(c.rope, c.head_dim);
    if (static_cast<int64_t>(inv.size()) != c.head_dim / 2) __builtin_trap();
    std::vector<float> cs(inv.size()), sn(inv.size());
    vq::rope_cos_sin(inv, 12345, cs.data(), sn.data());
  } catch (const vq::Error&) {
    // Refused with a message: the expected outcome for malformed configs.
  }
  return 0;
}
