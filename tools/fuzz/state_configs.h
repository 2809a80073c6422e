// The cache settings the state-file fuzz target (fuzz_cache_state.cpp) loads states into, shared
// with the seed generator (make_state_seeds.cpp). A fuzz input is one selector byte (index into
// state_configs(), modulo its size) followed by a state frame (veloxquant/binary_io.h).
// Every method is here, with small sizes so a loaded state can be exercised quickly:
// head_dim 16, SnapKV budget 8, SKVQ window 8 and group 8, streaming window 8.
#pragma once

#include <vector>

#include "veloxquant/cache_config.h"

namespace vq::fuzz {

inline const std::vector<CacheConfig>& state_configs() {
  static const std::vector<CacheConfig> configs = [] {
    CacheConfig base;
    base.head_dim = 16;
    base.snap_budget = 8;
    base.snap_obs_window = 4;
    base.snap_n_sink = 2;
    base.skvq_group_size = 8;
    base.skvq_window = 8;
    base.skvq_n_sink = 2;
    base.streaming_n_sink = 2;
    base.streaming_window = 8;
    std::vector<CacheConfig> v;
    for (const char* m : {"full", "streaming", "snapkv", "skvq", "snapkv+skvq"}) {
      CacheConfig c = base;
      c.method = m;
      v.push_back(c);
    }
    // Variants whose state files hold other fields: a pending SnapKV eviction (query window),
    // SKVQ with 1.5/4 bits, fp8 metadata, Hadamard rotation and a recent window, SKVQ with
    // channel-axis keys (whole chunks and runs), snapkv+skvq with channel-axis keys, SKVQ with
    // protected rows.
    CacheConfig snap_pending = base;
    snap_pending.method = "snapkv";
    snap_pending.snap_evict_at = SnapEvictAt::kPromptEnd;
    snap_pending.snap_scoring = SnapScoring::kQuery;
    snap_pending.snap_pool_kernel = 3;
    v.push_back(snap_pending);
    CacheConfig skvq_odd = base;
    skvq_odd.method = "skvq";
    skvq_odd.skvq_bits_key = 1.5;
    skvq_odd.skvq_bits_value = 4;
    skvq_odd.skvq_meta = MetaType::kFP8E4M3;
    skvq_odd.skvq_rotation = Rotation::kHadamard;
    skvq_odd.skvq_rotate_values = true;
    skvq_odd.skvq_recent = 3;
    v.push_back(skvq_odd);
    CacheConfig both_pending = base;
    both_pending.method = "snapkv+skvq";
    both_pending.snap_evict_at = SnapEvictAt::kPromptEnd;
    both_pending.skvq_bits_key = 4;
    v.push_back(both_pending);
    // Channel-axis keys: state frame version 2 (skvq_key_axis, packed.h's chunk records).
    CacheConfig skvq_channel = base;
    skvq_channel.method = "skvq";
    skvq_channel.skvq_key_axis = QuantAxis::kChannel;
    skvq_channel.skvq_bits_key = 3;
    v.push_back(skvq_channel);
    // Channel-axis keys over runs of rows (skvq_key_rows): state frame version 3, for SKVQ and
    // for snapkv+skvq (prompt-end eviction, the kept rows packed after it).
    CacheConfig skvq_runs = skvq_channel;
    skvq_runs.skvq_key_rows = 3;
    v.push_back(skvq_runs);
    CacheConfig both_channel = both_pending;
    both_channel.skvq_key_axis = QuantAxis::kChannel;
    both_channel.skvq_key_rows = 4;
    v.push_back(both_channel);
    // Protected rows (skvq_protect): state frame version 4, the protected keys, values and
    // positions after the packed chunks.
    CacheConfig skvq_protect = base;
    skvq_protect.method = "skvq";
    skvq_protect.skvq_bits_key = 2;
    skvq_protect.skvq_bits_value = 2;
    skvq_protect.skvq_protect = 0.25;
    skvq_protect.skvq_protect_obs_window = 4;
    v.push_back(skvq_protect);
    // The value rows' longer clip grid (skvq_value_clip_floor): state frame version 5.
    CacheConfig skvq_floor = skvq_channel;
    skvq_floor.skvq_bits_value = 2;
    skvq_floor.skvq_value_clip_floor = 0.5;
    v.push_back(skvq_floor);
    return v;
  }();
  return configs;
}

}  // namespace vq::fuzz
