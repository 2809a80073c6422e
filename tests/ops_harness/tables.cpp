// The op harness's case tables (see tables.h).
#include "ops_harness/tables.h"

#include <algorithm>
#include <sstream>

namespace vq::harness {

std::string AttnCase::vars() const {
  std::ostringstream o;
  o << "B=" << batch << ",Hkv=" << n_kv_heads << ",rep=" << n_rep << ",D=" << head_dim
    << ",N=" << n_q << ",shift=" << q_shift << ",win=" << window << ",segs=" << segs_str(segs);
  return o.str();
}

bool AttnCase::packed() const {
  for (const SegSpec& s : segs)
    if (s.packed) return true;
  return false;
}

bool AttnCase::all_fp_dtype(DType t) const {
  for (const SegSpec& s : segs)
    if (!s.packed && s.n > 0 && s.dtype != t) return false;
  return true;
}

std::vector<PackedSpec> packed_formats() {
  auto f = [](double kb, double vb, int64_t g, MetaType m, bool perm, bool rot) {
    PackedSpec p;
    p.kbits = kb;
    p.vbits = vb;
    p.group = g;
    p.meta = m;
    p.perm = perm;
    p.rot = rot;
    return p;
  };
  const MetaType f16 = MetaType::kF16, fp8 = MetaType::kFP8E4M3, f32 = MetaType::kF32;
  return {
      f(2, 2, 32, f16, false, false),
      f(4, 4, 32, f16, false, false),
      f(8, 8, 32, f16, false, false),
      f(4, 2, 32, f16, false, false),
      f(1.5, 1.5, 32, f16, false, false),
      f(2, 2, 128, f16, false, false),
      f(4, 4, 128, fp8, false, false),
      f(2, 2, 32, fp8, true, false),
      f(4, 4, 32, f16, false, true),
      f(2, 2, 32, f16, true, true),
      f(4, 2, 128, fp8, true, true),
      f(1.5, 1.5, 128, fp8, false, true),
      f(8, 8, 128, f32, true, false),
      f(2, 4, 24, f16, false, false),
      // bit pairs without an instance of their own in the CUDA decode kernels (its any-bits
      // instance), and groups that are not a multiple of 8 (its dequantized fallback)
      f(3, 3, 32, f16, false, false),
      f(1.5, 2, 32, fp8, true, false),
      f(2, 8, 16, f16, false, true),
      f(5, 6, 64, f32, true, false),
      f(8, 1, 32, f16, false, false),
      f(4, 4, 12, f16, false, false),
  };
}

std::vector<AttnCase> attention_cases(bool small) {
  std::vector<AttnCase> out;
  const DType dtypes[] = {DType::kF32, DType::kF16, DType::kBF16};
  const int64_t reps[] = {1, 4, 8};
  int idx = 0;
  // (1) Full-precision views: every length x dtype x head_dim, decode and prefill query counts,
  // GQA ratios, strides, windows and batch cycling with the case index.
  for (int64_t len : seq_lens(small))
    for (DType dt : dtypes)
      for (int64_t d : {64, 128})
        for (int k = 0; k < 3; ++k) {
          const int64_t nq = k == 0 ? 1 : std::min<int64_t>(len, k == 1 ? 7 : 129);
          if (k > 0 && nq == 1) continue;                           // len 1: decode only
          if (k == 2 && nq == std::min<int64_t>(len, 7)) continue;  // short views: sizes coincide
          if (len == 1000 && nq == 129 && dt != DType::kF16) continue;  // cost: f16 only
          if (small && (nq > 7 || d == 128) && idx % 3 != 0) {
            ++idx;
            continue;
          }
          AttnCase c;
          c.head_dim = d;
          c.n_q = nq;
          c.n_rep = reps[idx % 3];
          c.batch = idx % 7 == 6 ? 2 : 1;
          c.window = idx % 5 == 4 ? len / 3 + 1 : 0;
          SegSpec s;
          s.n = len;
          s.dtype = dt;
          s.strided = idx % 4 == 3;
          // Two segments (a split at len / 3) every other case: rows read across segments.
          if (idx % 2 == 1 && len >= 3) {
            SegSpec a = s;
            a.n = len / 3;
            s.n = len - a.n;
            c.segs.push_back(a);
          }
          c.segs.push_back(s);
          out.push_back(c);
          ++idx;
        }
  // (2) Packed and mixed views: every packed format over several lengths; fp16 sinks + packed
  // middle (explicit gapped positions every other case) + fp16 tail when the length allows, and
  // at length 129 the same with bf16 sinks and tail (with one query per head too: decode).
  const auto fmts = packed_formats();
  std::vector<int64_t> plens =
      small ? std::vector<int64_t>{3, 129} : std::vector<int64_t>{1, 3, 31, 129, 1000};
  for (size_t fi = 0; fi < fmts.size(); ++fi)
    for (int64_t len : plens) {
      if (len == 1000 && fi % 3 != 0) continue;  // the long view for a third of the formats
      AttnCase c;
      c.head_dim = (fi + static_cast<size_t>(len)) % 2 ? 128 : 64;
      if (fmts[fi].group == 24) c.head_dim = 64;  // ragged last group of 16
      c.n_rep = reps[(fi + static_cast<size_t>(len)) % 3];
      c.n_q = len >= 7 && fi % 2 ? 7 : 1;
      c.window = fi % 4 == 3 ? len / 2 + 1 : 0;
      c.batch = fi % 5 == 4 ? 2 : 1;
      SegSpec pk;
      pk.packed = true;
      pk.pk = fmts[fi];
      if (len < 31) {
        pk.n = len;
        c.segs.push_back(pk);
      } else {
        SegSpec sink, tail;
        sink.n = 4;
        tail.n = 8;
        pk.n = len - 12;
        pk.explicit_pos = fi % 2 == 1;
        c.segs = {sink, pk, tail};
      }
      out.push_back(c);
      if (len == 129) {  // the same view with bf16 sinks and tail (a bf16 model's SKVQ view),
        c.segs[0].dtype = c.segs[2].dtype = DType::kBF16;  // for prefill and decode alike
        out.push_back(c);
        if (c.n_q != 1) {
          c.n_q = 1;
          out.push_back(c);
        }
      }
    }
  // (3) Edge cases: an empty segment between two others; a window of 1 (each query sees only its
  // own position); queries past the view's end; a window that hides every key (zeros).
  {
    AttnCase c;
    SegSpec a, e, b;
    a.n = 17;
    e.n = 0;
    b.n = 31;
    b.dtype = DType::kBF16;
    c.segs = {a, e, b};
    c.n_q = 3;
    c.n_rep = 4;
    out.push_back(c);
  }
  {
    AttnCase c;
    SegSpec a;
    a.n = 129;
    c.segs = {a};
    c.n_q = 17;
    c.window = 1;
    c.n_rep = 8;
    out.push_back(c);
  }
  {
    AttnCase c;
    SegSpec a;
    a.n = 127;
    a.explicit_pos = true;
    c.segs = {a};
    c.n_q = 2;
    c.q_shift = 40;
    c.window = 100;
    c.head_dim = 128;
    out.push_back(c);
  }
  {
    AttnCase c;
    SegSpec a;
    a.n = 31;
    a.dtype = DType::kF32;
    SegSpec p;
    p.n = 40;
    p.packed = true;
    c.segs = {a, p};
    c.n_q = 1;
    c.q_shift = 500;  // every key is older than the window: the output is zeros
    c.window = 10;
    out.push_back(c);
  }
  // (4) Long prefill over f16 / bf16 rows: query rows (n_q x n_rep) over several 128-row blocks
  // of the GPU prefill kernel (prefill_fa.cu), with a partial last block, causal diagonal tiles,
  // windows, gapped explicit positions (the second segment of the last case) and batch 2.
  const auto long_prefill = [&](std::vector<int64_t> lens, DType dt, int64_t nq, int64_t rep,
                                int64_t d, int64_t win, int64_t batch) {
    AttnCase c;
    for (size_t i = 0; i < lens.size(); ++i) {
      SegSpec sg;
      sg.n = lens[i];
      sg.dtype = dt;
      sg.explicit_pos = i == 1;
      c.segs.push_back(sg);
    }
    c.n_q = nq;
    c.n_rep = rep;
    c.head_dim = d;
    c.window = win;
    c.batch = batch;
    out.push_back(c);
  };
  long_prefill({1000}, DType::kF16, 300, 4, 128, 0, 1);
  if (!small) {  // the reduced table (sanitizers) keeps the first
    long_prefill({1000}, DType::kBF16, 1000, 1, 128, 0, 1);  // every query: causal from position 0
    long_prefill({333, 667}, DType::kBF16, 257, 8, 64, 200, 2);
  }
  // (5) Decode over views long enough that fused_attention.cpp splits each (batch, KV head)
  // item's rows into parts merged after the loop (kSplitRows = 2048 rows per part): part
  // boundaries inside segments, fp16 / bf16 / packed rows mixed, explicit positions, a window
  // that leaves the first parts with no visible key (their sums are 0), one and two queries.
  for (int k = 0; k < (small ? 2 : 4); ++k) {
    AttnCase c;
    SegSpec sink, mid, tail;
    sink.n = 5;
    sink.dtype = k % 2 ? DType::kBF16 : DType::kF16;
    mid.n = k < 2 ? 4200 : 6100;
    mid.packed = k % 2 == 1;
    mid.pk.kbits = mid.pk.vbits = 4;
    mid.pk.group = 32;
    mid.explicit_pos = k == 2 || k == 3;
    tail.n = 77;
    c.segs = {sink, mid, tail};
    c.n_rep = k % 2 ? 3 : 4;
    c.n_q = k == 1 ? 2 : 1;
    c.window = k == 2 || k == 1 ? 3000 : 0;
    c.batch = k == 3 ? 2 : 1;
    out.push_back(c);
  }
  // (6) Query-head groups past 8 or not a power of two (16, 12, 6, 32): the CUDA decode kernels
  // take them as several blocks per KV head (DecodePlan::kv_rep) that must each read their own
  // stored head's rows, positions and transforms: two KV heads, batch 2, f16 rows, 2-bit codes
  // of the fixed-record instance, 4-bit codes rotated with fp8 metadata, bf16 sinks and tail,
  // explicit positions.
  for (int k = 0; k < 4; ++k) {
    AttnCase c;
    c.head_dim = 128;
    c.n_rep = k == 0 ? 16 : k == 1 ? 12 : k == 2 ? 6 : 32;
    c.batch = 2;
    c.window = k == 2 ? 200 : 0;
    SegSpec sink, mid, tail;
    sink.n = 9;
    sink.dtype = k == 3 ? DType::kBF16 : DType::kF16;
    tail.n = 40;
    tail.dtype = sink.dtype;
    mid.n = 300;
    mid.packed = k != 0;
    mid.pk.kbits = mid.pk.vbits = k == 2 ? 4 : 2;
    mid.pk.meta = k == 2 ? MetaType::kFP8E4M3 : MetaType::kF16;
    mid.pk.rot = k == 2;
    mid.pk.perm = k == 3;
    mid.explicit_pos = k % 2 == 1;
    c.segs = {sink, mid, tail};
    out.push_back(c);
  }
  // (7) Groups of 16 (and 32) whose views the 16-head block takes (heads in the mma's M
  // dimension, decode_attention_mma16.cuh): fixed group-32 records with f16 metadata, 2- and
  // 4-bit, beside f16 or bf16 sinks and tail; a window, explicit positions, rotated keys and
  // values with a permutation, head_dim 64, a partial last tile.
  for (int k = 0; k < (small ? 2 : 4); ++k) {
    AttnCase c;
    c.head_dim = k == 3 ? 64 : 128;
    c.n_rep = k == 2 ? 32 : 16;
    c.batch = k == 1 ? 1 : 2;
    c.window = k == 0 ? 150 : 0;
    SegSpec sink, mid, tail;
    sink.n = 4;
    sink.dtype = k == 1 ? DType::kBF16 : DType::kF16;
    tail.n = 37;
    tail.dtype = sink.dtype;
    mid.n = k == 3 ? 1000 : 333;
    mid.packed = true;
    mid.pk.kbits = mid.pk.vbits = k % 2 ? 4 : 2;
    mid.pk.meta = MetaType::kF16;
    mid.pk.rot = k == 2;
    mid.pk.perm = k == 2;
    mid.explicit_pos = k == 1;
    c.segs = {sink, mid, tail};
    out.push_back(c);
  }
  return out;
}

std::vector<AttnCase> packed_decode_cases(bool small) {
  std::vector<AttnCase> out;
  const double bits[] = {1, 1.5, 2, 4, 8};
  const int64_t dims[] = {64, 80, 96, 128};
  const int64_t groups[] = {32, 16, 64, 24};
  const MetaType metas[] = {MetaType::kF16, MetaType::kFP8E4M3, MetaType::kF32};
  const int64_t reps[] = {1, 4, 8};
  int idx = 0;
  for (double kb : bits)
    for (double vb : bits) {
      AttnCase c;
      c.head_dim = dims[idx % 4];
      c.n_rep = reps[idx % 3];
      c.n_q = idx % 4 == 1 ? 2 : 1;
      c.batch = idx % 6 == 5 ? 2 : 1;
      c.window = idx % 7 == 3 ? 40 : 0;
      SegSpec pk;
      pk.packed = true;
      pk.pk.kbits = kb;
      pk.pk.vbits = vb;
      pk.pk.group = groups[(idx / 4) % 4];
      pk.pk.meta = metas[idx % 3];
      pk.pk.perm = idx % 5 == 2;
      pk.pk.rot = idx % 5 == 4 && (c.head_dim == 64 || c.head_dim == 128);
      pk.n = small ? 70 : 200 + idx;
      pk.explicit_pos = idx % 2 == 0;
      SegSpec sink, tail;
      sink.n = 5;
      tail.n = idx % 3 == 0 ? 0 : 9;
      tail.dtype = idx % 2 ? DType::kF16 : DType::kBF16;
      c.segs = {sink, pk, tail};
      out.push_back(c);
      ++idx;
    }
  for (int64_t n : small ? std::vector<int64_t>{4096} : std::vector<int64_t>{4096, 16384})
    for (double b : {4.0, 2.0}) {
      AttnCase c;
      c.head_dim = 128;
      c.n_rep = 4;
      SegSpec sink, pk, tail;
      sink.n = 5;
      pk.packed = true;
      pk.pk.kbits = pk.pk.vbits = b;
      pk.pk.group = 32;
      pk.n = n;
      tail.n = 100;
      c.segs = {sink, pk, tail};
      out.push_back(c);
    }
  // The shipped model's shape (D 64, 3 query heads per KV head, groups of 32, fp16 metadata:
  // the row-lane key kernel and the row-major value kernels of packed_decode_{vnni,avx512}.cpp),
  // every bit pair of {2, 4, 8}, with rotation, permutation, windows (visible rows not one run)
  // and explicit positions; 87 packed rows (tiles of 32 with a 23-row tail, blocks of 16 with 7).
  int k = 0;
  for (double kb : {2.0, 4.0, 8.0})
    for (double vb : {2.0, 4.0, 8.0}) {
      AttnCase c;
      c.head_dim = 64;
      c.n_rep = 3;
      c.n_q = k % 3 == 2 ? 2 : 1;
      c.window = k % 4 == 1 ? 50 : 0;
      SegSpec sink, pk, tail;
      sink.n = 4;
      pk.packed = true;
      pk.pk.kbits = kb;
      pk.pk.vbits = vb;
      pk.pk.group = k % 5 == 3 ? 16 : 32;
      pk.pk.rot = k % 3 == 1;
      pk.pk.perm = k % 3 == 2;
      pk.n = 87;
      pk.explicit_pos = k % 2 == 1;
      tail.n = 20;
      c.segs = {sink, pk, tail};
      out.push_back(c);
      ++k;
    }
  // The CPU SKVQ store's layout: one packed segment per flushed chunk, so a head walks many
  // consecutive packed segments; vq::attention re-binds alike neighbours (same formats and
  // transform pointers) without a new set-up. Runs of alike chunks broken by a change of bits,
  // group or metadata, and chunks that each bring their own permutation / rotation buffers (a
  // stale set-up would read them with the wrong kernel or channel order); the long case (40
  // chunks of 129 rows) is split into row parts that start inside a chunk.
  for (int v = 0; v < 4; ++v) {
    AttnCase c;
    c.head_dim = 64;
    c.n_rep = 3;
    c.n_q = v == 1 ? 2 : 1;
    c.window = v == 2 ? 100 : 0;
    SegSpec sink, tail;
    sink.n = 5;
    tail.n = 7;
    c.segs = {sink};
    const auto chunk = [&](double kb, double vb, int64_t group, MetaType meta, int64_t n) {
      SegSpec pk;
      pk.packed = true;
      pk.pk.kbits = kb;
      pk.pk.vbits = vb;
      pk.pk.group = group;
      pk.pk.meta = meta;
      pk.pk.perm = v == 1;
      pk.pk.rot = v == 2;
      pk.n = n;
      pk.explicit_pos = v == 3;
      c.segs.push_back(pk);
    };
    if (v < 3) {
      chunk(4, 4, 32, MetaType::kF16, 40);
      chunk(4, 4, 32, MetaType::kF16, 32);
      chunk(4, 4, 32, MetaType::kF16, 45);
      chunk(2, 2, 32, MetaType::kF16, 32);
      chunk(2, 4, 32, MetaType::kF16, 33);
      chunk(2, 4, 16, MetaType::kF16, 31);
      chunk(2, 4, 16, MetaType::kFP8E4M3, 17);
      chunk(2, 4, 16, MetaType::kFP8E4M3, 20);
    } else {
      for (int i = 0; i < 40; ++i) chunk(small ? 2 : 4, 2, 32, MetaType::kF16, 129);
    }
    c.segs.push_back(tail);
    out.push_back(c);
  }
  return out;
}

std::string QuantCase::vars() const {
  std::ostringstream o;
  o << "n=" << n << ",d=" << d << ",bits=" << bits << ",g=" << group << ",meta="
    << (meta == MetaType::kF16   ? "f16"
        : meta == MetaType::kF32 ? "f32"
                                 : "fp8")
    << ",clip=" << clip << ",floor=" << clip_floor << ",in=" << dtype_name(in_dtype)
    << ",perm=" << perm << ",rot=" << rot;
  return o.str();
}

std::vector<QuantCase> quant_cases(bool small) {
  std::vector<QuantCase> out;
  const MetaType metas[] = {MetaType::kF16, MetaType::kFP8E4M3, MetaType::kF32};
  const DType dtypes[] = {DType::kF32, DType::kF16, DType::kBF16};
  const auto& lens = seq_lens(small);
  int idx = 0;
  for (double bits : {1.0, 1.5, 2.0, 3.0, 4.0, 8.0})
    for (int64_t group : {32, 128, 24})
      for (MetaType meta : metas) {
        if (small && idx % 2) {
          ++idx;
          continue;
        }
        QuantCase c;
        c.bits = bits;
        c.group = group;
        c.meta = meta;
        c.n = lens[static_cast<size_t>(idx) % lens.size()];
        // D = 100: ragged last group for every group size; 64 with g = 128: one ragged group.
        c.d = idx % 3 == 0 ? 100 : idx % 3 == 1 ? 64 : 128;
        c.clip = idx % 4 != 3;
        // the value rows' longer clip grid (group_quant.h clip_alphas) in three of four cases
        const double floors[] = {0.85, 0.5, 0.25, 0.7};
        c.clip_floor = floors[(idx / 2) % 4];
        c.in_dtype = dtypes[idx % 3 == 2 ? (idx / 3) % 3 : idx % 3];
        c.perm = idx % 5 == 1 || idx % 5 == 3;
        c.rot = idx % 5 >= 3 && c.d != 100;  // rotation needs real mixing (block >= 2)
        out.push_back(c);
        ++idx;
      }
  return out;
}

}  // namespace vq::harness
