// One configuration type for every cache method (docs/design.md §C6), its validation, and one
// parser for its sources: the method or compact spec (--cache), "key=value" options (--cache-opt)
// and JSON objects (--cache-config).
//
// Field names follow the seeds (snap_*, skvq_*). Validation happens at build time and names the
// field, the value and what is allowed: "[cache_config] snap_budget: expected >= 1 but got 0".
// Every integer field has an upper bound: row counts and positions fit int32 (kMaxCacheRows),
// head_dim and skvq_group_size fit kMaxCacheHeadDim, so sums of two fields fit int64.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace vq {

// Upper bound of every row-count / position field (windows, budgets, sinks, recent, max_ctx):
// positions are int32 everywhere.
inline constexpr int64_t kMaxCacheRows = 2147483647;
// Upper bound of head_dim and skvq_group_size.
inline constexpr int64_t kMaxCacheHeadDim = 65536;

enum class SnapDType : uint8_t { kAuto, kFloat16, kBFloat16 };
// kExternal: the caller hands the cache a score per stored row before the prompt ends
// (KVCache::set_external_scores, e.g. the context-reconstruction scores of
// veloxquant/reconstruct.h); needs snap_evict_at = prompt_end and the snapkv method.
enum class SnapScoring : uint8_t { kKeyProxy, kQuery, kExternal };
enum class PoolKind : uint8_t { kMax, kAvg };
// When SnapKV evicts: after every multi-token call (the seed), or once per prompt, at
// KVCache::end_prompt() or the first single-token call after the prompt (the paper).
enum class SnapEvictAt : uint8_t { kPrefillCall, kPromptEnd };
enum class MetaType : uint8_t { kF16, kF32, kFP8E4M3 };
enum class Rotation : uint8_t { kNone, kHadamard };
// Along which axis SKVQ quantizes keys: kToken = groups of skvq_group_size channels within each
// row (the seed); kChannel = each channel over the rows of its flushed chunk (KIVI's layout, one
// (lo, scale) per (chunk, channel); see packed.h).
enum class QuantAxis : uint8_t { kToken, kChannel };

struct CacheConfig {
  // "full", "snapkv", "skvq", "snapkv+skvq", "streaming"
  std::string method = "full";
  int64_t head_dim = 128;  // set per layer by the builder
  // Set per rank by a tensor-parallel shard plan (veloxquant/tensor_parallel.h), never by users:
  // the cache holds KV heads [kv_head_first, kv_head_first + its heads) of a layer of
  // kv_heads_total heads (0 = not sharded: the cache's own heads are the layer's). SKVQ takes
  // those heads' Hadamard signs and calibrated permutations, so a rank's cache is the unsharded
  // cache restricted to its heads.
  int64_t kv_head_first = 0;
  int64_t kv_heads_total = 0;

  // SnapKV (docs/design.md §C3). Defaults are the seed's.
  int64_t snap_budget = 512;     // rows kept per (b, h) after a prefill call, sinks included
  int64_t snap_obs_window = 32;  // observation window (trailing rows that vote)
  int64_t snap_n_sink = 4;       // leading positions always kept
  SnapDType snap_dtype = SnapDType::kAuto;
  SnapScoring snap_scoring = SnapScoring::kKeyProxy;
  int64_t snap_pool_kernel = 1;  // odd; 1 = no pooling
  PoolKind snap_pool = PoolKind::kMax;
  bool snap_keep_window = false;  // score the prefix only and always keep the window
  SnapEvictAt snap_evict_at = SnapEvictAt::kPrefillCall;
  // Decode-time eviction (long generations; method snapkv, CPU or CUDA): 0 = off; else after a
  // single-token call that leaves more than snap_decode_budget + snap_decode_every - 1 rows per
  // (b, h), the SnapKV selection re-scores every stored row with the queries of the last
  // min(obs_window, decode steps) decode calls and keeps snap_decode_budget rows (sinks, pooling
  // and keep_window as for the prompt). So a (b, h) holds at most budget + every - 1 rows after
  // any decode call, and one selection runs every `every` decode steps once the cache is full.
  int64_t snap_decode_budget = 0;
  int64_t snap_decode_every = 32;  // >= 1

  // SKVQ (docs/design.md §C4). Bits are 1..8, or 1.5 (three levels, five codes per byte).
  double skvq_bits_key = 2;
  double skvq_bits_value = 2;
  int64_t skvq_group_size = 32;
  int64_t skvq_window = 128;  // >= 2: full-precision window and flush chunk
  int64_t skvq_n_sink = 5;    // 0 <= n < window
  bool skvq_reorder = true;
  bool skvq_clip_search = true;
  double skvq_clip_alpha = 1.0;  // (0, 1]
  // The smallest clip alpha the value rows' search tries (skvq_clip_search on): the seed's grid
  // (1.0, 0.97, 0.94, 0.90, 0.85) continued in steps of 0.05 down to this floor, in
  // [0.25, 0.85]; 0.85 = the seed's grid. Keys keep the seed's grid; ignored (but checked)
  // with skvq_clip_search off (docs/design.md §C4).
  double skvq_value_clip_floor = 0.85;
  int64_t skvq_max_ctx = 0;  // 0 = unlimited
  MetaType skvq_meta = MetaType::kF16;
  int64_t skvq_recent = 0;  // minimum most-recent tokens kept at full precision
  Rotation skvq_rotation = Rotation::kNone;
  bool skvq_rotate_values = false;
  uint64_t skvq_rotation_seed = 0x5eed;
  std::string skvq_perm_file;                   // calibrated permutations (empty = from chunk 0)
  QuantAxis skvq_key_axis = QuantAxis::kToken;  // values always per token
  // Channel-axis keys only: rows per (lo, scale) of a key channel inside each flushed chunk (KIVI's
  // token groups); 0 = the whole chunk. A chunk of n rows holds floor(n / key_rows) runs, the
  // last one taking the remainder (docs/design.md §C4).
  int64_t skvq_key_rows = 0;
  // Channel-axis keys only (method skvq or snapkv+skvq): a query-moment file written
  // by `veloxquant calibrate --query-moments` (veloxquant/query_moments.h); each key row's codes
  // are then chosen by error feedback across its channels, weighted by the layer's query second
  // moments (docs/design.md §C4), instead of rounded to nearest. The metadata and the record
  // format are unchanged. Empty = round to nearest.
  std::string skvq_query_moments_file;
  // Mixed precision by layer: per-layer overrides of skvq_bits_key, skvq_key_rows and
  // skvq_bits_value, '/'-separated, entry i for layer i ("2/3/2/2/2/2"); empty = every layer takes
  // the single field. A model's caches need one entry per layer (build_caches); each layer's
  // packed formats are the single-field ones at that layer's entries (docs/design.md §C4).
  std::string skvq_layer_bits_key;
  std::string skvq_layer_key_rows;
  std::string skvq_layer_bits_value;
  // Salient rows kept precise (method skvq, CPU and CUDA; docs/design.md §C4): at the end of the
  // cache's first prompt, k = min(max(1, round(skvq_protect * prompt rows)), packed rows) packed
  // rows per (b, h), the k highest-scoring under SnapKV's rules (snapkv.h: scores of
  // skvq_protect_scoring with an observation window of skvq_protect_obs_window rows, max-pooled
  // over skvq_protect_pool_kernel positions, ties to the lower position), also get a full-precision
  // copy (keys, and values with skvq_protect_values) that attention reads instead of their codes.
  // 0 = off (the plain cache, bit for bit).
  double skvq_protect = 0;  // [0, 1)
  SnapScoring skvq_protect_scoring = SnapScoring::kQuery;
  int64_t skvq_protect_obs_window = 32;  // >= 1
  int64_t skvq_protect_pool_kernel = 1;  // odd, 1 = no pooling
  bool skvq_protect_values = true;       // false: values of protected rows stay their codes

  // StreamingLLM-style baseline: sinks + most recent window.
  int64_t streaming_n_sink = 4;
  int64_t streaming_window = 512;
};

// Methods the builder knows.
const std::vector<std::string>& cache_methods();

// Full names of the fields `method` reads besides the common head_dim (empty for "full"; snap_*
// for snapkv, skvq_* for skvq, both for snapkv+skvq, streaming_* for streaming). Throws on an
// unknown method.
std::vector<std::string> cache_method_fields(const std::string& method);

// The name of value `code` of an enum field ("skvq_meta", 2 -> "fp8_e4m3"); "code N" when out of
// range (a state file's byte). Throws on a field that is not an enum.
std::string cache_enum_name(const std::string& field, int64_t code);

// Throws vq::Error naming the first bad field, its value and the allowed range.
void validate(const CacheConfig& cfg);

// The key bits / rows per key scale of layer `layer`: the entry of skvq_layer_bits_key /
// skvq_layer_key_rows, or skvq_bits_key / skvq_key_rows when the list is empty. Throws vq::Error
// naming the list when it has no entry for the layer.
double skvq_key_bits_of(const CacheConfig& cfg, int64_t layer);
double skvq_value_bits_of(const CacheConfig& cfg, int64_t layer);
int64_t skvq_key_rows_of(const CacheConfig& cfg, int64_t layer);
// Entries of the per-layer lists (0 when empty); validate() has checked each entry.
int64_t skvq_layer_list_size(const std::string& list);

// validate() plus the rules for a configuration a user wrote (the caches themselves accept these
// degenerate settings from code): no field of another method differs from its default, and with
// SnapKV snap_n_sink < snap_budget (a budget that holds only sinks scores nothing).
void check_cache_config(const CacheConfig& cfg);

// Applies one "key=value" assignment to any field, whatever the method (key is a field name;
// '-' and '_' are equivalent). Throws vq::Error on an unknown key (listing close names) or a
// malformed value; cfg is unchanged then.
void set_field(CacheConfig& cfg, const std::string& key, const std::string& value);

// ---- the parser of user input (one key rule for specs, --cache-opt and JSON) ----------------
//
// Key rule for a config of method M: a full field name is accepted when M reads it (or it is
// head_dim); a short name gets M's prefix (budget -> snap_budget for snapkv, window ->
// skvq_window for skvq); a short name that two prefixes match (n_sink for snapkv+skvq) is
// ambiguous. Keys of another method, ambiguous and unknown keys are refused with a message naming
// the key, the method and the allowed keys; a bad value names the resolved field and what is
// allowed. On any error the config is left unchanged.

// "method" or "method:key=value:..." (compact spec) applied on top of cfg: sets the method, then
// each assignment. Does not run check_cache_config (more options may follow).
void apply_cache_arg(CacheConfig& cfg, const std::string& method_or_spec);
// A default config with apply_cache_arg, then check_cache_config.
CacheConfig parse_cache_arg(const std::string& method_or_spec);
// One "key=value" option for cfg.method (the --cache-opt form). Does not run check_cache_config
// (cross-field rules wait for the last option).
void apply_cache_option(CacheConfig& cfg, const std::string& key_eq_value);

// Parses a JSON object of fields (any subset). With a "method" member the key rule above applies
// and the result passes check_cache_config; without one only full field names are accepted (the
// method comes later, e.g. from --cache) and the result passes validate().
CacheConfig config_from_json(const std::string& json_text);
// The method, head_dim and the method's own fields (config_from_json reads it back).
std::string config_to_json(const CacheConfig& cfg);

// parse_cache_arg under its older name: "snapkv:budget=256:obs_window=16".
CacheConfig config_from_spec(const std::string& spec);

}  // namespace vq
