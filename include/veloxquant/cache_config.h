// One configuration type for every cache method (caches.md §6), its validation, and its two
// sources: a JSON object and command-line style "key=value" assignments.
//
// Field names follow the seeds (snap_*, skvq_*). Validation happens at build time and names the
// field, the value and what is allowed: "[cache_config] snap_budget: expected >= 1 but got 0".
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace vq {

enum class SnapDType : uint8_t { kAuto, kFloat16, kBFloat16 };
enum class SnapScoring : uint8_t { kKeyProxy, kQuery };
enum class PoolKind : uint8_t { kMax, kAvg };
// When SnapKV evicts: after every multi-token call (the seed), or once per prompt, at
// KVCache::end_prompt() or the first single-token call after the prompt (the paper).
enum class SnapEvictAt : uint8_t { kPrefillCall, kPromptEnd };
enum class MetaType : uint8_t { kF16, kF32, kFP8E4M3 };
enum class Rotation : uint8_t { kNone, kHadamard };

struct CacheConfig {
  // "full", "snapkv", "skvq", "snapkv+skvq", "streaming"
  std::string method = "full";
  int64_t head_dim = 128;  // set per layer by the builder

  // SnapKV (caches.md §3). Defaults are the seed's.
  int64_t snap_budget = 512;     // rows kept per (b, h) after a prefill call, sinks included
  int64_t snap_obs_window = 32;  // observation window (trailing rows that vote)
  int64_t snap_n_sink = 4;       // leading positions always kept
  SnapDType snap_dtype = SnapDType::kAuto;
  SnapScoring snap_scoring = SnapScoring::kKeyProxy;
  int64_t snap_pool_kernel = 1;  // odd; 1 = no pooling
  PoolKind snap_pool = PoolKind::kMax;
  bool snap_keep_window = false;  // score the prefix only and always keep the window
  SnapEvictAt snap_evict_at = SnapEvictAt::kPrefillCall;

  // SKVQ (caches.md §4). Bits are 1..8, or 1.5 (three levels, five codes per byte).
  double skvq_bits_key = 2;
  double skvq_bits_value = 2;
  int64_t skvq_group_size = 32;
  int64_t skvq_window = 128;  // >= 2: full-precision window and flush chunk
  int64_t skvq_n_sink = 5;    // 0 <= n < window
  bool skvq_reorder = true;
  bool skvq_clip_search = true;
  double skvq_clip_alpha = 1.0;  // (0, 1]
  int64_t skvq_max_ctx = 0;      // 0 = unlimited
  MetaType skvq_meta = MetaType::kF16;
  int64_t skvq_recent = 0;  // minimum most-recent tokens kept at full precision
  Rotation skvq_rotation = Rotation::kNone;
  bool skvq_rotate_values = false;
  uint64_t skvq_rotation_seed = 0x5eed;
  std::string skvq_perm_file;  // calibrated permutations (empty = from chunk 0)

  // StreamingLLM-style baseline: sinks + most recent window.
  int64_t streaming_n_sink = 4;
  int64_t streaming_window = 512;
};

// Methods the builder knows.
const std::vector<std::string>& cache_methods();

// Throws vq::Error naming the first bad field, its value and the allowed range.
void validate(const CacheConfig& cfg);

// Applies one "key=value" assignment (key is a field name; '-' and '_' are equivalent).
// Throws vq::Error on an unknown key (listing close names) or a malformed value.
void set_field(CacheConfig& cfg, const std::string& key, const std::string& value);

// Parses a JSON object of fields (any subset); unknown keys are refused.
CacheConfig config_from_json(const std::string& json_text);
std::string config_to_json(const CacheConfig& cfg);

// Parses a compact spec such as "snapkv:budget=256:obs_window=16" (the method, then
// assignments; a key without its method prefix gets it: budget -> snap_budget for snapkv).
CacheConfig config_from_spec(const std::string& spec);

}  // namespace vq
