// The SKVQ cache (see veloxquant/skvq_cache.h) and the store helpers of skvq_store.h.
//
// State: sinks [B, H, n_sink, D] full precision (after chunk 0), one PackedBlock per flushed
// chunk (chunk 0 holds rows n_sink..window-1, chunk k rows k*window..(k+1)*window-1, implicit
// positions), and the full-precision tail [B, H, offset - q_end, D] (positions q_end..offset-1).
// A flush reads its chunk rows from the tail or straight from this call's input (converted to the
// storage dtype first, so both paths quantize the same values), packs them per (b, h) in parallel
// (OpenMP) and never keeps the full-precision copies: the tail only ever holds unflushed rows.
#include "veloxquant/skvq_cache.h"

#include <algorithm>
#if defined(__F16C__)
#include <immintrin.h>
#endif
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <istream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <ostream>

#include "kv/skvq_store.h"
#include "veloxquant/error.h"
#include "veloxquant/hadamard.h"

namespace vq {
namespace skvq {

// ---- shared helpers ---------------------------------------------------------------------------

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

}  // namespace

void fast_to_f32(const void* src, DType t, float* dst, size_t n) {
  if (t == DType::kF16) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    size_t i = 0;
#if defined(__F16C__) && defined(__AVX__)
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i,
                       _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
#endif
    for (; i < n; ++i) dst[i] = fp16_to_f32(s[i]);
    return;
  }
  if (t == DType::kBF16) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (size_t i = 0; i < n; ++i) {
      const uint32_t u = static_cast<uint32_t>(s[i]) << 16;
      std::memcpy(dst + i, &u, 4);
    }
    return;
  }
  to_f32(src, t, dst, n);
}

void convert_row_to(const void* src, DType src_t, void* dst, DType dst_t, int64_t n) {
  convert_row(src, src_t, dst, dst_t, static_cast<size_t>(n));
}

std::vector<int32_t> channel_range_perm(const float* rows, int64_t n, int64_t d) {
  std::vector<float> range(static_cast<size_t>(d), 0.0f);
  if (n > 0) {
    std::vector<float> mn(rows, rows + d), mx(rows, rows + d);
    for (int64_t i = 1; i < n; ++i)
      for (int64_t c = 0; c < d; ++c) {
        const float x = rows[i * d + c];
        mn[c] = std::min(mn[c], x);
        mx[c] = std::max(mx[c], x);
      }
    for (int64_t c = 0; c < d; ++c) {
      const float r = mx[c] - mn[c];
      range[c] = std::isnan(r) ? std::numeric_limits<float>::infinity() : r;
    }
  }
  std::vector<int32_t> perm(static_cast<size_t>(d));
  std::iota(perm.begin(), perm.end(), 0);
  std::stable_sort(perm.begin(), perm.end(),
                   [&](int32_t a, int32_t b) { return range[a] < range[b]; });
  return perm;
}

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
    p.bits = kv == 0 ? cfg.skvq_bits_key : cfg.skvq_bits_value;
    p.group_size = cfg.skvq_group_size;
    p.clip_search = cfg.skvq_clip_search;
    p.clip_alpha = static_cast<float>(cfg.skvq_clip_alpha);
    p.meta = cfg.skvq_meta;
    (kv == 0 ? s.fk : s.fv) = make_row_format(s.head_dim, p.bits, p.group_size, p.meta);
  }
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
  return s;
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
}

namespace {

// Bits as a user writes them: bits_x2 3 -> "1.5", 8 -> "4".
std::string bits_text(int64_t bits_x2) {
  return std::to_string(bits_x2 / 2) + (bits_x2 % 2 ? ".5" : "");
}

std::string bool_text(bool b) {
  return b ? "true" : "false";
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
}

// ---- Transforms -------------------------------------------------------------------------------

Transforms initial_transforms(const Settings& s, int64_t heads, const char* op) {
  Transforms t;
  const int64_t d = s.head_dim;
  if (s.rotate) {
    t.signs = hadamard_signs(s.rotation_seed, heads * d);
    t.rot_block = static_cast<int32_t>(hadamard_block(d));
    t.rotate_values = s.rotate_values;
  }
  if (!s.file_perm_k.empty()) {
    if (s.file_heads != heads)
      fail(op, "skvq_perm_file", "permutations for " + std::to_string(heads) + " KV heads",
           std::to_string(s.file_heads) + " heads in the file");
    t.perm_k = s.file_perm_k;
    t.perm_v = s.file_perm_v;
  }
  return t;
}

static bool is_perm_set(const std::vector<int32_t>& p, int64_t heads, int64_t d) {
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

// ---- PackedBlock / FpRows ---------------------------------------------------------------------

void PackedBlock::bind(int64_t batch, int64_t heads, const Settings& s, const Transforms& t,
                       DType out) {
  seg = PackedSegment{};
  seg.batch = batch;
  seg.n_heads = heads;
  seg.n_rows = rows;
  seg.head_dim = s.head_dim;
  seg.out_dtype = out;
  for (int kv = 0; kv < 2; ++kv) {
    PackedTensor& pt = kv == 0 ? seg.keys : seg.values;
    const PackedRowFormat& f = kv == 0 ? s.fk : s.fv;
    const std::vector<uint8_t>& buf = kv == 0 ? k : v;
    const std::vector<int32_t>& perm = kv == 0 ? t.perm_k : t.perm_v;
    pt.data = buf.data();
    pt.fmt = f;
    pt.stride_h = rows * f.row_stride;
    pt.stride_b = heads * pt.stride_h;
    pt.perm = perm.empty() ? nullptr : perm.data();
    const bool rot = !t.signs.empty() && (kv == 0 || t.rotate_values);
    pt.signs = rot ? t.signs.data() : nullptr;
    pt.rot_block = rot ? t.rot_block : 0;
  }
}

int64_t PackedBlock::resident_bytes() const {
  return static_cast<int64_t>(k.capacity() + v.capacity() + pos.capacity() * 4 +
                              sizeof(PackedBlock));
}

void FpRows::init(DType t, int64_t b, int64_t h, int64_t dim, bool explicit_positions) {
  dtype = t;
  batch = b;
  heads = h;
  d = dim;
  cap = start = count = 0;
  explicit_pos = explicit_positions;
  buf_k.clear();
  buf_v.clear();
  pos.clear();
}

void FpRows::reserve_append(int64_t extra) {
  const int64_t need = count + extra;
  int64_t new_cap = cap;
  if (need > cap)
    new_cap = round_up(std::max({need, 2 * cap, int64_t{16}}), 16);
  else if (cap > 2 * std::max<int64_t>(need, 16))
    new_cap = round_up(std::max<int64_t>(need, 16), 16);
  const int64_t row_bytes = d * static_cast<int64_t>(es());
  const int64_t bh = batch * heads;
  if (new_cap != cap) {
    const size_t words = static_cast<size_t>((bh * new_cap * row_bytes + 7) / 8);
    std::vector<uint64_t> nk(words), nv(words);
    std::vector<int32_t> np(explicit_pos ? static_cast<size_t>(bh * new_cap) : 0);
    for (int64_t i = 0; i < bh; ++i) {
      if (count > 0) {
        std::memcpy(reinterpret_cast<char*>(nk.data()) + i * new_cap * row_bytes,
                    reinterpret_cast<const char*>(buf_k.data()) + (i * cap + start) * row_bytes,
                    static_cast<size_t>(count * row_bytes));
        std::memcpy(reinterpret_cast<char*>(nv.data()) + i * new_cap * row_bytes,
                    reinterpret_cast<const char*>(buf_v.data()) + (i * cap + start) * row_bytes,
                    static_cast<size_t>(count * row_bytes));
      }
      if (explicit_pos && count > 0)
        std::memcpy(np.data() + i * new_cap, pos.data() + i * cap + start,
                    static_cast<size_t>(count) * 4);
    }
    buf_k.swap(nk);
    buf_v.swap(nv);
    pos.swap(np);
    cap = new_cap;
    start = 0;
  } else if (start + need > cap) {
    for (int64_t i = 0; i < bh; ++i) {
      std::memmove(reinterpret_cast<char*>(buf_k.data()) + i * cap * row_bytes,
                   reinterpret_cast<const char*>(buf_k.data()) + (i * cap + start) * row_bytes,
                   static_cast<size_t>(count * row_bytes));
      std::memmove(reinterpret_cast<char*>(buf_v.data()) + i * cap * row_bytes,
                   reinterpret_cast<const char*>(buf_v.data()) + (i * cap + start) * row_bytes,
                   static_cast<size_t>(count * row_bytes));
      if (explicit_pos)
        std::memmove(pos.data() + i * cap, pos.data() + i * cap + start,
                     static_cast<size_t>(count) * 4);
    }
    start = 0;
  }
}

TensorView FpRows::k_view(int64_t i0, int64_t n) const {
  TensorView t;
  t.data = const_cast<char*>(k_row(0, 0, i0));
  t.dtype = dtype;
  t.shape = {batch, heads, n, d};
  t.stride = {heads * cap * d, cap * d, d, 1};
  return t;
}

TensorView FpRows::v_view(int64_t i0, int64_t n) const {
  TensorView t = k_view(i0, n);
  t.data = const_cast<char*>(v_row(0, 0, i0));
  return t;
}

int64_t FpRows::resident_bytes() const {
  return static_cast<int64_t>((buf_k.capacity() + buf_v.capacity()) * 8 + pos.capacity() * 4);
}

void FpRows::save(StateWriter& w) const {
  w.i64(count);
  const size_t rb = static_cast<size_t>(d) * es();
  for (int kv = 0; kv < 2; ++kv)
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t i = 0; i < count; ++i) w.bytes(kv == 0 ? k_row(b, h, i) : v_row(b, h, i), rb);
  if (explicit_pos)
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t i = 0; i < count; ++i) w.i32(position(b, h, i));
}

void FpRows::load(StateReader& r, const char* op) {
  const int64_t n = r.i64_in("full-precision rows", 0, INT32_MAX);
  const size_t rb = static_cast<size_t>(d) * es();
  // n * B * H * row bytes * 2 must fit what is left of the state; the product may overflow
  // (B * H can be near 2^48 in a corrupted file), so it is checked step by step.
  uint64_t need = 0;
  const bool fits =
      !__builtin_mul_overflow(static_cast<uint64_t>(n), static_cast<uint64_t>(batch), &need) &&
      !__builtin_mul_overflow(need, static_cast<uint64_t>(heads), &need) &&
      !__builtin_mul_overflow(need, static_cast<uint64_t>(rb) * 2, &need);
  VQ_CHECK(fits && need <= r.remaining(), std::string("[") + op + "] load: expected " +
                                              std::to_string(n) +
                                              " stored rows but the state is too short");
  count = 0;
  start = 0;
  reserve_append(n);
  count = n;
  if (count == 0) return;  // no row loops over (b, h): B * H alone may be huge
  for (int kv = 0; kv < 2; ++kv)
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t i = 0; i < count; ++i) r.bytes(kv == 0 ? k_row(b, h, i) : v_row(b, h, i), rb);
  if (explicit_pos)
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t i = 0; i < count; ++i) position(b, h, i) = r.i32();
}

void quantize_head_rows(float* rows, int64_t n, int64_t h, const Settings& s, const Transforms& t,
                        bool values, uint8_t* dst) {
  const int64_t d = s.head_dim;
  const std::vector<int32_t>& perm = values ? t.perm_v : t.perm_k;
  const bool rot = !t.signs.empty() && (!values || t.rotate_values);
  if (rot || !perm.empty()) {
    std::vector<float> tmp(static_cast<size_t>(d));
    for (int64_t i = 0; i < n; ++i) {
      float* row = rows + i * d;
      if (rot) hadamard_rotate(row, t.signs.data() + h * d, d, t.rot_block);
      if (!perm.empty()) {
        const int32_t* p = perm.data() + h * d;
        for (int64_t j = 0; j < d; ++j) tmp[static_cast<size_t>(j)] = row[p[j]];
        std::copy(tmp.begin(), tmp.end(), row);
      }
    }
  }
  const PackedRowFormat& f = values ? s.fv : s.fk;
  quantize_to_records(rows, n, f, values ? s.qv : s.qk, dst, f.row_stride, false);
}

// ---- the SKVQ cache's state -------------------------------------------------------------------

struct State {
  bool has_data = false;
  DType dtype = DType::kF16;
  int64_t batch = 0, heads = 0;
  int64_t offset = 0;  // tokens seen
  int64_t q_end = 0;   // flush frontier (multiple of window)
  Transforms tr;
  FpRows sinks;  // n_sink rows once chunk 0 is flushed
  std::vector<std::unique_ptr<PackedBlock>> blocks;
  FpRows tail;                     // positions q_end .. offset-1
  int64_t comp_k = 0, comp_v = 0;  // seed byte formula, cumulative over flushed chunks
};

}  // namespace skvq

using skvq::FpRows;
using skvq::PackedBlock;
using skvq::Settings;
using skvq::State;

namespace {
constexpr const char* kOp = "skvq";
}

std::unique_ptr<KVCache> make_skvq_cache(const CacheConfig& cfg, int64_t layer_index) {
  return std::make_unique<SkvqCache>(cfg, layer_index);
}

SkvqCache::SkvqCache(const CacheConfig& cfg, int64_t layer_index)
    : set_(std::make_unique<Settings>(Settings::from_config(cfg, layer_index, kOp))),
      st_(std::make_unique<State>()) {}

SkvqCache::~SkvqCache() = default;

int64_t SkvqCache::offset() const {
  return st_->offset;
}
int64_t SkvqCache::stored_rows() const {
  return st_->offset;
}
int64_t SkvqCache::batch() const {
  return st_->batch;
}
int64_t SkvqCache::n_kv_heads() const {
  return st_->heads;
}
int64_t SkvqCache::quantized_tokens() const {
  return st_->q_end;
}
DType SkvqCache::storage_dtype() const {
  return st_->dtype;
}
const std::vector<int32_t>& SkvqCache::key_perms() const {
  return st_->tr.perm_k;
}
const std::vector<int32_t>& SkvqCache::value_perms() const {
  return st_->tr.perm_v;
}
const std::vector<float>& SkvqCache::rotation_signs() const {
  return st_->tr.signs;
}

std::vector<int32_t> SkvqCache::stored_positions(int64_t b, int64_t h) const {
  VQ_CHECK(b >= 0 && b < st_->batch && h >= 0 && h < st_->heads,
           "[skvq] expected (b, h) within [" + std::to_string(st_->batch) + ", " +
               std::to_string(st_->heads) + ") but got (" + std::to_string(b) + ", " +
               std::to_string(h) + ")");
  std::vector<int32_t> p(static_cast<size_t>(st_->offset));
  std::iota(p.begin(), p.end(), 0);
  return p;
}

CacheView SkvqCache::update_and_fetch(const TensorView& keys, const TensorView& values,
                                      const UpdateOptions&) {
  const Settings& s = *set_;
  State& st = *st_;
  // ---- validation: nothing changes before all of it passes
  VQ_CHECK(keys.shape == values.shape, "[skvq] expected values of the keys' shape " +
                                           skvq::shape_str(keys) + " but got " +
                                           skvq::shape_str(values));
  VQ_CHECK(
      keys.shape[0] >= 1 && keys.shape[1] >= 1 && keys.shape[2] >= 0 && keys.shape[3] == s.head_dim,
      "[skvq] expected keys [B>=1, H>=1, S>=0, " + std::to_string(s.head_dim) +
          " (head_dim)] but got " + skvq::shape_str(keys));
  VQ_CHECK((keys.data && values.data) || keys.numel() == 0,
           "[skvq] expected keys and values data but got nullptr");
  if (st.has_data)
    VQ_CHECK(keys.shape[0] == st.batch && keys.shape[1] == st.heads,
             "[skvq] expected keys [" + std::to_string(st.batch) + ", " + std::to_string(st.heads) +
                 ", S, D] (fixed by the first call) but got " + skvq::shape_str(keys));
  const int64_t n_new = keys.shape[2];
  if (s.max_ctx > 0 && st.offset + n_new > s.max_ctx)
    throw Error("[skvq] skvq_max_ctx: expected at most " + std::to_string(s.max_ctx) +
                " tokens but this call would reach " + std::to_string(st.offset + n_new) + " (" +
                std::to_string(st.offset) + " seen + " + std::to_string(n_new) +
                "); nothing was changed");
  VQ_CHECK(st.offset + n_new <= INT32_MAX, "[skvq] expected positions to fit int32 but offset " +
                                               std::to_string(st.offset) + " + S " +
                                               std::to_string(n_new) + " does not");
  if (!st.has_data) {
    skvq::Transforms tr = skvq::initial_transforms(s, keys.shape[1], kOp);  // may throw
    st.has_data = true;
    st.dtype = keys.dtype;
    st.batch = keys.shape[0];
    st.heads = keys.shape[1];
    st.tr = std::move(tr);
    st.sinks.init(st.dtype, st.batch, st.heads, s.head_dim, false);
    st.tail.init(st.dtype, st.batch, st.heads, s.head_dim, false);
  }

  // ---- flush: chunks [q_end, q_new) from the tail and this call's input
  const int64_t bsz = st.batch, heads = st.heads, d = s.head_dim, w = s.window;
  const int64_t n_total = st.offset + n_new;
  int64_t q_new = st.q_end;
  while (n_total - q_new >= s.flush_span) q_new += w;
  const size_t es = dtype_size(st.dtype);

  // Row at position p of (b, h) in the storage dtype, as fp32.
  auto row_f32 = [&](int64_t b, int64_t h, int64_t p, float* out, std::vector<char>& tmp) {
    if (p < st.offset) {
      skvq::fast_to_f32(st.tail.k_row(b, h, p - st.q_end), st.dtype, out, static_cast<size_t>(d));
      skvq::fast_to_f32(st.tail.v_row(b, h, p - st.q_end), st.dtype, out + d,
                        static_cast<size_t>(d));
    } else {
      tmp.resize(static_cast<size_t>(d) * es);
      convert_view_row(keys, b, h, p - st.offset, tmp.data(), st.dtype);
      skvq::fast_to_f32(tmp.data(), st.dtype, out, static_cast<size_t>(d));
      convert_view_row(values, b, h, p - st.offset, tmp.data(), st.dtype);
      skvq::fast_to_f32(tmp.data(), st.dtype, out + d, static_cast<size_t>(d));
    }
  };

  if (q_new > st.q_end) {
    const int64_t n_chunks = (q_new - st.q_end) / w;
    std::vector<std::unique_ptr<PackedBlock>> fresh;
    for (int64_t c = 0; c < n_chunks; ++c) {
      const int64_t c0 = st.q_end + c * w;
      auto blk = std::make_unique<PackedBlock>();
      blk->first_pos = c0 == 0 ? s.n_sink : c0;
      blk->rows = c0 + w - blk->first_pos;
      blk->k.resize(static_cast<size_t>(bsz * heads * blk->rows * s.fk.row_stride));
      blk->v.resize(static_cast<size_t>(bsz * heads * blk->rows * s.fv.row_stride));
      fresh.push_back(std::move(blk));
    }
    if (st.q_end == 0) {
      // Chunk 0: permutations (pooled over batch and the chunk's rows) and exact sinks.
      if (s.reorder && !st.tr.has_perms()) {
        std::vector<int32_t> pk(static_cast<size_t>(heads * d)), pv(pk.size());
        std::vector<float> kr(static_cast<size_t>(bsz * w * d)), vr(kr.size()), two(2 * d);
        std::vector<char> tmp;
        for (int64_t h = 0; h < heads; ++h) {
          for (int64_t b = 0; b < bsz; ++b)
            for (int64_t i = 0; i < w; ++i) {
              row_f32(b, h, i, two.data(), tmp);
              std::copy(two.begin(), two.begin() + d, kr.begin() + (b * w + i) * d);
              std::copy(two.begin() + d, two.end(), vr.begin() + (b * w + i) * d);
            }
          const auto a = skvq::channel_range_perm(kr.data(), bsz * w, d);
          const auto v = skvq::channel_range_perm(vr.data(), bsz * w, d);
          std::copy(a.begin(), a.end(), pk.begin() + h * d);
          std::copy(v.begin(), v.end(), pv.begin() + h * d);
        }
        st.tr.perm_k = std::move(pk);
        st.tr.perm_v = std::move(pv);
      }
      if (s.n_sink > 0) {
        st.sinks.reserve_append(s.n_sink);
        for (int64_t b = 0; b < bsz; ++b)
          for (int64_t h = 0; h < heads; ++h)
            for (int64_t i = 0; i < s.n_sink; ++i) {
              char* dk = st.sinks.k_row(b, h, i);
              char* dv = st.sinks.v_row(b, h, i);
              if (i < st.offset) {
                std::memcpy(dk, st.tail.k_row(b, h, i), static_cast<size_t>(d) * es);
                std::memcpy(dv, st.tail.v_row(b, h, i), static_cast<size_t>(d) * es);
              } else {
                convert_view_row(keys, b, h, i - st.offset, dk, st.dtype);
                convert_view_row(values, b, h, i - st.offset, dv, st.dtype);
              }
            }
        st.sinks.count = s.n_sink;
      }
    }
    // Pack every (chunk, b, h) in parallel.
    const int64_t jobs = n_chunks * bsz * heads;
    std::exception_ptr failure;
#pragma omp parallel if (jobs > 1)
    {
      std::vector<float> kr, vr, two(static_cast<size_t>(2 * d));
      std::vector<char> tmp;
#pragma omp for schedule(dynamic, 1)
      for (int64_t j = 0; j < jobs; ++j) {
        try {
          const int64_t c = j / (bsz * heads), b = (j / heads) % bsz, h = j % heads;
          PackedBlock& blk = *fresh[static_cast<size_t>(c)];
          kr.resize(static_cast<size_t>(blk.rows * d));
          vr.resize(kr.size());
          for (int64_t i = 0; i < blk.rows; ++i) {
            row_f32(b, h, blk.first_pos + i, two.data(), tmp);
            std::copy(two.begin(), two.begin() + d, kr.begin() + i * d);
            std::copy(two.begin() + d, two.end(), vr.begin() + i * d);
          }
          const int64_t bh = b * heads + h;
          skvq::quantize_head_rows(kr.data(), blk.rows, h, s, st.tr, false,
                                   blk.k.data() + bh * blk.rows * s.fk.row_stride);
          skvq::quantize_head_rows(vr.data(), blk.rows, h, s, st.tr, true,
                                   blk.v.data() + bh * blk.rows * s.fv.row_stride);
        } catch (...) {
#pragma omp critical(vq_skvq_failure)
          if (!failure) failure = std::current_exception();
        }
      }
    }
    if (failure) std::rethrow_exception(failure);
    for (auto& blk : fresh) {
      blk->bind(bsz, heads, s, st.tr, st.dtype);
      st.comp_k +=
          skvq_compressed_bytes(blk->rows, d, s.qk.bits, s.qk.group_size, s.qk.meta).total() * bsz *
          heads;
      st.comp_v +=
          skvq_compressed_bytes(blk->rows, d, s.qv.bits, s.qv.group_size, s.qv.meta).total() * bsz *
          heads;
      st.blocks.push_back(std::move(blk));
    }
    st.tail.pop_front(std::min(st.tail.count, q_new - st.q_end));
  }

  // ---- the tail keeps rows [q_new, n_total)
  const int64_t first_in = std::max(q_new, st.offset) - st.offset;  // first input row kept
  st.tail.reserve_append(n_new - first_in);
  for (int64_t b = 0; b < bsz; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = first_in; i < n_new; ++i) {
        const int64_t r = st.tail.count + (i - first_in);
        convert_view_row(keys, b, h, i, st.tail.k_row(b, h, r), st.dtype);
        convert_view_row(values, b, h, i, st.tail.v_row(b, h, r), st.dtype);
      }
  st.tail.count += n_new - first_in;
  st.q_end = q_new;
  st.offset = n_total;
  return stored_view();
}

CacheView SkvqCache::stored_view() const {
  const State& st = *st_;
  CacheView view;
  view.batch = st.batch;
  view.n_kv_heads = st.heads;
  view.head_dim = set_->head_dim;
  if (!st.has_data) return view;
  if (st.sinks.count > 0) {
    ViewSegment seg;
    seg.n_rows = st.sinks.count;
    seg.first_pos = 0;
    seg.keys = st.sinks.k_view(0, st.sinks.count);
    seg.values = st.sinks.v_view(0, st.sinks.count);
    view.segments.push_back(seg);
  }
  for (const auto& blk : st.blocks) {
    ViewSegment seg;
    seg.n_rows = blk->rows;
    seg.first_pos = blk->first_pos;
    seg.packed = &blk->seg;
    seg.keys.dtype = seg.values.dtype = st.dtype;
    seg.keys.shape = seg.values.shape = {st.batch, st.heads, blk->rows, set_->head_dim};
    view.segments.push_back(seg);
  }
  if (st.tail.count > 0) {
    ViewSegment seg;
    seg.n_rows = st.tail.count;
    seg.first_pos = st.q_end;
    seg.keys = st.tail.k_view(0, st.tail.count);
    seg.values = st.tail.v_view(0, st.tail.count);
    view.segments.push_back(seg);
  }
  return view;
}

CacheStats SkvqCache::stats() const {
  const Settings& s = *set_;
  const State& st = *st_;
  const int64_t bh = st.batch * st.heads, d = s.head_dim;
  CacheStats cs;
  cs.method = method();
  cs.tokens_seen = st.offset;
  cs.rows_stored = st.offset;
  const int64_t fp16_k = bh * st.offset * d * 2;
  const int64_t n_sink_kept = std::min(s.n_sink, st.q_end);
  const int64_t residual = (st.offset - st.q_end + n_sink_kept) * d * 2 * 2 * bh;
  const int64_t perm_bytes = st.tr.has_perms() ? 2 * st.heads * d * 4 : 0;
  const int64_t n_q = st.q_end - n_sink_kept;
  const double avg_bits =
      n_q > 0 ? 8.0 * static_cast<double>(st.comp_k) / static_cast<double>(n_q * d * bh) : 16.0;
  cs.bytes_accounted = st.comp_k + st.comp_v + residual + perm_bytes;
  cs.fp16_bytes = 2 * fp16_k;
  int64_t resident =
      st.sinks.resident_bytes() + st.tail.resident_bytes() +
      static_cast<int64_t>((st.tr.perm_k.capacity() + st.tr.perm_v.capacity()) * 4 +
                           st.tr.signs.capacity() * 4 + st.blocks.capacity() * sizeof(void*));
  for (const auto& blk : st.blocks) resident += blk->resident_bytes();
  cs.bytes_resident = resident;
  cs.figures = {
      {"compressed_key_bytes", static_cast<double>(st.comp_k)},
      {"compressed_value_bytes", static_cast<double>(st.comp_v)},
      {"fp16_key_bytes", static_cast<double>(fp16_k)},
      {"fp16_value_bytes", static_cast<double>(fp16_k)},
      {"residual_fp16_bytes", static_cast<double>(residual)},
      {"perm_bytes", static_cast<double>(perm_bytes)},
      {"quantized_tokens", static_cast<double>(st.q_end)},
      {"tokens_seen", static_cast<double>(st.offset)},
      {"key_perms", st.tr.has_perms() ? 1.0 : 0.0},
      {"value_perms", st.tr.has_perms() ? 1.0 : 0.0},
      {"assigned_avg_bits", avg_bits},
      {"packed_rows", static_cast<double>(n_q)},
      {"rotation", st.tr.signs.empty() ? 0.0 : 1.0},
  };
  return cs;
}

void SkvqCache::save(std::ostream& out) const {
  const State& st = *st_;
  StateWriter w;
  set_->save(w);
  w.boolean(st.has_data);
  if (st.has_data) {
    w.u8(static_cast<uint8_t>(st.dtype));
    w.i64(st.batch);
    w.i64(st.heads);
    w.i64(st.offset);
    w.i64(st.q_end);
    w.i64(st.comp_k);
    w.i64(st.comp_v);
    st.tr.save(w);
    st.sinks.save(w);
    w.u64(st.blocks.size());
    for (const auto& blk : st.blocks) {
      w.i64(blk->rows);
      w.i64(blk->first_pos);
      w.blob(blk->k.data(), blk->k.size());
      w.blob(blk->v.data(), blk->v.size());
    }
    st.tail.save(w);
  }
  w.write(out, method());
}

void SkvqCache::load(std::istream& in) {
  const Settings& s = *set_;
  StateReader r(in, method());
  s.check_saved(r, kOp);
  auto ns = std::make_unique<State>();
  const std::string pre = "[skvq] load: ";
  ns->has_data = r.boolean();
  if (ns->has_data) {
    const uint8_t dt = r.u8();
    VQ_CHECK(dt <= 2, pre + "expected a dtype code 0..2 but got " + std::to_string(dt));
    ns->dtype = static_cast<DType>(dt);
    ns->batch = r.i64_in("batch", 1, 1 << 20);
    ns->heads = r.i64_in("heads", 1, 1 << 20);
    ns->offset = r.i64_in("offset", 0, s.max_ctx > 0 ? s.max_ctx : INT32_MAX);
    ns->q_end = r.i64_in("quantized_tokens", 0, ns->offset);
    ns->comp_k = r.i64();
    ns->comp_v = r.i64();
    const int64_t d = s.head_dim, bh = ns->batch * ns->heads;
    VQ_CHECK(ns->q_end % s.window == 0 && ns->offset - ns->q_end < s.flush_span,
             pre +
                 "expected a frontier at a whole chunk with fewer than window + recent rows "
                 "after it but got offset " +
                 std::to_string(ns->offset) + ", frontier " + std::to_string(ns->q_end));
    ns->tr = skvq::Transforms::load(r, ns->heads, d, kOp);
    VQ_CHECK(ns->tr.signs.empty() == !s.rotate,
             pre + "expected rotation signs exactly when skvq_rotation is on");
    VQ_CHECK(ns->tr.has_perms() == (s.reorder && (ns->q_end > 0 || !s.file_perm_k.empty())),
             pre + "expected permutations exactly when reordering has run");
    ns->sinks.init(ns->dtype, ns->batch, ns->heads, d, false);
    ns->sinks.load(r, kOp);
    VQ_CHECK(ns->sinks.count == (ns->q_end > 0 ? s.n_sink : 0),
             pre + "expected " + std::to_string(ns->q_end > 0 ? s.n_sink : 0) +
                 " sink rows but got " + std::to_string(ns->sinks.count));
    const uint64_t n_blocks = r.u64();
    VQ_CHECK(n_blocks == static_cast<uint64_t>(ns->q_end / s.window),
             pre + "expected " + std::to_string(ns->q_end / s.window) + " packed chunks but got " +
                 std::to_string(n_blocks));
    int64_t ck = 0, cv = 0;
    for (uint64_t i = 0; i < n_blocks; ++i) {
      auto blk = std::make_unique<PackedBlock>();
      blk->rows = r.i64();
      blk->first_pos = r.i64();
      const int64_t c0 = static_cast<int64_t>(i) * s.window;
      const int64_t want_first = i == 0 ? s.n_sink : c0;
      VQ_CHECK(blk->first_pos == want_first && blk->rows == c0 + s.window - want_first,
               pre + "expected chunk " + std::to_string(i) + " at rows " +
                   std::to_string(want_first) + ".." + std::to_string(c0 + s.window - 1));
      const std::string kb = r.blob(), vb = r.blob();
      VQ_CHECK(static_cast<int64_t>(kb.size()) == bh * blk->rows * s.fk.row_stride &&
                   static_cast<int64_t>(vb.size()) == bh * blk->rows * s.fv.row_stride,
               pre + "expected packed chunk sizes of the row format");
      blk->k.assign(kb.begin(), kb.end());
      blk->v.assign(vb.begin(), vb.end());
      ck += skvq_compressed_bytes(blk->rows, d, s.qk.bits, s.qk.group_size, s.qk.meta).total() * bh;
      cv += skvq_compressed_bytes(blk->rows, d, s.qv.bits, s.qv.group_size, s.qv.meta).total() * bh;
      ns->blocks.push_back(std::move(blk));
    }
    VQ_CHECK(ck == ns->comp_k && cv == ns->comp_v,
             pre + "expected compressed byte counters matching the chunks");
    ns->tail.init(ns->dtype, ns->batch, ns->heads, d, false);
    ns->tail.load(r, kOp);
    VQ_CHECK(ns->tail.count == ns->offset - ns->q_end,
             pre + "expected " + std::to_string(ns->offset - ns->q_end) + " tail rows but got " +
                 std::to_string(ns->tail.count));
    for (auto& blk : ns->blocks) blk->bind(ns->batch, ns->heads, s, ns->tr, ns->dtype);
  }
  r.expect_end();
  st_.swap(ns);
}

// ---- calibrated permutations ------------------------------------------------------------------

std::vector<int32_t> skvq_channel_perms(const TensorView& block) {
  const int64_t bsz = block.shape[0], heads = block.shape[1], n = block.shape[2],
                d = block.shape[3];
  VQ_CHECK(bsz >= 1 && heads >= 1 && n >= 1 && d >= 1 && block.data,
           "[skvq_channel_perms] expected a non-empty block [B, H, S, D] but got " +
               skvq::shape_str(block));
  std::vector<int32_t> out(static_cast<size_t>(heads * d));
  std::vector<float> rows(static_cast<size_t>(bsz * n * d));
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t b = 0; b < bsz; ++b)
      for (int64_t i = 0; i < n; ++i)
        convert_view_row(block, b, h, i, rows.data() + (b * n + i) * d, DType::kF32);
    const auto p = skvq::channel_range_perm(rows.data(), bsz * n, d);
    std::copy(p.begin(), p.end(), out.begin() + h * d);
  }
  return out;
}

void save_skvq_perm_file(const std::string& path, const SkvqPermSet& ps) {
  VQ_CHECK(ps.key.size() == ps.value.size() && !ps.key.empty(),
           "[skvq_perm_file] expected as many key as value layers (>= 1) but got " +
               std::to_string(ps.key.size()) + " and " + std::to_string(ps.value.size()));
  nlohmann::json j;
  j["format"] = "veloxquant.skvq_perms";
  j["version"] = 1;
  j["n_kv_heads"] = ps.n_kv_heads;
  j["head_dim"] = ps.head_dim;
  j["layers"] = nlohmann::json::array();
  for (size_t l = 0; l < ps.key.size(); ++l) {
    VQ_CHECK(skvq::is_perm_set(ps.key[l], ps.n_kv_heads, ps.head_dim) &&
                 skvq::is_perm_set(ps.value[l], ps.n_kv_heads, ps.head_dim),
             "[skvq_perm_file] expected valid permutations for layer " + std::to_string(l));
    nlohmann::json layer;
    for (int kv = 0; kv < 2; ++kv) {
      nlohmann::json heads = nlohmann::json::array();
      const auto& p = kv == 0 ? ps.key[l] : ps.value[l];
      for (int64_t h = 0; h < ps.n_kv_heads; ++h)
        heads.push_back(
            std::vector<int32_t>(p.begin() + h * ps.head_dim, p.begin() + (h + 1) * ps.head_dim));
      layer[kv == 0 ? "key" : "value"] = heads;
    }
    j["layers"].push_back(layer);
  }
  std::ofstream f(path);
  VQ_CHECK(f.good(), "[skvq_perm_file] expected a writable file but could not open '" + path + "'");
  f << j.dump() << "\n";
  VQ_CHECK(f.good(), "[skvq_perm_file] expected to write '" + path + "' but the write failed");
}

SkvqPermSet load_skvq_perm_file(const std::string& path) {
  std::ifstream f(path);
  VQ_CHECK(f.good(), "[skvq_perm_file] expected a readable file but could not open '" + path + "'");
  const std::string pre = "[skvq_perm_file] '" + path + "': ";
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(f);
  } catch (const std::exception& e) {
    throw Error(pre + "expected JSON but got a parse error: " + e.what());
  }
  // An integer field in [lo, hi]. JSON numbers that are not integers (1e20, 2.5) are refused
  // before any conversion: converting an out-of-range double to an integer is undefined.
  const auto integer = [&pre](const nlohmann::json& v, const std::string& what, int64_t lo,
                              int64_t hi) -> int64_t {
    bool ok = false;
    int64_t x = 0;
    if (v.is_number_unsigned()) {  // nlohmann stores non-negative integers as unsigned
      ok = v.get<uint64_t>() <= static_cast<uint64_t>(hi);
      if (ok) x = static_cast<int64_t>(v.get<uint64_t>());
    } else if (v.is_number_integer()) {
      ok = true;
      x = v.get<int64_t>();
    }
    VQ_CHECK(ok && x >= lo && x <= hi, pre + what + ": expected an integer in " +
                                           std::to_string(lo) + ".." + std::to_string(hi) +
                                           " but got " + v.dump());
    return x;
  };
  SkvqPermSet ps;
  try {
    VQ_CHECK(j.is_object() && j.value("format", "") == "veloxquant.skvq_perms",
             pre + "expected format \"veloxquant.skvq_perms\"");
    integer(j.at("version"), "version", 1, 1);
    ps.n_kv_heads = integer(j.at("n_kv_heads"), "n_kv_heads", 1, 4096);
    ps.head_dim = integer(j.at("head_dim"), "head_dim", 1, 65536);
    const auto& layers = j.at("layers");
    VQ_CHECK(layers.is_array() && !layers.empty(), pre + "expected a non-empty layers array");
    for (size_t l = 0; l < layers.size(); ++l)
      for (int kv = 0; kv < 2; ++kv) {
        const std::string where = "layer " + std::to_string(l) + (kv == 0 ? " key" : " value");
        const auto& heads = layers[l].at(kv == 0 ? "key" : "value");
        VQ_CHECK(heads.is_array() && static_cast<int64_t>(heads.size()) == ps.n_kv_heads,
                 pre + "layer " + std::to_string(l) + ": expected " +
                     std::to_string(ps.n_kv_heads) + " heads");
        std::vector<int32_t> flat;
        for (const auto& hp : heads) {
          VQ_CHECK(hp.is_array() && static_cast<int64_t>(hp.size()) == ps.head_dim,
                   pre + "layer " + std::to_string(l) + ": expected " +
                       std::to_string(ps.head_dim) + " channels per head but got " +
                       (hp.is_array() ? std::to_string(hp.size()) : std::string(hp.type_name())));
          for (const auto& c : hp)
            flat.push_back(
                static_cast<int32_t>(integer(c, where + " channel", 0, ps.head_dim - 1)));
        }
        VQ_CHECK(skvq::is_perm_set(flat, ps.n_kv_heads, ps.head_dim),
                 pre + "layer " + std::to_string(l) +
                     ": expected each head's list to be a "
                     "permutation of 0.." +
                     std::to_string(ps.head_dim - 1));
        (kv == 0 ? ps.key : ps.value).push_back(std::move(flat));
      }
  } catch (const nlohmann::json::exception& e) {
    throw Error(pre + "expected the documented fields but got: " + e.what());
  }
  return ps;
}

}  // namespace vq
