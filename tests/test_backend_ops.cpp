// One table-driven harness for every numeric op on the CPU (issue 12 item 5; the CUDA part is
// tests/cuda/test_backend_ops_cuda.cpp over the same tables): each op's scalar reference against
// its fast path, over the shapes of tests/ops_harness/tables.h, with the metric the op declares
// (tests/ops_harness/harness.h): exact for codes, metadata, records, selections and RoPE angles;
// derived per-element bounds for attention (decode N = 1 and prefill N > 1, full-precision,
// packed and mixed views, windows), matmul (exact and bf16 modes), Hadamard rotation, SnapKV
// scores, group dequantization, RMSNorm, SwiGLU and RoPE. Every case prints its parameters and
// the share of its tolerance used; a summary prints each op's worst share. VQ_HARNESS=small (or
// an AddressSanitizer build) runs the reduced table.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

#include "ops/kernels.h"
#include "ops/packed_decode.h"
#include "ops_harness/attention_bounds.h"
#include "ops_harness/harness.h"
#include "ops_harness/tables.h"
#include "ops_harness/views.h"
#include "veloxquant/attention.h"
#include "veloxquant/group_quant.h"
#include "veloxquant/hadamard.h"
#include "veloxquant/model.h"
#include "veloxquant/packed.h"
#include "veloxquant/snapkv.h"

namespace vq {
namespace {

using harness::Check;
using harness::kU;
using harness::Vars;

std::vector<float> gaussian(int64_t n, uint64_t seed, float sd = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, sd);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = nd(rng);
  return v;
}

// ---- dtype conversion ---------------------------------------------------------------------------

// Rows converted f32 -> f16/bf16 (from_f32, the vector path for long rows) equal the scalar
// f32_to_fp16 / f32_to_bf16 bit for bit, and the round trip is elementwise within the dtype's
// rounding: |x - rt| <= atol + rtol |x| with rtol = 2^-11 (f16) / 2^-8 (bf16) (half an ulp of an
// 11- or 8-bit significand) and atol = half the smallest subnormal (2^-25 / 2^-134); inputs
// stay inside the f16 range.
TEST(BackendOps, ConvertRow) {
  uint64_t seed = 50;
  for (DType dt : {DType::kF16, DType::kBF16})
    for (int64_t n : {1, 2, 3, 17, 31, 127, 129, 1000})
      for (float sd : {1.0f, 1e-6f, 1000.0f}) {
        const auto x = gaussian(n, ++seed, sd);
        std::vector<uint16_t> got(static_cast<size_t>(n)), want(got.size());
        from_f32(x.data(), got.data(), dt, x.size());
        for (size_t i = 0; i < x.size(); ++i)
          want[i] = dt == DType::kF16 ? f32_to_fp16(x[i]) : f32_to_bf16(x[i]);
        Check k("convert_row", "cpu", Vars()("dtype", dtype_name(dt))("n", n)("sd", sd).str());
        k.exact_bytes(got.data(), want.data(), got.size() * 2, "bits");
        std::vector<float> rt(x.size());
        to_f32(got.data(), dt, rt.data(), rt.size());
        const std::vector<double> ref(x.begin(), x.end());
        k.elementwise(rt.data(), ref.data(), ref.size(), dt == DType::kF16 ? 0x1p-25 : 0x1p-134,
                      dt == DType::kF16 ? 0x1p-11 : 0x1p-8, "round trip");
      }
}

// ---- attention --------------------------------------------------------------------------------

TEST(BackendOps, AttentionFusedCpuVsReference) {
  const auto cases = harness::attention_cases(harness::small_sweep());
  uint64_t seed = 1;
  for (const harness::AttnCase& c : cases) {
    ++seed;
    const auto hv = harness::make_view(c.batch, c.n_kv_heads, c.head_dim, c.segs, seed);
    const int64_t hq = c.n_kv_heads * c.n_rep;
    AttentionParams ap;
    ap.q_pos0 = std::max<int64_t>(hv->span - c.n_q, 0) + c.q_shift;
    ap.window = c.window;
    const auto q = gaussian(c.batch * hq * c.n_q * c.head_dim, seed * 7 + 1, 1.5f);
    Tensor qt(DType::kF32, c.batch, hq, c.n_q, c.head_dim);
    std::copy(q.begin(), q.end(), static_cast<float*>(qt.data()));
    std::vector<float> got(q.size(), -1.0f);
    attention(qt.view(), hv->view, ap, got.data());
    const DenseView dense = dequantize_view(hv->view, DType::kF32);
    const auto ref = harness::attention_ref(dense.view, q, hq, c.n_q, ap);
    Check k(c.n_q == 1 ? "attention decode" : "attention prefill", "cpu", c.vars());
    if (c.q_shift >= 500) {  // no visible key: zeros, exactly
      k.allow_zero_reference();
      k.exact(got, std::vector<float>(got.size(), 0.0f), "out");
      continue;
    }
    k.bounded(got, ref, harness::fused_cpu_bound(hv->view, dense.view, q, hq, c.n_q, ap), "out");
  }
}

// The bf16 tensor-core arithmetic of the CUDA attention paths over bf16 rows
// (decode_attention_mma.cuh's bf16-row instances, prefill_attention.cu's E = bf16 kernel),
// emulated in double: q rounded once to bf16, bf16 keys and values exact, logits scaled, softmax
// from the unrounded logits, p rounded once to bf16 for P V, the sum l from the unrounded p.
// mutant: the values' bf16 bits read as fp16 (an fp16 kernel fed bf16 rows).
float bf16_round(float x) {
  uint16_t h = 0;
  from_f32(&x, &h, DType::kBF16, 1);
  float y = 0;
  to_f32(&h, DType::kBF16, &y, 1);
  return y;
}

float bf16_bits_as_f16(float x) {
  uint16_t h = 0;
  from_f32(&x, &h, DType::kBF16, 1);
  float y = 0;
  to_f32(&h, DType::kF16, &y, 1);
  return y;
}

std::vector<float> emulate_bf16_tc(const CacheView& dense, const std::vector<float>& q, int64_t hq,
                                   int64_t n_q, const AttentionParams& ap, bool mutant) {
  const int64_t B = dense.batch, H = dense.n_kv_heads, D = dense.head_dim, G = hq / H;
  const double scale = ap.scale != 0.0f ? ap.scale : 1.0 / std::sqrt(static_cast<double>(D));
  std::vector<float> out(q.size(), 0.0f);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t qh = 0; qh < hq; ++qh)
      for (int64_t i = 0; i < n_q; ++i) {
        const int64_t kh = qh / G, qpos = ap.q_pos0 + i;
        const size_t at = static_cast<size_t>(((b * hq + qh) * n_q + i) * D);
        std::vector<double> l, acc(static_cast<size_t>(D), 0.0);
        std::vector<const ViewSegment*> seg;
        std::vector<int64_t> row;
        for (const ViewSegment& s : dense.segments)
          for (int64_t j = 0; j < s.n_rows; ++j) {
            const int64_t pos = s.position(b, kh, j, H);
            if (pos > qpos || (ap.window > 0 && qpos >= pos + ap.window)) continue;
            double dot = 0;
            for (int64_t d = 0; d < D; ++d)
              dot += static_cast<double>(bf16_round(q[at + d])) * s.keys.at(b, kh, j, d);
            l.push_back(dot * scale);
            seg.push_back(&s);
            row.push_back(j);
          }
        if (l.empty()) continue;
        const double mx = *std::max_element(l.begin(), l.end());
        double sum = 0;
        for (size_t j = 0; j < l.size(); ++j) {
          const double p = std::exp(l[j] - mx);
          sum += p;
          const double pb = bf16_round(static_cast<float>(p));
          for (int64_t d = 0; d < D; ++d) {
            const float v = seg[j]->values.at(b, kh, row[j], d);
            acc[d] += pb * (mutant ? bf16_bits_as_f16(v) : v);
          }
        }
        for (int64_t d = 0; d < D; ++d) out[at + d] = static_cast<float>(acc[d] / sum);
      }
  return out;
}

// The bf16-operand bound (kGpuBf16LogitRel, kGpuBf16ValueRel) holds for the emulated bf16
// arithmetic over every full-precision bf16 view of the table, and a kernel that reads bf16
// rows as fp16 breaks it on most views: the CUDA tests of that bound can fail. Also reported:
// the share of the fp16-operand bound the bf16 arithmetic uses (informational: both bounds are
// worst cases, the emulation's errors typical ones).
TEST(BackendOps, GpuBf16OperandBoundOnEmulatedArithmetic) {
  uint64_t seed = 1;
  double worst_f16_bound = 0, mutant_min = 1e300;
  int n = 0, mutant_caught = 0;
  for (const harness::AttnCase& c : harness::attention_cases(harness::small_sweep())) {
    ++seed;
    if (c.packed() || !c.all_fp_dtype(DType::kBF16) || c.q_shift >= 500) continue;
    const auto hv = harness::make_view(c.batch, c.n_kv_heads, c.head_dim, c.segs, seed);
    if (hv->view.n_rows() == 0) continue;
    const int64_t hq = c.n_kv_heads * c.n_rep;
    AttentionParams ap;
    ap.q_pos0 = std::max<int64_t>(hv->span - c.n_q, 0) + c.q_shift;
    ap.window = c.window;
    const auto q = gaussian(c.batch * hq * c.n_q * c.head_dim, seed * 7 + 1, 1.5f);
    const DenseView dense = dequantize_view(hv->view, DType::kF32);
    const auto ref = harness::attention_ref(dense.view, q, hq, c.n_q, ap);
    ASSERT_EQ(harness::tc_operands(hv->view), DType::kBF16) << c.vars();
    const auto bound = harness::gpu_attention_bound(
        dense.view, q, hq, c.n_q, ap, harness::GpuAttnKernel::kDecode, DType::kBF16, ref);
    const auto f16 = harness::gpu_attention_bound(
        dense.view, q, hq, c.n_q, ap, harness::GpuAttnKernel::kDecode, DType::kF16, ref);
    const auto got = emulate_bf16_tc(dense.view, q, hq, c.n_q, ap, false);
    const auto bad = emulate_bf16_tc(dense.view, q, hq, c.n_q, ap, true);
    Check k("bf16 tensor-core emulation", "cpu", c.vars());
    k.bounded(got, ref, bound, "out");
    double r16 = 0, rbad = 0;
    for (size_t e = 0; e < ref.size(); ++e) {
      r16 = std::max(r16, std::abs(got[e] - ref[e]) / f16[e]);
      rbad = std::max(rbad, std::abs(bad[e] - ref[e]) / bound[e]);
    }
    worst_f16_bound = std::max(worst_f16_bound, r16);
    mutant_min = std::min(mutant_min, rbad);
    mutant_caught += rbad > 1.0;
    ++n;
  }
  EXPECT_GT(n, 0);
  // A broken kernel fails the CUDA test when any case leaves its bound; the bound is absolute
  // (V = max |v|), so long views whose output averages many rows can hide the mutant, short
  // ones cannot: most views must catch it.
  EXPECT_GT(2 * mutant_caught, n) << mutant_caught << " of " << n << " views caught the mutant";
  std::printf(
      "[bf16 emulation] %d views; worst share of the fp16-operand bound %.1f%%; the "
      "fp16-read mutant leaves the bf16 bound in %d views (smallest worst share %.0f%%)\n",
      n, 100 * worst_f16_bound, mutant_caught, 100 * mutant_min);
}

// Decode over packed rows on every packed decode path this CPU has (portable, AVX2, AVX-512,
// AVX-512 VNNI with int8 queries: the kernels of src/ops/packed_decode.h, chosen through
// vq::attention), each against the reference with packed_decode_bound (attention_bounds.cpp
// derives it for each path's arithmetic).
TEST(BackendOps, AttentionPackedDecodePaths) {
  const auto cases = harness::packed_decode_cases(harness::small_sweep());
  const detail::CpuIsa best = detail::detected_isa();
  for (detail::CpuIsa isa :
       {detail::CpuIsa::kPortable, detail::CpuIsa::kAvx2, detail::CpuIsa::kAvx2Int8,
        detail::CpuIsa::kAvx512, detail::CpuIsa::kAvx512Vnni, detail::CpuIsa::kAvx512Bf16}) {
    if (isa > best) continue;
    detail::set_attention_isa(isa);
    uint64_t seed = 1000;
    for (const harness::AttnCase& c : cases) {
      ++seed;
      const auto hv = harness::make_view(c.batch, c.n_kv_heads, c.head_dim, c.segs, seed);
      const int64_t hq = c.n_kv_heads * c.n_rep;
      AttentionParams ap;
      ap.q_pos0 = std::max<int64_t>(hv->span - c.n_q, 0);
      ap.window = c.window;
      const auto q = gaussian(c.batch * hq * c.n_q * c.head_dim, seed * 7 + 1, 1.5f);
      Tensor qt(DType::kF32, c.batch, hq, c.n_q, c.head_dim);
      std::copy(q.begin(), q.end(), static_cast<float*>(qt.data()));
      std::vector<float> got(q.size(), -1.0f);
      attention(qt.view(), hv->view, ap, got.data());
      const DenseView dense = dequantize_view(hv->view, DType::kF32);
      const auto ref = harness::attention_ref(dense.view, q, hq, c.n_q, ap);
      Check k("attention packed decode", detail::isa_name(isa), c.vars());
      k.bounded(got, ref, harness::packed_decode_bound(hv->view, dense.view, q, hq, c.n_q, ap, isa),
                "out");
    }
  }
  detail::reset_attention_isa();
}

// fp8 (e4m3) metadata in the packed key kernels is decoded exactly: every fp8 value is an fp16
// value, so records with fp8 metadata and the same records with that metadata stored as fp16
// give bit-identical logits on every instruction set of this CPU (the same kernel arithmetic
// after the decode). Metadata bytes cover every finite fp8 code (subnormals, both signs);
// rows listed out of order, a 13-row tail (partial gathers). mutant: a one-ulp error in one
// fp8 value's decode changes the logits (checked by the mutation in the commit message).
TEST(BackendOps, PackedKeysFp8MetadataEqualsFp16) {
  const detail::CpuIsa best = detail::detected_isa();
  int checked = 0;
  for (int bits : {1, 2, 4, 8})
    for (int64_t d : {64, 128}) {
      const PackedRowFormat f8 = make_row_format(d, bits, 32, MetaType::kFP8E4M3);
      const PackedRowFormat f16 = make_row_format(d, bits, 32, MetaType::kF16);
      const int64_t n = 45, n_q = 3;
      std::vector<uint8_t> r8(static_cast<size_t>(n * f8.row_stride));
      std::vector<uint8_t> r16(static_cast<size_t>(n * f16.row_stride));
      std::mt19937_64 rng(static_cast<uint64_t>(bits * 1000 + d));
      int code = 0;
      for (int64_t r = 0; r < n; ++r) {
        uint8_t* a = r8.data() + r * f8.row_stride;
        uint8_t* b = r16.data() + r * f16.row_stride;
        for (int32_t c = 0; c < f8.code_bytes; ++c) a[c] = b[c] = static_cast<uint8_t>(rng());
        for (int32_t j = 0; j < 2 * f8.n_groups; ++j) {
          uint8_t m = static_cast<uint8_t>(code++ % 256);
          if ((m & 0x7f) == 0x7f) m = static_cast<uint8_t>(m - 1);  // finite codes only
          a[f8.code_bytes + j] = m;
          meta_store(b + f16.code_bytes, j, fp8_e4m3_decode(m), MetaType::kF16);
        }
      }
      std::vector<int32_t> rows(static_cast<size_t>(n));
      for (int64_t t = 0; t < n; ++t)
        rows[static_cast<size_t>(t)] = static_cast<int32_t>((t * 7) % n);
      const auto q = gaussian(n_q * d, 11, 1.0f);
      std::vector<float> qsum(static_cast<size_t>(n_q * f8.n_groups), 0.0f);
      for (int64_t m = 0; m < n_q; ++m)
        for (int64_t i = 0; i < d; ++i)
          qsum[static_cast<size_t>(m * f8.n_groups + i / 32)] += q[static_cast<size_t>(m * d + i)];
      for (detail::CpuIsa isa :
           {detail::CpuIsa::kPortable, detail::CpuIsa::kAvx2, detail::CpuIsa::kAvx2Int8,
            detail::CpuIsa::kAvx512, detail::CpuIsa::kAvx512Vnni, detail::CpuIsa::kAvx512Bf16}) {
        if (isa > best) continue;
        const detail::PackedKernel k8 = detail::packed_kernel(f8, isa);
        const detail::PackedKernel k16 = detail::packed_kernel(f16, isa);
        if (k8.keys == nullptr || k8.isa != k16.isa || k8.int8_query != k16.int8_query)
          continue;  // not the same kernel family (AVX2's int8 keys take fp16 metadata only)
        auto logits = [&](const detail::PackedKernel& k, const PackedRowFormat& f,
                          const std::vector<uint8_t>& rec) {
          std::vector<uint64_t> prep;
          if (k.prepare) {
            prep.resize(static_cast<size_t>((k.prep_bytes(f, n_q) + 7) / 8));
            k.prepare(f, q.data(), qsum.data(), n_q, prep.data());
          }
          std::vector<float> out(static_cast<size_t>(n_q * 64), 0.0f);  // [m][row], row < n
          for (int64_t t0 = 0; t0 < n; t0 += 32) {
            const detail::PackedTile tile{rec.data(), f.row_stride, rows.data() + t0,
                                          std::min<int64_t>(32, n - t0)};
            k.keys(f, tile, q.data(), qsum.data(), n_q, out.data(), 64, prep.data());
          }
          return out;
        };
        const auto a = logits(k8, f8, r8), b = logits(k16, f16, r16);
        EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * 4), 0)
            << "bits " << bits << " d " << d << " isa " << detail::isa_name(isa);
        ++checked;
      }
    }
  EXPECT_GE(checked, 8);
}

// (On AVX2 CPUs the value check covers the AVX2 kernels, packed_decode_avx2_values.cpp among
// them; the int8 key kernel there sums its lanes in another order and is held to its bound by
// AttentionPackedDecodePaths.)
// The AVX-512 packed decode kernels read up to 16 records at a time with plain loads and a
// transpose (src/ops/packed_decode_rows16.h): every tile size 1 .. 32 (partial blocks of 16),
// rows listed out of order or as a run, the last record of the buffer ending at a page that
// may not be read (a load past a record's bytes faults), fp16 and fp8 metadata. The key kernel
// (int8 queries, packed_decode_vnni.cpp) gives bit for bit the logits its declared arithmetic
// gives in scalar code: per group the exact integer sum of q8_i c_i, then
// tot = fma(float(acc), s_g sq_g, tot), tot = fma(lo_g, qsum_g, tot); the value kernel gives bit
// for bit acc_i = fma(p s_g, c_i, acc_i) over the rows in order, and acc_lo within
// n_rows u sum_t |p_t lo_t| of the exact sum (its lanes add the rows in another order).
// The key check covers both key kernels: the fixed-shape one (keys_fixed: fp16 metadata, group
// 32, D 64 or 128, 2- or 4-bit codes) and the general one (the other formats here).
// mutants: the 8-word registers loading record r in place of r + 1 fails the key check;
// keys_fixed gathering group NG - 1 - g's metadata for group g fails it (bits=2,d=64,meta=f16);
// loading all 64 bytes of every record (no byte mask) faults on the page after the last record.
TEST(BackendOps, PackedDecodeRowTilesExact) {
  const detail::CpuIsa best = detail::detected_isa();
  if (best < detail::CpuIsa::kAvx2) GTEST_SKIP() << "no AVX2 or AVX-512 kernels on this CPU";
  const int64_t page = sysconf(_SC_PAGESIZE);
  int checked_keys = 0, checked_values = 0;
  for (MetaType meta : {MetaType::kF16, MetaType::kFP8E4M3})
    for (int bits : {1, 2, 4, 8})
      for (int64_t d : {64, 128, 256}) {
        const int64_t gs = 32;
        const PackedRowFormat f = make_row_format(d, bits, gs, meta);
        const int64_t n = 40, ng = f.n_groups, n_q = 3;
        // The records end where a PROT_NONE page begins.
        const int64_t bytes = n * f.row_stride, pages = (bytes + page - 1) / page + 1;
        void* mem = mmap(nullptr, static_cast<size_t>(pages * page), PROT_READ | PROT_WRITE,
                         MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        ASSERT_NE(mem, MAP_FAILED);
        uint8_t* guard = static_cast<uint8_t*>(mem) + (pages - 1) * page;
        ASSERT_EQ(mprotect(guard, static_cast<size_t>(page), PROT_NONE), 0);
        uint8_t* rec = guard - bytes;
        std::mt19937_64 rng(static_cast<uint64_t>(bits * 1000 + d + 7 * static_cast<int>(meta)));
        std::normal_distribution<float> nd(0.0f, 1.0f);
        for (int64_t r = 0; r < n; ++r) {
          uint8_t* a = rec + r * f.row_stride;
          for (int32_t c = 0; c < f.code_bytes; ++c) a[c] = static_cast<uint8_t>(rng());
          for (int64_t j = 0; j < 2 * ng; ++j) {
            const float v = j % 2 ? 0.05f + std::abs(nd(rng)) : nd(rng);
            meta_store(a + f.code_bytes, j, meta_round(v, meta), meta);
          }
        }
        const auto q = gaussian(n_q * d, static_cast<uint64_t>(bits + d), 1.0f);
        std::vector<float> qsum(static_cast<size_t>(n_q * ng), 0.0f);
        for (int64_t m = 0; m < n_q; ++m)
          for (int64_t i = 0; i < d; ++i)
            qsum[static_cast<size_t>(m * ng + i / gs)] += q[static_cast<size_t>(m * d + i)];
        // the fp32 value kernels (the bf16 ones: PackedDecodeBf16Values)
        const detail::PackedKernel k =
            detail::packed_kernel(f, std::min(best, detail::CpuIsa::kAvx512Vnni));
        std::vector<uint64_t> prep;
        if (k.prepare) {
          prep.resize(static_cast<size_t>((k.prep_bytes(f, n_q) + 7) / 8));
          k.prepare(f, q.data(), qsum.data(), n_q, prep.data());
        }
        const auto code = [&](int64_t t, int64_t i) {
          return static_cast<float>(code_at(rec + t * f.row_stride, i, f.spec));
        };
        const auto meta_of = [&](int64_t t, int64_t j) {
          return meta_load(rec + t * f.row_stride + f.code_bytes, j, f.meta);
        };
        const auto p = gaussian(n_q * n, 99, 1.0f);  // weights [m][row]
        for (int64_t nt = 1; nt <= 32; ++nt)
          for (int order = 0; order < 2; ++order) {
            // the last nt records as a run, or listed backwards with a gap
            std::vector<int32_t> rows(static_cast<size_t>(nt));
            for (int64_t i = 0; i < nt; ++i)
              rows[static_cast<size_t>(i)] =
                  static_cast<int32_t>(order == 0 ? n - nt + i : n - 1 - 2 * i * (n - 1) / 64);
            const detail::PackedTile tile{rec, f.row_stride, rows.data(), nt};
            const std::string v = "bits=" + std::to_string(bits) + ",d=" + std::to_string(d) +
                                  (meta == MetaType::kF16 ? ",meta=f16" : ",meta=fp8") +
                                  ",rows=" + std::to_string(nt) + ",order=" + std::to_string(order);
            if (k.int8_query && k.isa >= detail::CpuIsa::kAvx512Vnni) {
              std::vector<float> got(static_cast<size_t>(n_q * n), -1.0f);
              k.keys(f, tile, q.data(), qsum.data(), n_q, got.data(), n, prep.data());
              for (int64_t m = 0; m < n_q; ++m) {
                const float* qm = q.data() + m * d;
                for (int64_t i = 0; i < nt; ++i) {
                  const int64_t t = rows[static_cast<size_t>(i)];
                  float tot = 0.0f;
                  for (int64_t g = 0; g < ng; ++g) {
                    float mx = 0.0f;
                    for (int64_t c = g * gs; c < (g + 1) * gs; ++c)
                      mx = std::max(mx, std::abs(qm[c]));
                    const float sq = mx / 127.0f;
                    int64_t acc = 0;
                    for (int64_t c = g * gs; c < (g + 1) * gs; ++c) {
                      const float r = sq > 0.0f ? std::nearbyint(qm[c] / sq) : 0.0f;
                      acc += static_cast<int64_t>(std::clamp(r, -127.0f, 127.0f)) *
                             static_cast<int64_t>(code(t, c));
                    }
                    tot = std::fma(static_cast<float>(acc), meta_of(t, 2 * g + 1) * sq, tot);
                    tot = std::fma(meta_of(t, 2 * g), qsum[static_cast<size_t>(m * ng + g)], tot);
                  }
                  const float gv = got[static_cast<size_t>(m * n + t)];
                  if (std::memcmp(&gv, &tot, 4) != 0) {
                    ADD_FAILURE() << "keys " << v << " m " << m << " row " << t << ": " << gv
                                  << " vs " << tot;
                    return;
                  }
                }
              }
              ++checked_keys;
            }
            if (meta != MetaType::kF16 || k.isa < detail::CpuIsa::kAvx2) continue;
            std::vector<float> acc(static_cast<size_t>(n_q * d), 0.5f), ref = acc;
            std::vector<float> acc_lo(static_cast<size_t>(n_q * ng), 0.0f);
            std::vector<float> scratch(static_cast<size_t>(detail::packed_values_scratch(ng, n_q)));
            k.values(f, tile, p.data(), n, n_q, acc.data(), acc_lo.data(), scratch.data());
            for (int64_t m = 0; m < n_q; ++m)
              for (int64_t g = 0; g < ng; ++g) {
                double lo_sum = 0.0, lo_abs = 0.0;
                for (int64_t i = 0; i < nt; ++i) {
                  const int64_t t = rows[static_cast<size_t>(i)];
                  const float pm = p[static_cast<size_t>(m * n + t)];
                  const float w = pm * meta_of(t, 2 * g + 1);
                  for (int64_t c = g * gs; c < (g + 1) * gs; ++c) {
                    float& a = ref[static_cast<size_t>(m * d + c)];
                    a = std::fma(w, code(t, c), a);
                  }
                  lo_sum += static_cast<double>(pm) * meta_of(t, 2 * g);
                  lo_abs += std::abs(static_cast<double>(pm) * meta_of(t, 2 * g));
                }
                const double err = std::abs(acc_lo[static_cast<size_t>(m * ng + g)] - lo_sum);
                EXPECT_LE(err, static_cast<double>(nt + 1) * kU * lo_abs)
                    << "values acc_lo " << v << " m " << m << " g " << g;
              }
            if (std::memcmp(acc.data(), ref.data(), acc.size() * 4) != 0) {
              ADD_FAILURE() << "values " << v;
              return;
            }
            ++checked_values;
          }
        munmap(mem, static_cast<size_t>(pages * page));
      }
  if (best >= detail::CpuIsa::kAvx512Vnni) {
    EXPECT_GE(checked_keys, 2 * 4 * 3 * 64);
  }
  EXPECT_GE(checked_values, 1 * 3 * 3 * 64);
}

// The bf16 value kernel (src/ops/packed_decode_bf16.cpp, CPUs with AVX-512 BF16): acc_i +=
// bf16(fl32(p s_g)) c_i with fp32 sums, two rows per vdpbf16ps, against the scalar reference
// (double sums of the exact terms t = p s_g c_i) with the bound derived there:
//   |acc - (acc0 + sum_t t)| <= (u_b + u + u_b u) S + gamma_{n+1} (|acc0| + (1 + u_b + 2 u) S)
//                               + n 2^-126 2^B,   S = sum_t |t|, u_b = 2^-8, u = 2^-24,
// and, tighter, against the same sum with each weight rounded as the kernel must round it
// (fp32 product, then bf16 round to nearest even: dtype.h's f32_to_bf16): within
// gamma_{n+1} (|acc0| + sum |bf16(w) c|) + n 2^-126 2^B, which a wrong pairing, a lone last row
// taken twice or a weight rounded otherwise would leave. mutants (checked by hand): row r's codes
// in place of row r + 1's fails both checks; each weight times (1 + 2^-10) before its rounding
// passes the derived bound and fails the second. acc_lo (fp32) as the fp32 kernel's. Tiles of
// 1-32 rows (odd counts: the last row pairs with itself at weight 0), rows as a run, listed
// backwards with gaps, or every other record; 2- and 4-bit codes, D = 64 and 128, groups of
// whole code blocks and of half of one, n_q 1-8 (passes of 4, 3, 2, 1 queries).
TEST(BackendOps, PackedDecodeBf16Values) {
  const detail::CpuIsa best = detail::detected_isa();
  if (best < detail::CpuIsa::kAvx512Bf16) GTEST_SKIP() << "no AVX-512 BF16 on this CPU";
  constexpr double kUb = 0x1p-8;  // bf16 unit roundoff (8 significand bits)
  int checked = 0;
  double worst = 0, worst_tight = 0;
  for (int bits : {2, 4})
    for (int64_t d : {64, 128})
      for (int64_t gs : {16, 32, 64}) {
        const PackedRowFormat f = make_row_format(d, bits, gs, MetaType::kF16);
        const detail::PackedKernel k = detail::packed_kernel(f, best);
        if (!k.bf16_values) continue;
        const int64_t n = 70, ng = f.n_groups;
        std::vector<uint8_t> rec(static_cast<size_t>(n * f.row_stride));
        std::mt19937_64 rng(static_cast<uint64_t>(bits * 1000 + d * 10 + gs));
        std::normal_distribution<float> nd(0.0f, 1.0f);
        for (int64_t r = 0; r < n; ++r) {
          uint8_t* a = rec.data() + r * f.row_stride;
          for (int32_t c = 0; c < f.code_bytes; ++c) a[c] = static_cast<uint8_t>(rng());
          for (int64_t j = 0; j < 2 * ng; ++j) {
            const float v = j % 2 ? 0.05f + std::abs(nd(rng)) : nd(rng);
            meta_store(a + f.code_bytes, j, meta_round(v, MetaType::kF16), MetaType::kF16);
          }
        }
        const auto code = [&](int64_t t, int64_t i) {
          return static_cast<double>(code_at(rec.data() + t * f.row_stride, i, f.spec));
        };
        const auto meta_of = [&](int64_t t, int64_t j) {
          return meta_load(rec.data() + t * f.row_stride + f.code_bytes, j, f.meta);
        };
        for (int64_t n_q = 1; n_q <= 8; ++n_q) {
          const auto p = gaussian(n_q * n, static_cast<uint64_t>(n_q + 17 * bits + d), 1.0f);
          const auto acc0 = gaussian(n_q * d, static_cast<uint64_t>(n_q * 31 + gs), 0.5f);
          for (int64_t nt = 1; nt <= 32; ++nt)
            for (int order = 0; order < 3; ++order) {
              // the last nt records as a run, listed backwards with gaps, or every other record
              std::vector<int32_t> rows(static_cast<size_t>(nt));
              for (int64_t i = 0; i < nt; ++i)
                rows[static_cast<size_t>(i)] = static_cast<int32_t>(
                    order == 0 ? n - nt + i
                               : (order == 1 ? n - 1 - 2 * i * (n - 1) / 64 : 2 * i + 1));
              const detail::PackedTile tile{rec.data(), f.row_stride, rows.data(), nt};
              std::vector<float> acc = acc0;
              std::vector<float> acc_lo(static_cast<size_t>(n_q * ng), 0.0f);
              std::vector<float> scratch(
                  static_cast<size_t>(detail::packed_values_scratch(ng, n_q)));
              k.values(f, tile, p.data(), n, n_q, acc.data(), acc_lo.data(), scratch.data());
              const std::string v = "bits=" + std::to_string(bits) + ",d=" + std::to_string(d) +
                                    ",gs=" + std::to_string(gs) + ",n_q=" + std::to_string(n_q) +
                                    ",rows=" + std::to_string(nt) +
                                    ",order=" + std::to_string(order);
              const double flush = static_cast<double>(nt) * 0x1p-126 * (1 << bits);
              for (int64_t m = 0; m < n_q; ++m)
                for (int64_t c = 0; c < d; ++c) {
                  const int64_t g = c / gs;
                  const double a0 = acc0[static_cast<size_t>(m * d + c)];
                  double exact = a0, sabs = 0, tight = a0, tabs = 0;
                  for (int64_t i = 0; i < nt; ++i) {
                    const int64_t t = rows[static_cast<size_t>(i)];
                    const float pm = p[static_cast<size_t>(m * n + t)];
                    const float sg = meta_of(t, 2 * g + 1);
                    const double term = static_cast<double>(pm) * sg * code(t, c);
                    exact += term;
                    sabs += std::abs(term);
                    const double wb = bf16_to_f32(f32_to_bf16(pm * sg));
                    tight += wb * code(t, c);
                    tabs += std::abs(wb * code(t, c));
                  }
                  const double got = acc[static_cast<size_t>(m * d + c)];
                  const double bound =
                      (kUb + kU + kUb * kU) * sabs +
                      harness::gamma_n(nt + 1) * (std::abs(a0) + (1 + kUb + 2 * kU) * sabs) + flush;
                  const double tbound = harness::gamma_n(nt + 1) * (std::abs(a0) + tabs) + flush;
                  const double err = std::abs(got - exact), terr = std::abs(got - tight);
                  worst = std::max(worst, err / bound);
                  worst_tight = std::max(worst_tight, terr / tbound);
                  if (!(err <= bound) || !(terr <= tbound)) {
                    ADD_FAILURE() << "values " << v << " m " << m << " c " << c << ": " << got
                                  << " vs " << exact << " (bound " << bound << ") / " << tight
                                  << " (bound " << tbound << ")";
                    return;
                  }
                }
              for (int64_t m = 0; m < n_q; ++m)
                for (int64_t g = 0; g < ng; ++g) {
                  double lo_sum = 0.0, lo_abs = 0.0;
                  for (int64_t i = 0; i < nt; ++i) {
                    const int64_t t = rows[static_cast<size_t>(i)];
                    const double x =
                        static_cast<double>(p[static_cast<size_t>(m * n + t)]) * meta_of(t, 2 * g);
                    lo_sum += x;
                    lo_abs += std::abs(x);
                  }
                  EXPECT_LE(std::abs(acc_lo[static_cast<size_t>(m * ng + g)] - lo_sum),
                            static_cast<double>(nt + 1) * kU * lo_abs)
                      << "values acc_lo " << v << " m " << m << " g " << g;
                }
              ++checked;
            }
        }
      }
  std::printf(
      "[bf16 values] %d tiles; worst share of the derived bound %.1f%%, of the bound "
      "around bf16-rounded weights %.1f%%\n",
      checked, 100 * worst, 100 * worst_tight);
  // 2-bit: gs 32 (half blocks), 64; 4-bit: gs 16 (half blocks), 32, 64; D 64 and 128 (4-bit
  // gs 64 at D 64 is one group of two blocks)
  EXPECT_GE(checked, 10 * 8 * 32 * 3);
}

// ---- group quantization -----------------------------------------------------------------------

// Inputs for a quantizer case: normal rows with heterogeneous channels, then special rows (all
// zero, constant, one outlier, dyadic integers), rounded to the case's input dtype.
std::vector<float> quant_input(const harness::QuantCase& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> ch(static_cast<size_t>(c.d));
  for (auto& s : ch) s = 0.1f + 3.0f * std::abs(nd(rng));
  std::vector<float> x(static_cast<size_t>(c.n * c.d));
  for (int64_t r = 0; r < c.n; ++r)
    for (int64_t j = 0; j < c.d; ++j) {
      float v = nd(rng) * ch[j];
      switch (r % 11) {
        case 5:
          v = 0.0f;
          break;
        case 7:
          v = 1.25f;
          break;
        case 9:
          v = j == 3 ? 400.0f : v * 0.01f;
          break;
        case 10:
          v = static_cast<float>(static_cast<int>(rng() % 17) - 8);
          break;
        default:
          break;
      }
      x[static_cast<size_t>(r * c.d + j)] = v;
    }
  std::vector<uint8_t> tmp(dtype_size(c.in_dtype));
  for (auto& v : x) {
    from_f32(&v, tmp.data(), c.in_dtype, 1);
    to_f32(tmp.data(), c.in_dtype, &v, 1);
  }
  return x;
}

GroupQuantParams quant_params(const harness::QuantCase& c) {
  GroupQuantParams p;
  p.bits = c.bits;
  p.group_size = c.group;
  p.meta = c.meta;
  p.clip_search = c.clip;
  p.clip_alpha = c.clip ? 1.0f : 0.9f;
  p.clip_floor = c.clip_floor;
  return p;
}

// Codes, lo and scale of the optimised quantizer equal the scalar reference's; packed records
// equal the reference codes packed by pack_codes with meta_store'd metadata; dequantize_record
// equals group_dequantize_reference; and dequantization is within the derived bound
//   |x - deq(q(x))| <= scale/2 + max(0, lo - x, x - (lo + L scale)) + u (2 L scale + 2 |lo|)
// (round to nearest inside the covered range [lo, lo + L scale]; a clipped or metadata-rounded
// range adds the distance to it; code*scale + lo is two fp32 roundings). All-zero groups
// round-trip exactly. The bound is attained: at 1 bit an element near the middle of its group's
// range errs by scale/2, so low-bit cases use ~100% of it.
TEST(BackendOps, GroupQuantization) {
  uint64_t seed = 100;
  for (const harness::QuantCase& c : harness::quant_cases(harness::small_sweep())) {
    ++seed;
    const auto x = quant_input(c, seed);
    const GroupQuantParams p = quant_params(c);
    const int64_t G = (c.d + c.group - 1) / c.group;
    std::vector<uint8_t> rc(x.size()), fc(x.size());
    std::vector<float> rlo(static_cast<size_t>(c.n * G)), rsc(rlo.size()), flo(rlo.size()),
        fsc(rlo.size());
    group_quantize_reference(x.data(), c.n, c.d, p, rc.data(), rlo.data(), rsc.data());
    group_quantize(x.data(), c.n, c.d, p, fc.data(), flo.data(), fsc.data());
    {
      Check k("group_quantize", "cpu", c.vars());
      k.exact(fc, rc, "codes");
      k.allow_zero_reference();  // a one-row case may have lo == 0
      k.exact(flo, rlo, "lo");
      k.exact(fsc, rsc, "scale");
    }
    const PackedRowFormat f = make_row_format(c.d, c.bits, c.group, c.meta);
    {
      std::vector<uint8_t> got(static_cast<size_t>(c.n * f.row_stride), 0), want(got.size(), 0);
      quantize_to_records(x.data(), c.n, f, p, got.data(), f.row_stride, c.n % 2 == 0);
      for (int64_t r = 0; r < c.n; ++r) {
        uint8_t* rec = want.data() + r * f.row_stride;
        pack_codes(rc.data() + r * c.d, c.d, f.spec, rec);
        for (int64_t g = 0; g < G; ++g) {
          meta_store(rec + f.code_bytes, 2 * g, rlo[static_cast<size_t>(r * G + g)], c.meta);
          meta_store(rec + f.code_bytes, 2 * g + 1, rsc[static_cast<size_t>(r * G + g)], c.meta);
        }
      }
      Check k("quantize_to_records", "cpu", c.vars());
      k.exact(got, want, "records");
      std::vector<float> deq_rec(x.size()), deq_ref(x.size());
      for (int64_t r = 0; r < c.n; ++r)
        dequantize_record(got.data() + r * f.row_stride, f, deq_rec.data() + r * c.d);
      group_dequantize_reference(rc.data(), rlo.data(), rsc.data(), c.n, c.d, c.group,
                                 deq_ref.data());
      k.exact(deq_rec, deq_ref, "dequantize_record");
      Check e("group_dequantize bound", "cpu", c.vars());
      std::vector<double> bound(x.size()), xd(x.begin(), x.end());
      const double levels = f.spec.levels();
      for (int64_t r = 0; r < c.n; ++r)
        for (int64_t j = 0; j < c.d; ++j) {
          const size_t at = static_cast<size_t>(r * c.d + j),
                       ag = static_cast<size_t>(r * G + j / c.group);
          const double lo = rlo[ag], sc = rsc[ag], hi = lo + levels * sc, xv = x[at];
          bound[at] = sc / 2 + std::max({0.0, lo - xv, xv - hi}) +
                      kU * (2 * levels * sc + 2 * std::abs(lo));
          // All-zero group: exact.
          bool zero_group = true;
          for (int64_t jj = j / c.group * c.group; jj < std::min(c.d, (j / c.group + 1) * c.group);
               ++jj)
            zero_group &= x[static_cast<size_t>(r * c.d + jj)] == 0.0f;
          if (zero_group) bound[at] = 0;
        }
      e.bounded(deq_ref, xd, bound, "x - deq(q(x))");
    }
  }
}

// ---- Hadamard ---------------------------------------------------------------------------------

// hadamard_rotate / unrotate against the dense fp64 matrix product (hadamard_matrix_reference):
// per element (log2 b + 2) u ||x_block||_1 / sqrt(b) (log2 b butterfly levels, the sign flip and
// the normalisation, each at most u of the block's absolute sum / sqrt(b)), plus the double
// product's own d 2^-53 ||x||_1.
TEST(BackendOps, Hadamard) {
  for (int64_t d : {1, 2, 3, 8, 64, 96, 100, 128})
    for (int trial = 0; trial < 3; ++trial) {
      const int64_t b = hadamard_block(d);
      const auto signs = hadamard_signs(42 + d + trial, d);
      const auto m = hadamard_matrix_reference(d, b, signs.data());
      const auto x = gaussian(d, 1000 * d + trial, trial == 2 ? 100.0f : 1.0f);
      for (bool inverse : {false, true}) {
        std::vector<float> y = x;
        if (inverse)
          hadamard_unrotate(y.data(), signs.data(), d, b);
        else
          hadamard_rotate(y.data(), signs.data(), d, b);
        std::vector<double> ref(static_cast<size_t>(d)), bound(ref.size());
        double l1 = 0;
        for (float v : x) l1 += std::abs(v);
        for (int64_t i = 0; i < d; ++i) {
          for (int64_t j = 0; j < d; ++j)  // R^T for the inverse
            ref[i] += (inverse ? m[j * d + i] : m[i * d + j]) * x[j];
          double blk = 0;
          for (int64_t j = i / b * b; j < i / b * b + b; ++j) blk += std::abs(x[j]);
          bound[i] =
              (std::log2(double(b)) + 2) * kU * blk / std::sqrt(double(b)) + d * 0x1p-53 * l1;
        }
        Check k(inverse ? "hadamard_unrotate" : "hadamard_rotate", "cpu",
                Vars()("d", d)("block", b)("trial", trial).str());
        k.bounded(y, ref, bound, "y");
      }
    }
}

// ---- SnapKV -----------------------------------------------------------------------------------

// Per-score bound of the optimised scorers against the double references: a logit is a D-term
// fp32 dot product times the fp32 scale, |dl| <= gamma(D + 2) A (A = sum |q_c k_c| / sqrt(D));
// p_j = exp(l_j - m) / Z: u R for the subtraction (R the row's logit range), expf 1 ulp, Z an
// n-term fp32 sum (gamma(n)), 1/Z and the product 2u; logit errors move p_j by exp(2 dl); the
// means are in double, rounded once (u); the double reference adds (D + n + 8) 2^-53; fp32 exp
// underflows below 2^-126 (2^-120 absolute).
std::vector<double> score_bound(const std::vector<float>& keys, const int32_t* key_pos, int64_t n,
                                int64_t d, const float* queries, const int32_t* query_pos,
                                int64_t nq_rows, int64_t w, const std::vector<double>& ref) {
  double rel = 0.0;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (int64_t i = 0; i < nq_rows; ++i) {
    const float* q = queries + i * d;
    double amax = 0.0, lmax = -1e300, lmin = 1e300;
    for (int64_t j = 0; j < n; ++j) {
      if (key_pos && key_pos[j] > query_pos[i % w]) continue;
      double a = 0.0, l = 0.0;
      for (int64_t c = 0; c < d; ++c) {
        a += std::fabs(static_cast<double>(q[c]) * keys[j * d + c]);
        l += static_cast<double>(q[c]) * keys[j * d + c];
      }
      amax = std::max(amax, a * scale);
      lmax = std::max(lmax, l * scale);
      lmin = std::min(lmin, l * scale);
    }
    if (lmax < lmin) continue;
    const double dmax = harness::gamma_n(static_cast<double>(d + 2)) * amax;
    rel = std::max(rel, std::expm1(2 * dmax + kU * (lmax - lmin)) +
                            harness::gamma_n(static_cast<double>(n)) + 4 * kU);
  }
  std::vector<double> tol(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j)
    tol[j] = std::fabs(ref[j]) * (rel + kU + (d + n + 8) * 0x1p-53) + 0x1p-120;
  return tol;
}

TEST(BackendOps, SnapScores) {
  uint64_t seed = 500;
  for (int64_t n : harness::seq_lens(harness::small_sweep()))
    for (int64_t d : {64, 128})
      for (int64_t w : {1, 8, 32})
        for (int64_t n_rep : {0, 1, 4, 8}) {  // 0: key proxy
          ++seed;
          if ((n_rep == 8 && d == 64) || (n_rep == 1 && w == 8)) continue;
          const auto keys = gaussian(n * d, seed);
          std::vector<float> got(static_cast<size_t>(n), -1.0f), rf(got.size());
          if (n_rep == 0) {
            snap_key_proxy_scores(keys.data(), n, d, w, got.data());
            snap_key_proxy_scores_reference(keys.data(), n, d, w, rf.data());
            const std::vector<double> ref(rf.begin(), rf.end());
            const int64_t ww = std::clamp<int64_t>(w, 1, n);
            Check k("snap_key_proxy_scores", "cpu", Vars()("n", n)("D", d)("w", w).str());
            k.bounded(
                got, ref,
                score_bound(keys, nullptr, n, d, keys.data() + (n - ww) * d, nullptr, ww, ww, ref),
                "scores");
            continue;
          }
          const auto q = gaussian(n_rep * w * d, seed + 1);
          for (bool causal : {false, true}) {
            std::vector<int32_t> kp(static_cast<size_t>(n)), qp(static_cast<size_t>(w));
            for (int64_t j = 0; j < n; ++j) kp[j] = static_cast<int32_t>(2 * j);
            for (int64_t i = 0; i < w; ++i) qp[i] = static_cast<int32_t>(2 * (n - w + i) + 1);
            const int32_t* k_pos = causal ? kp.data() : nullptr;
            const int32_t* q_pos = causal ? qp.data() : nullptr;
            snap_query_scores(keys.data(), k_pos, n, d, q.data(), q_pos, n_rep, w, got.data());
            snap_query_scores_reference(keys.data(), k_pos, n, d, q.data(), q_pos, n_rep, w,
                                        rf.data());
            const std::vector<double> ref(rf.begin(), rf.end());
            Check k("snap_query_scores", "cpu",
                    Vars()("n", n)("D", d)("w", w)("rep", n_rep)("causal", causal).str());
            // Causal: the earliest window queries may see no key of a short frame; zeros are fine.
            if (causal) k.allow_zero_reference();
            k.bounded(got, ref, score_bound(keys, k_pos, n, d, q.data(), q_pos, n_rep * w, w, ref),
                      "scores");
          }
        }
}

// Pooling against a scalar reference written here from the contract in snapkv.h: max exact
// (NaN ranked as -inf, NaN only when every neighbour is); avg = double sum / count, rounded once
// (any NaN neighbour gives NaN): the same operations, so exact too.
std::vector<float> pool_ref(const std::vector<float>& in, int64_t kernel, PoolKind kind) {
  const int64_t n = static_cast<int64_t>(in.size()), r = kernel / 2;
  std::vector<float> out(in.size());
  for (int64_t j = 0; j < n; ++j) {
    const int64_t a = std::max<int64_t>(0, j - r), b = std::min<int64_t>(n - 1, j + r);
    if (kind == PoolKind::kMax) {
      float m = std::numeric_limits<float>::quiet_NaN();
      for (int64_t i = a; i <= b; ++i)
        if (!std::isnan(in[i]) && (std::isnan(m) || in[i] > m)) m = in[i];
      out[j] = m;
    } else {
      double s = 0;
      for (int64_t i = a; i <= b; ++i) s += in[i];
      out[j] = static_cast<float>(s / static_cast<double>(b - a + 1));
    }
  }
  return out;
}

TEST(BackendOps, SnapPool) {
  uint64_t seed = 900;
  for (int64_t n : harness::seq_lens(harness::small_sweep()))
    for (int64_t kernel : {1, 3, 5, 7})
      for (PoolKind kind : {PoolKind::kMax, PoolKind::kAvg}) {
        auto in = gaussian(n, ++seed);
        for (auto& v : in) v = std::abs(v);
        if (n > 10) in[static_cast<size_t>(n / 2)] = std::numeric_limits<float>::quiet_NaN();
        std::vector<float> got(in.size(), -1.0f);
        snap_pool_scores(in.data(), n, kernel, kind, got.data());
        Check k(
            "snap_pool_scores", "cpu",
            Vars()("n", n)("kernel", kernel)("kind", kind == PoolKind::kMax ? "max" : "avg").str());
        k.exact(got, pool_ref(in, kernel, kind), "pooled");
      }
}

// Score vectors for selection: tie-free, heavy ties (four levels), and non-finite values
// (NaN, +-inf, -0 and +0).
std::vector<float> select_scores(int64_t n, int kind, uint64_t seed) {
  auto s = gaussian(n, seed);
  std::mt19937_64 rng(seed);
  for (int64_t j = 0; j < n; ++j) {
    if (kind == 1) s[j] = static_cast<float>(rng() % 4);
    if (kind == 2) {
      switch (rng() % 6) {
        case 0:
          s[j] = std::numeric_limits<float>::quiet_NaN();
          break;
        case 1:
          s[j] = -0.0f;
          break;
        case 2:
          s[j] = 0.0f;
          break;
        case 3:
          s[j] = (rng() % 2) ? std::numeric_limits<float>::infinity()
                             : -std::numeric_limits<float>::infinity();
          break;
        default:
          break;
      }
    }
  }
  return s;
}

// Ascending, unique, in range: checked on every selection (besides equality to the reference).
void check_selection(Check& k, const std::vector<int64_t>& sel, int64_t n) {
  for (size_t i = 0; i < sel.size(); ++i) {
    k.expect(sel[i] >= 0 && sel[i] < n, "index out of range");
    if (i) k.expect(sel[i] > sel[i - 1], "indices not strictly ascending (duplicate or order)");
  }
}

TEST(BackendOps, SnapSelect) {
  const std::vector<int64_t> lens = {0, 1, 2, 3, 17, 31, 127, 129, 1000};
  uint64_t seed = 1300;
  std::vector<float> scratch;
  for (int64_t n : lens)
    for (int kind : {0, 1, 2})
      for (int64_t budget : {int64_t{0}, int64_t{1}, n / 2, n - 1, n, n + 3})
        for (int64_t sinks : {0, 4}) {
          const auto s = select_scores(n, kind, ++seed);
          const int64_t count = snap_select_count(n, budget);
          {
            std::vector<int64_t> got(static_cast<size_t>(count), -1);
            const int64_t r = snap_select(s.data(), n, budget, sinks, got.data(), &scratch);
            const auto want = snap_select_reference(s.data(), n, budget, sinks);
            Check k("snap_select", "cpu",
                    Vars()("n", n)("scores", kind)("budget", budget)("sinks", sinks).str());
            k.allow_zero_reference();  // index 0 alone is a valid selection
            k.expect(r == count, "returned count differs from snap_select_count");
            k.exact(got, want, "indices");
            check_selection(k, got, n);
          }
          for (int64_t window : {int64_t{0}, int64_t{8}, n}) {
            std::vector<int64_t> got(static_cast<size_t>(count), -1);
            const int64_t r =
                snap_select_keep_window(s.data(), n, budget, sinks, window, got.data(), &scratch);
            const auto want = snap_select_keep_window_reference(s.data(), n, budget, sinks, window);
            Check k(
                "snap_select_keep_window", "cpu",
                Vars()("n", n)("scores", kind)("budget", budget)("sinks", sinks)("window", window)
                    .str());
            k.allow_zero_reference();
            k.expect(r == count, "returned count differs from snap_select_count");
            k.exact(got, want, "indices");
            check_selection(k, got, n);
          }
        }
}

// ---- matmul -----------------------------------------------------------------------------------

// Exact mode: both formulations sum fp32 products with FMAs, one rounding per step (at most
// K/16 steps per lane plus a 6-level tree, or K sequential steps) plus the bias:
// |err| <= (K + 7) u (sum |x w| + |bias|), the reference's own rounding inside.
// bf16 mode (products of two bf16 values exact in fp32): the additions only, d roundings with
// d = K + 7 (portable), 2 ceil(K/2) (packed, >= 4 tokens) or 2 ceil(K/32) + 7 (vdpbf16ps dot):
// gamma(d) sum |terms| + u |ref| + d 2^-126 (flushed subnormals).
// Every instruction set this build and CPU have (kernels::MatmulIsa) runs the whole sweep.
TEST(BackendOps, Matmul) {
  const bool small = harness::small_sweep();
  const kernels::MatmulIsa best = kernels::matmul_isa();
  for (int is = 0; is <= static_cast<int>(best); ++is) {
    const auto isa = static_cast<kernels::MatmulIsa>(is);
    kernels::cap_matmul_isa(isa);
    ASSERT_EQ(kernels::matmul_isa(), isa);
    uint64_t seed = 2000;
    std::vector<bool> bf16_paths{true};
    kernels::force_portable_bf16(false);
    if (kernels::bf16_dot_active()) bf16_paths.insert(bf16_paths.begin(), false);
    int idx = 0;
    for (int64_t T : {1, 2, 3, 17, 31, 127, 129})
      for (int64_t K : {64, 100, 128, 1100, 2100})
        for (int64_t N : {1, 17, 64}) {
          // K 2100: two K blocks of the packed paths (2048 + 52), the second starting from the
          // first's partial sums; a few shapes only (the reference's cost).
          if (K == 2100) {
            if ((T != 2 && T != 17) || N != 17) continue;
          } else if (++idx; (small || T > 31) && idx % 3 != 0) {
            continue;
          }
          if (T >= 127 && K == 1100 && N == 64) continue;  // the reference's cost, not coverage
          const int64_t ldx = K + 3, ldy = N + 2;
          const auto x = gaussian(T * ldx, ++seed);
          const auto wf = gaussian(N * K, ++seed, 0.1f);
          const auto bias = gaussian(N, ++seed);
          for (DType wt : {DType::kF32, DType::kF16, DType::kBF16}) {
            std::vector<uint8_t> w(wf.size() * dtype_size(wt));
            from_f32(wf.data(), w.data(), wt, wf.size());
            const float* b = (T + K + N) % 2 == 0 ? bias.data() : nullptr;
            const std::string vars =
                Vars()("isa", kernels::matmul_isa_name(isa))("T", T)("K", K)("N", N)(
                    "w", dtype_name(wt))("bias", b != nullptr)("ldx", ldx)("ldy", ldy)
                    .str();
            for (int mode = 0; mode < 1 + (wt == DType::kBF16 ? int(bf16_paths.size()) : 0);
                 ++mode) {
              const bool bf = mode > 0;
              const bool portable = bf && bf16_paths[static_cast<size_t>(mode - 1)];
              kernels::force_portable_bf16(portable);
              std::vector<float> y(static_cast<size_t>(T * ldy), -7.0f), r(y);
              kernels::matmul(x.data(), T, K, ldx, w.data(), wt, N, b, y.data(), ldy,
                              bf ? kernels::Precision::kBF16 : kernels::Precision::kExact);
              if (bf)
                kernels::matmul_bf16_reference(x.data(), T, K, ldx, w.data(), wt, N, b, r.data(),
                                               ldy);
              else
                kernels::matmul_reference(x.data(), T, K, ldx, w.data(), wt, N, b, r.data(), ldy);
              std::vector<float> got;
              std::vector<double> ref, bound;
              for (int64_t t = 0; t < T; ++t)
                for (int64_t n = 0; n < ldy; ++n) {
                  const size_t at = static_cast<size_t>(t * ldy + n);
                  got.push_back(y[at]);
                  ref.push_back(n < N ? r[at] : -7.0);  // the row gaps stay untouched
                  if (n >= N) {
                    bound.push_back(0);
                    continue;
                  }
                  double mag = b ? std::abs(b[n]) : 0.0;
                  for (int64_t i = 0; i < K; ++i) {
                    float xv = x[static_cast<size_t>(t * ldx + i)];
                    if (bf) {
                      const uint32_t bits = uint32_t{kernels::bf16_round(xv)} << 16;
                      std::memcpy(&xv, &bits, 4);
                    }
                    mag += std::abs(double(xv) *
                                    load_f32(w.data(), wt, static_cast<size_t>(n * K + i)));
                  }
                  if (!bf) {
                    bound.push_back((K + 7) * kU * mag);
                  } else {
                    const int64_t d = portable ? K + 7
                                      : T >= 4 ? 2 * ((K + 1) / 2)
                                               : 2 * ((K + 31) / 32) + 7;
                    bound.push_back(harness::gamma_n(double(d)) * mag + kU * std::abs(r[at]) +
                                    d * 0x1p-126);
                  }
                }
              Check k(bf ? "matmul bf16" : "matmul", "cpu",
                      vars + (bf ? (portable ? ",path=portable" : ",path=vdpbf16ps") : ""));
              k.bounded(got, ref, bound, "y");
            }
          }
        }
  }
  kernels::cap_matmul_isa(kernels::MatmulIsa::kAvx512);
  kernels::force_portable_bf16(false);
}

// ---- RMSNorm, SwiGLU, RoPE --------------------------------------------------------------------

// RMSNorm: the sum of squares in double (n 2^-53 relative), 1/sqrt rounded to fp32 (u), then
// x * inv and weight * (.) (u each): |err| <= (3u + n 2^-52) |ref| + 2^-126 (a subnormal result).
TEST(BackendOps, RmsNorm) {
  uint64_t seed = 3000;
  for (int64_t n : {1, 2, 3, 17, 64, 127, 128, 1000, 4096})
    for (double eps : {1e-5, 1e-6}) {
      const auto x = gaussian(n, ++seed, n % 2 ? 30.0f : 1.0f);
      const auto w = gaussian(n, ++seed);
      std::vector<float> got(static_cast<size_t>(n));
      kernels::rmsnorm(x.data(), w.data(), n, eps, got.data());
      double ss = 0;
      for (float v : x) ss += double(v) * v;
      const double inv = 1.0 / std::sqrt(ss / double(n) + eps);
      std::vector<double> ref(got.size()), bound(got.size());
      for (int64_t i = 0; i < n; ++i) {
        ref[i] = double(w[i]) * x[i] * inv;
        bound[i] = (3 * kU + n * 0x1p-52) * std::abs(ref[i]) * (1 + 4 * kU) + 0x1p-126;
      }
      Check k("rmsnorm", "cpu", Vars()("n", n)("eps", eps).str());
      k.bounded(got, ref, bound, "out");
    }
}

// SwiGLU: silu(g) within 3.5 u of exact (kernels.h), times up (one more rounding):
// |err| <= 4.5 u |ref| (1 + u) + 2^-126 (results in the subnormal range lose relative accuracy).
// Below g = -87 the AVX-512 exp (ops/exp_nonpos16.h: x < -87 gives 0) flushes e = exp(-|g|) and
// the result to 0 (the portable g / (1 + exp(-g)) does so near -88.7, where exp(-g) overflows):
// the error is then |g e up / (1 + e)| < |g up| e^-87, an absolute term the 3.5 u of kernels.h
// does not state.
TEST(BackendOps, Swiglu) {
  uint64_t seed = 3500;
  for (int64_t n : {1, 2, 3, 17, 31, 127, 129, 1000})
    for (float sd : {1.0f, 8.0f, 40.0f}) {
      auto g = gaussian(n, ++seed, sd);
      const auto u = gaussian(n, ++seed);
      if (n > 3) {
        g[0] = 0.0f;
        g[1] = -90.0f;
        g[2] = 90.0f;
      }
      std::vector<float> got(static_cast<size_t>(n));
      kernels::swiglu(g.data(), u.data(), n, got.data());
      std::vector<double> ref(got.size()), bound(got.size());
      for (int64_t i = 0; i < n; ++i) {
        const double gv = g[i];
        ref[i] = gv / (1.0 + std::exp(-gv)) * u[i];
        bound[i] = 4.5 * kU * std::abs(ref[i]) * (1 + kU) + 0x1p-126 +
                   (gv < -87.0 ? std::abs(gv * u[i]) * std::exp(-87.0) : 0.0);
      }
      Check k("swiglu", "cpu", Vars()("n", n)("sd", sd).str());
      k.allow_zero_reference();
      k.bounded(got, ref, bound, "out");
    }
}

// RoPE: rope_cos_sin is exact against its definition (angle = fp32(fp32(pos) * inv_freq[i]),
// cos/sin in double rounded once); apply_rope computes a c - b s and b c + a s in fp32 (two
// products and a sum, one rounding each): |err| <= u (|a c| + |b s|) (1 + u) + u |ref|, for both
// pairings (half-split and interleaved) and head_dim 64/128.
TEST(BackendOps, Rope) {
  uint64_t seed = 4000;
  for (RopeStyle style : {RopeStyle::kHalfSplit, RopeStyle::kInterleaved})
    for (int64_t d : {64, 128})
      for (int64_t pos : {0, 1, 17, 1000, 4095, 131071}) {
        RopeConfig rc;
        rc.theta = d == 64 ? 10000.0 : 500000.0;
        rc.style = style;
        const auto inv = rope_inv_freq(rc, d);
        const int64_t half = d / 2;
        std::vector<float> c(static_cast<size_t>(half)), s(c.size()), cr(c.size()), sr(c.size());
        rope_cos_sin(inv, pos, c.data(), s.data());
        for (int64_t i = 0; i < half; ++i) {
          const float angle = static_cast<float>(pos) * inv[i];
          cr[i] = static_cast<float>(std::cos(double(angle)));
          sr[i] = static_cast<float>(std::sin(double(angle)));
        }
        const std::string vars =
            Vars()("style", style == RopeStyle::kHalfSplit ? "half" : "interleaved")("D", d)("pos",
                                                                                             pos)
                .str();
        {
          Check k("rope_cos_sin", "cpu", vars);
          k.exact(c, cr, "cos");
          k.allow_zero_reference();  // sin(0) at pos 0
          k.exact(s, sr, "sin");
        }
        const int64_t heads = 3;
        const auto x = gaussian(heads * d, ++seed, 2.0f);
        std::vector<float> got = x;
        apply_rope(got.data(), heads, d, c.data(), s.data(), style);
        std::vector<double> ref(x.size()), bound(x.size());
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t i = 0; i < half; ++i) {
            const int64_t i0 = h * d + (style == RopeStyle::kHalfSplit ? i : 2 * i);
            const int64_t i1 = h * d + (style == RopeStyle::kHalfSplit ? i + half : 2 * i + 1);
            const double a = x[i0], b = x[i1];
            ref[i0] = a * c[i] - b * s[i];
            ref[i1] = b * c[i] + a * s[i];
            const double m = std::abs(a * c[i]) + std::abs(b * s[i]);
            const double m1 = std::abs(b * c[i]) + std::abs(a * s[i]);
            bound[i0] = kU * m * (1 + kU) + kU * std::abs(ref[i0]);
            bound[i1] = kU * m1 * (1 + kU) + kU * std::abs(ref[i1]);
          }
        Check k("apply_rope", "cpu", vars);
        k.bounded(got, ref, bound, "x");
      }
}

}  // namespace
}  // namespace vq
