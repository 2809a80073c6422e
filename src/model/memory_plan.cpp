// The memory planner (veloxquant/memory_plan.h): replays a sequence's life on counts alone (rows
// per (b, h), the SKVQ frontier, SnapKV's keep count) at every point a caller can read the caches'
// stats, and evaluates the caches' own byte formulas there (docs/design.md §C2-§C5:
// eviction_stats' 2 bytes per element, skvq_compressed_bytes for packed rows). The resident bound
// replays the stores' own growth rules where they matter (the SKVQ packed run, src/kv/
// skvq_store.cpp) and counts a reserved store exactly (FullCache::reserve, SkvqCache::reserve).
#include "veloxquant/memory_plan.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <utility>

#include "veloxquant/device_memory.h"
#include "veloxquant/error.h"
#include "veloxquant/group_quant.h"
#include "veloxquant/prefill_schedule.h"
#include "veloxquant/skvq_cache.h"
#include "veloxquant/snapkv.h"
#include "veloxquant/tensor_parallel.h"

namespace vq {

namespace {

constexpr int64_t kGrowStep = 256;  // row-store growth granularity (full cache; SnapKV uses 64)

// The points a caller can read the stats at: tokens seen, whether a prompt-end eviction is still
// pending (the prompt's chunks before end_prompt), whether this call was a multi-token call.
struct Point {
  int64_t offset = 0;
  int64_t s = 0;        // tokens of the call that reached this point (0: end_prompt)
  bool prompt = false;  // a prefill chunk (before end_prompt)
};

std::vector<Point> life(const MemoryPlanRequest& r) {
  std::vector<Point> pts;
  int64_t off = 0;
  for (int64_t c : prefill_chunks(r.prompt_tokens, r.prefill_step)) {
    off += c;
    pts.push_back({off, c, true});
  }
  pts.push_back({off, 0, false});  // end_prompt
  for (int64_t i = 1; i < r.max_new_tokens; ++i) pts.push_back({off + i, 1, false});
  return pts;
}

struct Bytes {
  int64_t accounted = 0;
  int64_t fp_rows = 0;  // full-precision rows per (b, h) held (the part that grows with slack)
  int64_t packed = 0;   // SKVQ methods: packed rows per (b, h) (an upper bound for snapkv+skvq)
  int64_t comp = 0;     // their accounted bytes (all heads)
};

// Bytes one device allocation of `bytes` holds (cuda::device_alloc_bytes, device_memory.h:
// DeviceBuffer's words and spare word, whole 2 MiB pages above 1 MiB); the CPU's host buffers
// (64-byte aligned, whole 2 MiB above it) hold no more.
int64_t device_alloc(int64_t bytes) {
  return cuda::device_alloc_bytes(bytes);
}

// A packed store of one sequence (B = 1) with `cap` records per head over `heads` heads
// (src/kv/row_store.h PackedStore): keys, values and, when `positions`, int32 positions, one
// allocation each.
struct PackedFormat {
  int64_t heads = 0, key = 0, value = 0;  // record bytes (row_stride) of keys and values
  bool positions = false;
  int64_t bytes(int64_t cap) const {
    const int64_t f = heads * cap;
    return device_alloc(f * key) + device_alloc(f * value) + (positions ? device_alloc(f * 4) : 0);
  }
};

// Capacity, in records per head, of a packed run grown by skvq::Store::pack_tail's rule
// (src/kv/skvq_store.cpp: round_up(max(needed, 1.5 x capacity, 64), 64), growing only when the
// records do not fit) once it holds `rows`: below round_up(max(1.5 rows, 64), 64) at any time.
int64_t grown_packed_capacity(int64_t rows) {
  return rows > 0 ? round_up(std::max(rows + rows / 2, int64_t{64}), 64) : 0;
}

// The skvq full-precision store's capacity on a device (skvq::Store::refit and fit,
// src/kv/skvq_store.cpp, with kv::RowBackend::keeps_tail_room): grown to max(needed, 2 x
// capacity) rounded up to 16 rows, shrunk to max(rows, floor = sinks + flush span, 16) rounded up
// to 16 when more than twice that. (The CPU store shrinks to its rows: it never holds more than
// this.) A reallocation copies into a new store while the old one is alive: `extra` is the most
// the smaller of the two held.
struct FpStore {
  int64_t cap = 0, max_cap = 0, extra = 0, floor = 16;
  void set(int64_t c) {
    if (c == cap) return;
    extra = std::max(extra, std::min(c, cap));
    cap = c;
    max_cap = std::max(max_cap, cap);
  }
  void append(int64_t rows, int64_t n) {  // rows held before the call, n appended
    const int64_t need = rows + n;
    if (need > cap)
      set(round_up(std::max({need, 2 * cap, int64_t{16}}), 16));
    else
      fit(need);
  }
  void fit(int64_t rows) {
    const int64_t keep = std::max({rows, floor, int64_t{16}});
    if (cap > 2 * keep) set(round_up(keep, 16));
  }
};

// Packed bytes of one row per (b, h) at the settings (an upper bound per row of the block
// formula: ceil(n*d*bits/8) <= n*ceil(d*bits/8)).
int64_t packed_row_bytes(const CacheConfig& c, int64_t d) {
  return skvq_compressed_bytes(1, d, c.skvq_bits_key, c.skvq_group_size, c.skvq_meta).total() +
         skvq_compressed_bytes(1, d, c.skvq_bits_value, c.skvq_group_size, c.skvq_meta).total();
}

// The packed stores of an SKVQ method, one layer of one sequence: `packed` bounds what they hold
// at any time, `transient` what a growth copy holds besides (the old run, until the copy ends).
struct SkvqResident {
  int64_t packed = 0, transient = 0;
};

// skvq with reserve_capacity: one run of the context's packed rows rounded up to 64
// (SkvqCache::reserve), never grown. Otherwise the run grows (x1.5, grown_packed_capacity) on a
// backend with one packed run (CUDA; the CPU's per-block stores hold less); snapkv+skvq also
// keeps, until its next call, the run an eviction replaced (<= the grown capacity) and the kept
// records' store (<= the packed rows) it may grow out of.
SkvqResident skvq_resident(const MemoryPlanRequest& r, const CacheConfig& cc, int64_t n_lists,
                           int64_t heads, int64_t max_packed, int64_t context) {
  PackedFormat f;
  f.heads = heads;
  f.positions = cc.method == "snapkv+skvq";  // explicit positions (evicted rows)
  for (int64_t l = 0; l < n_lists; ++l) {
    f.key = std::max(f.key, skvq_record_stride(cc, l, false));
    f.value = std::max(f.value, skvq_record_stride(cc, l, true));
  }
  SkvqResident out;
  if (cc.method == "skvq" && r.reserve_capacity) {
    const int64_t rows = skvq_packed_rows(cc, context);
    out.packed = rows > 0 ? f.bytes(round_up(std::max(rows, int64_t{64}), 64)) : 0;
    return out;
  }
  const int64_t grown = f.bytes(grown_packed_capacity(max_packed));
  out.packed = cc.method == "skvq" ? grown : 2 * grown + f.bytes(max_packed);
  out.transient = f.bytes(max_packed);  // the old run: fewer records than the rows it overflowed
  return out;
}

}  // namespace

int64_t activation_bytes(const ModelConfig& m, int64_t tokens, int64_t logit_rows) {
  const int64_t T = tokens, Hd = m.hidden_size, D = m.head_dim, Hq = m.n_heads * D;
  const int64_t Hkv = m.n_kv_heads * D, I = m.intermediate_size;
  // x, h, q, k, v, qh, attn, attn_t, gate, up, cos/sin (forward.cpp's ForwardScratch buffers).
  const int64_t f32 = T * (Hd + std::max(Hd, Hq) + 4 * Hq + 2 * Hkv + 2 * I + D);
  const int64_t kv = 2 * T * Hkv;  // K/V blocks handed to the caches, counted at fp32
  const int64_t logits = logit_rows * (Hd + m.vocab_size);
  return 4 * (f32 + kv + logits);
}

MemoryPlan plan_memory(const MemoryPlanRequest& r) {
  const ModelConfig& m = r.model;
  VQ_CHECK(r.prompt_tokens >= 1,
           "[memory_plan] prompt_tokens: expected >= 1 but got " + std::to_string(r.prompt_tokens));
  VQ_CHECK(r.max_new_tokens >= 0, "[memory_plan] max_new_tokens: expected >= 0 but got " +
                                      std::to_string(r.max_new_tokens));
  VQ_CHECK(r.prefill_step >= 1,
           "[memory_plan] prefill_step: expected >= 1 but got " + std::to_string(r.prefill_step));
  VQ_CHECK(r.max_batch >= 1,
           "[memory_plan] max_batch: expected >= 1 but got " + std::to_string(r.max_batch));
  VQ_CHECK(r.weight_bytes >= 0 && r.device_bytes >= 0,
           "[memory_plan] expected byte counts >= 0 but got weights " +
               std::to_string(r.weight_bytes) + ", device " + std::to_string(r.device_bytes));
  VQ_CHECK(m.n_layers >= 1 && m.n_kv_heads >= 1 && m.head_dim >= 1,
           "[memory_plan] expected a model config with layers, KV heads and head_dim >= 1");
  const ShardPlan tp = make_shard_plan(m, r.tensor_parallel);  // N divides the KV heads
  VQ_CHECK(r.ranks_per_device == 1 || r.ranks_per_device == r.tensor_parallel,
           "[memory_plan] ranks_per_device: expected 1 (a device per rank) or tensor_parallel (" +
               std::to_string(r.tensor_parallel) + ", simulated ranks on one device) but got " +
               std::to_string(r.ranks_per_device));
  CacheConfig cc = r.cache;
  cc.head_dim = m.head_dim;
  validate(cc);
  const CacheConfig as_given = cc;  // before the per-layer lists are folded below
  // Per-layer lists hold one entry per layer of the model (build_caches and the CUDA engine
  // refuse another count; a longer list would otherwise be planned from its first entries).
  for (const auto& [name, list] :
       {std::pair<const char*, const std::string*>{"skvq_layer_bits_key", &cc.skvq_layer_bits_key},
        {"skvq_layer_key_rows", &cc.skvq_layer_key_rows},
        {"skvq_layer_bits_value", &cc.skvq_layer_bits_value}}) {
    const int64_t n = skvq_layer_list_size(*list);
    VQ_CHECK(n == 0 || n == m.n_layers,
             std::string("[memory_plan] ") + name + ": expected " + std::to_string(m.n_layers) +
                 " entries (one per layer) but got " + std::to_string(n) + " ('" + *list + "')");
  }
  // Per-layer key and value bits: every layer planned at the lists' largest (an upper bound;
  // skvq_key_bits_of / skvq_value_bits_of give the single field where a list is empty).
  double key_bits = 0, value_bits = 0;
  for (int64_t i = 0; i < m.n_layers; ++i) {
    key_bits = std::max(key_bits, skvq_key_bits_of(cc, i));
    value_bits = std::max(value_bits, skvq_value_bits_of(cc, i));
  }
  cc.skvq_bits_key = key_bits;
  cc.skvq_bits_value = value_bits;

  MemoryPlan p;
  p.context_tokens = r.prompt_tokens + std::max<int64_t>(r.max_new_tokens - 1, 0);
  if (m.max_position_embeddings > 0)
    VQ_CHECK(p.context_tokens <= m.max_position_embeddings,
             "[memory_plan] expected a context within the model's max_position_embeddings " +
                 std::to_string(m.max_position_embeddings) + " but got " +
                 std::to_string(p.context_tokens) + " tokens (" + std::to_string(r.prompt_tokens) +
                 " prompt + " + std::to_string(r.max_new_tokens) + " new - 1)");

  // One rank's heads; the figures are multiplied by the ranks on the device at the end.
  const int64_t d = m.head_dim, H = m.n_kv_heads / tp.n_ranks;
  const int64_t fp_row = 2 * H * d * 2;  // K and V of one position, all heads, 2 bytes each
  const int64_t es = static_cast<int64_t>(dtype_size(r.kv_dtype));
  const std::string& meth = cc.method;
  const SnapSelectParams sp = SnapSelectParams::from_config(cc);
  const int64_t w = cc.skvq_window, span = cc.skvq_window + cc.skvq_recent;
  const int64_t perm = 2 * H * d * 4;
  // Packed bytes per (b, h) of skvq's chunk 0 (window - n_sink rows) and of a later chunk, and
  // of snapkv+skvq's chunks (window rows), by the caches' own formula (skvq_flushed_chunk_bytes:
  // runs of skvq_key_rows, channel-axis keys); the largest over the layers when per-layer lists
  // make them differ (an upper bound).
  int64_t comp_k0 = 0, comp_kw = 0;
  const bool lists = skvq_layer_list_size(cc.skvq_layer_bits_key) > 0 ||
                     skvq_layer_list_size(cc.skvq_layer_bits_value) > 0 ||
                     skvq_layer_list_size(cc.skvq_layer_key_rows) > 0;
  if (meth == "skvq" || meth == "snapkv+skvq") {
    for (int64_t l = 0; l < (lists ? m.n_layers : 1); ++l) {
      if (meth == "skvq")
        comp_k0 = std::max(comp_k0, skvq_flushed_chunk_bytes(as_given, l, w - cc.skvq_n_sink));
      comp_kw = std::max(comp_kw, skvq_flushed_chunk_bytes(as_given, l, w));
    }
  }
  // snapkv+skvq: packed bytes per row (all heads), an upper bound for rows packed in whole chunks
  // of `window` rows (snapkv_skvq_cache.cpp packs nothing else): the chunk formula per row, and
  // for token-axis keys at least their per-row formula. Channel-axis keys have no per-row
  // formula (a chunk's rows share one (lo, scale) per channel): the chunk's alone.
  const int64_t chunk_row = (comp_kw + w - 1) / w;
  const int64_t prow =
      (cc.skvq_key_axis == QuantAxis::kChannel ? chunk_row
                                               : std::max(packed_row_bytes(cc, d), chunk_row)) *
      H;
  const bool perm_file = !cc.skvq_perm_file.empty();

  int64_t snap_rows = 0;  // SnapKV rows per (b, h)
  bool pending = false;
  int64_t max_fp_rows = 0, max_chunk = 0;
  bool exact = true;
  // SKVQ methods: the most packed rows per (b, h), their accounted bytes, the most of the rest
  // accounted besides full-precision rows (permutations, protected rows), the skvq fp store.
  int64_t max_packed = 0, max_comp = 0, max_other = 0, prev_fp = 0, prev_q = 0;
  FpStore fps;
  for (const Point& pt : life(r)) {
    max_chunk = std::max(max_chunk, pt.s);
    Bytes b;
    if (meth == "full") {
      b.accounted = pt.offset * 2 * H * d * es;
      b.fp_rows = pt.offset;
    } else if (meth == "streaming") {
      const int64_t rows = std::min(pt.offset, cc.streaming_n_sink + cc.streaming_window);
      b.accounted = rows * fp_row;
      b.fp_rows = rows;
    } else if (meth == "snapkv" || meth == "snapkv+skvq") {
      const bool at_end = cc.snap_evict_at == SnapEvictAt::kPromptEnd;
      if (pt.s > 1) {
        snap_rows += pt.s;
        if (at_end) {
          pending = true;
        } else {
          snap_rows = snap_keep_count(snap_rows, sp);
        }
      } else if (pt.s == 1) {
        if (pending) snap_rows = snap_keep_count(snap_rows, sp), pending = false;
        snap_rows += 1;
        if (cc.snap_decode_budget > 0 &&
            snap_rows > cc.snap_decode_budget + cc.snap_decode_every - 1)
          snap_rows = cc.snap_decode_budget;  // decode-time eviction (snapkv, either device)
      } else if (pending) {                   // end_prompt
        snap_rows = snap_keep_count(snap_rows, sp);
        pending = false;
      }
      if (meth == "snapkv") {
        b.accounted = snap_rows * fp_row;
        b.fp_rows = snap_rows;
      } else {
        // Full precision while a prompt-end eviction is pending; else at most the sinks and a
        // tail below the flush span stay full precision, the rest is packed.
        const int64_t fp = pending ? snap_rows : std::min(snap_rows, cc.skvq_n_sink + span - 1);
        const bool perms = perm_file || (cc.skvq_reorder && snap_rows >= w);
        b.accounted = fp * fp_row + (snap_rows - fp) * prow + (perms ? perm : 0);
        b.fp_rows = fp;
        b.packed = snap_rows - fp;
        b.comp = b.packed * prow;
        exact = false;
      }
    } else if (meth == "skvq") {
      int64_t q_end = 0;
      while (pt.offset - q_end >= span) q_end += w;
      const int64_t n_chunks = q_end / w;
      const int64_t comp = n_chunks > 0 ? (comp_k0 + (n_chunks - 1) * comp_kw) * H : 0;
      const int64_t sinks = std::min(cc.skvq_n_sink, q_end);
      const bool perms = perm_file || (cc.skvq_reorder && q_end > 0);
      const int64_t fp = pt.offset - q_end + sinks;
      b.accounted = comp + fp * fp_row + (perms ? perm : 0);
      b.fp_rows = fp;
      b.packed = q_end > 0 ? q_end - cc.skvq_n_sink : 0;
      b.comp = comp;
      if (pt.s > 0) {  // the call's append, then the fit after a flush (skvq_cache.cpp)
        // The store's sinks count from the first flush (promote_sinks) on.
        fps.floor = (prev_q > 0 ? cc.skvq_n_sink : 0) + span;
        fps.append(prev_fp, pt.s);
        fps.floor = cc.skvq_n_sink + span;
        if (q_end > prev_q) fps.fit(fp);
      }
      prev_fp = fp;
      prev_q = q_end;
      // Protected rows (skvq_cache.h), chosen at end_prompt over the prompt's packed rows: per row
      // and head an fp16 key (and value) and an int32 position.
      if (cc.skvq_protect > 0.0 && !pt.prompt) {
        int64_t q_p = 0;
        while (r.prompt_tokens - q_p >= span) q_p += w;
        const int64_t packed = q_p > 0 ? q_p - cc.skvq_n_sink : 0;
        const int64_t k =
            packed > 0
                ? std::min(packed,
                           std::max<int64_t>(1, std::llround(cc.skvq_protect *
                                                             static_cast<double>(r.prompt_tokens))))
                : 0;
        b.accounted += k * H * (d * 2 * (cc.skvq_protect_values ? 2 : 1) + 4);
      }
    } else {
      throw Error("[memory_plan] expected a method of cache_methods() but got '" + meth + "'");
    }
    if (pt.prompt) p.cache_bytes_prompt = b.accounted;  // the last chunk's wins
    p.cache_bytes_peak = std::max(p.cache_bytes_peak, b.accounted);
    max_fp_rows = std::max(max_fp_rows, b.fp_rows);
    max_packed = std::max(max_packed, b.packed);
    max_comp = std::max(max_comp, b.comp);
    max_other = std::max(max_other, b.accounted - b.comp - b.fp_rows * fp_row);
  }
  p.cache_bytes_exact = exact && !lists;
  const int64_t row_es = meth == "full" ? 2 * H * d * es : fp_row;
  // Growth slack of the full-precision rows (x1.25 rounded up to the store's step) and one
  // prefill chunk of rows held by a call before its eviction / flush.
  const int64_t slack_rows = max_fp_rows / 4 + kGrowStep + max_chunk;
  p.cache_bytes_resident = p.cache_bytes_peak + slack_rows * row_es;
  int64_t transient = 0;  // one layer's reallocation at a time (per rank, not per layer)
  if (meth == "skvq" || meth == "snapkv+skvq") {
    const SkvqResident sr =
        skvq_resident(r, as_given, lists ? m.n_layers : 1, H, max_packed, p.context_tokens);
    // The fp store: keys and values of kv_dtype rows (the accounted figure counts them at 2
    // bytes) and for snapkv+skvq int32 positions, one allocation each.
    const int64_t half_row = H * d * std::max<int64_t>(es, 2);
    const bool pos = meth == "snapkv+skvq";
    const auto fp_store = [&](int64_t rows) {
      return 2 * device_alloc(rows * half_row) + (pos ? device_alloc(rows * H * 4) : 0);
    };
    const int64_t fp_rows = std::max(max_fp_rows + slack_rows, fps.max_cap);
    p.cache_bytes_resident = std::max(sr.packed, max_comp) + max_other + fp_store(fp_rows);
    transient = std::max(sr.transient, fp_store(fps.extra));
    if (cc.skvq_key_axis == QuantAxis::kChannel && max_packed > 0) {
      // The one packed run's block starts for its views (skvq::Store::run_index, one device copy
      // per view slot): blocks of at least the shortest run's rows.
      int64_t shortest = meth == "skvq" ? w - cc.skvq_n_sink : w;
      for (int64_t l = 0; l < (lists ? m.n_layers : 1); ++l)
        if (skvq_key_rows_of(as_given, l) > 0)
          shortest = std::min(shortest, skvq_key_rows_of(as_given, l));
      const int64_t blocks = (max_packed + shortest - 1) / std::max<int64_t>(shortest, 1);
      p.cache_bytes_resident += 2 * device_alloc((blocks + 1) * 4);
    }
  }
  // snapkv's decode query window (RowBackend::make_query_window), on either device: fp32 queries
  // of the rank's query heads in one allocation of at most 2 x min(obs_window, max(decode calls,
  // 4)) steps (the CUDA buffer's growth rule, src/cuda/row_store_cuda.cpp; the CPU's vector holds
  // at most min(obs_window, decode calls) steps).
  if (meth == "snapkv" && cc.snap_decode_budget > 0 && r.max_new_tokens > 1) {
    const int64_t hq = m.n_heads / tp.n_ranks;
    const int64_t steps = 2 * std::min(std::max<int64_t>(cc.snap_obs_window, 1),
                                       std::max<int64_t>(r.max_new_tokens - 1, 4));
    p.cache_bytes_resident += device_alloc(steps * hq * d * 4);
  }
  // skvq_protect (src/kv/skvq_cache.cpp), on either device: until the selection, the prompt's
  // fp32 copies (keys, values and int32 positions, one allocation each; grown over the prefill
  // chunks by skvq_protect_copy_capacity, the old store alive during its copy) and the window
  // queries (at most obs_window rows of the rank's query heads); after it, the protected rows
  // (keys and values of the storage dtype, positions) and the packed rows' position table (the
  // one packed run's capacity on the device, reserved or grown; the covered rows on the CPU).
  // The copies are freed after the selection; the bound counts them throughout.
  if (meth == "skvq" && cc.skvq_protect > 0.0) {
    const auto copies = [&](int64_t rows) {
      return rows > 0 ? 2 * device_alloc(rows * H * d * 4) + device_alloc(rows * H * 4) : 0;
    };
    int64_t cap = 0, rows = 0, before = 0;
    for (const int64_t c : prefill_chunks(r.prompt_tokens, r.prefill_step)) {
      const int64_t next = skvq_protect_copy_capacity(cap, rows + c);
      before = std::max(before, copies(next) + (next != cap ? copies(cap) : 0));
      cap = next;
      rows += c;
    }
    const int64_t hq = m.n_heads / tp.n_ranks;
    before += device_alloc(hq * std::min(cc.skvq_protect_obs_window, r.prompt_tokens) * d * 4);
    const int64_t cand = skvq_packed_rows(cc, r.prompt_tokens);
    const int64_t k =
        cand > 0
            ? std::min(cand,
                       std::max<int64_t>(
                           1, std::llround(cc.skvq_protect * static_cast<double>(r.prompt_tokens))))
            : 0;
    const int64_t run =
        std::max(grown_packed_capacity(max_packed),
                 round_up(std::max(skvq_packed_rows(cc, p.context_tokens), int64_t{64}), 64));
    const int64_t after = k > 0 ? 2 * device_alloc(k * H * d * std::max<int64_t>(es, 2)) +
                                      device_alloc(k * H * 4) + device_alloc(run * H * 4)
                                : 0;
    // The selection holds both, and the chosen rows' fp32 staging store (copies(k)).
    p.cache_bytes_resident += before + after + copies(k);
  }
  if (meth == "full" && r.reserve_capacity) {
    // one store of the reserved rows (FullCache::reserve): K and V one device allocation each
    const int64_t half = (p.context_tokens + kGrowStep - 1) / kGrowStep * kGrowStep * row_es / 2;
    p.cache_bytes_resident = 2 * device_alloc(half);
  }
  const int64_t per_device = r.ranks_per_device;
  p.cache_bytes_peak *= m.n_layers * per_device;
  p.cache_bytes_prompt *= m.n_layers * per_device;
  p.cache_bytes_resident = (p.cache_bytes_resident * m.n_layers + transient) * per_device;
  p.weight_bytes = r.weight_bytes;
  // A rank's activations: its query / KV heads and the largest rank's intermediate columns.
  ModelConfig shard = m;
  shard.n_heads = m.n_heads / tp.n_ranks;
  shard.n_kv_heads = H;
  shard.intermediate_size = tp.ranks[0].intermediate.count;
  p.workspace_bytes =
      activation_bytes(shard, std::max(r.prefill_step, r.max_batch), r.max_batch) * per_device;
  const int64_t free_bytes = r.device_bytes - p.weight_bytes - p.workspace_bytes;
  p.max_sequences =
      free_bytes > 0 && p.cache_bytes_resident > 0 ? free_bytes / p.cache_bytes_resident : 0;
  return p;
}

std::string MemoryPlan::summary() const {
  const auto mib = [](int64_t b) { return static_cast<double>(b) / (1024.0 * 1024.0); };
  char buf[512];
  std::snprintf(buf, sizeof(buf),
                "%lld tokens: cache %.1f MiB peak (%s), %.1f MiB resident bound per sequence; "
                "weights %.1f MiB, workspace %.1f MiB; %lld sequences fit",
                static_cast<long long>(context_tokens), mib(cache_bytes_peak),
                cache_bytes_exact ? "exact" : "upper bound", mib(cache_bytes_resident),
                mib(weight_bytes), mib(workspace_bytes), static_cast<long long>(max_sequences));
  return buf;
}

void check_fits(const MemoryPlan& p, const MemoryPlanRequest& r, int64_t n) {
  if (n <= p.max_sequences) return;
  const auto mib = [](int64_t b) { return std::to_string(b / (1024 * 1024)); };
  throw Error("[memory_plan] expected at most " + std::to_string(p.max_sequences) +
              " sequences of " + std::to_string(p.context_tokens) + " tokens with " +
              r.cache.method + " to fit in " + mib(r.device_bytes) + " MiB (weights " +
              mib(p.weight_bytes) + " MiB + workspace " + mib(p.workspace_bytes) + " MiB + " +
              mib(p.cache_bytes_resident) + " MiB per sequence) but got " + std::to_string(n) +
              "; nothing was allocated");
}

}  // namespace vq
