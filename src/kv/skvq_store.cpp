// The pieces the SKVQ policies share (src/kv/skvq_store.h): settings, transforms, and the Store
// of one cache's rows over a row backend: appends, the packed tail of the flush frontier, SnapKV
// selection and the gather that keeps each row's representation, views and state-file pieces.
#include "kv/skvq_store.h"

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>

#include "veloxquant/device_memory.h"
#include "veloxquant/error.h"
#include "veloxquant/hadamard.h"
#include "veloxquant/key_rounding.h"
#include "veloxquant/query_moments.h"
#include "veloxquant/skvq_cache.h"

namespace vq::skvq {

std::string shape_str(const TensorView& t) {
  std::string s = "[";
  for (int i = 0; i < 4; ++i) {
    s += std::to_string(t.shape[i]);
    s += i < 3 ? ", " : "]";
  }
  return s;
}

namespace {

[[noreturn]] void fail(const char* op, const std::string& field, const std::string& expected,
                       const std::string& got) {
  throw Error(std::string("[") + op + "] " + field + ": expected " + expected + " but got " + got);
}

// The query-moment file at path, loaded and checked (every head's key rounding factor exists)
// once per process while some cache holds it: a model's layer caches, and every sequence's,
// share one copy instead of each reading the whole file. Keyed by path, size and modification
// time, so a rewritten file is read again.
std::shared_ptr<const QueryMomentSet> shared_query_moments(const std::string& path) {
  static std::mutex mu;
  static std::map<std::string, std::weak_ptr<const QueryMomentSet>> loaded;
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  const auto when = std::filesystem::last_write_time(path, ec);
  const std::string key = ec ? std::string()
                             : path + '\0' + std::to_string(size) + '\0' +
                                   std::to_string(when.time_since_epoch().count());
  std::lock_guard<std::mutex> lock(mu);
  if (!key.empty())
    if (auto held = loaded[key].lock()) return held;
  auto set = std::make_shared<const QueryMomentSet>(load_query_moment_file(path));
  const int64_t d = set->head_dim;
  for (size_t l = 0; l < set->layers.size(); ++l)
    for (int64_t h = 0; h < set->n_kv_heads; ++h) {
      try {
        key_rounding_factor(set->layers[l].data() + h * d * d, d);
      } catch (const Error& e) {
        throw Error("[query_moments_file] '" + path + "': layer " + std::to_string(l) + " head " +
                    std::to_string(h) + ": " + e.what());
      }
    }
  if (!key.empty()) loaded[key] = set;
  return set;
}

}  // namespace

// ---- Settings ---------------------------------------------------------------------------------

Settings Settings::from_config(const CacheConfig& cfg, int64_t layer_index, const char* op) {
  validate(cfg);
  Settings s;
  s.head_dim = cfg.head_dim;
  s.window = cfg.skvq_window;
  s.n_sink = cfg.skvq_n_sink;
  s.recent = cfg.skvq_recent;
  // validate() bounds both by kMaxCacheRows; checked again here because a wrap would loop the
  // flush frontier forever (issue 17).
  VQ_CHECK(s.window <= kMaxCacheRows && s.recent <= kMaxCacheRows,
           std::string("[") + op +
               "] skvq_window, skvq_recent: expected <= " + std::to_string(kMaxCacheRows) +
               " but got " + std::to_string(s.window) + ", " + std::to_string(s.recent));
  s.flush_span = s.window + s.recent;
  s.max_ctx = cfg.skvq_max_ctx;
  s.rotate = cfg.skvq_rotation == Rotation::kHadamard;
  s.rotate_values = s.rotate && cfg.skvq_rotate_values;
  s.rotation_seed = cfg.skvq_rotation_seed;
  s.head_first = cfg.kv_head_first;
  s.heads_total = cfg.kv_heads_total;
  s.reorder = cfg.skvq_reorder && !s.rotate;
  if (s.rotate && s.head_dim % 2 != 0)
    fail(op, "head_dim",
         "an even head_dim with skvq_rotation=hadamard (Hadamard blocks of the "
         "largest power of two dividing it)",
         std::to_string(s.head_dim));
  if (s.rotate && !cfg.skvq_perm_file.empty())
    fail(op, "skvq_perm_file",
         "no calibrated permutation with skvq_rotation=hadamard (the rotation replaces reordering)",
         "'" + cfg.skvq_perm_file + "'");
  VQ_CHECK(layer_index >= 0, std::string("[") + op + "] expected layer_index >= 0 but got " +
                                 std::to_string(layer_index));
  for (int kv = 0; kv < 2; ++kv) {
    GroupQuantParams& p = kv == 0 ? s.qk : s.qv;
    // The layer's entry of skvq_layer_bits_key / skvq_layer_bits_value when that list is set.
    p.bits = kv == 0 ? skvq_key_bits_of(cfg, layer_index) : skvq_value_bits_of(cfg, layer_index);
    p.group_size = cfg.skvq_group_size;
    p.clip_search = cfg.skvq_clip_search;
    p.clip_alpha = static_cast<float>(cfg.skvq_clip_alpha);
    // Values only (keys keep the seed's grid), and only for the search (docs/design.md §C4).
    if (kv == 1 && p.clip_search) p.clip_floor = cfg.skvq_value_clip_floor;
    p.meta = cfg.skvq_meta;
    (kv == 0 ? s.fk : s.fv) = make_row_format(s.head_dim, p.bits, p.group_size, p.meta);
  }
  s.protect = cfg.skvq_protect;
  s.protect_scoring = cfg.skvq_protect_scoring;
  s.protect_obs_window = cfg.skvq_protect_obs_window;
  s.protect_pool_kernel = cfg.skvq_protect_pool_kernel;
  s.protect_values = cfg.skvq_protect_values;
  s.key_axis = cfg.skvq_key_axis;
  // validate(): 0, or channel axis and <= window - n_sink (each entry of the per-layer list too)
  s.key_rows = skvq_key_rows_of(cfg, layer_index);
  // The shortest block: key_rows rows, or a whole chunk: chunk 0 (window - n_sink rows) for skvq,
  // `window` kept rows for snapkv+skvq (its sinks are not part of a chunk).
  const int64_t shortest =
      s.key_rows > 0 ? s.key_rows : s.window - (cfg.method == "snapkv+skvq" ? 0 : s.n_sink);
  if (s.key_axis == QuantAxis::kChannel)
    s.fk = make_channel_row_format(s.head_dim, s.qk.bits, shortest, s.qk.meta);
  if (!cfg.skvq_perm_file.empty()) {
    const SkvqPermSet ps = load_skvq_perm_file(cfg.skvq_perm_file);
    if (ps.head_dim != s.head_dim)
      fail(op, "skvq_perm_file", "permutations for head_dim " + std::to_string(s.head_dim),
           "head_dim " + std::to_string(ps.head_dim) + " in '" + cfg.skvq_perm_file + "'");
    if (layer_index >= static_cast<int64_t>(ps.key.size()))
      fail(op, "skvq_perm_file", "an entry for layer " + std::to_string(layer_index),
           std::to_string(ps.key.size()) + " layers in '" + cfg.skvq_perm_file + "'");
    s.file_perm_k = ps.key[static_cast<size_t>(layer_index)];
    s.file_perm_v = ps.value[static_cast<size_t>(layer_index)];
    s.file_heads = ps.n_kv_heads;
    s.reorder = true;
  }
  if (!cfg.skvq_query_moments_file.empty()) {  // validate(): channel-axis keys
    const std::string& path = cfg.skvq_query_moments_file;
    try {
      s.moment_set = shared_query_moments(path);
    } catch (const Error& e) {
      fail(op, "skvq_query_moments_file", "a usable query-moment file", e.what());
    }
    const QueryMomentSet& qm = *s.moment_set;
    if (qm.head_dim != s.head_dim)
      fail(op, "skvq_query_moments_file", "moments for head_dim " + std::to_string(s.head_dim),
           "head_dim " + std::to_string(qm.head_dim) + " in '" + path + "'");
    if (layer_index >= static_cast<int64_t>(qm.layers.size()))
      fail(op, "skvq_query_moments_file", "an entry for layer " + std::to_string(layer_index),
           std::to_string(qm.layers.size()) + " layers in '" + path + "'");
    const int64_t total = s.heads_total > 0 ? s.heads_total : qm.n_kv_heads;
    if (qm.n_kv_heads != total)
      fail(op, "skvq_query_moments_file", "moments for " + std::to_string(total) + " KV heads",
           std::to_string(qm.n_kv_heads) + " heads in '" + path + "'");
    s.query_moments = qm.layers[static_cast<size_t>(layer_index)].data();
    s.moment_heads = qm.n_kv_heads;
  }
  return s;
}

int Settings::state_version() const {
  if (qv.clip_floor != kClipFloorSeed) return 5;
  if (protect > 0.0) return 4;
  if (key_axis != QuantAxis::kToken) return key_rows > 0 ? 3 : 2;
  return 1;
}

void Settings::set_state_version(StateWriter& w) const {
  if (state_version() > 1) w.set_version(static_cast<uint32_t>(state_version()));
}

std::vector<int64_t> Settings::chunk_blocks(int64_t n) const {
  if (key_rows <= 0 || n < 2 * key_rows) return {n};
  std::vector<int64_t> b(static_cast<size_t>(n / key_rows), key_rows);
  b.back() += n % key_rows;
  return b;
}

int64_t Settings::key_chunk_bytes(int64_t n) const {
  if (key_axis == QuantAxis::kChannel) return skvq_channel_bytes(n, fk).total();
  return skvq_compressed_bytes(n, head_dim, qk.bits, qk.group_size, qk.meta).total();
}

int64_t Settings::value_chunk_bytes(int64_t n) const {
  return skvq_compressed_bytes(n, head_dim, qv.bits, qv.group_size, qv.meta).total();
}

void Settings::save(StateWriter& w) const {
  w.i64(head_dim);
  w.i64(window);
  w.i64(n_sink);
  w.i64(recent);
  w.u8(fk.spec.bits_x2);
  w.u8(fv.spec.bits_x2);
  w.i64(qk.group_size);
  w.u8(static_cast<uint8_t>(qk.meta));
  w.boolean(qk.clip_search);
  w.f32(qk.clip_alpha);
  w.boolean(reorder);
  w.boolean(rotate);
  w.boolean(rotate_values);
  w.u64(rotation_seed);
  const int v = state_version();
  if (v >= 2) w.u8(static_cast<uint8_t>(key_axis));  // version 2
  if (v >= 3) w.i64(key_rows);                       // version 3
  if (v >= 4) {                                      // version 4
    w.f64(protect);
    w.u8(static_cast<uint8_t>(protect_scoring));
    w.i64(protect_obs_window);
    w.i64(protect_pool_kernel);
    w.boolean(protect_values);
  }
  if (v >= 5) w.f64(qv.clip_floor);  // version 5
}

namespace {

// Bits as a user writes them: bits_x2 3 -> "1.5", 8 -> "4".
std::string bits_text(int64_t bits_x2) {
  return std::to_string(bits_x2 / 2) + (bits_x2 % 2 ? ".5" : "");
}

std::string bool_text(bool b) {
  return b ? "true" : "false";
}

std::string f64_text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

std::string f32_text(float v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", static_cast<double>(v));
  return buf;
}

}  // namespace

void Settings::check_saved(StateReader& r, const char* op) const {
  // "[skvq] state was saved with skvq_bits_value=2 but this cache has 4; nothing was changed"
  auto check = [&](const char* field, const std::string& saved, const std::string& mine) {
    check_saved_setting(op, field, saved, mine);
  };
  auto num = [](int64_t v) { return std::to_string(v); };
  check("head_dim", num(r.i64()), num(head_dim));
  check("skvq_window", num(r.i64()), num(window));
  check("skvq_n_sink", num(r.i64()), num(n_sink));
  check("skvq_recent", num(r.i64()), num(recent));
  check("skvq_bits_key", bits_text(r.u8()), bits_text(fk.spec.bits_x2));
  check("skvq_bits_value", bits_text(r.u8()), bits_text(fv.spec.bits_x2));
  check("skvq_group_size", num(r.i64()), num(qk.group_size));
  check("skvq_meta", cache_enum_name("skvq_meta", r.u8()),
        cache_enum_name("skvq_meta", static_cast<int64_t>(qk.meta)));
  check("skvq_clip_search", bool_text(r.boolean()), bool_text(qk.clip_search));
  const float a = r.f32();
  if (std::memcmp(&a, &qk.clip_alpha, 4) != 0)  // bit-exact, as the quantizer uses it
    check("skvq_clip_alpha",
          f32_text(a) + (f32_text(a) == f32_text(qk.clip_alpha) ? " (bits)" : ""),
          f32_text(qk.clip_alpha));
  check("skvq_reorder", bool_text(r.boolean()), bool_text(reorder));
  check("skvq_rotation", r.boolean() ? "hadamard" : "none", rotate ? "hadamard" : "none");
  check("skvq_rotate_values", bool_text(r.boolean()), bool_text(rotate_values));
  check("skvq_rotation_seed", std::to_string(r.u64()), std::to_string(rotation_seed));
  // Version 1 states predate the option: their keys are token-axis.
  const int64_t axis = r.version() >= 2 ? r.u8() : 0;
  check("skvq_key_axis", cache_enum_name("skvq_key_axis", axis),
        cache_enum_name("skvq_key_axis", static_cast<int64_t>(key_axis)));
  // Version 2 states predate skvq_key_rows: their key runs are whole chunks.
  check("skvq_key_rows", std::to_string(r.version() >= 3 ? r.i64() : 0), std::to_string(key_rows));
  // Versions 1-3 predate skvq_protect: nothing protected.
  if (r.version() >= 4) {
    const double p = r.f64();
    if (std::memcmp(&p, &protect, 8) != 0) check("skvq_protect", f64_text(p), f64_text(protect));
    check("skvq_protect_scoring", cache_enum_name("skvq_protect_scoring", r.u8()),
          cache_enum_name("skvq_protect_scoring", static_cast<int64_t>(protect_scoring)));
    check("skvq_protect_obs_window", num(r.i64()), num(protect_obs_window));
    check("skvq_protect_pool_kernel", num(r.i64()), num(protect_pool_kernel));
    check("skvq_protect_values", bool_text(r.boolean()), bool_text(protect_values));
  } else if (protect > 0.0) {
    check("skvq_protect", "0", f64_text(protect));
  }
  // Versions 1-4 predate skvq_value_clip_floor: the seed's grid.
  const double floor = r.version() >= 5 ? r.f64() : kClipFloorSeed;
  if (std::memcmp(&floor, &qv.clip_floor, 8) != 0)
    check("skvq_value_clip_floor", f64_text(floor), f64_text(qv.clip_floor));
}

// ---- Transforms -------------------------------------------------------------------------------

Transforms initial_transforms(const Settings& s, int64_t heads, const char* op) {
  Transforms t;
  const int64_t d = s.head_dim;
  const int64_t total = s.heads_total ? s.heads_total : heads;
  if (s.head_first + heads > total)
    fail(op, "kv_head_first", "heads within the layer's " + std::to_string(total) + " KV heads",
         "heads " + std::to_string(s.head_first) + " .. " +
             std::to_string(s.head_first + heads - 1));
  const auto first = static_cast<std::ptrdiff_t>(s.head_first * d);
  if (s.rotate) {
    // The signs of the layer's heads in order, so a shard's head h has the unsharded head's.
    t.signs = hadamard_signs(s.rotation_seed, (s.head_first + heads) * d);
    t.signs.erase(t.signs.begin(), t.signs.begin() + first);
    t.rot_block = static_cast<int32_t>(hadamard_block(d));
    t.rotate_values = s.rotate_values;
  }
  if (s.query_moments && s.moment_heads != total)
    fail(op, "skvq_query_moments_file", "moments for " + std::to_string(total) + " KV heads",
         std::to_string(s.moment_heads) + " heads in the file");
  if (!s.file_perm_k.empty()) {
    if (s.file_heads != total)
      fail(op, "skvq_perm_file", "permutations for " + std::to_string(total) + " KV heads",
           std::to_string(s.file_heads) + " heads in the file");
    const auto last = first + static_cast<std::ptrdiff_t>(heads * d);
    t.perm_k.assign(s.file_perm_k.begin() + first, s.file_perm_k.begin() + last);
    t.perm_v.assign(s.file_perm_v.begin() + first, s.file_perm_v.begin() + last);
  }
  return t;
}

bool is_perm_set(const std::vector<int32_t>& p, int64_t heads, int64_t d) {
  if (static_cast<int64_t>(p.size()) != heads * d) return false;
  for (int64_t h = 0; h < heads; ++h) {
    std::vector<char> seen(static_cast<size_t>(d), 0);
    for (int64_t j = 0; j < d; ++j) {
      const int32_t c = p[static_cast<size_t>(h * d + j)];
      if (c < 0 || c >= d || seen[static_cast<size_t>(c)]) return false;
      seen[static_cast<size_t>(c)] = 1;
    }
  }
  return true;
}

void Transforms::save(StateWriter& w) const {
  w.vec_i32(perm_k);
  w.vec_i32(perm_v);
  w.vec_f32(signs);
  w.i32(rot_block);
  w.boolean(rotate_values);
}

Transforms Transforms::load(StateReader& r, int64_t heads, int64_t d, const char* op) {
  Transforms t;
  t.perm_k = r.vec_i32();
  t.perm_v = r.vec_i32();
  t.signs = r.vec_f32();
  t.rot_block = r.i32();
  t.rotate_values = r.boolean();
  const std::string pre = std::string("[") + op + "] load: ";
  VQ_CHECK(t.perm_k.empty() == t.perm_v.empty(), pre + "expected both permutations or none");
  VQ_CHECK(t.perm_k.empty() || (is_perm_set(t.perm_k, heads, d) && is_perm_set(t.perm_v, heads, d)),
           pre + "expected valid [H, D] permutations");
  if (!t.signs.empty()) {
    VQ_CHECK(static_cast<int64_t>(t.signs.size()) == heads * d,
             pre + "expected " + std::to_string(heads * d) + " rotation signs but got " +
                 std::to_string(t.signs.size()));
    for (float x : t.signs) VQ_CHECK(x == 1.0f || x == -1.0f, pre + "expected +-1 signs");
    VQ_CHECK(t.rot_block == hadamard_block(d), pre + "expected the Hadamard block of head_dim");
  }
  return t;
}

void check_blocks(const TensorView& keys, const TensorView& values, int64_t d, bool has_data,
                  int64_t batch, int64_t heads, const char* op) {
  const std::string pre = std::string("[") + op + "] ";
  VQ_CHECK(keys.shape == values.shape, pre + "expected values of the keys' shape " +
                                           shape_str(keys) + " but got " + shape_str(values));
  VQ_CHECK(keys.shape[0] >= 1 && keys.shape[1] >= 1 && keys.shape[2] >= 0 && keys.shape[3] == d,
           pre + "expected keys [B>=1, H>=1, S>=0, " + std::to_string(d) + " (head_dim)] but got " +
               shape_str(keys));
  VQ_CHECK((keys.data && values.data) || keys.numel() == 0,
           pre + "expected keys and values data but got nullptr");
  if (has_data)
    VQ_CHECK(keys.shape[0] == batch && keys.shape[1] == heads,
             pre + "expected keys [" + std::to_string(batch) + ", " + std::to_string(heads) +
                 ", S, D] (fixed by the first call) but got " + shape_str(keys));
}

// ---- Store ------------------------------------------------------------------------------------

Store::Store(const kv::RowBackend& backend, const Settings& s, bool explicit_positions,
             const char* op)
    : be_(&backend), s_(&s), explicit_pos_(explicit_positions), op_(op) {}

void Store::make_dtr() {
  const Settings& s = *s_;
  std::vector<double> key_u;
  if (s.query_moments) {
    const int64_t d = s.head_dim;
    key_u.assign(static_cast<size_t>(heads * d * d), 0.0);
    for (int64_t h = 0; h < heads; ++h) {
      const double* m = s.query_moments + (s.head_first + h) * d * d;
      const std::vector<double> ms = stored_order_moments(
          m, d, tr.signs.empty() ? nullptr : tr.signs.data() + h * d, tr.rot_block,
          tr.perm_k.empty() ? nullptr : tr.perm_k.data() + h * d);
      const std::vector<double> u = key_rounding_factor(ms.data(), d);
      std::copy(u.begin(), u.end(), key_u.begin() + h * d * d);
    }
  }
  dtr_ =
      be_->make_transforms(tr.perm_k, tr.perm_v, tr.signs, tr.rot_block, tr.rotate_values, key_u);
}

void Store::start(DType t, int64_t b, int64_t h, Transforms transforms) {
  has_data = true;
  dtype = t;
  batch = b;
  heads = h;
  tr = std::move(transforms);
  make_dtr();
}

void Store::set_perms(std::vector<int32_t> pk, std::vector<int32_t> pv) {
  tr.perm_k = std::move(pk);
  tr.perm_v = std::move(pv);
  make_dtr();
}

int64_t Store::packed() const {
  int64_t n = 0;
  for (const Run& r : runs_) n += r.rows;
  return n;
}

int64_t Store::packed_capacity() const {
  int64_t n = 0;
  for (const Run& r : runs_) n += r.store ? r.store->capacity() : 0;
  return n;
}

int64_t Store::fp_floor() const {
  return be_->keeps_tail_room() ? n_sink + s_->flush_span : 16;
}

void Store::refit(int64_t extra, bool retire) {
  // The growth rule of a row buffer: max(need, 2 cap) rounded up to 16 rows; a buffer more than
  // twice max(its rows, fp_floor()) shrinks to that; otherwise the tail moves down to the sinks
  // when the end is reached.
  const int64_t need = n_sink + n_tail + extra, cap = fp_cap();
  const int64_t keep = std::max({need, fp_floor(), int64_t{16}});
  int64_t new_cap = cap;
  if (need > cap)
    new_cap = round_up(std::max({need, 2 * cap, int64_t{16}}), 16);
  else if (cap > 2 * keep)
    new_cap = round_up(keep, 16);
  if (new_cap != cap) {
    auto fresh = be_->make(fp_shape(), new_cap, explicit_pos_);
    if (fp_) {
      fresh->copy_range(*fp_, 0, 0, n_sink);
      fresh->copy_range(*fp_, t0_, n_sink, n_tail);
      if (retire) retired_fp_.push_back(std::move(fp_));
    }
    fp_ = std::move(fresh);
    fp_unseen_ = false;
    t0_ = n_sink;
  } else if (t0_ + n_tail + extra > cap) {
    // t0 > n_sink here (else need > cap). Without overlapping copies: on a device a tail longer
    // than the window (skvq_recent) would otherwise make a scratch store every window steps.
    kv::move_rows_down(*fp_, t0_, n_sink, n_tail);
    t0_ = n_sink;
  }
}

void Store::append(const TensorView& keys, const TensorView& values, int64_t s0, int64_t n,
                   int64_t first_pos) {
  if (n <= 0) return;
  refit(n, false);
  fp_->write_block(keys, values, s0, n, t0_ + n_tail);
  if (explicit_pos_) fp_->fill_positions(t0_ + n_tail, n, first_pos);
  n_tail += n;
}

void Store::promote_sinks(int64_t n) {
  VQ_CHECK(t0_ == n_sink && runs_.empty() && n <= n_tail,
           std::string("[") + op_ + "] internal: sinks only grow before any packed row");
  n_sink += n;
  t0_ += n;
  n_tail -= n;
}

void Store::freeze_perms(int64_t n) {
  VQ_CHECK(n <= n_sink || t0_ == n_sink,
           std::string("[") + op_ + "] internal: the permutation rows are not contiguous");
  set_perms(be_->channel_perms(*fp_, 0, n, false), be_->channel_perms(*fp_, 0, n, true));
}

void Store::pack_tail(const std::vector<int64_t>& block_rows) {
  int64_t n = 0;
  for (const int64_t m : block_rows) n += m;
  VQ_CHECK(n <= n_tail, std::string("[") + op_ + "] internal: packing more rows than the tail");
  if (n <= 0) return;
  const Settings& s = *s_;
  if (be_->one_packed_run()) {
    if (runs_.empty()) runs_.push_back(Run{});
    Run& r = runs_.back();
    const int64_t cap = r.store ? r.store->capacity() : 0;
    if (r.rows + n > cap) {  // x1.5 growth in steps of 64 rows, at least the reservation
      const int64_t new_cap =
          round_up(std::max({r.rows + n, cap + cap / 2, int64_t{64}, packed_reserve_}), 64);
      auto fresh = be_->make_packed(packed_shape(), new_cap, explicit_pos_);
      if (r.store) {
        fresh->copy_range(*r.store, 0, 0, r.rows);
        retired_packed_.push_back(std::move(r.store));
      }
      r.store = std::move(fresh);
    }
    if (s.key_axis == QuantAxis::kChannel) {
      // Channel-axis keys: every block is one quantization run (its channels fitted over its
      // own rows, the metadata in its first records), so each is quantized by itself.
      int64_t at = t0_;
      for (const int64_t m : block_rows) {
        r.store->quantize(*fp_, at, m, r.rows, s.qk, s.qv, *dtr_);
        r.rows += m;
        at += m;
      }
    } else {
      r.store->quantize(*fp_, t0_, n, r.rows, s.qk, s.qv, *dtr_);
      r.rows += n;
    }
  } else {
    int64_t at = t0_;
    for (const int64_t m : block_rows) {
      Run r;
      r.store = be_->make_packed(packed_shape(), m, explicit_pos_);
      r.store->quantize(*fp_, at, m, 0, s.qk, s.qv, *dtr_);
      r.rows = m;
      runs_.push_back(std::move(r));
      at += m;
    }
  }
  blocks_.insert(blocks_.end(), block_rows.begin(), block_rows.end());
  t0_ += n;
  n_tail -= n;
}

void Store::fit() {
  const int64_t need = n_sink + n_tail;
  if (fp_ && fp_cap() > 2 * std::max({need, fp_floor(), int64_t{16}})) refit(0, true);
}

void Store::fit_kept() {
  if (!fp_unseen_ || !be_->keeps_tail_room()) return;
  fp_unseen_ = false;
  const int64_t need = n_sink + n_tail;
  // No view reads the old store: it is freed now, so the resident bytes only fall.
  if (fp_cap() > 2 * std::max({need, fp_floor(), int64_t{16}})) refit(0, false);
}

void Store::release_retired() {
  retired_fp_.clear();
  retired_packed_.clear();
}

CacheView Store::view(int slot) const {
  CacheView v;
  v.batch = batch;
  v.n_kv_heads = heads;
  v.head_dim = s_->head_dim;
  if (!has_data) return v;
  fp_unseen_ = false;
  const int64_t d = s_->head_dim;
  if (n_sink > 0) {
    ViewSegment seg;
    seg.n_rows = n_sink;
    seg.keys = fp_->keys(0, n_sink);
    seg.values = fp_->values(0, n_sink);
    v.segments.push_back(seg);
  }
  std::vector<PackedSegment>& segs = segs_[slot];
  segs.assign(runs_.size(), PackedSegment{});
  int64_t pos = n_sink;  // implicit positions follow the sinks
  for (size_t i = 0; i < runs_.size(); ++i) {
    const Run& r = runs_[i];
    segs[i] = r.store->segment(0, r.rows, dtype, *dtr_);
    if (s_->key_axis == QuantAxis::kChannel && be_->one_packed_run()) {
      // One run of every block: the blocks' first records, on the device (kept per slot while
      // the blocks stay the same).
      const RunIndex& ri = run_index(slot);
      segs[i].keys.runs = ri.dev->data();
      segs[i].keys.n_runs = static_cast<int32_t>(ri.host.size() - 1);
    }
    ViewSegment seg;
    seg.n_rows = r.rows;
    if (explicit_pos_) {
      seg.positions = r.store->positions();
      seg.pos_stride = r.store->capacity();
    } else {
      seg.first_pos = pos;
    }
    pos += r.rows;
    seg.packed = &segs[i];
    seg.keys.dtype = seg.values.dtype = dtype;
    seg.keys.shape = seg.values.shape = {batch, heads, r.rows, d};
    v.segments.push_back(seg);
  }
  if (n_tail > 0) {
    ViewSegment seg;
    seg.n_rows = n_tail;
    if (explicit_pos_) {
      seg.positions = fp_->positions() + t0_;
      seg.pos_stride = fp_cap();
    } else {
      seg.first_pos = pos;
    }
    seg.keys = fp_->keys(t0_, n_tail);
    seg.values = fp_->values(t0_, n_tail);
    v.segments.push_back(seg);
  }
  return v;
}

std::vector<int32_t> Store::select(int64_t count, const TensorView* q, int64_t q_first,
                                   const SnapSelectParams& p) const {
  const int64_t n = rows(), n_p = packed();
  VQ_CHECK(explicit_pos_, std::string("[") + op_ + "] internal: selection needs positions");
  std::unique_ptr<kv::RowIndex> idx;
  if (n_p == 0 && t0_ == n_sink) {  // the frame is the full-precision store itself
    idx = be_->snap_select(*fp_, n, q, q_first, p);
  } else {  // an fp32 frame: sinks, dequantized packed keys, tail (with positions)
    auto frame = be_->make({DType::kF32, batch, heads, s_->head_dim}, n, true);
    frame->copy_range(*fp_, 0, 0, n_sink);
    int64_t at = n_sink;
    for (const Run& r : runs_) {
      r.store->dequantize_keys(0, r.rows, *frame, at, *dtr_);
      at += r.rows;
    }
    frame->copy_range(*fp_, t0_, at, n_tail);
    idx = be_->snap_select(*frame, n, q, q_first, p);
  }
  VQ_CHECK(idx->count == count, std::string("[") + op_ + "] internal: selected " +
                                    std::to_string(idx->count) + " rows, expected " +
                                    std::to_string(count));
  return idx->download();
}

void Store::keep(const std::vector<int32_t>& idx, int64_t count) {
  const int64_t F = batch * heads, n_s = n_sink, n_p = packed();
  const std::string pre = std::string("[") + op_ + "] internal: ";
  const int64_t n_s2 = std::min(n_s, count);
  // Channel-axis records share their block's metadata: they are packed after the selection only.
  VQ_CHECK(s_->key_axis == QuantAxis::kToken || n_p == 0,
           pre + "a selection over packed channel-axis rows");
  std::vector<int64_t> pk(static_cast<size_t>(F), 0);
  for (int64_t f = 0; f < F; ++f) {
    const int32_t* sel = idx.data() + f * count;
    for (int64_t i = 0; i < n_s2; ++i) VQ_CHECK(sel[i] == i, pre + "a sink row was not kept");
    for (int64_t i = 0; i < count; ++i) pk[f] += sel[i] >= n_s && sel[i] < n_s + n_p;
  }
  const int64_t p2 = *std::max_element(pk.begin(), pk.end());
  const int64_t f2 = count - n_s2 - p2;
  int64_t e_max = 0;  // full-precision rows a frame quantizes early, at most
  for (int64_t f = 0; f < F; ++f) e_max = std::max(e_max, p2 - pk[f]);
  // Frame row j >= n_s + n_p is tail row j - n_s - n_p, at store row t0 + that.
  auto tail_row = [&](int32_t j) { return static_cast<int32_t>(t0_ + j - n_s - n_p); };

  std::unique_ptr<kv::PackedStore> kept_packed;
  if (p2 > 0) {
    const Settings& s = *s_;
    // The early rows of every frame, quantized: Q [F, e_max] (a frame with fewer repeats its
    // first tail row; those records are never read).
    std::unique_ptr<kv::PackedStore> early;
    if (e_max > 0) {
      std::vector<int32_t> ie(static_cast<size_t>(F * e_max), static_cast<int32_t>(t0_));
      for (int64_t f = 0; f < F; ++f)
        for (int64_t e = 0; e < p2 - pk[f]; ++e)
          ie[f * e_max + e] = tail_row(idx[f * count + n_s2 + pk[f] + e]);
      auto rows = be_->make(fp_shape(), e_max, true);
      rows->gather(*fp_, *be_->upload_index(e_max, ie), 0);
      early = be_->make_packed(packed_shape(), e_max, true);
      early->quantize(*rows, 0, e_max, 0, s.qk, s.qv, *dtr_);
    }
    // Every candidate record in one store: the packed rows, then the early ones.
    std::unique_ptr<kv::PackedStore> all;
    const kv::PackedStore* src = runs_.size() == 1 && !early ? runs_[0].store.get() : nullptr;
    if (!src) {
      all = be_->make_packed(packed_shape(), n_p + e_max, true);
      int64_t at = 0;
      for (const Run& r : runs_) {
        all->copy_range(*r.store, 0, at, r.rows);
        at += r.rows;
      }
      if (early) all->copy_range(*early, 0, n_p, e_max);
      src = all.get();
    }
    std::vector<int32_t> ip(static_cast<size_t>(F * p2));
    for (int64_t f = 0; f < F; ++f)
      for (int64_t i = 0; i < p2; ++i)
        ip[f * p2 + i] = i < pk[f] ? static_cast<int32_t>(idx[f * count + n_s2 + i] - n_s)
                                   : static_cast<int32_t>(n_p + i - pk[f]);
    kept_packed = be_->make_packed(packed_shape(), p2, true);
    kept_packed->gather(*src, *be_->upload_index(p2, ip));
  }
  // Full precision: the kept sinks, then the rows after the packed ones.
  const int64_t nf = n_s2 + f2;
  std::vector<int32_t> ifp(static_cast<size_t>(F * nf));
  for (int64_t f = 0; f < F; ++f)
    for (int64_t i = 0; i < nf; ++i)
      ifp[f * nf + i] =
          i < n_s2 ? static_cast<int32_t>(i) : tail_row(idx[f * count + n_s2 + p2 + (i - n_s2)]);
  // Room for 16 more rows (a few decode steps) before the first regrowth doubles the store.
  auto kept_fp = be_->make(fp_shape(), round_up(std::max<int64_t>(nf, 16), 16) + 16, true);
  if (nf > 0) kept_fp->gather(*fp_, *be_->upload_index(nf, ifp), 0);

  // The last view still reads the old stores: retire them.
  retired_fp_.push_back(std::move(fp_));
  for (Run& r : runs_) retired_packed_.push_back(std::move(r.store));
  runs_.clear();
  blocks_.clear();
  fp_ = std::move(kept_fp);
  fp_unseen_ = true;
  n_sink = n_s2;
  t0_ = n_s2;
  n_tail = f2;
  if (p2 > 0) {
    runs_.push_back(Run{std::move(kept_packed), p2});
    blocks_.push_back(p2);
  }
}

// ---- state pieces -----------------------------------------------------------------------------

void Store::write_rows(StateWriter& w, bool sinks) const {
  const int64_t n = sinks ? n_sink : n_tail, row0 = sinks ? 0 : t0_;
  w.i64(n);
  if (n == 0) return;
  for (int kv = 0; kv < 2; ++kv) {
    const Tensor t = fp_->download(kv == 1, row0, n);
    w.bytes(t.data(), t.nbytes());
  }
  if (explicit_pos_ && !sinks)
    for (const int32_t p : fp_->download_positions(row0, n)) w.i32(p);
}

HostRows Store::read_rows(StateReader& r, bool positions) const {
  HostRows out;
  const int64_t n = r.i64_in("full-precision rows", 0, INT32_MAX);
  const size_t rb = static_cast<size_t>(s_->head_dim) * dtype_size(dtype);
  // n * B * H * row bytes * 2 must fit what is left of the state; the product may overflow
  // (B * H can be near 2^48 in a corrupted file), so it is checked step by step.
  uint64_t need = 0;
  const bool fits =
      !__builtin_mul_overflow(static_cast<uint64_t>(n), static_cast<uint64_t>(batch), &need) &&
      !__builtin_mul_overflow(need, static_cast<uint64_t>(heads), &need) &&
      !__builtin_mul_overflow(need, static_cast<uint64_t>(rb) * 2, &need);
  VQ_CHECK(fits && need <= r.remaining(), std::string("[") + op_ + "] load: expected " +
                                              std::to_string(n) +
                                              " stored rows but the state is too short");
  out.n = n;
  if (n == 0) return out;  // no row loops over (b, h): B * H alone may be huge
  out.k.resize(need / 2);
  out.v.resize(need / 2);
  r.bytes(out.k.data(), out.k.size());
  r.bytes(out.v.data(), out.v.size());
  if (positions) {
    out.pos.resize(static_cast<size_t>(batch * heads * n));
    for (int32_t& p : out.pos) p = r.i32();
  }
  return out;
}

std::vector<uint8_t> Store::records(int64_t row0, int64_t n, bool values) const {
  const int64_t F = batch * heads, st = (values ? s_->fv : s_->fk).row_stride;
  std::vector<uint8_t> out(static_cast<size_t>(F * n * st));
  int64_t r0 = 0;  // first packed row of the run
  for (const Run& r : runs_) {
    const int64_t lo = std::max(row0, r0), hi = std::min(row0 + n, r0 + r.rows);
    if (lo < hi) {
      const std::vector<uint8_t> part = r.store->download(values, lo - r0, hi - lo);
      for (int64_t f = 0; f < F; ++f)
        std::memcpy(out.data() + (f * n + lo - row0) * st, part.data() + f * (hi - lo) * st,
                    static_cast<size_t>((hi - lo) * st));
    }
    r0 += r.rows;
  }
  return out;
}

std::vector<int32_t> Store::record_positions(int64_t row0, int64_t n) const {
  const int64_t F = batch * heads;
  std::vector<int32_t> out(static_cast<size_t>(F * n));
  int64_t r0 = 0;
  for (const Run& r : runs_) {
    const int64_t lo = std::max(row0, r0), hi = std::min(row0 + n, r0 + r.rows);
    if (lo < hi) {
      const std::vector<int32_t> part = r.store->download_positions(lo - r0, hi - lo);
      for (int64_t f = 0; f < F; ++f)
        std::copy(part.begin() + f * (hi - lo), part.begin() + (f + 1) * (hi - lo),
                  out.begin() + f * n + (lo - row0));
    }
    r0 += r.rows;
  }
  return out;
}

std::vector<int32_t> Store::frame_positions(int64_t f) const {
  std::vector<int32_t> out(static_cast<size_t>(n_sink));
  std::iota(out.begin(), out.end(), 0);
  const int64_t n_p = packed();
  if (n_p > 0) {
    const std::vector<int32_t> p = record_positions(0, n_p);
    out.insert(out.end(), p.begin() + f * n_p, p.begin() + (f + 1) * n_p);
  }
  if (n_tail > 0) {
    const std::vector<int32_t> p = fp_->download_positions(t0_, n_tail);
    out.insert(out.end(), p.begin() + f * n_tail, p.begin() + (f + 1) * n_tail);
  }
  return out;
}

std::vector<uint8_t> Store::block_records(size_t i, bool values) const {
  int64_t row0 = 0;
  for (size_t j = 0; j < i; ++j) row0 += blocks_[j];
  return records(row0, blocks_[i], values);
}

std::vector<int32_t> Store::block_positions(size_t i) const {
  int64_t row0 = 0;
  for (size_t j = 0; j < i; ++j) row0 += blocks_[j];
  return record_positions(row0, blocks_[i]);
}

void Store::install(const HostRows& sinks, const std::vector<HostBlock>& blocks,
                    const HostRows& tail) {
  const int64_t d = s_->head_dim;
  n_sink = sinks.n;
  n_tail = tail.n;
  fp_ = be_->make(fp_shape(), round_up(std::max<int64_t>(n_sink + n_tail, 16), 16), explicit_pos_);
  fp_unseen_ = false;
  t0_ = n_sink;
  if (n_sink > 0) {
    fp_->upload(TensorView::contiguous(const_cast<uint8_t*>(sinks.k.data()), dtype, batch, heads,
                                       n_sink, d),
                TensorView::contiguous(const_cast<uint8_t*>(sinks.v.data()), dtype, batch, heads,
                                       n_sink, d),
                0, n_sink, nullptr);
    if (explicit_pos_) fp_->fill_positions(0, n_sink, 0);
  }
  if (n_tail > 0)
    fp_->upload(
        TensorView::contiguous(const_cast<uint8_t*>(tail.k.data()), dtype, batch, heads, n_tail, d),
        TensorView::contiguous(const_cast<uint8_t*>(tail.v.data()), dtype, batch, heads, n_tail, d),
        n_sink, n_tail, explicit_pos_ ? &tail.pos : nullptr);
  runs_.clear();
  blocks_.clear();
  int64_t total = 0;
  for (const HostBlock& b : blocks) total += b.rows;
  if (be_->one_packed_run() && total > 0) {
    Run r;
    r.store = be_->make_packed(packed_shape(), round_up(std::max(total, packed_reserve_), 64),
                               explicit_pos_);
    for (const HostBlock& b : blocks) {
      r.store->upload(b.k.data(), b.v.data(), explicit_pos_ ? b.pos.data() : nullptr, r.rows,
                      b.rows);
      r.rows += b.rows;
    }
    runs_.push_back(std::move(r));
  } else {
    for (const HostBlock& b : blocks) {
      Run r;
      r.store = be_->make_packed(packed_shape(), b.rows, explicit_pos_);
      r.store->upload(b.k.data(), b.v.data(), explicit_pos_ ? b.pos.data() : nullptr, 0, b.rows);
      r.rows = b.rows;
      runs_.push_back(std::move(r));
    }
  }
  for (const HostBlock& b : blocks) blocks_.push_back(b.rows);
}

const Store::RunIndex& Store::run_index(int slot) const {
  VQ_CHECK(runs_.size() == 1,
           std::string("[") + op_ + "] internal: channel-axis run starts need one packed run");
  std::vector<int32_t> starts(1, 0);
  for (const int64_t b : blocks_) starts.push_back(static_cast<int32_t>(starts.back() + b));
  VQ_CHECK(starts.back() == runs_[0].rows,
           std::string("[") + op_ + "] internal: the blocks do not cover the packed run");
  RunIndex& ri = run_index_[slot];
  if (!ri.dev || ri.host != starts) {
    ri.dev = be_->upload_index(static_cast<int64_t>(starts.size()), starts);
    ri.host = std::move(starts);
  }
  return ri;
}

int64_t Store::resident_bytes() const {
  int64_t n = static_cast<int64_t>(
      (tr.perm_k.capacity() + tr.perm_v.capacity() + tr.signs.capacity()) * 4 +
      (segs_[0].capacity() + segs_[1].capacity()) * sizeof(PackedSegment) + blocks_.capacity() * 8);
  if (dtr_) n += dtr_->bytes;
  for (const RunIndex& ri : run_index_)  // the device copy of the run starts
    if (ri.dev) n += cuda::device_alloc_bytes(static_cast<int64_t>(ri.host.size()) * 4);
  if (fp_) n += fp_->resident_bytes();
  for (const Run& r : runs_) n += r.store->resident_bytes();
  for (const auto& s : retired_fp_) n += s->resident_bytes();
  for (const auto& s : retired_packed_) n += s->resident_bytes();
  return n;
}

}  // namespace vq::skvq

namespace vq {

int64_t skvq_flushed_chunk_bytes(const CacheConfig& cfg, int64_t layer, int64_t n) {
  const skvq::Settings s = skvq::Settings::from_config(cfg, layer, "memory_plan");
  int64_t bytes = 0;
  for (const int64_t rows : s.chunk_blocks(n))
    bytes += s.key_chunk_bytes(rows) + s.value_chunk_bytes(rows);
  return bytes;
}

int64_t skvq_record_stride(const CacheConfig& cfg, int64_t layer, bool values) {
  const skvq::Settings s = skvq::Settings::from_config(cfg, layer, "memory_plan");
  return (values ? s.fv : s.fk).row_stride;
}

}  // namespace vq
