// The split kernel of fused decode attention for packed segments with channel-axis keys
// (decode_attention_channel.cuh), templated on D (64, 128), the query heads per block G (1, 2,
// 4, 8; DecodePlan::kv_rep blocks per KV head take larger or odd groups) and the key / value code
// widths KB / VB (2, 3 or 4 bits read from the staged records' 32-bit words with compile-time
// shifts; 0: any width or the three-level format, one code_at per code).
//
// A block of 128 threads reads rows [begin, end) of one split of one (b, kv head) for its G query
// heads. Inside a run of key rows sharing (lo_c, scale_c) per stored channel c (run r = rows
// [k_runs[r], k_runs[r + 1]) of DecodeChannelParams, its metadata list in its first records):
//   q . k_t = sum_c (q'_c * scale_c) * code_{t,c} + sum_c q'_c * lo_c      (q' = P R q *
//   scale_log2)
// so each run's scales are folded into the query once (qf, [run][D][G] in shared memory) and its
// zero points into one bias per head. The split's records stream through two shared-memory stages
// of 128-row tiles (cp.async of whole 16-byte words, the next tile in flight while one is read);
// a tile goes in steps of up to 128 rows, one row per thread, a step spanning up to
// ChGeo::R runs (each row reads its own run's folded query):
//  (1) logits: thread i takes row t0 + i, its D codes from the staged record's words (compile-time
//      shifts, a funnel shift where a code straddles two words) made exact floats by the 2^23 magic
//      number, then D * G fp32 FMAs with the folded query (broadcast shared loads of G floats);
//  (2) an online-softmax step per head in the log2 domain: the block's max and sum by warp
//      shuffles and one shared slot per warp (running max m and sum l kept by every thread);
//  (3) values: thread (u, ph) owns value channels CPT u .. CPT u + CPT - 1 (one metadata group: the
//      group size is a multiple of CPT) of rows ph, ph + PH, ...: one 32-bit read of its codes,
//      one (lo, scale) pair per row, code * scale + lo by an FMA, G FMAs per channel.
// Everything is fp32 (FMA contraction allowed: attention meets a bound, not bits; the codes are
// exact, the folded query is q' * scale rounded once, as the CPU's channel-axis attention folds
// it). Partials: acc [B, H_q, n_splits, D] in stored value channel order (the combine un-transforms
// it), (m, l) [B, H_q, n_splits, 2], m = -inf and zeros for a split that sees no key.
#include <cuda_fp16.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "cuda/check.h"
#include "cuda/decode_attention_channel.cuh"
#include "cuda/decode_attention_kernel.cuh"
#include "cuda/decode_plan.h"
#include "veloxquant/packed.h"

namespace vq::cuda {

namespace {

constexpr int kChThreads = decode_impl::kThreads;  // 128: transform_queries' stride
constexpr int kChWarps = kChThreads / 32;
constexpr int kChStep = kChThreads;  // rows per online-softmax step: one per thread
static_assert(kChStep == kChannelTileRows, "the planner's tiles are the kernel's steps");
constexpr int kTileGroups = 8;  // value groups per record the tile's metadata table holds

template <int D, int G>
struct ChGeo {
  static constexpr int R = G >= 8 ? 4 : 8;    // runs a step may span
  static constexpr int CPT = G >= 8 ? 4 : 8;  // value channels per thread
  static constexpr int UNITS = D / CPT;
  static constexpr int PH = kChThreads / UNITS;  // row phases of the value accumulation
  static constexpr int QF = R * D * G;           // folded queries
  static constexpr int MERGE = PH * G * D;       // the phases' accumulators at the end
  static constexpr int BIG = QF > MERGE ? (QF > G * D ? QF : G * D)
                                        : (MERGE > G * D ? MERGE : G * D);
};

// G consecutive floats of shared memory (16-byte aligned for G >= 4).
template <int G>
__device__ __forceinline__ void load_g(const float* src, float (&q)[G]) {
  if constexpr (G % 4 == 0) {
#pragma unroll
    for (int i = 0; i < G / 4; ++i) {
      const float4 v = reinterpret_cast<const float4*>(src)[i];
      q[4 * i] = v.x;
      q[4 * i + 1] = v.y;
      q[4 * i + 2] = v.z;
      q[4 * i + 3] = v.w;
    }
  } else if constexpr (G == 2) {
    const float2 v = *reinterpret_cast<const float2*>(src);
    q[0] = v.x;
    q[1] = v.y;
  } else {
    q[0] = src[0];
  }
}

// An unsigned code below 2^23 as an exact float: the bits 2^23 + c, minus 2^23.
__device__ __forceinline__ float code_float(uint32_t c) {
  return __uint_as_float(0x4B000000u | c) - 8388608.0f;
}

// Code k (compile-time after unrolling) of B bits of x as the float 1 + c 2^-B (exact): the code
// shifted to the top of the mantissa, ORed into 1.0's bits.
template <int B>
__device__ __forceinline__ float unit_mantissa(uint32_t x, int k) {
  const int sh = 23 - B - k * B;  // bit position of code k, moved to bit 23 - B
  const uint32_t y = sh >= 0 ? x << sh : x >> -sh;
  // (y & mask) | 1.0f's bits in one lop3 (the mask in a register: one immediate per instruction)
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;"
      : "=r"(r)
      : "r"(y), "r"(((1u << B) - 1u) << (23 - B)), "n"(0x3F800000));
  return __uint_as_float(r);
}

// Code j (compile-time after unrolling) of KB bits from the words w of a record.
template <int KB, int NW>
__device__ __forceinline__ uint32_t word_code(const uint32_t (&w)[NW], int j) {
  const int bit = j * KB, i = bit >> 5, s = bit & 31;
  const uint32_t x = s + KB <= 32 ? (w[i] >> s) : __funnelshift_r(w[i], w[i + 1], s);
  return x & ((1u << KB) - 1u);
}

// lg[g] += sum_c qf[c][g] * code_c of the key record at byte off of the staged tile st (al: the
// record is 4-byte aligned, one shared load per word; else two and a funnel shift).
template <int D, int G, int KB>
__device__ __forceinline__ void key_dots(const uint8_t* st, uint32_t off, bool al, const float* qf,
                                         CodeSpec spec, float (&lg)[G]) {
  if constexpr (KB > 0) {
    constexpr int NW = D * KB / 32;
    uint32_t w[NW + 1];
    if (al) {
#pragma unroll
      for (int i = 0; i < NW; ++i) w[i] = reinterpret_cast<const uint32_t*>(st + off)[i];
    } else {
#pragma unroll
      for (int i = 0; i < NW; ++i) w[i] = decode_impl::lds_u32_any(st, off + 4 * i);
    }
    w[NW] = 0u;
#pragma unroll
    for (int j = 0; j < D; ++j) {
      const float cf = code_float(word_code<KB>(w, j));
      float q[G];
      load_g<G>(qf + j * G, q);
#pragma unroll
      for (int g = 0; g < G; ++g) lg[g] = fmaf(q[g], cf, lg[g]);
    }
  } else {
    for (int j = 0; j < D; ++j) {
      const float cf = static_cast<float>(code_at(st + off, j, spec));
      float q[G];
      load_g<G>(qf + j * G, q);
#pragma unroll
      for (int g = 0; g < G; ++g) lg[g] = fmaf(q[g], cf, lg[g]);
    }
  }
}

// (lo, scale) of group gi of a staged token-axis record whose metadata starts at byte off of st
// (any alignment: the pair's bytes by lds_u32_any).
__device__ __forceinline__ void meta_pair(const uint8_t* st, uint32_t off, int gi, MetaType t,
                                          float& lo, float& sc) {
  if (t == MetaType::kF16) {
    const uint32_t h = decode_impl::lds_u32_any(st, off + 4 * gi);
    lo = fp16_bits_to_f32(static_cast<uint16_t>(h & 0xffffu));
    sc = fp16_bits_to_f32(static_cast<uint16_t>(h >> 16));
  } else if (t == MetaType::kF32) {
    lo = __uint_as_float(decode_impl::lds_u32_any(st, off + 8 * gi));
    sc = __uint_as_float(decode_impl::lds_u32_any(st, off + 8 * gi + 4));
  } else {
    const uint32_t h = decode_impl::lds_u32_any(st, off + 2 * gi);
    lo = fp8_e4m3_decode(h & 0xffu);
    sc = fp8_e4m3_decode((h >> 8) & 0xffu);
  }
}

template <int D, int G, int KB, int VB>
__global__ void __launch_bounds__(kChThreads)
    decode_channel_kernel(const __grid_constant__ DecodeParams p,
                          const __grid_constant__ DecodeChannelParams ch, int si, int stage_k,
                          int stage_v) {
  using Geo = ChGeo<D, G>;
  constexpr int R = Geo::R, CPT = Geo::CPT, PH = Geo::PH;
  static_assert(D % 32 == 0 && kChThreads % Geo::UNITS == 0, "D 64 or 128");
  __shared__ __align__(16) float q0[G * D];        // q' * scale_log2, stored key channel order
  __shared__ __align__(16) float big[Geo::BIG];    // transform scratch, qf [R][D][G], the merge
  __shared__ __align__(16) float pl[kChStep * G];  // probabilities of one step [row][G]
  __shared__ float redb[R][kChWarps][G];           // the runs' bias partials
  __shared__ float redm[kChWarps][G], reds[kChWarps][G];
  __shared__ int64_t rstart[R + 1];  // the step's run boundaries (rows)
  // the tile's value metadata decoded once per (row, group) as (2^VB scale, lo - 2^VB scale)
  // (fast value path, at most kTileGroups groups per record)
  __shared__ float2 vmeta[kChStep * kTileGroups];
  // two stages of one tile's key records (stage_k bytes) then value records (stage_v bytes)
  extern __shared__ __align__(16) uint8_t stages[];
  float* qf = big;

  const DecodeSegmentParams& sg = p.seg[si];
  const DecodePackedParams& pk = p.pk;
  int kvh = 0;
  const int seg_split = decode_impl::block_split(p, kvh);  // the split within the segment
  const int split = sg.split_begin + seg_split, b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t r_begin = static_cast<int64_t>(seg_split) * sg.rows_per_split;
  const int64_t r_end = decode_impl::min64(sg.n_rows, r_begin + sg.rows_per_split);
  const int64_t bh = static_cast<int64_t>(b) * p.n_kv_heads + kvh;
  const int64_t kbh = decode_impl::kv_bh(p, b, kvh);  // the stored head's rows
  const int krb = sg.k_row_bytes, vrb = sg.v_row_bytes;
  const uint8_t* kbase = sg.k + kbh * sg.capacity * krb;
  const uint8_t* vbase = sg.v + kbh * sg.capacity * vrb;
  const int32_t* pos = sg.positions ? sg.positions + kbh * sg.capacity : nullptr;
  CodeSpec kspec, vspec;
  kspec.bits_x2 = static_cast<uint8_t>(ch.k_bits_x2);
  vspec.bits_x2 = static_cast<uint8_t>(ch.v_bits_x2);
  const MetaType kmt = static_cast<MetaType>(pk.k_meta), vmt = static_cast<MetaType>(pk.v_meta);
  const int slots = ch.k_meta_slots;
  const int32_t* runs = ch.k_runs[si];
  const int32_t n_runs = runs ? ch.k_n_runs[si] : 1;

  // ---- the first two tiles in flight while the queries are prepared
  const int n_tiles = static_cast<int>((r_end - r_begin + kChStep - 1) / kChStep);
  const auto issue = [&](int t) {
    const int64_t r0 = r_begin + static_cast<int64_t>(t) * kChStep;
    const int64_t nr = decode_impl::min64(kChStep, r_end - r0);
    uint8_t* sk = stages + (t & 1) * (stage_k + stage_v);
    decode_impl::copy_range(sk, kbase + r0 * krb, nr * krb, tid);
    decode_impl::copy_range(sk + stage_k, vbase + r0 * vrb, nr * vrb, tid);
  };
  for (int t = 0; t < 2; ++t) {
    if (t < n_tiles) issue(t);
    decode_impl::cp_async_commit();
  }

  // ---- queries of the G heads, scaled and transformed like the keys (P R q)
  const float* qg = p.q + (bh * G) * D;
  for (int i = tid; i < G * D; i += kChThreads) q0[i] = qg[i] * p.scale_log2;
  __syncthreads();
  if (pk.k_signs || pk.k_perm)
    decode_impl::transform_queries<D, G>(q0, big, pk, kvh / p.kv_rep, tid);

  // value unit and row phase of this thread
  const int u = tid % Geo::UNITS, ph = tid / Geo::UNITS;
  float acc[G][CPT];
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int k = 0; k < CPT; ++k) acc[g][k] = 0.0f;
  float m_run[G], l_run[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m_run[g] = -INFINITY;
    l_run[g] = 0.0f;
  }

  // the run holding r_begin: the last r with k_runs[r] <= r_begin
  int32_t run = 0;
  if (runs) {
    int32_t lo = 0, hi = n_runs - 1;
    while (lo < hi) {
      const int32_t mid = (lo + hi + 1) / 2;
      if (runs[mid] <= r_begin) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    run = lo;
  }
  const auto run_begin = [&](int32_t r) -> int64_t { return runs ? runs[r] : 0; };
  const auto run_end = [&](int32_t r) -> int64_t { return runs ? runs[r + 1] : sg.n_rows; };
  int32_t folded = -1;  // the run whose fold sits alone in slot 0 (a step of one run), or -1
  // this thread's key channel c = tid in a run's metadata list: element 2 c (lo) and 2 c + 1
  // (scale), slot e % slots of record e / slots (offsets from the run's first record), and the
  // records the list takes
  static_assert(D <= kChThreads, "one key channel per thread in the fold");
  const int64_t lo_off = static_cast<int64_t>((2 * tid) / slots) * krb + pk.k_code_bytes;
  const int64_t sc_off = static_cast<int64_t>((2 * tid + 1) / slots) * krb + pk.k_code_bytes;
  const int lo_slot = (2 * tid) % slots, sc_slot = (2 * tid + 1) % slots;
  const int64_t meta_rows = (2 * D + slots - 1) / slots;
  // value codes as 1 + c 2^-VB (the float's mantissa bits), dequantized by one FMA with the
  // tile's table: (1 + c 2^-VB) (2^VB scale) + (lo - 2^VB scale) = c scale + lo, the table's
  // lo - 2^VB scale rounded once in fp32
  const bool vtab = VB > 0 && D / pk.group_size <= kTileGroups;

  for (int t = 0; t < n_tiles; ++t) {
    decode_impl::cp_async_wait<1>();
    __syncthreads();
    const int64_t r0 = r_begin + static_cast<int64_t>(t) * kChStep;
    const int64_t r1 = decode_impl::min64(r_end, r0 + kChStep);
    const uint8_t* sk = stages + (t & 1) * (stage_k + stage_v);
    const uint8_t* sv = sk + stage_k;
    const uint32_t kmis = static_cast<uint32_t>(decode_impl::misalign16(kbase + r0 * krb));
    const uint32_t vmis = static_cast<uint32_t>(decode_impl::misalign16(vbase + r0 * vrb));
    // word loads of whole records where every record of the tile is 4-byte aligned
    const bool kal = (kmis & 3u) == 0 && krb % 4 == 0;
    if (vtab) {  // read after the step's barriers
      const int ng = D / pk.group_size, nr = static_cast<int>(r1 - r0);
      for (int i = tid; i < nr * ng; i += kChThreads) {
        float lo, sc;
        meta_pair(sv, vmis + (i / ng) * vrb + pk.v_code_bytes, i % ng, vmt, lo, sc);
        const float s2 = sc * static_cast<float>(1 << VB);  // exact: a power of two
        vmeta[(i / ng) * kTileGroups + i % ng] = make_float2(s2, lo - s2);
      }
    }

    for (int64_t t0 = r0; t0 < r1;) {
      // ---- the step: rows [t0, t_end) of the tile, at most R runs
      int nrun = 0;
      int64_t t_end = t0;
      while (nrun < R && t_end < r1) {
        // the last run covers the rest (runs[n_runs] is the segment's rows)
        t_end = run + nrun + 1 >= n_runs ? r1 : decode_impl::min64(run_end(run + nrun), r1);
        ++nrun;
      }
      const int nt = static_cast<int>(t_end - t0);
      const uint32_t off0 = static_cast<uint32_t>(t0 - r0);  // the step's first row in the tile
      // ---- fold each run's scales into the query, its zero points into one bias per head
      if (!(nrun == 1 && folded == run)) {
        for (int k = 0; k < nrun; ++k) {
          // the run's metadata list from the staged tile where the tile holds its records
          const int64_t rb = run_begin(run + k);
          const uint8_t* chunk0 =
              rb >= r0 && rb + meta_rows <= r1 ? sk + kmis + (rb - r0) * krb : kbase + rb * krb;
          float bp[G];
#pragma unroll
          for (int g = 0; g < G; ++g) bp[g] = 0.0f;
          if (tid < D) {  // channel c = tid (D <= kChThreads)
            const int c = tid;
            const float lo = meta_load(chunk0 + lo_off, lo_slot, kmt);
            const float sc = meta_load(chunk0 + sc_off, sc_slot, kmt);
#pragma unroll
            for (int g = 0; g < G; ++g) {
              qf[(k * D + c) * G + g] = q0[g * D + c] * sc;
              bp[g] = fmaf(q0[g * D + c], lo, bp[g]);
            }
          }
#pragma unroll
          for (int g = 0; g < G; ++g) {
#pragma unroll
            for (int o = 16; o >= 1; o >>= 1) bp[g] += __shfl_xor_sync(0xffffffffu, bp[g], o);
            if (lane == 0) redb[k][warp][g] = bp[g];
          }
        }
        if (tid <= nrun) rstart[tid] = tid < nrun ? run_begin(run + tid) : t_end;
        folded = nrun == 1 ? run : -1;
        __syncthreads();
      }

      // ---- (1) logits of the step's rows, one per thread
      float lg[G];
      {
        const int64_t row = t0 + tid;
        bool vis = tid < nt;
        if (vis) {
          const int64_t pj = pos ? pos[row] : sg.first_pos + row;
          vis = pj <= p.q_pos && (p.window <= 0 || p.q_pos < pj + p.window);
        }
        if (vis) {
          int k = 0;
          while (k + 1 < nrun && rstart[k + 1] <= row) ++k;
#pragma unroll
          for (int g = 0; g < G; ++g) {
            float s = 0.0f;
#pragma unroll
            for (int w = 0; w < kChWarps; ++w) s += redb[k][w][g];
            lg[g] = s;
          }
          key_dots<D, G, KB>(sk, kmis + (off0 + tid) * krb, kal, qf + k * D * G, kspec, lg);
        } else {
#pragma unroll
          for (int g = 0; g < G; ++g) lg[g] = -INFINITY;
        }
      }
      // ---- (2) online softmax per head (log2 domain): the block's max, then its sum
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float mx = lg[g];
#pragma unroll
        for (int o = 16; o >= 1; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        if (lane == 0) redm[warp][g] = mx;
      }
      __syncthreads();
      float corr[G];
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float mx = redm[0][g];
#pragma unroll
        for (int w = 1; w < kChWarps; ++w) mx = fmaxf(mx, redm[w][g]);
        const float m_new = fmaxf(m_run[g], mx);
        const bool none = m_new == -INFINITY;  // nothing visible yet: keep zeros
        corr[g] = none ? 1.0f : exp2f(m_run[g] - m_new);
        const float pr = none ? 0.0f : exp2f(lg[g] - m_new);
        m_run[g] = m_new;
        pl[tid * G + g] = pr;
        float s = pr;
#pragma unroll
        for (int o = 16; o >= 1; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) reds[warp][g] = s;
      }
      __syncthreads();
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < kChWarps; ++w) s += reds[w][g];
        l_run[g] = fmaf(l_run[g], corr[g], s);
      }

      // ---- (3) values: channels CPT u + k of rows ph, ph + PH, ... of the step
#pragma unroll
      for (int g = 0; g < G; ++g)
#pragma unroll
        for (int k = 0; k < CPT; ++k) acc[g][k] *= corr[g];
#pragma unroll 2
      for (int rr = ph; rr < nt; rr += PH) {
        const uint32_t rec = vmis + (off0 + rr) * vrb;  // the record's byte in sv
        float pp[G];
        load_g<G>(pl + rr * G, pp);
        float v[CPT];
        if constexpr (VB > 0) {
          constexpr int UB = CPT * VB;  // bits of the unit's codes (32, or at most 24)
          const uint32_t bit = static_cast<uint32_t>(u * UB);
          const uint32_t x = decode_impl::lds_u32_any(sv, rec + (bit >> 3)) >> (bit & 7u);
          const int gi = (CPT * u) / pk.group_size;
          if (vtab) {
            const float2 m = vmeta[(off0 + rr) * kTileGroups + gi];
#pragma unroll
            for (int k = 0; k < CPT; ++k) v[k] = fmaf(unit_mantissa<VB>(x, k), m.x, m.y);
          } else {
            float lo, sc;
            meta_pair(sv, rec + pk.v_code_bytes, gi, vmt, lo, sc);
#pragma unroll
            for (int k = 0; k < CPT; ++k)
              v[k] = fmaf(code_float((x >> (k * VB)) & ((1u << VB) - 1u)), sc, lo);
          }
        } else {
          const uint8_t* r8 = sv + rec;
#pragma unroll
          for (int k = 0; k < CPT; ++k) {
            const int d = CPT * u + k, vg = d / pk.group_size;
            float lo, sc;
            meta_pair(sv, rec + pk.v_code_bytes, vg, vmt, lo, sc);
            v[k] = fmaf(static_cast<float>(code_at(r8, d, vspec)), sc, lo);
          }
        }
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
          for (int k = 0; k < CPT; ++k) acc[g][k] = fmaf(pp[g], v[k], acc[g][k]);
      }
      __syncthreads();  // pl, redm, reds, qf and rstart are rewritten by the next step

      // the run holding t_end
      t0 = t_end;
      while (runs && run + 1 < n_runs && runs[run + 1] <= t0) ++run;
    }
    if (t + 2 < n_tiles) issue(t + 2);  // into the stage just read (every thread is past it)
    decode_impl::cp_async_commit();
  }
  decode_impl::cp_async_wait<0>();

  // ---- partials: the phases' accumulators summed (one running max per head)
  float* tmp = big;  // [PH][G][D]
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int k = 0; k < CPT; ++k) tmp[(ph * G + g) * D + CPT * u + k] = acc[g][k];
  __syncthreads();
  for (int i = tid; i < G * D; i += kChThreads) {
    const int g = i / D, c = i % D;
    float a = 0.0f;
#pragma unroll
    for (int k = 0; k < PH; ++k) a += tmp[(k * G + g) * D + c];
    const int64_t row = (bh * G + g) * p.n_splits + split;
    p.part_acc[row * D + c] = m_run[g] == -INFINITY ? 0.0f : a;
    if (c == 0) {
      p.part_ml[2 * row] = m_run[g];
      p.part_ml[2 * row + 1] = l_run[g];
    }
  }
}

// Shared memory of one stage's records: a tile's kChStep records from a 16-byte word boundary,
// plus a word read past the last (lds_u32_any), in whole 16-byte words.
int stage_bytes(int row_bytes) {
  return (kChStep * row_bytes + 15 + 4 + 15) / 16 * 16;
}

// The instance of the view's code widths: (KB, VB) of the pairs with their own instance, else
// (0, 0) (any width, the three-level format: code_at per code).
template <int D, int G, int KB, int VB>
void launch_inst(const DecodeParams& p, const DecodeChannelParams& ch, int si, cudaStream_t s) {
  const DecodeSegmentParams& sg = p.seg[si];
  const dim3 grid = decode_impl::split_grid(p, sg.n_splits, p.batch);
  const int sk = stage_bytes(sg.k_row_bytes), sv = stage_bytes(sg.v_row_bytes);
  const size_t dyn = static_cast<size_t>(2 * (sk + sv));
  const auto kernel = decode_channel_kernel<D, G, KB, VB>;
  // the instance's dynamic shared memory limit, raised once to the largest stages asked for
  static std::atomic<size_t> limit{0};
  if (dyn > limit.load()) {
    VQ_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(dyn)));
    limit.store(dyn);
  }
  kernel<<<grid, kChThreads, dyn, s>>>(p, ch, si, sk, sv);
  VQ_CUDA_LAUNCH_CHECK(decode_channel_kernel);
}

template <int D, int G>
void launch_dg(const DecodeParams& p, const DecodeChannelParams& ch, int si, cudaStream_t s) {
  const int kb = ch.k_bits_x2 % 2 == 0 ? ch.k_bits_x2 / 2 : 0;
  const int vb =
      ch.v_bits_x2 % 2 == 0 && p.pk.group_size % ChGeo<D, G>::CPT == 0 ? ch.v_bits_x2 / 2 : 0;
  switch (10 * kb + vb) {
    case 22:
      return launch_inst<D, G, 2, 2>(p, ch, si, s);
    case 32:
      return launch_inst<D, G, 3, 2>(p, ch, si, s);
    case 33:
      return launch_inst<D, G, 3, 3>(p, ch, si, s);
    case 42:
      return launch_inst<D, G, 4, 2>(p, ch, si, s);
    case 44:
      return launch_inst<D, G, 4, 4>(p, ch, si, s);
    default:
      return launch_inst<D, G, 0, 0>(p, ch, si, s);
  }
}

template <int D>
void launch_d(const DecodeParams& p, const DecodeChannelParams& ch, int si, cudaStream_t s) {
  switch (p.group) {
    case 1:
      return launch_dg<D, 1>(p, ch, si, s);
    case 2:
      return launch_dg<D, 2>(p, ch, si, s);
    case 4:
      return launch_dg<D, 4>(p, ch, si, s);
    case 8:
      return launch_dg<D, 8>(p, ch, si, s);
    default:
      throw Error("[decode_attention] internal: expected 1, 2, 4 or 8 query heads per block, got " +
                  std::to_string(p.group));
  }
}

}  // namespace

void decode_channel_launch(const DecodeParams& p, const DecodeChannelParams& ch, cudaStream_t s) {
  VQ_CHECK(p.seqs == nullptr, "[decode_attention] expected an unbatched run for channel-axis keys");
  VQ_CHECK(ch.k_meta_slots >= 1 && p.pk.group_size >= 1,
           "[decode_attention] expected channel-axis key metadata slots and a value group size");
  for (int si = 0; si < p.n_segments; ++si) {
    if (p.seg[si].packed != 2 || p.seg[si].n_splits == 0) continue;
    switch (p.head_dim) {
      case 64:
        launch_d<64>(p, ch, si, s);
        break;
      case 128:
        launch_d<128>(p, ch, si, s);
        break;
      default:
        throw Error("[decode_attention] expected head_dim in {64, 128} but got " +
                    std::to_string(p.head_dim));
    }
  }
}

}  // namespace vq::cuda
