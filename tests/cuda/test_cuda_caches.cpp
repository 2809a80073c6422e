// GPU-resident caches (veloxquant/cuda_cache.h) against the CPU caches of the same config: the
// same sequence of prefill chunks and decode steps is fed to both, and after every call the
// fetched views must hold the same rows per (b, h) in the same order, with the same positions,
// the same representation (full precision or packed) and the same bytes (full-precision rows,
// packed codes + metadata; permutations too), and the caches the same offsets, stored positions
// and figures (bytes_resident excepted: on the device it is what cudaMalloc holds, checked
// against the byte formulas instead). decode_attention over each GPU view is checked against
// attention_reference over the CPU view (dequantized), and prefill_attention over the views of
// prefill calls likewise. Methods full, snapkv, skvq, snapkv+skvq, streaming; snapkv and
// snapkv+skvq also with snap_evict_at = prompt_end (end_prompt() on both caches, or the first
// single-token call), and chunked prompt-end prefill against one-shot on the device; snapkv also
// with decode-time eviction (snap_decode_budget, the decode query window on the device);
// snapkv+skvq also with a Hadamard rotation. After every step: make_mask of both caches (1 and 4
// queries, with and without a window) agree entry for entry, and the state files too: the device
// cache saves the CPU cache's bytes exactly, a CPU cache loads them and a device cache loads the
// CPU's (positions, figures, and saving again gives the same bytes); from the middle of each case
// on, both sides continue from the loaded caches. Error cases: bad configs, shapes, max_ctx, trim,
// merge; state files refused (corrupted, truncated, another method, other settings, another
// batch) with the CPU's message and nothing changed.
// snapkv+skvq scores packed rows by their dequantized keys: the device dequantizes with the same
// two roundings (code * scale, + lo) as the CPU, so its frame is bit-identical and the selections
// meet the same ulp-of-expf argument as SnapKV alone.
// SnapKV scores are not bit-exact on the device (expf differs from the host's exp by an ulp or
// two; test_cuda_snapkv bounds the score difference): with continuous random data no two
// competing scores come within that bound, so the selections must still be identical here.
// Skipped cleanly without a device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "cuda/attention_check.h"
#include "cuda/cuda_test_util.h"
#include "cuda/device_cache_scores.h"
#include "util/test_util.h"
#include "veloxquant/builder.h"
#include "veloxquant/cuda.h"
#include "veloxquant/cuda_cache.h"
#include "veloxquant/error.h"
#include "veloxquant/packed.h"
#include "veloxquant/query_moments.h"
#include "veloxquant/skvq_cache.h"
#include "veloxquant/snapkv_skvq_cache.h"

namespace vq {
namespace {

// ---- blocks on host and device ------------------------------------------------------------------

// A host block [B, H, S, D] stored either contiguous or token-major ([B, S, H, D] memory, the
// layout a projection produces), and its device copy with the same strides.
struct Block {
  Tensor storage;
  TensorView host;
  cuda::DeviceBuffer buf;
  TensorView dev;
};

std::unique_ptr<Block> make_block(DType t, int64_t B, int64_t H, int64_t S, int64_t D,
                                  uint64_t seed, bool token_major) {
  auto blk = std::make_unique<Block>();
  blk->storage = token_major ? test::random_tensor(t, B, S, H, D, seed)
                             : test::random_tensor(t, B, H, S, D, seed);
  TensorView v = blk->storage.view();
  if (token_major) {  // view [B, H, S, D] over [B, S, H, D] memory
    v.shape = {B, H, S, D};
    v.stride = {S * H * D, D, H * D, 1};
  }
  blk->host = v;
  blk->buf = cuda::DeviceBuffer::from_host(blk->storage.data(), blk->storage.nbytes());
  blk->dev = v;
  blk->dev.data = blk->buf.data();
  return blk;
}

// Keys and values [B, H, S, D] of dtype t, contiguous (seeds seed and seed + 1).
struct KV {
  std::unique_ptr<Block> k, v;
};
KV make_kv(DType t, int64_t B, int64_t H, int64_t S, int64_t D, uint64_t seed) {
  return {make_block(t, B, H, S, D, seed, false), make_block(t, B, H, S, D, seed + 1, false)};
}

// ---- rows of a view, per (b, h) -----------------------------------------------------------------

struct Row {
  int32_t pos = 0;
  bool packed = false;
  std::vector<uint8_t> k, v;
};
using Rows = std::vector<std::vector<Row>>;  // [B * H][rows]

Rows cpu_rows(const CacheView& view) {
  const int64_t B = view.batch, H = view.n_kv_heads, D = view.head_dim;
  Rows out(static_cast<size_t>(B * H));
  for (const ViewSegment& s : view.segments)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < s.n_rows; ++i) {
          Row r;
          r.pos = s.position(b, h, i, H);
          r.packed = s.packed != nullptr;
          if (s.packed) {
            const uint8_t* k = s.packed->keys.record(b, h, i);
            const uint8_t* v = s.packed->values.record(b, h, i);
            r.k.assign(k, k + s.packed->keys.fmt.row_stride);
            r.v.assign(v, v + s.packed->values.fmt.row_stride);
          } else {
            EXPECT_EQ(s.keys.stride[3], 1);
            const size_t nb = static_cast<size_t>(D) * dtype_size(s.keys.dtype);
            const auto* k = static_cast<const uint8_t*>(s.keys.row(b, h, i));
            const auto* v = static_cast<const uint8_t*>(s.values.row(b, h, i));
            r.k.assign(k, k + nb);
            r.v.assign(v, v + nb);
          }
          out[static_cast<size_t>(b * H + h)].push_back(std::move(r));
        }
  return out;
}

Rows gpu_rows(const cuda::DeviceCacheView& view) {
  const int64_t F = view.batch() * view.n_kv_heads();
  Rows out(static_cast<size_t>(F));
  for (size_t si = 0; si < view.segments().size(); ++si) {
    const cuda::HostSegment hs = cuda::download_segment(view, si);
    for (int64_t f = 0; f < F; ++f)
      for (int64_t i = 0; i < hs.n_rows; ++i) {
        Row r;
        r.pos = hs.positions[static_cast<size_t>(f * hs.n_rows + i)];
        r.packed = hs.packed;
        const uint8_t* k = hs.keys.data() + (f * hs.n_rows + i) * hs.k_row_bytes;
        const uint8_t* v = hs.values.data() + (f * hs.n_rows + i) * hs.v_row_bytes;
        r.k.assign(k, k + hs.k_row_bytes);
        r.v.assign(v, v + hs.v_row_bytes);
        out[static_cast<size_t>(f)].push_back(std::move(r));
      }
  }
  return out;
}

void expect_same_rows(const Rows& c, const Rows& g, const std::string& vars) {
  ASSERT_EQ(c.size(), g.size()) << vars;
  int64_t bad = 0;
  for (size_t f = 0; f < c.size(); ++f) {
    ASSERT_EQ(c[f].size(), g[f].size()) << vars << " frame " << f << ": row counts";
    for (size_t i = 0; i < c[f].size(); ++i) {
      const Row &a = c[f][i], &b = g[f][i];
      if (a.pos != b.pos || a.packed != b.packed || a.k != b.k || a.v != b.v) {
        if (bad++ < 3)
          ADD_FAILURE() << vars << " frame " << f << " row " << i << ": cpu pos " << a.pos
                        << (a.packed ? " packed" : " fp") << ", gpu pos " << b.pos
                        << (b.packed ? " packed" : " fp") << ", keys "
                        << (a.k == b.k ? "equal" : "differ") << ", values "
                        << (a.v == b.v ? "equal" : "differ");
      }
    }
  }
  EXPECT_EQ(bad, 0) << vars << ": rows that differ";
}

// Permutations of the packed segments: the CPU's (one per packed block, all the same) against
// the device's.
void expect_same_perms(const CacheView& cv, const cuda::DeviceCacheView& gv,
                       const std::string& vars) {
  const int64_t HD = cv.n_kv_heads * cv.head_dim;
  const PackedSegment* cp = nullptr;
  for (const ViewSegment& s : cv.segments)
    if (s.packed) cp = s.packed;
  for (size_t i = 0; i < gv.segments().size(); ++i) {
    if (!gv.segments()[i].packed) continue;
    ASSERT_NE(cp, nullptr) << vars;
    const cuda::HostSegment hs = cuda::download_segment(gv, i);
    ASSERT_EQ(hs.k_perm.empty(), cp->keys.perm == nullptr) << vars;
    if (cp->keys.perm) {
      EXPECT_EQ(hs.k_perm, std::vector<int32_t>(cp->keys.perm, cp->keys.perm + HD)) << vars;
      EXPECT_EQ(hs.v_perm, std::vector<int32_t>(cp->values.perm, cp->values.perm + HD)) << vars;
    }
  }
}

void expect_same_stats(const CacheStats& c, const CacheStats& g, const std::string& vars) {
  EXPECT_EQ(c.method, g.method) << vars;
  EXPECT_EQ(c.tokens_seen, g.tokens_seen) << vars;
  EXPECT_EQ(c.rows_stored, g.rows_stored) << vars;
  EXPECT_EQ(c.bytes_accounted, g.bytes_accounted) << vars;
  EXPECT_EQ(c.fp16_bytes, g.fp16_bytes) << vars;
  ASSERT_EQ(c.figures.size(), g.figures.size()) << vars;
  for (size_t i = 0; i < c.figures.size(); ++i) {
    EXPECT_EQ(c.figures[i].first, g.figures[i].first) << vars;
    EXPECT_EQ(c.figures[i].second, g.figures[i].second) << vars << " " << c.figures[i].first;
  }
}

// ---- masks and state files ----------------------------------------------------------------------

// The message of the vq::Error f throws, or "" when it throws none.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

void expect_same_mask(const Mask& c, const Mask& g, int64_t B, int64_t H, const std::string& vars) {
  ASSERT_EQ(static_cast<int>(c.kind), static_cast<int>(g.kind)) << vars;
  ASSERT_EQ(c.n_queries, g.n_queries) << vars;
  ASSERT_EQ(c.n_keys, g.n_keys) << vars;
  if (c.kind != Mask::Kind::kExplicit) return;
  int64_t bad = 0;  // visible() broadcasts a mask made before any row was seen
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < c.n_queries; ++i)
        for (int64_t j = 0; j < c.n_keys; ++j)
          bad += c.visible(b, h, i, j) != g.visible(b, h, i, j);
  EXPECT_EQ(bad, 0) << vars << ": mask entries that differ";
}

// make_mask of both caches for 1 and 4 queries, without and with a window of 7: the same mask,
// or both refused (a windowed single query while a prompt-end eviction is owed).
void expect_same_masks(const KVCache& cpu, const cuda::DeviceKVCache& gpu, int64_t B, int64_t H,
                       const std::string& vars) {
  for (const int64_t nq : {int64_t{1}, int64_t{4}})
    for (const int64_t window : {int64_t{0}, int64_t{7}}) {
      const std::string mv =
          vars + " mask n_queries " + std::to_string(nq) + " window " + std::to_string(window);
      Mask cm, gm;
      const std::string c_err = error_of([&] { cm = cpu.make_mask(nq, window); });
      const std::string g_err = error_of([&] { gm = gpu.make_mask(nq, window); });
      ASSERT_EQ(c_err.empty(), g_err.empty()) << mv << ": " << c_err << " / " << g_err;
      if (c_err.empty()) expect_same_mask(cm, gm, B, H, mv);
    }
}

template <class C>
std::string save_bytes(const C& c) {
  std::ostringstream out;
  c.save(out);
  return out.str();
}

template <class C>
void load_bytes(C& c, const std::string& bytes) {
  std::istringstream in(bytes);
  c.load(in);
}

void expect_same_bytes(const std::string& a, const std::string& b, const std::string& vars) {
  ASSERT_EQ(a.size(), b.size()) << vars << ": state sizes";
  const auto d = std::mismatch(a.begin(), a.end(), b.begin());
  EXPECT_TRUE(d.first == a.end()) << vars << ": states differ first at byte "
                                  << (d.first - a.begin()) << " of " << a.size();
}

void expect_same_state(const KVCache& cpu, const cuda::DeviceKVCache& gpu, int64_t B, int64_t H,
                       const std::string& vars) {
  ASSERT_EQ(cpu.offset(), gpu.offset()) << vars;
  ASSERT_EQ(cpu.stored_rows(), gpu.stored_rows()) << vars;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      EXPECT_EQ(cpu.stored_positions(b, h), gpu.stored_positions(b, h)) << vars;
  expect_same_stats(cpu.stats(), gpu.stats(), vars);
}

// State exchange after a step: the device cache writes the CPU cache's bytes exactly; a CPU cache
// loads them and writes them back unchanged; a device cache loads the CPU's bytes, matches the
// CPU cache (positions, figures) and writes them back unchanged (the device round trip).
// Returns the two loaded caches.
std::pair<std::unique_ptr<KVCache>, std::unique_ptr<cuda::DeviceKVCache>> exchange_state(
    const CacheConfig& cfg, const KVCache& cpu, const cuda::DeviceKVCache& gpu, int64_t B,
    int64_t H, int64_t D, const std::string& vars, int64_t layer = 0) {
  const std::string bc = save_bytes(cpu), bg = save_bytes(gpu);
  expect_same_bytes(bc, bg, vars + " device save vs CPU save");
  // A state the CPU cache's own load refuses (a CPU-side bound, see the report): the device
  // load, which validates with the CPU's, must refuse it with the same message; nothing more can
  // be exchanged at this step.
  const std::string cpu_refusal = error_of([&] { load_bytes(*make_layer_cache(cfg, layer), bc); });
  if (!cpu_refusal.empty()) {
    auto g = cuda::make_device_cache(cfg, B, H, D, nullptr, layer);
    EXPECT_EQ(cpu_refusal, error_of([&] { load_bytes(*g, bc); })) << vars;
    EXPECT_EQ(g->offset(), 0) << vars;
    std::printf("[state] %s: the CPU cache refuses its own state (%s); the device alike\n",
                vars.c_str(), cpu_refusal.c_str());
    return {nullptr, nullptr};
  }
  auto cpu2 = make_layer_cache(cfg, layer);
  load_bytes(*cpu2, bg);
  expect_same_bytes(bc, save_bytes(*cpu2), vars + " device save -> CPU load -> CPU save");
  auto gpu2 = cuda::make_device_cache(cfg, B, H, D, nullptr, layer);
  load_bytes(*gpu2, bc);
  expect_same_state(cpu, *gpu2, B, H, vars + " CPU save -> device load");
  expect_same_bytes(bc, save_bytes(*gpu2), vars + " CPU save -> device load -> device save");
  return {std::move(cpu2), std::move(gpu2)};
}

using test::random_q;

// Channel-axis keys (skvq_key_axis=channel): the decode kernel (decode_attention_channel.cu)
// computes a logit as sum_c fl(q'_c s_c) code_tc + sum_c q'_c lo_c in fp32, against the dense
// twin's keys k_c = fl(fl(code_tc s_c) + lo_c): one rounding of each product q'_c s_c, a chain
// of D fmas over the codes (exact in fp32), D fmas for the bias and one addition, and the twin's
// two roundings, so the logit errs by at most gamma(D + 4) sum_c |q'_c| m_c with
// m_c = |code_tc s_c| + |lo_c| (the metadata values exact in fp32), <= gamma(D + 4) ||q|| ||m||
// (Cauchy-Schwarz; ||q'|| = ||q|| up to the transform's rounding, inside gamma's slack). kDecode's
// bound (attention_bounds.h) carries gamma(D + log2 D + 3D/8 + 8) ||q|| ||k|| plus kGpuLogitRel
// ||q|| ||k|| = 2^-11 ||q|| ||k||; with ||m|| <= 16 ||k|| per row the channel term is at most
// 16 gamma(132) < 2^-12 of ||q|| ||k|| (D <= 128), inside kGpuLogitRel alone. Values (2-, 3- and
// 4-bit codes with the tile's metadata table) are fl((1 + c 2^-b) (2^b s) + fl(lo - 2^b s)), not
// the twin's fl(fl(c s) + lo) bit for bit: with u = 2^-24 both lie within u (|lo| + 2^b |s|) +
// u |v| and u |c s| + 2 u |v| of c s + lo, so they differ by at most
// u (|lo| + 2^(b+1) |s| + 3 |v|) per value (|c s| <= 2^b |s|), about 2^-21 of the row's group
// magnitude |lo| + 2^b |s|; kGpuValueRel allows 2^-9 of the weighted |v|, which holds while a
// row's group magnitude is within 2^11 of the weighted values (true of these tests' data, whose
// worst channel-axis decode error is under 1 % of the bound; not proven for every input). Other
// widths keep the twin's two roundings. This checks the precondition ||m|| <= 16 ||k|| on every
// packed channel-axis row of a CPU view (per-block segments: a segment is one chunk).
void expect_channel_magnitudes(const CacheView& cv, const std::string& vars) {
  const int64_t D = cv.head_dim;
  std::vector<float> k(static_cast<size_t>(D));
  double worst = 0;
  for (const ViewSegment& sg : cv.segments) {
    if (!sg.packed || sg.packed->keys.fmt.axis != QuantAxis::kChannel) continue;
    const PackedTensor& t = sg.packed->keys;
    for (int64_t b = 0; b < cv.batch; ++b)
      for (int64_t h = 0; h < cv.n_kv_heads; ++h)
        for (int64_t i = 0; i < sg.n_rows; ++i) {
          dequantize_row(t, b, h, i, k.data());
          double kn = 0, mn = 0;
          for (int64_t c = 0; c < D; ++c) {
            const double lo = channel_meta(t.record(b, h, 0), t.fmt.row_stride, t.fmt, 2 * c);
            const double sc = channel_meta(t.record(b, h, 0), t.fmt.row_stride, t.fmt, 2 * c + 1);
            const double m =
                std::abs(code_at(t.record(b, h, i), c, t.fmt.spec) * sc) + std::abs(lo);
            mn += m * m;
            kn += static_cast<double>(k[c]) * k[c];
          }
          worst = std::max(worst, std::sqrt(mn / std::max(kn, 1e-300)));
        }
  }
  EXPECT_LE(worst, 16.0) << vars << ": ||m|| / ||k|| of a channel-axis key row";
}

// ---- the driver ---------------------------------------------------------------------------------

struct Case {
  CacheConfig cfg;
  int64_t B = 1, H = 2, D = 64, Hq = 8;
  DType dtype = DType::kF16;
  bool token_major = false;
  bool queries = false;   // pass the real queries (SnapKV query scoring)
  bool attention = true;  // decode / prefill attention checks over the views
  // Also upload the CPU view (DeviceCacheView::upload: per-block channel-axis segments merged
  // into one with its run starts) and check its rows and decode attention.
  bool upload_twin = false;
  int64_t layer = 0;  // the model layer both caches serve (entries of the per-layer lists)
  // Before each end_prompt(): the same external scores [B, H, rows so far] to both caches
  // (scoring=external), small integers so that the selection's tie rule decides.
  bool external_scores = false;
  std::vector<int64_t> steps;
  std::vector<size_t> end_prompt_after;  // 1-based steps after which end_prompt() runs on both
  std::string name;

  // Blocks [b, h, S, d] of dtype t (token-major memory or not), hq query heads; chainable.
  Case& blocks(int64_t b, int64_t h, int64_t d, int64_t hq, DType t, bool tm = false) {
    B = b;
    H = h;
    D = d;
    Hq = hq;
    dtype = t;
    token_major = tm;
    return *this;
  }
  // This case with the given steps and name.
  Case with(std::vector<int64_t> s, std::string n) const {
    Case c = *this;
    c.steps = std::move(s);
    c.name = std::move(n);
    return c;
  }
};

// prefix, then n single-token steps, then suffix.
std::vector<int64_t> steps(std::vector<int64_t> prefix, int n, std::vector<int64_t> suffix) {
  prefix.insert(prefix.end(), static_cast<size_t>(n), 1);
  prefix.insert(prefix.end(), suffix.begin(), suffix.end());
  return prefix;
}

// skvq K4V4, group 32, fp32 metadata, 8 recent rows kept, window 32 (a case of skvq and of
// snapkv+skvq).
void set_k4v4_meta_f32_recent8(CacheConfig& c) {
  c.skvq_bits_key = 4;
  c.skvq_bits_value = 4;
  c.skvq_group_size = 32;
  c.skvq_meta = MetaType::kF32;
  c.skvq_recent = 8;
  c.skvq_window = 32;
}

CacheConfig config(const char* method) {
  CacheConfig c;
  c.method = method;
  return c;
}

struct Worst {
  double decode = 0, prefill = 0;
};

void run_case(const Case& cs, uint64_t seed, Worst& worst) {
  CacheConfig cfg = cs.cfg;
  cfg.head_dim = cs.D;
  std::unique_ptr<KVCache> cpu = make_layer_cache(cfg, cs.layer);
  std::unique_ptr<cuda::DeviceKVCache> gpu =
      cuda::make_device_cache(cfg, cs.B, cs.H, cs.D, nullptr, cs.layer);
  const int64_t B = cs.B, H = cs.H, D = cs.D, Hq = cs.Hq;
  int step = 0;
  for (int64_t s : cs.steps) {
    const std::string vars = cs.name + " step " + std::to_string(step) +
                             " (S=" + std::to_string(s) + ", offset " +
                             std::to_string(cpu->offset()) + ")";
    ++step;
    auto k = make_block(cs.dtype, B, H, s, D, seed + 101 * step, cs.token_major);
    auto v = make_block(cs.dtype, B, H, s, D, seed + 101 * step + 1, cs.token_major);
    std::unique_ptr<Block> q;
    UpdateOptions co;
    cuda::DeviceUpdateOptions go;
    if (cs.queries) {
      q = make_block(DType::kF32, B, Hq, s, D, seed + 101 * step + 2, false);
      co.queries = &q->host;
      go.queries = &q->dev;
    }
    const CacheView cv = cpu->update_and_fetch(k->host, v->host, co);
    const cuda::DeviceCacheView gv = gpu->update_and_fetch(k->dev, v->dev, go);
    expect_same_rows(cpu_rows(cv), gpu_rows(gv), vars + " fetched view");
    expect_same_perms(cv, gv, vars);
    if (cfg.skvq_key_axis == QuantAxis::kChannel) expect_channel_magnitudes(cv, vars);
    if (cs.attention && cv.n_rows() > 0) {
      const DenseView dense = dequantize_view(cv, DType::kF32);
      AttentionParams ap;
      ap.q_pos0 = cpu->offset() - 1;  // the newest row's query
      const auto qd = random_q(B * Hq * D, seed + step);
      const auto od = cuda::decode_attention_host(qd, Hq, gv, ap);
      const auto cd =
          test::check_attention(dense.view, qd, Hq, 1, ap, od, test::AttnKernel::kDecode,
                                harness::tc_operands(cv), vars + " decode");
      EXPECT_GT(cd.nonzero, 0) << vars;
      worst.decode = std::max(worst.decode, cd.worst_ratio);
      if (cs.upload_twin) {
        const cuda::DeviceCacheView uv = cuda::DeviceCacheView::upload(cv);
        expect_same_rows(cpu_rows(cv), gpu_rows(uv), vars + " uploaded view");
        const auto ou = cuda::decode_attention_host(qd, Hq, uv, ap);
        const auto cu =
            test::check_attention(dense.view, qd, Hq, 1, ap, ou, test::AttnKernel::kDecode,
                                  harness::tc_operands(cv), vars + " decode (uploaded view)");
        worst.decode = std::max(worst.decode, cu.worst_ratio);
      }
      // Rotated packed rows take prefill's tensor-core path only (full-precision rows all f16
      // or all bf16).
      bool rotated = false, tc_rows = true, f16 = false, bf16 = false;
      for (const auto& sg : gv.segments()) {
        rotated = rotated || sg.k_signs || sg.v_signs;
        if (sg.packed || sg.n_rows == 0) continue;
        f16 = f16 || sg.dtype == DType::kF16;
        bf16 = bf16 || sg.dtype == DType::kBF16;
        if (sg.dtype != DType::kF16 && sg.dtype != DType::kBF16) tc_rows = false;
      }
      if (f16 && bf16) tc_rows = false;
      if (s > 1 && (!rotated || tc_rows)) {  // this call's queries, with and without a window
        for (int64_t window : {int64_t{0}, int64_t{13}}) {
          AttentionParams pp;
          pp.q_pos0 = cpu->offset() - s;
          pp.window = window;
          const auto qp = random_q(B * Hq * s * D, seed + step + 7);
          const auto op = cuda::prefill_attention_host(qp, Hq, s, gv, pp);
          const auto cp = test::check_attention(
              dense.view, qp, Hq, s, pp, op, test::AttnKernel::kPrefill, harness::tc_operands(cv),
              vars + " prefill window " + std::to_string(window));
          EXPECT_GT(cp.nonzero, 0) << vars;
          worst.prefill = std::max(worst.prefill, cp.worst_ratio);
        }
      }
    }
    expect_same_state(*cpu, *gpu, B, H, vars);
    if (::testing::Test::HasFatalFailure()) return;
    const CacheStats gs = gpu->stats();
    // Resident bytes are real allocations that hold at least what the formula counts (records
    // round their codes up to the metadata alignment, never down) minus the permutations the
    // formula counts at 4 bytes and the buffers hold at 4 bytes too.
    EXPECT_GE(gs.bytes_resident, gs.bytes_accounted) << vars;
    if (std::find(cs.end_prompt_after.begin(), cs.end_prompt_after.end(),
                  static_cast<size_t>(step)) != cs.end_prompt_after.end()) {
      if (cs.external_scores) {
        const int64_t n = cpu->offset();
        std::mt19937 rng(static_cast<uint32_t>(seed + 977 * step));
        std::vector<float> sc(static_cast<size_t>(B * H * n));
        for (float& x : sc) x = static_cast<float>(rng() % 7);
        cpu->set_external_scores(sc.data(), B, H, n);
        cuda::set_external_scores(*gpu, sc.data(), B, H, n);
      }
      cpu->end_prompt();
      gpu->end_prompt();
      expect_same_state(*cpu, *gpu, B, H, vars + " after end_prompt");
      if (::testing::Test::HasFatalFailure()) return;
    }
    expect_same_masks(*cpu, *gpu, B, H, vars);
    // skvq_protect: no state is written while the selection of protected rows is owed.
    const auto* sk = dynamic_cast<const SkvqCache*>(cpu.get());
    if (sk && sk->protection_pending()) continue;
    auto [cpu2, gpu2] = exchange_state(cfg, *cpu, *gpu, B, H, D, vars, cs.layer);
    if (step == static_cast<int>(cs.steps.size() + 1) / 2 && cpu2) {
      // From the middle on, both sides continue from loaded state (the CPU cache from the device's
      // bytes, the device cache from the CPU's): every later step must still match bit for bit.
      cpu = std::move(cpu2);
      gpu = std::move(gpu2);
    }
  }
}

// Every case, seeds seed0 + i; prints the worst attention errors as a fraction of the tolerance.
void run_cases(const char* label, const std::vector<Case>& cases, uint64_t seed0) {
  Worst w;
  for (size_t i = 0; i < cases.size(); ++i) run_case(cases[i], seed0 + i, w);
  std::printf("[%s] worst decode error %.3f%%, prefill %.3f%% of tolerance\n", label,
              100 * w.decode, 100 * w.prefill);
}

// ---- tests --------------------------------------------------------------------------------------

TEST(CudaCaches, FullMatchesCpu) {
  SKIP_WITHOUT_DEVICE();
  Case c;
  c.cfg = config("full");
  run_cases("full",
            {c.with({17, 1, 1, 300, 1, 129}, "full f16 B1 H2 D64"),
             c.blocks(2, 1, 128, 4, DType::kBF16, true)
                 .with({1, 127, 1}, "full bf16 token-major B2 H1 D128"),
             c.blocks(8, 2, 64, 2, DType::kF32).with({129, 1}, "full f32 B8 H2 D64")},
            1000);
}

// A refused allocation that the caller catches (DeviceBuffer's cudaMalloc of 4 PiB) leaves no
// stale error behind: the next kernel launches and their checks succeed (a bench once failed at
// a later engine's first launch check after copy_bandwidth's fallback from a refused buffer).
TEST(CudaCaches, RefusedAllocationLeavesLaterLaunchesWorking) {
  SKIP_WITHOUT_DEVICE();
  EXPECT_THROW(cuda::DeviceBuffer(size_t{1} << 52), Error);
  Case c;
  c.cfg = config("full");
  run_cases("full after a refused allocation", {c.with({5, 1}, "full f16 B1 H2 D64")}, 1000);
}

TEST(CudaCaches, FullTrimMatchesCpu) {
  SKIP_WITHOUT_DEVICE();
  CacheConfig cfg;
  cfg.method = "full";
  cfg.head_dim = 64;
  auto cpu = make_cache(cfg);
  auto gpu = cuda::make_device_cache(cfg, 1, 2, 64);
  ASSERT_TRUE(gpu->is_trimmable());
  const KV kv = make_kv(DType::kF16, 1, 2, 40, 64, 5);
  cpu->update_and_fetch(kv.k->host, kv.v->host);
  gpu->update_and_fetch(kv.k->dev, kv.v->dev);
  EXPECT_EQ(cpu->trim(7), gpu->trim(7));
  EXPECT_EQ(cpu->trim(100), gpu->trim(100) + 0);
  EXPECT_THROW(gpu->trim(-1), Error);
  const KV kv2 = make_kv(DType::kF16, 1, 2, 9, 64, 7);
  const CacheView cv = cpu->update_and_fetch(kv2.k->host, kv2.v->host);
  const cuda::DeviceCacheView gv = gpu->update_and_fetch(kv2.k->dev, kv2.v->dev);
  expect_same_rows(cpu_rows(cv), gpu_rows(gv), "full after trim");
  expect_same_stats(cpu->stats(), gpu->stats(), "full after trim");
}

TEST(CudaCaches, SnapKVMatchesCpu) {
  SKIP_WITHOUT_DEVICE();
  std::vector<Case> cases;
  Case c;
  c.cfg = config("snapkv");
  c.cfg.snap_budget = 24;
  c.cfg.snap_obs_window = 8;
  c.cfg.snap_n_sink = 4;
  cases.push_back(c.with({50, 37, 1, 1, 1, 20, 1, 2}, "snapkv key-proxy f16 B1 H2 D64"));
  c.cfg.snap_pool_kernel = 5;
  c.blocks(2, 2, 128, 8, DType::kBF16, true);
  cases.push_back(c.with({129, 1, 17, 1}, "snapkv pool max 5 bf16 token-major B2 H2 D128"));
  c.cfg.snap_pool_kernel = 3;
  c.cfg.snap_pool = PoolKind::kAvg;
  c.cfg.snap_keep_window = true;
  c.blocks(2, 2, 128, 8, DType::kF32);
  cases.push_back(c.with({127, 1, 40}, "snapkv keep-window avg 3 f32 B2 H2 D128"));
  c.cfg = config("snapkv");
  c.cfg.snap_budget = 20;
  c.cfg.snap_obs_window = 6;
  c.cfg.snap_scoring = SnapScoring::kQuery;
  c.queries = true;
  c.blocks(8, 1, 64, 4, DType::kF16);
  cases.push_back(c.with({33, 1, 1, 17, 2}, "snapkv query scoring GQA 4 B8 H1 D64"));
  run_cases("snapkv", cases, 2000);
}

TEST(CudaCaches, StreamingMatchesCpu) {
  SKIP_WITHOUT_DEVICE();
  Case c;
  c.cfg = config("streaming");
  c.cfg.streaming_n_sink = 4;
  c.cfg.streaming_window = 32;
  std::vector<Case> cases = {
      // 73 single steps slide past the slack: the run is moved back
      c.with(steps({50}, 73, {100, 1, 3, 2}), "streaming sinks 4 window 32 f16 B1 H2 D64")};
  c.cfg.streaming_n_sink = 0;
  c.cfg.streaming_window = 17;
  c.blocks(2, 2, 128, 8, DType::kBF16, true);
  cases.push_back(
      c.with({1, 2, 17, 1, 129, 1}, "streaming no sinks window 17 bf16 token-major B2 H2 D128"));
  c.cfg.streaming_n_sink = 7;
  c.cfg.streaming_window = 5;
  c.blocks(8, 1, 64, 8, DType::kF32);
  cases.push_back(c.with({3, 3, 1, 127, 1, 1}, "streaming sinks 7 window 5 f32 B8 H1 D64"));
  run_cases("streaming", cases, 4000);
}

// docs/design.md §C3 worked example: B=1, H=2, D=128, S=64, budget 16.
TEST(CudaCaches, SnapKVWorkedExample) {
  SKIP_WITHOUT_DEVICE();
  CacheConfig cfg;
  cfg.method = "snapkv";
  cfg.snap_budget = 16;
  auto gpu = cuda::make_device_cache(cfg, 1, 2, 128);
  const KV kv = make_kv(DType::kF16, 1, 2, 64, 128, 9);
  const cuda::DeviceCacheView view = gpu->update_and_fetch(kv.k->dev, kv.v->dev);
  EXPECT_EQ(view.n_rows(), 64);  // deferred eviction: this step sees every row
  CacheStats s = gpu->stats();
  EXPECT_EQ(s.figure("kept_key_bytes"), 8192);
  EXPECT_EQ(s.figure("full_key_bytes"), 32768);
  EXPECT_EQ(s.figure("eviction_ratio"), 4.0);
  EXPECT_EQ(s.figure("keep_rate"), 0.25);
  const KV kv1 = make_kv(DType::kF16, 1, 2, 1, 128, 11);
  gpu->update_and_fetch(kv1.k->dev, kv1.v->dev);
  s = gpu->stats();
  EXPECT_EQ(s.figure("kept_key_bytes"), 8192 + 512);
  EXPECT_EQ(s.figure("full_key_bytes"), 32768 + 512);
}

TEST(CudaCaches, SkvqMatchesCpu) {
  SKIP_WITHOUT_DEVICE();
  std::vector<Case> cases;
  Case c;
  c.cfg = config("skvq");
  c.cfg.skvq_window = 16;
  c.cfg.skvq_n_sink = 4;
  c.cfg.skvq_group_size = 16;
  cases.push_back(c.with(steps({35}, 13, {40, 1, 3}), "skvq K2V2 g16 f16 B1 H2 D64"));
  set_k4v4_meta_f32_recent8(c.cfg);
  c.blocks(2, 2, 128, 8, DType::kBF16, true);
  cases.push_back(c.with({17, 1, 129, 1, 1, 40},
                         "skvq K4V4 g32 meta f32 recent 8 bf16 token-major B2 H2 D128"));
  c.cfg = config("skvq");
  c.cfg.skvq_window = 16;
  c.cfg.skvq_bits_key = 2;
  c.cfg.skvq_bits_value = 4;
  c.cfg.skvq_group_size = 48;  // ragged last group at D = 64
  c.cfg.skvq_meta = MetaType::kFP8E4M3;
  c.cfg.skvq_reorder = false;
  c.blocks(8, 1, 64, 1, DType::kF32);
  cases.push_back(c.with({1, 17, 127, 1}, "skvq K2V4 g48 fp8 no reorder f32 B8 H1 D64"));
  c.cfg = config("skvq");
  c.cfg.skvq_window = 32;
  c.cfg.skvq_bits_key = 4;
  c.cfg.skvq_bits_value = 2;
  c.cfg.skvq_rotation = Rotation::kHadamard;
  c.cfg.skvq_rotate_values = true;
  c.blocks(1, 2, 128, 16, DType::kF16);
  cases.push_back(c.with({70, 1, 33}, "skvq K4V2 hadamard keys+values B1 H2 D128"));
  run_cases("skvq", cases, 3000);
}

// Path independence on the device (docs/design.md §C4): one-shot prefill and token-by-token decode
// give bit-identical stores (the flush rule depends only on the row count).
TEST(CudaCaches, SkvqPathIndependence) {
  SKIP_WITHOUT_DEVICE();
  CacheConfig cfg;
  cfg.method = "skvq";
  cfg.skvq_window = 32;
  cfg.skvq_recent = 3;
  auto one = cuda::make_device_cache(cfg, 2, 2, 64);
  auto step = cuda::make_device_cache(cfg, 2, 2, 64);
  const KV kv = make_kv(DType::kF16, 2, 2, 150, 64, 41);
  one->update_and_fetch(kv.k->dev, kv.v->dev);
  for (int64_t i = 0; i < 150; ++i) {
    TensorView ki = kv.k->dev.slice_tokens(i, i + 1), vi = kv.v->dev.slice_tokens(i, i + 1);
    step->update_and_fetch(ki, vi);
  }
  expect_same_rows(gpu_rows(one->stored_view()), gpu_rows(step->stored_view()),
                   "skvq one-shot vs token-by-token");
  EXPECT_EQ(one->stats().bytes_accounted, step->stats().bytes_accounted);
  EXPECT_EQ(one->stats().figure("quantized_tokens"), 128);
}

// docs/design.md §C4 worked example (B=1, H=2, D=64, window 16, n_sink 4, group 16, 2 bits, S =
// 35), and resident memory that follows the packed bytes over a long decode.
TEST(CudaCaches, SkvqWorkedExampleAndResidentBytes) {
  SKIP_WITHOUT_DEVICE();
  CacheConfig cfg;
  cfg.method = "skvq";
  cfg.skvq_window = 16;
  cfg.skvq_n_sink = 4;
  cfg.skvq_group_size = 16;
  auto gpu = cuda::make_device_cache(cfg, 1, 2, 64);
  const KV kv = make_kv(DType::kF16, 1, 2, 35, 64, 13);
  gpu->update_and_fetch(kv.k->dev, kv.v->dev);
  const CacheStats s = gpu->stats();
  EXPECT_EQ(s.figure("compressed_key_bytes"), 1792);
  EXPECT_EQ(s.figure("fp16_key_bytes"), 8960);
  EXPECT_EQ(s.figure("residual_fp16_bytes"), 3584);
  EXPECT_EQ(s.figure("perm_bytes"), 1024);
  EXPECT_EQ(s.figure("assigned_avg_bits"), 4.0);

  // 4096 rows of B=1, H=8, D=128 at K2V2 g32: the fp16 rows are freed as chunks are packed.
  CacheConfig big;
  big.method = "skvq";
  auto g2 = cuda::make_device_cache(big, 1, 8, 128);
  const KV kvb = make_kv(DType::kF16, 1, 8, 4096, 128, 15);
  g2->update_and_fetch(kvb.k->dev, kvb.v->dev);
  const CacheStats s2 = g2->stats();
  std::printf("[skvq resident] accounted %lld, resident %lld, fp16 %lld bytes\n",
              static_cast<long long>(s2.bytes_accounted), static_cast<long long>(s2.bytes_resident),
              static_cast<long long>(s2.fp16_bytes));
  // Packed capacity grows by at most 1.5x (plus a 64-row step) and the tail buffer holds at most
  // twice its rows (plus 16): resident <= 1.5 x accounted + 64 packed rows + 2 x the residual;
  // above 1 MiB cudaMalloc hands out whole 2 MiB pages (veloxquant/device_memory.h), so the two
  // packed stores (keys, values: 1.5 MiB each here) may each take up to one page more.
  const int64_t page = int64_t{2} << 20;
  const int64_t slack = 64 * 8 * 2 * 32 * 2 +
                        2 * static_cast<int64_t>(s2.figure("residual_fp16_bytes")) + 4096 +
                        2 * page;
  EXPECT_LE(s2.bytes_resident, s2.bytes_accounted * 3 / 2 + slack);
  // Had the fp16 rows not been freed, resident would be at least fp16_bytes. 2-bit codes with f16
  // metadata per 32 channels are 3 bits of 16 (0.19), grown by up to 1.5x (0.28) and rounded to
  // whole pages: below half of fp16_bytes (8 of its 16 MiB here) with room to spare.
  EXPECT_LT(s2.bytes_resident, s2.fp16_bytes / 2);
}

// Channel-axis keys (skvq_key_axis=channel, with whole-chunk runs and runs of skvq_key_rows rows):
// the device caches pack each block on the device (skvq_quantize_rows' channel kernels) into one
// run whose blocks the view lists (DeviceSegment::k_runs), bit for bit the CPU's records,
// positions, figures and state bytes (both directions of the state exchange); decode attention
// reads the keys in place (decode_attention_channel.cu), prefill tile by tile on CUDA cores (f32
// rows) or through dequant_rows on the tensor-core path; every output within kDecode / kPrefill
// bounds (the channel term derived at expect_channel_magnitudes). Rotation on and off; f16, fp8
// and f32 metadata; 2-, 3- and 4-bit keys, 2-, 4- and 1.5-bit values; skvq and snapkv+skvq.
TEST(CudaCaches, ChannelAxisKeysMatchCpu) {
  SKIP_WITHOUT_DEVICE();
  std::vector<Case> cases;
  Case c;
  c.cfg = config("skvq");
  c.cfg.skvq_key_axis = QuantAxis::kChannel;
  c.cfg.skvq_window = 32;
  c.cfg.skvq_n_sink = 4;
  c.cfg.skvq_group_size = 16;
  c.upload_twin = true;
  cases.push_back(c.with(steps({70}, 20, {33, 1}), "skvq channel K2V2 f16 meta B1 H2 D64"));
  c.upload_twin = false;
  c.cfg.skvq_key_rows = 7;
  c.cfg.skvq_bits_key = 4;
  c.cfg.skvq_meta = MetaType::kFP8E4M3;
  c.blocks(2, 2, 128, 8, DType::kBF16, true);
  c.upload_twin = true;
  cases.push_back(c.with({17, 1, 129, 1, 1, 40},
                         "skvq channel key_rows 7 K4V2 fp8 meta bf16 token-major B2 H2 D128"));
  c.upload_twin = false;
  c.cfg = config("skvq");
  c.cfg.skvq_key_axis = QuantAxis::kChannel;
  c.cfg.skvq_window = 32;
  c.cfg.skvq_bits_key = 3;
  c.cfg.skvq_bits_value = 1.5;
  c.cfg.skvq_meta = MetaType::kF32;
  c.cfg.skvq_rotation = Rotation::kHadamard;
  c.cfg.skvq_rotate_values = true;
  c.blocks(1, 2, 128, 16, DType::kF16);
  cases.push_back(c.with({70, 1, 33, 1}, "skvq channel K3V1.5 f32 meta hadamard keys+values D128"));
  c.cfg = config("skvq");
  c.cfg.skvq_key_axis = QuantAxis::kChannel;
  c.cfg.skvq_window = 16;
  c.cfg.skvq_n_sink = 2;
  c.cfg.skvq_key_rows = 5;
  c.cfg.skvq_bits_value = 4;
  c.cfg.skvq_group_size = 32;
  c.cfg.skvq_recent = 3;
  c.blocks(2, 1, 64, 2, DType::kF32);  // f32 rows: prefill's CUDA-core path (tiles in place)
  cases.push_back(
      c.with({1, 17, 50, 1, 1, 19}, "skvq channel key_rows 5 K2V4 recent 3 f32 B2 D64"));
  c.cfg.skvq_key_rows = 0;
  c.cfg.skvq_reorder = false;
  c.blocks(1, 4, 64, 16, DType::kF16);
  cases.push_back(c.with({45, 1, 31}, "skvq channel no reorder K2V4 f16 B1 H4 G4 D64"));
  // the decode kernel's word-load instances (decode_attention_channel.cu): 2-, 3- and 4-bit codes
  // of 4-byte aligned records at D 128, 1 to 8 query heads per block, runs of 32 rows (steps of
  // 128 rows span four runs), long enough for several steps per split
  c.cfg = config("skvq");
  c.cfg.skvq_key_axis = QuantAxis::kChannel;
  c.cfg.skvq_window = 64;
  c.cfg.skvq_key_rows = 32;
  c.cfg.skvq_group_size = 32;
  c.cfg.skvq_bits_key = 3;
  c.cfg.skvq_bits_value = 2;
  c.blocks(1, 2, 128, 16, DType::kF16);
  cases.push_back(c.with(steps({400}, 12, {}), "skvq channel key_rows 32 K3V2 f16 G8 D128"));
  c.cfg.skvq_bits_value = 3;
  c.cfg.skvq_meta = MetaType::kFP8E4M3;
  c.cfg.skvq_rotation = Rotation::kHadamard;
  c.blocks(2, 2, 128, 4, DType::kF16);
  cases.push_back(
      c.with(steps({300}, 12, {}), "skvq channel key_rows 32 K3V3 fp8 hadamard G2 D128"));
  c.cfg.skvq_bits_key = 2;
  c.cfg.skvq_bits_value = 2;
  c.blocks(1, 2, 128, 8, DType::kF16);
  cases.push_back(
      c.with(steps({520}, 12, {}), "skvq channel key_rows 32 K2V2 fp8 hadamard G4 D128"));
  c.cfg.skvq_bits_key = 4;
  c.cfg.skvq_bits_value = 2;
  c.cfg.skvq_meta = MetaType::kF32;
  c.blocks(1, 2, 128, 2, DType::kF16);
  cases.push_back(
      c.with(steps({260}, 12, {}), "skvq channel key_rows 32 K4V2 f32 hadamard G1 D128"));

  // snapkv+skvq: packed after the one prompt-end selection (the kept rows in chunks of window)
  Case sc;
  sc.cfg = config("snapkv+skvq");
  sc.cfg.skvq_key_axis = QuantAxis::kChannel;
  sc.cfg.snap_evict_at = SnapEvictAt::kPromptEnd;
  sc.cfg.snap_budget = 40;
  sc.cfg.snap_obs_window = 8;
  sc.cfg.snap_n_sink = 4;
  sc.cfg.skvq_window = 16;
  sc.cfg.skvq_n_sink = 4;
  sc.cfg.skvq_group_size = 16;
  sc.end_prompt_after = {2};
  sc.upload_twin = true;
  cases.push_back(sc.with(steps({50, 37}, 30, {}), "snapkv+skvq channel K2V2 f16 B1 H2 D64"));
  sc.upload_twin = false;
  sc.cfg.skvq_key_rows = 5;
  sc.cfg.skvq_rotation = Rotation::kHadamard;
  sc.cfg.skvq_meta = MetaType::kFP8E4M3;
  sc.cfg.skvq_bits_key = 4;
  sc.cfg.skvq_bits_value = 4;
  sc.queries = true;
  sc.cfg.snap_scoring = SnapScoring::kQuery;
  sc.end_prompt_after = {1};
  sc.blocks(2, 2, 128, 8, DType::kBF16);
  cases.push_back(sc.with(steps({60}, 40, {}),
                          "snapkv+skvq channel key_rows 5 hadamard fp8 K4V4 query bf16 D128"));
  sc.cfg = config("snapkv+skvq");
  sc.cfg.skvq_key_axis = QuantAxis::kChannel;
  sc.cfg.snap_evict_at = SnapEvictAt::kPromptEnd;
  sc.cfg.snap_budget = 24;
  sc.cfg.skvq_window = 8;
  sc.cfg.skvq_n_sink = 2;
  sc.cfg.skvq_group_size = 32;
  sc.cfg.skvq_meta = MetaType::kF32;
  sc.queries = false;
  sc.end_prompt_after = {};  // the first single-token call runs the owed selection
  sc.blocks(1, 2, 64, 2, DType::kF32);
  cases.push_back(
      sc.with(steps({45}, 25, {}), "snapkv+skvq channel f32 meta f32 rows, no end_prompt"));
  run_cases("channel-axis keys", cases, 3500);
}

// Device cache `layer` of cfg (window 16, 4 sinks, D 64, 2 heads) after 40 f16 rows of `seed`:
// every packed segment holds kb-bit keys and vb-bit values, and there is one.
void expect_packed_bits(CacheConfig cfg, int64_t layer, int kb, int vb, uint64_t seed) {
  cfg.skvq_window = 16;
  cfg.skvq_n_sink = 4;
  cfg.head_dim = 64;
  const KV kv = make_kv(DType::kF16, 1, 2, 40, 64, seed);
  auto gpu = cuda::make_device_cache(cfg, 1, 2, 64, nullptr, layer);
  const cuda::DeviceCacheView v = gpu->update_and_fetch(kv.k->dev, kv.v->dev, {});
  int packed = 0;
  for (const cuda::DeviceSegment& sg : v.segments()) {
    if (!sg.packed || sg.n_rows == 0) continue;
    ++packed;
    EXPECT_EQ(sg.k_fmt.spec.bits(), kb) << "layer " << layer;
    EXPECT_EQ(sg.v_fmt.spec.bits(), vb) << "layer " << layer;
  }
  EXPECT_GT(packed, 0) << "layer " << layer;
}

// Per-layer key precision (skvq_layer_bits_key / skvq_layer_key_rows): the device cache of layer
// i is the CPU cache of layer i (the same driver: stored records byte for byte, permutations,
// states, masks, attention within kDecode's / kPrefill's bound). Layers 0 and 1 differ in key
// bits and key_rows, so a device cache that ignored its layer would store other records (and
// fail the check of the packed key format below).
TEST(CudaCaches, PerLayerKeyPrecisionMatchesCpu) {
  SKIP_WITHOUT_DEVICE();
  std::vector<Case> cases;
  Case c;
  c.cfg = config("skvq");
  c.cfg.skvq_key_axis = QuantAxis::kChannel;
  c.cfg.skvq_window = 32;
  c.cfg.skvq_n_sink = 4;
  c.cfg.skvq_group_size = 16;
  c.cfg.skvq_bits_value = 2;
  c.cfg.skvq_layer_bits_key = "4/2/3";
  c.cfg.skvq_layer_key_rows = "7/5/0";
  for (int64_t l = 0; l < 3; ++l) {
    c.layer = l;
    c.upload_twin = l == 1;
    cases.push_back(c.with(steps({70}, 12, {33, 1}), "skvq channel layer " + std::to_string(l) +
                                                         " of bits 4/2/3 rows 7/5/0"));
  }
  // token-axis keys: layer 0 K4V2 (fused), layer 1 K2V2 (tensor-core), layer 2 K3V2 (dequantized)
  c.cfg = config("skvq");
  c.cfg.skvq_window = 16;
  c.cfg.skvq_n_sink = 4;
  c.cfg.skvq_group_size = 32;
  c.cfg.skvq_layer_bits_key = "4/2/3";
  c.upload_twin = false;
  c.blocks(1, 2, 128, 8, DType::kF16);
  for (int64_t l = 0; l < 3; ++l) {
    c.layer = l;
    cases.push_back(c.with(steps({35}, 9, {40, 1}),
                           "skvq token layer " + std::to_string(l) + " of bits 4/2/3 f16 D128"));
  }
  // snapkv+skvq, channel-axis keys packed after the prompt-end selection
  Case sc;
  sc.cfg = config("snapkv+skvq");
  sc.cfg.skvq_key_axis = QuantAxis::kChannel;
  sc.cfg.snap_evict_at = SnapEvictAt::kPromptEnd;
  sc.cfg.snap_budget = 40;
  sc.cfg.snap_obs_window = 8;
  sc.cfg.skvq_window = 16;
  sc.cfg.skvq_n_sink = 4;
  sc.cfg.skvq_group_size = 16;
  sc.cfg.skvq_layer_bits_key = "2/4";
  sc.cfg.skvq_layer_key_rows = "0/5";
  sc.end_prompt_after = {2};
  for (int64_t l = 0; l < 2; ++l) {
    sc.layer = l;
    cases.push_back(sc.with(steps({50, 37}, 20, {}),
                            "snapkv+skvq channel layer " + std::to_string(l) + " of bits 2/4"));
  }
  run_cases("per-layer key precision", cases, 3700);

  // Each layer's device cache packs its own key bits: the same rows into layers 0 and 1.
  CacheConfig cfg = config("skvq");
  cfg.skvq_layer_bits_key = "4/2";
  expect_packed_bits(cfg, 0, 4, 2, 3790);
  expect_packed_bits(cfg, 1, 2, 2, 3790);
}

// Per-layer value bits (skvq_layer_bits_value): the device cache of layer i is the CPU cache of
// layer i, and packs its own value bits (K2V4: the CUDA-core kernel, K2V2: the tensor-core one,
// K2V3: codes of any spec decoded in place).
TEST(CudaCaches, PerLayerValueBitsMatchCpu) {
  SKIP_WITHOUT_DEVICE();
  std::vector<Case> cases;
  Case c;
  c.cfg = config("skvq");
  c.cfg.skvq_window = 16;
  c.cfg.skvq_n_sink = 4;
  c.cfg.skvq_group_size = 32;
  c.cfg.skvq_bits_key = 2;
  c.cfg.skvq_layer_bits_value = "4/2/3";
  c.blocks(1, 2, 128, 8, DType::kF16);
  for (int64_t l = 0; l < 3; ++l) {
    c.layer = l;
    cases.push_back(c.with(steps({35}, 9, {40, 1}),
                           "skvq layer " + std::to_string(l) + " of value bits 4/2/3 f16 D128"));
  }
  run_cases("per-layer value bits", cases, 3750);
  CacheConfig cfg = config("skvq");
  cfg.skvq_layer_bits_value = "4/2";
  expect_packed_bits(cfg, 0, 2, 4, 3760);
  expect_packed_bits(cfg, 1, 2, 2, 3760);
}

// A layer a per-layer list has no entry for is refused on the device with the CPU's message
// (the list's length against a model's layers is the builders' check: build_caches, the CUDA
// engine), and a negative layer with the device's.
TEST(CudaCaches, PerLayerListWithoutTheLayerRefused) {
  SKIP_WITHOUT_DEVICE();
  for (const char* method : {"skvq", "snapkv+skvq"}) {
    CacheConfig cfg = config(method);
    cfg.skvq_key_axis = QuantAxis::kChannel;
    cfg.snap_evict_at = SnapEvictAt::kPromptEnd;
    cfg.skvq_layer_bits_key = "4/2";
    cfg.skvq_layer_key_rows = "8/16/8";
    cfg.head_dim = 64;
    const std::string cpu_msg = error_of([&] { make_layer_cache(cfg, 2); });
    ASSERT_NE(cpu_msg.find("skvq_layer_bits_key"), std::string::npos) << cpu_msg;
    EXPECT_EQ(cpu_msg, error_of([&] { cuda::make_device_cache(cfg, 1, 2, 64, nullptr, 2); }))
        << method;
    cfg.skvq_layer_bits_key = "4/2/2";
    cfg.skvq_layer_key_rows = "8/16";
    const std::string rows_msg = error_of([&] { make_layer_cache(cfg, 2); });
    ASSERT_NE(rows_msg.find("skvq_layer_key_rows"), std::string::npos) << rows_msg;
    EXPECT_EQ(rows_msg, error_of([&] { cuda::make_device_cache(cfg, 1, 2, 64, nullptr, 2); }))
        << method;
    EXPECT_NE(error_of([&] {
                cuda::make_device_cache(cfg, 1, 2, 64, nullptr, -1);
              }).find("[make_device_cache] layer: expected >= 0 but got -1"),
              std::string::npos);
  }
}

// A query-moment file (veloxquant/query_moments.h) for one layer of H KV heads at head_dim D with
// anisotropic moments (test::aniso_moments per head), so that the error-feedback key rounding
// moves codes away from round-to-nearest.
std::string aniso_moment_file(int64_t H, int64_t D, uint64_t seed, const std::string& name) {
  QueryMomentSet set;
  set.n_kv_heads = H;
  set.head_dim = D;
  set.n_tokens = 1;
  std::vector<double> m;
  for (int64_t h = 0; h < H; ++h) {
    const std::vector<double> mh = test::aniso_moments(D, seed + static_cast<uint64_t>(h));
    m.insert(m.end(), mh.begin(), mh.end());
  }
  set.layers.push_back(m);
  const std::string path = ::testing::TempDir() + name;
  save_query_moment_file(path, set);
  return path;
}

// skvq_query_moments_file on the device (session 24): the device flush rounds channel-axis key
// codes by error feedback (a warp per row, key_feedback_codes' fp64 operations), so records,
// states and attention equal the CPU cache's after every call, for skvq (plain, rotated with
// runs of rows and fp8 metadata) and snapkv+skvq at the prompt's end. The moments must matter:
// each case's CPU states with and without the file differ.
TEST(CudaCaches, QueryMomentsMatchCpu) {
  SKIP_WITHOUT_DEVICE();
  std::vector<Case> cases;
  Case c;
  c.cfg = config("skvq");
  c.cfg.skvq_key_axis = QuantAxis::kChannel;
  c.cfg.skvq_window = 32;
  c.cfg.skvq_n_sink = 4;
  c.cfg.skvq_group_size = 16;
  c.cfg.skvq_query_moments_file = aniso_moment_file(2, 64, 11, "qm_cuda_64.bin");
  cases.push_back(c.with(steps({70}, 20, {33, 1}), "skvq channel moments K2V2 f16 B1 H2 D64"));
  c.cfg.skvq_key_rows = 16;
  c.cfg.skvq_rotation = Rotation::kHadamard;
  c.cfg.skvq_meta = MetaType::kFP8E4M3;
  c.cfg.skvq_query_moments_file = aniso_moment_file(2, 128, 12, "qm_cuda_128.bin");
  c.blocks(2, 2, 128, 8, DType::kBF16, true);
  cases.push_back(c.with({17, 1, 129, 1, 1, 40},
                         "skvq channel moments key_rows 16 hadamard fp8 bf16 token-major B2 H2"));
  c.cfg = config("snapkv+skvq");
  c.cfg.snap_evict_at = SnapEvictAt::kPromptEnd;
  c.cfg.snap_budget = 48;
  c.cfg.skvq_key_axis = QuantAxis::kChannel;
  c.cfg.skvq_window = 16;
  c.cfg.skvq_key_rows = 8;
  c.cfg.skvq_query_moments_file = aniso_moment_file(2, 64, 13, "qm_cuda_snap.bin");
  c.end_prompt_after = {1};
  c.blocks(1, 2, 64, 4, DType::kF16);
  cases.push_back(c.with(steps({90}, 20, {}), "snapkv+skvq channel moments key_rows 8 D64"));
  for (const Case& cs : cases) {
    CacheConfig plain = cs.cfg;
    plain.head_dim = cs.D;
    plain.skvq_query_moments_file.clear();
    CacheConfig with = plain;
    with.skvq_query_moments_file = cs.cfg.skvq_query_moments_file;
    auto a = make_layer_cache(plain, 0), b = make_layer_cache(with, 0);
    const auto k = make_block(cs.dtype, cs.B, cs.H, 90, cs.D, 5, false);
    const auto v = make_block(cs.dtype, cs.B, cs.H, 90, cs.D, 6, false);
    a->update_and_fetch(k->host, v->host);
    b->update_and_fetch(k->host, v->host);
    a->end_prompt();
    b->end_prompt();
    EXPECT_NE(save_bytes(*a), save_bytes(*b)) << cs.name << ": the moments changed no code";
  }
  run_cases("skvq query moments", cases, 8300);
}

// skvq_value_clip_floor on the device (session 24): the flush kernel searches clip_alphas' list
// (the seed's five, then the tail down to the floor, five alphas per pass over a group), so the
// value records equal the CPU's, for skvq (token- and channel-axis keys, rotated values) and
// snapkv+skvq; floors 0.5, 0.25 and 0.8 (one tail alpha).
TEST(CudaCaches, ValueClipFloorMatchesCpu) {
  SKIP_WITHOUT_DEVICE();
  std::vector<Case> cases;
  Case c;
  c.cfg = config("skvq");
  c.cfg.skvq_window = 16;
  c.cfg.skvq_n_sink = 4;
  c.cfg.skvq_group_size = 16;
  c.cfg.skvq_value_clip_floor = 0.5;
  cases.push_back(c.with(steps({35}, 13, {40, 1, 3}), "skvq floor 0.5 K2V2 g16 f16 B1 H2 D64"));
  c.cfg.skvq_key_axis = QuantAxis::kChannel;
  c.cfg.skvq_window = 48;
  c.cfg.skvq_key_rows = 32;
  c.cfg.skvq_rotation = Rotation::kHadamard;
  c.cfg.skvq_rotate_values = true;
  c.cfg.skvq_meta = MetaType::kFP8E4M3;
  c.cfg.skvq_value_clip_floor = 0.25;
  c.cfg.skvq_group_size = 32;
  c.blocks(2, 2, 128, 8, DType::kBF16, true);
  cases.push_back(c.with({17, 1, 129, 1, 1, 40},
                         "skvq floor 0.25 channel keys rotated values fp8 bf16 B2 H2 D128"));
  c.cfg = config("snapkv+skvq");
  c.cfg.snap_budget = 40;
  c.cfg.snap_obs_window = 8;
  c.cfg.skvq_window = 16;
  c.cfg.skvq_group_size = 16;
  c.cfg.skvq_value_clip_floor = 0.8;
  c.blocks(1, 2, 64, 8, DType::kF16);
  cases.push_back(c.with(steps({50, 37}, 16, {30, 1, 2}), "snapkv+skvq floor 0.8 K2V2 g16 D64"));
  for (const Case& cs : cases) {
    CacheConfig seed_grid = cs.cfg;
    seed_grid.head_dim = cs.D;
    seed_grid.skvq_value_clip_floor = 0.85;
    CacheConfig floor = seed_grid;
    floor.skvq_value_clip_floor = cs.cfg.skvq_value_clip_floor;
    auto a = make_layer_cache(seed_grid, 0), b = make_layer_cache(floor, 0);
    const auto k = make_block(cs.dtype, cs.B, cs.H, 90, cs.D, 7, false);
    const auto v = make_block(cs.dtype, cs.B, cs.H, 90, cs.D, 8, false);
    const auto packed_values = [](const CacheView& view) {
      std::vector<uint8_t> out;
      for (const std::vector<Row>& frame : cpu_rows(view))
        for (const Row& r : frame)
          if (r.packed) out.insert(out.end(), r.v.begin(), r.v.end());
      return out;
    };
    // the prompt, its end (snapkv+skvq packs its kept rows only then) and one decode row
    a->update_and_fetch(k->host, v->host);
    b->update_and_fetch(k->host, v->host);
    a->end_prompt();
    b->end_prompt();
    const auto k1 = make_block(cs.dtype, cs.B, cs.H, 1, cs.D, 9, false);
    const auto v1 = make_block(cs.dtype, cs.B, cs.H, 1, cs.D, 10, false);
    const std::vector<uint8_t> pa = packed_values(a->update_and_fetch(k1->host, v1->host));
    const std::vector<uint8_t> pb = packed_values(b->update_and_fetch(k1->host, v1->host));
    EXPECT_FALSE(pa.empty()) << cs.name;
    EXPECT_NE(pa, pb) << cs.name << ": the floor changed no value record";
  }
  run_cases("skvq value clip floor", cases, 8400);
}

TEST(CudaCaches, ErrorsMatchCpuAndChangeNothing) {
  SKIP_WITHOUT_DEVICE();
  // Bad configs: the CPU builder's message.
  std::vector<std::pair<std::string, CacheConfig>> bad(3);
  bad[0].first = "snapkv budget 0";
  bad[0].second.method = "snapkv";
  bad[0].second.snap_budget = 0;
  bad[1].first = "skvq window 1";
  bad[1].second.method = "skvq";
  bad[1].second.skvq_window = 1;
  bad[2].first = "skvq n_sink 200";
  bad[2].second.method = "skvq";
  bad[2].second.skvq_n_sink = 200;
  for (const auto& [spec, cfg] : bad) {
    CacheConfig c = cfg;
    c.head_dim = 64;
    const std::string cpu_msg = error_of([&] { make_cache(c); });
    const std::string gpu_msg = error_of([&] { cuda::make_device_cache(cfg, 1, 2, 64); });
    EXPECT_FALSE(cpu_msg.empty()) << spec;
    EXPECT_EQ(cpu_msg, gpu_msg) << spec;
  }
  for (const char* method : {"full", "snapkv", "skvq", "snapkv+skvq", "streaming"}) {
    CacheConfig cfg;
    cfg.method = method;
    cfg.skvq_window = 16;
    cfg.skvq_max_ctx = 40;
    cfg.snap_budget = 10;
    auto gpu = cuda::make_device_cache(cfg, 1, 2, 64);
    const KV kv = make_kv(DType::kF16, 1, 2, 35, 64, 21);
    gpu->update_and_fetch(kv.k->dev, kv.v->dev);
    const Rows before = gpu_rows(gpu->stored_view());
    const CacheStats st = gpu->stats();
    auto expect_refused = [&](auto&& f, const std::string& needle, const std::string& what) {
      const std::string msg = error_of(f);
      EXPECT_NE(msg.find(needle), std::string::npos)
          << method << " " << what << ": '" << msg << "' (empty: accepted)";
      EXPECT_EQ(gpu->offset(), 35) << method << " " << what;
      expect_same_rows(before, gpu_rows(gpu->stored_view()), std::string(method) + " " + what);
      EXPECT_EQ(gpu->stats().bytes_accounted, st.bytes_accounted) << method << " " << what;
    };
    auto kh = make_block(DType::kF16, 1, 3, 2, 64, 23, false);  // wrong H
    auto vh = make_block(DType::kF16, 1, 3, 2, 64, 24, false);
    expect_refused([&] { gpu->update_and_fetch(kh->dev, vh->dev); },
                   "expected keys [1, 2, S>=0, 64]", "wrong heads");
    auto kd = make_block(DType::kF16, 1, 2, 2, 32, 25, false);  // wrong D
    expect_refused([&] { gpu->update_and_fetch(kd->dev, kd->dev); }, "but got [1, 2, 2, 32]",
                   "wrong head_dim");
    auto k2 = make_block(DType::kF16, 1, 2, 2, 64, 26, false);
    auto v3 = make_block(DType::kF16, 1, 2, 3, 64, 27, false);
    expect_refused([&] { gpu->update_and_fetch(k2->dev, v3->dev); }, "values of the keys' shape",
                   "values shape");
    TensorView bad = k2->dev;
    bad.dtype = static_cast<DType>(7);
    expect_refused([&] { gpu->update_and_fetch(bad, k2->dev); }, "dtype code 7", "bad dtype");
    expect_refused([&] { gpu->merge_batch({gpu.get()}); }, "merg", "merge");
    if (std::string(method) != "full") {
      expect_refused([&] { gpu->trim(1); }, "not trimmable", "trim");
    }
    if (std::string(method) == "skvq" || std::string(method) == "snapkv+skvq") {
      auto k6 = make_block(DType::kF16, 1, 2, 6, 64, 28, false);
      expect_refused([&] { gpu->update_and_fetch(k6->dev, k6->dev); }, "skvq_max_ctx", "max_ctx");
      auto k5 = make_block(DType::kF16, 1, 2, 5, 64, 29, false);
      gpu->update_and_fetch(k5->dev, k5->dev);  // exactly max_ctx is fine
      EXPECT_EQ(gpu->offset(), 40);
    }
  }

  // SnapKV query scoring: query heads must be a multiple of the KV heads.
  CacheConfig qc;
  qc.method = "snapkv";
  qc.snap_scoring = SnapScoring::kQuery;
  auto gq = cuda::make_device_cache(qc, 1, 2, 64);
  auto k = make_block(DType::kF16, 1, 2, 4, 64, 31, false);
  auto q3 = make_block(DType::kF32, 1, 3, 4, 64, 32, false);
  cuda::DeviceUpdateOptions o;
  o.queries = &q3->dev;
  EXPECT_THROW(gq->update_and_fetch(k->dev, k->dev, o), Error);
  EXPECT_EQ(gq->offset(), 0);
}

TEST(CudaCaches, SnapkvSkvqMatchesCpu) {
  SKIP_WITHOUT_DEVICE();
  std::vector<Case> cases;
  Case c;
  c.cfg = config("snapkv+skvq");
  c.cfg.snap_budget = 40;
  c.cfg.snap_obs_window = 8;
  c.cfg.snap_n_sink = 4;
  c.cfg.skvq_window = 16;
  c.cfg.skvq_n_sink = 4;
  c.cfg.skvq_group_size = 16;
  // 50: evict to 40 (all full precision), flush two chunks; 37: selection over sinks ++ packed ++
  // tail keeps some packed rows per head (equalised by early quantization); decode steps flush.
  cases.push_back(
      c.with(steps({50, 37}, 16, {30, 1, 2}), "snapkv+skvq key-proxy K2V2 g16 f16 B1 H2 D64"));
  c.cfg.snap_budget = 64;
  c.cfg.snap_pool_kernel = 5;
  set_k4v4_meta_f32_recent8(c.cfg);
  c.cfg.skvq_n_sink = 5;
  c.blocks(2, 2, 128, 8, DType::kBF16, true);
  cases.push_back(
      c.with({129, 1, 17, 1, 1, 40, 1},
             "snapkv+skvq pool max 5 K4V4 g32 meta f32 recent 8 bf16 token-major B2 H2 D128"));
  c.cfg = config("snapkv+skvq");
  c.cfg.snap_budget = 30;
  c.cfg.snap_obs_window = 6;
  c.cfg.snap_scoring = SnapScoring::kQuery;
  c.cfg.skvq_window = 16;
  c.cfg.skvq_bits_key = 2;
  c.cfg.skvq_bits_value = 4;
  c.cfg.skvq_group_size = 48;  // ragged last group at D = 64
  c.cfg.skvq_meta = MetaType::kFP8E4M3;
  c.cfg.skvq_reorder = false;
  c.queries = true;
  c.blocks(8, 1, 64, 4, DType::kF16);
  cases.push_back(c.with(steps({33, 1, 1, 17, 2}, 14, {20}),
                         "snapkv+skvq query scoring GQA 4 K2V4 g48 fp8 no reorder B8 H1 D64"));
  c.cfg = config("snapkv+skvq");
  c.cfg.snap_budget = 3;  // below the sinks: the budget cuts into them
  c.cfg.snap_n_sink = 4;
  c.cfg.skvq_n_sink = 5;
  c.cfg.skvq_window = 6;
  c.cfg.skvq_group_size = 32;
  c.queries = false;
  c.blocks(1, 2, 64, 2, DType::kF32);
  // 2 + 1 + 1: the sinks grow to 4; 10 evicts to 3 rows (new sinks); six decode rows flush one
  // packed chunk; 5 evicts every packed row (the budget keeps the 3 sinks only).
  cases.push_back(c.with(steps({2, 1, 10}, 7, {5, 1}),
                         "snapkv+skvq budget 3 < sinks 4 window 6 f32 B1 H2 D64"));
  // Key codes decode_attention does not read (1.5-bit ternary, 3-bit codes across byte borders):
  // the selection still scores their dequantized keys; rows, positions and figures only.
  // Then skvq_rotation = hadamard (no reordering): keys rotated, or keys and values; the selection
  // scores keys un-rotated on the device like the CPU's dequantize_row. D = 96 has three
  // Hadamard blocks of 32 (decode_attention reads D 64 / 128 only: rows, positions, figures).
  c.blocks(1, 2, 64, 2, DType::kF16);
  for (const double kb : {1.5, 3.0, 2.0, 4.0, 2.5}) {
    const bool rot = kb == 2.0 || kb == 4.0 || kb == 2.5;
    c.cfg = config("snapkv+skvq");
    c.cfg.snap_budget = 40;
    c.cfg.snap_obs_window = 8;
    c.cfg.skvq_window = 16;
    c.cfg.skvq_group_size = 16;
    c.cfg.skvq_bits_key = rot ? std::floor(kb) : kb;
    c.cfg.skvq_bits_value = rot ? std::floor(kb) : kb == 3.0 ? 1.5 : 3.0;
    c.cfg.skvq_rotation = rot ? Rotation::kHadamard : Rotation::kNone;
    c.cfg.skvq_rotate_values = kb != 2.0;
    c.attention = kb == 2.0 || kb == 4.0;
    if (kb == 4.0) c.blocks(2, 2, 128, 8, DType::kBF16);
    if (kb == 2.5) c.blocks(1, 2, 96, 2, DType::kF16);
    const std::string what =
        rot ? "hadamard keys" + std::string(kb != 2.0 ? "+values" : "") + " K" +
                  std::to_string(static_cast<int>(kb)) + " D" + std::to_string(c.D)
            : "keys " + std::to_string(kb) + " bits, no attention, f16 B1 H2 D64";
    cases.push_back(c.with(steps({50, 37}, 16, {30, 1}), "snapkv+skvq " + what));
  }
  run_cases("snapkv+skvq", cases, 5000);
}

// snap_evict_at = prompt_end: the chunks of a prompt are stored whole, the selection runs once,
// at end_prompt() (explicit) or before the first single-token call (implicit); decode calls after
// that append; a later multi-token call starts a new prompt.
TEST(CudaCaches, PromptEndMatchesCpu) {
  SKIP_WITHOUT_DEVICE();
  std::vector<Case> cases;
  Case c;
  c.cfg = config("snapkv");
  c.cfg.snap_evict_at = SnapEvictAt::kPromptEnd;
  c.cfg.snap_budget = 24;
  c.cfg.snap_obs_window = 8;
  cases.push_back(c.with({50, 37, 20, 1, 1, 1, 30, 1, 1},
                         "snapkv prompt_end implicit key-proxy f16 B1 H2 D64"));
  c.cfg.snap_scoring = SnapScoring::kQuery;
  c.cfg.snap_pool_kernel = 3;
  c.queries = true;
  c.blocks(2, 2, 128, 8, DType::kBF16, true);
  c.end_prompt_after = {3, 6};
  cases.push_back(  // the last chunk (33) is longer than the window (8)
      c.with({40, 5, 33, 1, 1, 17, 1},
             "snapkv prompt_end explicit query scoring pool 3 bf16 token-major B2 H2 D128"));
  c.cfg = config("snapkv+skvq");
  c.cfg.snap_evict_at = SnapEvictAt::kPromptEnd;
  c.cfg.snap_budget = 40;
  c.cfg.snap_obs_window = 8;
  c.cfg.skvq_window = 16;
  c.cfg.skvq_group_size = 16;
  c.queries = false;
  c.blocks(1, 2, 64, 8, DType::kF16);
  c.end_prompt_after = {};
  cases.push_back(c.with(steps({50, 37, 20}, 16, {30, 1, 1}),
                         "snapkv+skvq prompt_end implicit key-proxy K2V2 g16 f16 B1 H2 D64"));
  c.cfg.snap_scoring = SnapScoring::kQuery;
  c.cfg.snap_obs_window = 6;
  c.cfg.skvq_bits_key = 4;
  c.cfg.skvq_bits_value = 4;
  c.cfg.skvq_group_size = 32;
  c.cfg.skvq_recent = 4;
  c.queries = true;
  c.blocks(4, 2, 128, 8, DType::kF16);
  c.end_prompt_after = {3, 6};
  cases.push_back(  // the last chunk (4) is shorter than the window (6)
      c.with({3, 60, 4, 1, 1, 25, 1},
             "snapkv+skvq prompt_end explicit query scoring K4V4 g32 recent 4 B4 H2 D128"));
  run_cases("prompt_end", cases, 6000);
}

// The decode-time evictions a case's steps make (single-token calls that leave fewer rows than
// they found plus one), counted on a CPU cache alone: the counts depend on the row counts only.
int decode_evictions(const Case& cs) {
  CacheConfig cfg = cs.cfg;
  cfg.head_dim = cs.D;
  std::unique_ptr<KVCache> cpu = make_cache(cfg);
  int n = 0;
  uint64_t seed = 1;
  for (size_t i = 0; i < cs.steps.size(); ++i) {
    const int64_t s = cs.steps[i];
    const Tensor k = test::random_tensor(cs.dtype, cs.B, cs.H, s, cs.D, seed++);
    const Tensor q = test::random_tensor(DType::kF32, cs.B, cs.Hq, s, cs.D, seed++);
    UpdateOptions o;
    const TensorView qv = q.view();
    if (cs.queries) o.queries = &qv;
    const int64_t before = cpu->stored_rows();
    cpu->update_and_fetch(k.view(), k.view(), o);
    if (s == 1 && cpu->stored_rows() < before + 1) ++n;
    if (std::find(cs.end_prompt_after.begin(), cs.end_prompt_after.end(), i + 1) !=
        cs.end_prompt_after.end())
      cpu->end_prompt();
  }
  return n;
}

// Decode-time eviction (snap_decode_budget): the decode query window lives on the device
// (RowBackend::make_query_window, src/cuda/row_store_cuda.cpp), the selections run on the device.
// Every step must store the CPU cache's rows bit for bit at the same positions (the selections
// meet the ulp-of-expf argument of the file's header, as SnapKVMatchesCpu), and the states must be
// byte-identical: run_case exchanges them at every step, so windows of 1 .. obs_window decode
// queries cross from the device to the CPU and back. The first case swaps to the loaded caches
// at its middle step, the first decode call after a multi-token call (a window of one query),
// and its later evictions score with the loaded window as it grows past obs_window and slides
// (the device buffer grows, then moves its run to the front). GQA (H_q = 2 x or 4 x H_kv),
// obs_window > 1, decode_every > 1; the key proxy when no queries are handed in; prompt_end with
// the pending selection run by the first decode call. Each case must evict at decode time at
// least three times.
TEST(CudaCaches, SnapKVDecodeBudgetMatchesCpu) {
  SKIP_WITHOUT_DEVICE();
  std::vector<Case> cases;
  Case c;
  c.cfg = config("snapkv");
  c.cfg.snap_budget = 24;
  c.cfg.snap_obs_window = 5;
  c.cfg.snap_n_sink = 2;
  c.cfg.snap_scoring = SnapScoring::kQuery;
  c.cfg.snap_pool_kernel = 3;
  c.cfg.snap_decode_budget = 20;
  c.cfg.snap_decode_every = 3;
  c.queries = true;
  c.blocks(2, 2, 64, 4, DType::kF16);
  // 29 steps: the middle (15th) is the first decode call after the 6-token call.
  cases.push_back(c.with(steps({40}, 12, steps({6}, 15, {})),
                         "snapkv decode_budget 20 every 3 window 5 query GQA 2 f16 B2 H2 D64"));
  c.cfg.snap_budget = 64;
  c.cfg.snap_obs_window = 8;
  c.cfg.snap_n_sink = 4;
  c.cfg.snap_pool = PoolKind::kAvg;
  c.cfg.snap_keep_window = true;
  c.cfg.snap_evict_at = SnapEvictAt::kPromptEnd;
  c.cfg.snap_decode_budget = 30;
  c.cfg.snap_decode_every = 4;
  c.blocks(1, 4, 128, 16, DType::kBF16, true);
  cases.push_back(c.with(steps({50, 21}, 40, {}),
                         "snapkv decode_budget 30 every 4 window 8 keep-window avg prompt_end "
                         "GQA 4 bf16 token-major B1 H4 D128"));
  c.cfg = config("snapkv");
  c.cfg.snap_budget = 32;
  c.cfg.snap_obs_window = 4;
  c.cfg.snap_decode_budget = 16;
  c.cfg.snap_decode_every = 2;
  c.queries = false;
  c.blocks(2, 2, 64, 4, DType::kF32);
  cases.push_back(
      c.with(steps({30}, 20, {}), "snapkv decode_budget 16 every 2 key proxy f32 B2 H2 D64"));
  for (const Case& cs : cases) EXPECT_GE(decode_evictions(cs), 3) << cs.name;
  run_cases("snapkv decode budget", cases, 7000);
}

// Protected rows of a case's CPU cache after its steps (0 unless skvq with skvq_protect).
int64_t protected_rows(const Case& cs) {
  CacheConfig cfg = cs.cfg;
  cfg.head_dim = cs.D;
  SkvqCache cpu(cfg, cs.layer);
  uint64_t seed = 1;
  for (size_t i = 0; i < cs.steps.size(); ++i) {
    const int64_t s = cs.steps[i];
    const Tensor k = test::random_tensor(cs.dtype, cs.B, cs.H, s, cs.D, seed++);
    const Tensor q = test::random_tensor(DType::kF32, cs.B, cs.Hq, s, cs.D, seed++);
    UpdateOptions o;
    const TensorView qv = q.view();
    if (cs.queries) o.queries = &qv;
    cpu.update_and_fetch(k.view(), k.view(), o);
    if (std::find(cs.end_prompt_after.begin(), cs.end_prompt_after.end(), i + 1) !=
        cs.end_prompt_after.end()) {
      if (cs.external_scores) {
        std::vector<float> sc(static_cast<size_t>(cs.B * cs.H * cpu.offset()));
        for (size_t j = 0; j < sc.size(); ++j) sc[j] = static_cast<float>(j % 7);
        cpu.set_external_scores(sc.data(), cs.B, cs.H, cpu.offset());
      }
      cpu.end_prompt();
    }
  }
  return cpu.protected_rows();
}

// skvq_protect on the device (the policy of skvq_cache.cpp over the CUDA row backend): the
// prompt's fp32 copies and window queries live on the device, the selection runs there
// (RowBackend::snap_select_rows: the device's scores, pooling and top-k), and the view has the
// protected rows' segment (explicit positions) before the sinks and the one packed run, whose
// explicit positions hide the protected rows (INT32_MAX). After every call the rows, their bytes
// and positions (INT32_MAX included), the masks, the figures (protected_rows, protected_bytes) and
// the state bytes equal the CPU cache's (selections under the ulp-of-expf argument of the file's
// header), and decode / prefill attention over the device view is within the bound of the CPU
// view's reference. Query scoring with GQA (pool 3), key-proxy scoring, values protected or their
// codes' values (also rotated values), an implicit prompt end (the first single-token call) and an
// explicit one, a later multi-token call (no new protected rows), decode steps that grow the
// packed run past the protected rows (the positions are rebuilt for its new capacity), and the
// state exchange from the middle step on. Each case protects rows.
TEST(CudaCaches, SkvqProtectMatchesCpu) {
  SKIP_WITHOUT_DEVICE();
  std::vector<Case> cases;
  Case c;
  c.cfg = config("skvq");
  c.cfg.skvq_window = 16;
  c.cfg.skvq_n_sink = 4;
  c.cfg.skvq_group_size = 16;
  c.cfg.skvq_recent = 3;
  c.cfg.skvq_protect = 0.1;
  c.cfg.skvq_protect_scoring = SnapScoring::kQuery;
  c.cfg.skvq_protect_obs_window = 8;
  c.cfg.skvq_protect_pool_kernel = 3;
  c.queries = true;
  c.blocks(2, 2, 64, 4, DType::kF16);
  cases.push_back(c.with(steps({40, 30}, 40, {33, 1, 1}),
                         "skvq protect 0.1 query GQA 2 pool 3 K2V2 g16 f16 B2 H2 D64"));
  c.cfg.skvq_protect = 0.05;
  c.cfg.skvq_protect_scoring = SnapScoring::kKeyProxy;
  c.cfg.skvq_protect_pool_kernel = 1;
  c.cfg.skvq_protect_values = false;
  c.queries = false;
  c.blocks(1, 4, 128, 16, DType::kBF16, true);
  c.end_prompt_after = {1};
  cases.push_back(c.with(steps({90}, 50, {}),
                         "skvq protect 0.05 key proxy codes' values explicit end bf16 token-major "
                         "B1 H4 D128"));
  set_k4v4_meta_f32_recent8(c.cfg);
  c.cfg.skvq_rotation = Rotation::kHadamard;
  c.cfg.skvq_rotate_values = true;
  c.cfg.skvq_protect = 0.15;
  c.cfg.skvq_protect_scoring = SnapScoring::kQuery;
  c.cfg.skvq_protect_obs_window = 6;
  c.queries = true;
  c.blocks(1, 2, 128, 8, DType::kF16);
  c.end_prompt_after = {};
  cases.push_back(c.with(steps({37, 45}, 70, {}),
                         "skvq protect 0.15 query GQA 4 codes' values hadamard keys+values K4V4 "
                         "meta f32 B1 H2 D128"));
  c.cfg = config("skvq");
  c.cfg.skvq_window = 16;
  c.cfg.skvq_n_sink = 2;
  c.cfg.skvq_group_size = 16;
  c.cfg.skvq_key_axis = QuantAxis::kChannel;
  c.cfg.skvq_key_rows = 8;
  c.cfg.skvq_protect = 0.1;
  c.cfg.skvq_protect_scoring = SnapScoring::kQuery;
  c.queries = true;
  c.blocks(1, 2, 64, 4, DType::kF16);
  cases.push_back(
      c.with(steps({64}, 40, {}), "skvq protect 0.1 query channel-axis keys rows 8 f16 B1 H2 D64"));
  for (const Case& cs : cases) EXPECT_GT(protected_rows(cs), 0) << cs.name;
  run_cases("skvq protect", cases, 8000);
}

// skvq_protect_scoring = external on the device: both caches take the same host scores before
// the prompt's end (cuda::set_external_scores, the CUDA engine's path for the reconstruction
// scores of veloxquant/reconstruct.h), and the protected rows, their positions, bytes, masks and
// state equal the CPU cache's after every call, as in SkvqProtectMatchesCpu. Token-axis K2V2 and
// channel-axis keys; pooled and not; a later decode that grows the packed run.
TEST(CudaCaches, SkvqProtectExternalScoresMatchCpu) {
  SKIP_WITHOUT_DEVICE();
  std::vector<Case> cases;
  Case c;
  c.cfg = config("skvq");
  c.cfg.skvq_window = 16;
  c.cfg.skvq_n_sink = 4;
  c.cfg.skvq_group_size = 16;
  c.cfg.skvq_protect = 0.1;
  c.cfg.skvq_protect_scoring = SnapScoring::kExternal;
  c.external_scores = true;
  c.end_prompt_after = {2};
  c.blocks(2, 2, 64, 4, DType::kF16);
  cases.push_back(
      c.with(steps({40, 30}, 40, {}), "skvq protect 0.1 external K2V2 g16 f16 B2 H2 D64"));
  c.cfg.skvq_protect_pool_kernel = 3;
  c.cfg.skvq_key_axis = QuantAxis::kChannel;
  c.cfg.skvq_key_rows = 8;
  c.end_prompt_after = {1};
  c.blocks(1, 2, 128, 8, DType::kBF16);
  cases.push_back(c.with(steps({90}, 30, {}),
                         "skvq protect 0.1 external pool 3 channel-axis keys bf16 B1 H2 D128"));
  for (const Case& cs : cases) EXPECT_GT(protected_rows(cs), 0) << cs.name;
  run_cases("skvq protect external", cases, 8100);
}

// snapkv+skvq with snap_scoring = external (session 22): the same policy takes the handed-over
// scores on the device (token- and channel-axis keys); the driver gives both caches the same
// scores before end_prompt and compares records, positions, states and attention.
TEST(CudaCaches, SnapkvSkvqExternalScoresMatchCpu) {
  SKIP_WITHOUT_DEVICE();
  std::vector<Case> cases;
  Case c;
  c.cfg = config("snapkv+skvq");
  c.cfg.snap_evict_at = SnapEvictAt::kPromptEnd;
  c.cfg.snap_scoring = SnapScoring::kExternal;
  c.cfg.snap_budget = 40;
  c.cfg.snap_n_sink = 4;
  c.cfg.snap_pool_kernel = 3;
  c.cfg.skvq_window = 16;
  c.cfg.skvq_n_sink = 4;
  c.cfg.skvq_group_size = 16;
  c.external_scores = true;
  c.end_prompt_after = {2};
  c.blocks(1, 2, 64, 4, DType::kF16);
  cases.push_back(c.with(steps({50, 37}, 20, {}), "snapkv+skvq external K2V2 g16 f16 B1 H2 D64"));
  c.cfg.skvq_key_axis = QuantAxis::kChannel;
  c.cfg.skvq_key_rows = 8;
  c.cfg.skvq_rotation = Rotation::kHadamard;
  c.end_prompt_after = {1};
  c.blocks(2, 2, 128, 8, DType::kBF16);
  cases.push_back(
      c.with(steps({90}, 20, {}), "snapkv+skvq external channel key_rows 8 hadamard bf16 D128"));
  run_cases("snapkv+skvq external", cases, 8200);
}

// Metamorphic, on the device alone: with snap_evict_at = prompt_end a prompt fed in chunks stores
// exactly what the one-shot prompt stores (key-proxy scoring: the frame and its last key rows are
// the same), for snapkv and snapkv+skvq.
TEST(CudaCaches, PromptEndChunkedEqualsOneShot) {
  SKIP_WITHOUT_DEVICE();
  for (const char* method : {"snapkv", "snapkv+skvq"}) {
    CacheConfig cfg;
    cfg.method = method;
    cfg.snap_evict_at = SnapEvictAt::kPromptEnd;
    cfg.snap_budget = 48;
    cfg.skvq_window = 16;
    auto one = cuda::make_device_cache(cfg, 2, 2, 64);
    auto chunked = cuda::make_device_cache(cfg, 2, 2, 64);
    const KV kv = make_kv(DType::kF16, 2, 2, 150, 64, 51);
    one->update_and_fetch(kv.k->dev, kv.v->dev);
    one->end_prompt();
    for (auto [a, b] : {std::pair<int64_t, int64_t>{0, 40}, {40, 73}, {73, 150}})
      chunked->update_and_fetch(kv.k->dev.slice_tokens(a, b), kv.v->dev.slice_tokens(a, b));
    EXPECT_EQ(chunked->stored_rows(), 150) << method << ": nothing evicted before the end";
    chunked->end_prompt();
    EXPECT_EQ(one->stored_rows(), 48) << method;
    expect_same_rows(gpu_rows(one->stored_view()), gpu_rows(chunked->stored_view()),
                     std::string(method) + " one-shot vs chunked prompt");
    EXPECT_EQ(one->stats().bytes_accounted, chunked->stats().bytes_accounted) << method;
  }
}

// Device load refuses what the CPU load refuses, with the CPU's message, and then holds exactly
// what it held: a corrupted byte, a truncated stream, another method's state, a state saved under
// other settings. A state of another batch than the device cache was built for is refused by the
// device (the CPU cache takes its shape from the file). An empty state empties a used cache, which
// then fills again like a fresh CPU cache.
TEST(CudaCaches, StateRefusalsMatchCpuAndChangeNothing) {
  SKIP_WITHOUT_DEVICE();
  for (const char* method : {"full", "snapkv", "skvq", "snapkv+skvq", "streaming"}) {
    CacheConfig cfg;
    cfg.method = method;
    cfg.head_dim = 64;
    cfg.snap_budget = 10;
    cfg.skvq_window = 16;
    cfg.streaming_window = 8;
    const KV kv = make_kv(DType::kF16, 1, 2, 35, 64, 61);
    const KV kv2 = make_kv(DType::kF16, 1, 2, 20, 64, 63);
    auto saved_after = [&](const CacheConfig& c, bool both) {
      auto cpu = make_cache(c);
      cpu->update_and_fetch(kv.k->host, kv.v->host);
      if (both) cpu->update_and_fetch(kv2.k->host, kv2.v->host);
      return save_bytes(*cpu);
    };
    const std::string good = saved_after(cfg, false);
    auto gpu = cuda::make_device_cache(cfg, 1, 2, 64);
    gpu->update_and_fetch(kv.k->dev, kv.v->dev);
    gpu->update_and_fetch(kv2.k->dev, kv2.v->dev);
    const std::string held = save_bytes(*gpu);
    expect_same_bytes(saved_after(cfg, true), held, std::string(method) + " two blocks");

    std::vector<std::pair<std::string, std::string>> bad;
    std::string corrupt = good;
    corrupt[corrupt.size() / 2] = static_cast<char>(corrupt[corrupt.size() / 2] ^ 0x5a);
    bad.emplace_back("corrupted byte", corrupt);
    bad.emplace_back("truncated", good.substr(0, good.size() - 9));
    CacheConfig other = cfg;
    other.method = std::string(method) == "full" ? "snapkv" : "full";
    bad.emplace_back("another method's state", saved_after(other, false));
    other = cfg;
    other.snap_budget = 11;
    other.skvq_window = 32;
    other.streaming_window = 9;
    if (std::string(method) != "full")
      bad.emplace_back("other settings", saved_after(other, false));
    for (const auto& [what, bytes] : bad) {
      const std::string vars = std::string(method) + " " + what;
      const std::string cpu_msg = error_of([&] { load_bytes(*make_cache(cfg), bytes); });
      const std::string gpu_msg = error_of([&] { load_bytes(*gpu, bytes); });
      EXPECT_FALSE(gpu_msg.empty()) << vars << ": accepted";
      EXPECT_EQ(cpu_msg, gpu_msg) << vars;
      expect_same_bytes(held, save_bytes(*gpu), vars + ": state after the refused load");
      EXPECT_EQ(gpu->offset(), 55) << vars;
    }

    auto gpu_b2 = cuda::make_device_cache(cfg, 2, 2, 64);
    const std::string b2_msg = error_of([&] { load_bytes(*gpu_b2, good); });
    EXPECT_NE(b2_msg.find("fixed when the device cache was built"), std::string::npos)
        << method << ": a batch-1 state into a batch-2 device cache: '" << b2_msg << "'";
    EXPECT_EQ(gpu_b2->offset(), 0) << method;

    const std::string empty = save_bytes(*make_cache(cfg));
    load_bytes(*gpu, empty);
    EXPECT_EQ(gpu->offset(), 0) << method;
    EXPECT_EQ(gpu->stored_rows(), 0) << method;
    expect_same_bytes(empty, save_bytes(*gpu), std::string(method) + " emptied");
    gpu->update_and_fetch(kv.k->dev, kv.v->dev);
    expect_same_bytes(good, save_bytes(*gpu), std::string(method) + " refilled after emptying");
  }
}

}  // namespace
}  // namespace vq
