// Steady decode makes no stores on a device-like backend (issue 13): a CPU backend that answers
// the policy questions as the CUDA backend does (src/cuda/row_store_cuda.cpp: one_packed_run and
// keeps_tail_room true) and counts, per call, every store, index and query buffer it makes, every
// store it frees, and every temporary the CUDA backend makes inside a call (an overlapping
// copy_range within one store goes through a scratch store; a gather into a store whose capacity
// is not the count goes through scratch buffers; a selection copies the frames). An SKVQ cache
// (skvq, snapkv+skvq) fed a prompt and then hundreds of single-token calls (several flushes) may
// make a store in decode only to grow: a larger capacity than the last store of its kind, by at
// least 1.5x (the packed run's growth rule, src/kv/skvq_store.cpp), so O(log n) times.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "kv/row_store.h"
#include "util/cpu_delegate_backend.h"
#include "util/llama_shapes.h"
#include "util/test_util.h"
#include "veloxquant/cache_config.h"
#include "veloxquant/memory_plan.h"
#include "veloxquant/model.h"
#include "veloxquant/packed.h"
#include "veloxquant/prefill_schedule.h"
#include "veloxquant/skvq_cache.h"
#include "veloxquant/snapkv_skvq_cache.h"
#include "veloxquant/streaming_cache.h"

namespace vq {
namespace {

// What the backend saw during one cache call.
struct Event {
  std::string what;  // "make", "make_packed", "upload_index", ..., "free", "temp ..."
  std::string kind;  // a store's kind (dtype, positions), "" for the rest
  int64_t cap = 0;   // a store's capacity
};

class CountingBackend;

// A CPU row store behind the RowStore interface, so that the backend sees copies and frees. The
// base class's pointers are the inner store's (its views read the same memory).
class CountedRows final : public kv::RowStore {
 public:
  CountedRows(std::unique_ptr<kv::RowStore> inner, const CountingBackend* be, std::string kind)
      : inner_(std::move(inner)), be_(be), kind_(std::move(kind)) {
    shape_ = inner_->shape();
    capacity_ = inner_->capacity();
    with_pos_ = inner_->has_positions();
    k_ = inner_->keys(0, 0).data;
    v_ = inner_->values(0, 0).data;
    pos_ = const_cast<int32_t*>(inner_->positions());
  }
  ~CountedRows() override;
  static const kv::RowStore& in(const kv::RowStore& s) {
    return *static_cast<const CountedRows&>(s).inner_;
  }
  static kv::RowStore& in(kv::RowStore& s) { return *static_cast<CountedRows&>(s).inner_; }

  void copy_range(const kv::RowStore& src, int64_t src_row0, int64_t dst_row0, int64_t n) override;
  void write_block(const TensorView& k, const TensorView& v, int64_t s0, int64_t n,
                   int64_t row0) override {
    inner_->write_block(k, v, s0, n, row0);
  }
  void fill_positions(int64_t row0, int64_t n, int64_t first) override {
    inner_->fill_positions(row0, n, first);
  }
  void gather(const kv::RowStore& src, const kv::RowIndex& idx, int64_t src_first) override;
  Tensor download(bool values, int64_t row0, int64_t n) const override {
    return inner_->download(values, row0, n);
  }
  std::vector<int32_t> download_positions(int64_t row0, int64_t n) const override {
    return inner_->download_positions(row0, n);
  }
  void upload(const TensorView& k, const TensorView& v, int64_t row0, int64_t n,
              const std::vector<int32_t>* positions) override {
    inner_->upload(k, v, row0, n, positions);
  }
  int64_t resident_bytes() const override { return inner_->resident_bytes(); }

 private:
  std::unique_ptr<kv::RowStore> inner_;
  const CountingBackend* be_;
  std::string kind_;
};

// Transforms with no data: only for reading a packed store's record pointers (segment()).
class NoTransforms final : public kv::PackedTransforms {};

class CountedPacked final : public kv::PackedStore {
 public:
  CountedPacked(std::unique_ptr<kv::PackedStore> inner, const CountingBackend* be, std::string kind)
      : inner_(std::move(inner)), be_(be), kind_(std::move(kind)) {
    shape_ = inner_->shape();
    capacity_ = inner_->capacity();
    const PackedSegment seg = inner_->segment(0, 0, DType::kF32, NoTransforms{});
    k_ = const_cast<uint8_t*>(seg.keys.data);
    v_ = const_cast<uint8_t*>(seg.values.data);
    pos_ = const_cast<int32_t*>(inner_->positions());
  }
  ~CountedPacked() override;
  static const kv::PackedStore& in(const kv::PackedStore& s) {
    return *static_cast<const CountedPacked&>(s).inner_;
  }

  void copy_range(const kv::PackedStore& src, int64_t src_row0, int64_t dst_row0,
                  int64_t n) override {
    inner_->copy_range(in(src), src_row0, dst_row0, n);
  }
  void quantize(const kv::RowStore& rows, int64_t src_row0, int64_t n, int64_t dst_row0,
                const GroupQuantParams& qk, const GroupQuantParams& qv,
                const kv::PackedTransforms& t) override {
    inner_->quantize(CountedRows::in(rows), src_row0, n, dst_row0, qk, qv, t);
  }
  void gather(const kv::PackedStore& src, const kv::RowIndex& idx) override;
  void dequantize_keys(int64_t src_row0, int64_t n, kv::RowStore& dst, int64_t dst_row0,
                       const kv::PackedTransforms& t) const override {
    inner_->dequantize_keys(src_row0, n, CountedRows::in(dst), dst_row0, t);
  }
  std::vector<uint8_t> download(bool values, int64_t row0, int64_t n) const override {
    return inner_->download(values, row0, n);
  }
  std::vector<int32_t> download_positions(int64_t row0, int64_t n) const override {
    return inner_->download_positions(row0, n);
  }
  void upload(const void* k, const void* v, const int32_t* positions, int64_t row0,
              int64_t n) override {
    inner_->upload(k, v, positions, row0, n);
  }
  int64_t resident_bytes() const override { return inner_->resident_bytes(); }

 private:
  std::unique_ptr<kv::PackedStore> inner_;
  const CountingBackend* be_;
  std::string kind_;
};

// The CPU backend with the CUDA backend's policy answers, counting what it makes.
class CountingBackend final : public test::CpuDelegateBackend {
 public:
  mutable std::vector<Event> events;
  void note(std::string what, std::string kind = "", int64_t cap = 0) const {
    events.push_back({std::move(what), std::move(kind), cap});
  }

  bool one_packed_run() const override { return true; }
  bool keeps_tail_room() const override { return true; }
  void synchronize() const override { note("synchronize"); }

  std::unique_ptr<kv::RowStore> make(const kv::RowShape& s, int64_t cap, bool pos) const override {
    std::string kind = std::string("rows ") + dtype_name(s.dtype) + (pos ? " +pos" : "");
    note("make", kind, cap);
    return std::make_unique<CountedRows>(cpu().make(s, cap, pos), this, kind);
  }
  std::unique_ptr<kv::PackedStore> make_packed(const kv::PackedShape& s, int64_t cap,
                                               bool pos) const override {
    std::string kind = std::string("packed") + (pos ? " +pos" : "");
    note("make_packed", kind, cap);
    return std::make_unique<CountedPacked>(cpu().make_packed(s, cap, pos), this, kind);
  }
  std::unique_ptr<kv::RowIndex> upload_index(int64_t count,
                                             const std::vector<int32_t>& idx) const override {
    note("upload_index");
    return cpu().upload_index(count, idx);
  }
  std::unique_ptr<kv::QueryRows> keep_queries(const TensorView& q, int64_t rows) const override {
    note("keep_queries");
    return cpu().keep_queries(q, rows);
  }
  std::unique_ptr<kv::QueryRows> upload_queries(int64_t b, int64_t hq, int64_t rows, int64_t d,
                                                const std::vector<float>& q) const override {
    note("upload_queries");
    return cpu().upload_queries(b, hq, rows, d, q);
  }
  std::unique_ptr<kv::QueryWindow> make_query_window(int64_t b, int64_t hq, int64_t d,
                                                     int64_t max_rows,
                                                     const std::vector<float>& q) const override {
    note("make_query_window");
    return cpu().make_query_window(b, hq, d, max_rows, q);
  }
  std::unique_ptr<kv::PackedTransforms> make_transforms(
      const std::vector<int32_t>& pk, const std::vector<int32_t>& pv,
      const std::vector<float>& signs, int32_t block, bool rv,
      const std::vector<double>& ku) const override {
    note("make_transforms");
    return cpu().make_transforms(pk, pv, signs, block, rv, ku);
  }
  // The CUDA backend's selections copy the frames and make their index and score buffers.
  std::unique_ptr<kv::RowIndex> snap_select(const kv::RowStore& rows, int64_t n,
                                            const TensorView* q, int64_t q_first,
                                            const SnapSelectParams& p) const override {
    note("snap_select");
    return cpu().snap_select(CountedRows::in(rows), n, q, q_first, p);
  }
  std::vector<int32_t> snap_select_rows(const kv::RowStore& rows, int64_t n, const TensorView* q,
                                        int64_t q_first, int64_t obs_window, int64_t pool_kernel,
                                        int64_t lo, int64_t hi, int64_t k) const override {
    note("snap_select_rows");
    return cpu().snap_select_rows(CountedRows::in(rows), n, q, q_first, obs_window, pool_kernel, lo,
                                  hi, k);
  }
  std::vector<int32_t> channel_perms(const kv::RowStore& rows, int64_t row0, int64_t n,
                                     bool values) const override {
    note("channel_perms");
    return cpu().channel_perms(CountedRows::in(rows), row0, n, values);
  }
};

CountedRows::~CountedRows() {
  be_->note("free", kind_, capacity_);
}

void CountedRows::copy_range(const kv::RowStore& src, int64_t src_row0, int64_t dst_row0,
                             int64_t n) {
  // The CUDA store copies overlapping ranges of itself through a scratch store of n rows.
  if (&src == this && n > 0 && src_row0 != dst_row0 &&
      std::max(src_row0, dst_row0) < std::min(src_row0, dst_row0) + n)
    be_->note("temp copy_range overlap", kind_, n);
  inner_->copy_range(in(src), src_row0, dst_row0, n);
}

void CountedRows::gather(const kv::RowStore& src, const kv::RowIndex& idx, int64_t src_first) {
  if (idx.count > 0 && idx.count != capacity_) be_->note("temp gather scratch", kind_, idx.count);
  inner_->gather(in(src), idx, src_first);
}

CountedPacked::~CountedPacked() {
  be_->note("free", kind_, capacity_);
}

void CountedPacked::gather(const kv::PackedStore& src, const kv::RowIndex& idx) {
  if (idx.count > 0 && idx.count != capacity_) be_->note("temp gather scratch", kind_, idx.count);
  inner_->gather(in(src), idx);
}

struct Life {
  int64_t prompt = 4096;     // tokens of the prompt
  int64_t prompt_calls = 1;  // the prompt in this many calls
  int64_t steps = 600;       // single-token calls after it (a flush every `window` steps)
  bool queries = false;      // hand the cache queries (query scoring)
  bool end_prompt = false;   // end_prompt() after the prompt
  int64_t first_steady = 0;  // decode calls before it are not judged (an owed selection)
};

// What a cache's decode steps made: events per step, and the ones that are not growth.
struct Tally {
  std::vector<std::vector<Event>> steps;  // [step] events, step 0 = the first decode call
  int64_t growths = 0;
  std::vector<std::string> churn;  // "step s: what kind cap" of every creation that is no growth
  int64_t frees = 0;
  int64_t late_frees = 0;  // after the first judged step (which frees what the prompt replaced)
};

std::string saved(const KVCache& c) {
  std::ostringstream out;
  c.save(out);
  return out.str();
}

// Every row each (b, h) attends to: positions and the dequantized keys and values.
std::vector<float> rows_of(const CacheView& v, int64_t b, int64_t h) {
  const DenseView dv = dequantize_view(v, DType::kF32);
  std::vector<float> out;
  for (const ViewSegment& s : dv.view.segments)
    for (int64_t i = 0; i < s.n_rows; ++i) {
      out.push_back(static_cast<float>(s.position(b, h, i, v.n_kv_heads)));
      for (const TensorView* t : {&s.keys, &s.values})
        for (int64_t j = 0; j < v.head_dim; ++j) out.push_back(t->at(b, h, i, j));
    }
  return out;
}

// The cache over the counting backend and the CPU cache agree after a call: the fetched views'
// rows, the state bytes, the accounted bytes.
void expect_same(const CacheView& got, const CacheView& want, const KVCache& cache,
                 const KVCache& ref, const std::string& what) {
  for (int64_t b = 0; b < want.batch; ++b)
    for (int64_t h = 0; h < want.n_kv_heads; ++h)
      ASSERT_EQ(rows_of(got, b, h), rows_of(want, b, h)) << what << " (" << b << ", " << h << ")";
  ASSERT_EQ(saved(cache), saved(ref)) << what;
  ASSERT_EQ(cache.stats().bytes_accounted, ref.stats().bytes_accounted) << what;
}

// Runs a cache over `be` through the life (and `ref`, the same cache over the CPU backend) and
// sorts the decode steps' events. A creation is a growth when it is a store whose capacity is at
// least 1.5x the last store of its kind made before it (in the prompt or in decode); everything
// else a decode step makes is churn.
Tally run_life(KVCache& cache, KVCache& ref, CountingBackend& be, const Life& lf, int64_t h,
               int64_t d) {
  const int64_t hq = 2 * h;
  std::map<std::string, int64_t> last_cap;
  auto seen = [&](const std::vector<Event>& evs) {
    for (const Event& e : evs)
      if (e.what == "make" || e.what == "make_packed") last_cap[e.kind] = e.cap;
  };
  const Tensor pk = test::random_tensor(DType::kF16, 1, h, lf.prompt, d, 11);
  const Tensor pv = test::random_tensor(DType::kF16, 1, h, lf.prompt, d, 12);
  const Tensor pq = test::random_tensor(DType::kF32, 1, hq, lf.prompt, d, 13);
  for (int64_t c = 0; c < lf.prompt_calls; ++c) {
    const int64_t s0 = lf.prompt * c / lf.prompt_calls, s1 = lf.prompt * (c + 1) / lf.prompt_calls;
    UpdateOptions o;
    const TensorView q = pq.view().slice_tokens(s0, s1);
    if (lf.queries) o.queries = &q;
    const TensorView kb = pk.view().slice_tokens(s0, s1), vb = pv.view().slice_tokens(s0, s1);
    expect_same(cache.update_and_fetch(kb, vb, o), ref.update_and_fetch(kb, vb, o), cache, ref,
                "prompt call " + std::to_string(c));
  }
  if (lf.end_prompt) {
    cache.end_prompt();
    ref.end_prompt();
  }
  seen(be.events);
  be.events.clear();
  const Tensor dk = test::random_tensor(DType::kF16, 1, h, lf.steps, d, 21);
  const Tensor dv = test::random_tensor(DType::kF16, 1, h, lf.steps, d, 22);
  const Tensor dq = test::random_tensor(DType::kF32, 1, hq, lf.steps, d, 23);
  Tally t;
  for (int64_t s = 0; s < lf.steps; ++s) {
    UpdateOptions o;
    const TensorView q = dq.view().slice_tokens(s, s + 1);
    if (lf.queries) o.queries = &q;
    const TensorView kb = dk.view().slice_tokens(s, s + 1), vb = dv.view().slice_tokens(s, s + 1);
    const CacheView got = cache.update_and_fetch(kb, vb, o), want = ref.update_and_fetch(kb, vb, o);
    // every step at first, then every 7th (a difference in what is stored would persist)
    if (s < 8 || s % 7 == 0 || s + 1 == lf.steps)
      expect_same(got, want, cache, ref, "decode step " + std::to_string(s));
    for (const Event& e : be.events) {
      if (s < lf.first_steady) break;
      if (e.what == "free") {
        ++t.frees;
        t.late_frees += s > lf.first_steady;
        continue;
      }
      const bool store = e.what == "make" || e.what == "make_packed";
      const auto it = last_cap.find(e.kind);
      if (store && it != last_cap.end() && 2 * e.cap >= 3 * it->second) {
        ++t.growths;
      } else {
        t.churn.push_back("step " + std::to_string(s) + ": " + e.what + " " + e.kind + " " +
                          std::to_string(e.cap));
      }
    }
    seen(be.events);
    t.steps.push_back(std::move(be.events));
    be.events.clear();
  }
  // The per-step record, for the log: each step that made, freed or copied anything.
  for (size_t s = 0; s < t.steps.size(); ++s) {
    if (t.steps[s].empty()) continue;
    std::string line = "[steady] step " + std::to_string(s) + ":";
    for (const Event& e : t.steps[s])
      line +=
          " " + e.what + (e.kind.empty() ? "" : "(" + e.kind + " " + std::to_string(e.cap) + ")");
    std::printf("%s\n", line.c_str());
  }
  std::printf("[steady] %zu decode steps: %lld growths, %zu other creations, %lld frees\n",
              t.steps.size(), static_cast<long long>(t.growths), t.churn.size(),
              static_cast<long long>(t.frees));
  return t;
}

// The engine benchmark's cache (tools/cli/cmd_bench.cpp, docs/results/gpu/run13_s14/e6/call.sh):
// snapkv+skvq:budget=1024:bits_key=4:bits_value=4, one prefill call, key-proxy scoring.
CacheConfig bench_cfg(const char* method, int64_t d) {
  CacheConfig c;
  c.method = method;
  c.head_dim = d;
  c.snap_budget = 1024;
  c.skvq_bits_key = 4;
  c.skvq_bits_value = 4;
  c.skvq_group_size = 32;
  return c;
}

constexpr int64_t kH = 2, kD = 64;

// Growths of a store grown x1.5 from 64 rows to hold `rows` more than the prompt's: a bound for
// every store a cache grows in decode.
int64_t log_growths(int64_t steps) {
  int64_t g = 0;
  for (double cap = 64; cap < static_cast<double>(steps) * 4; cap *= 1.5) ++g;
  return g;
}

void expect_steady(const Tally& t, int64_t steps) {
  EXPECT_TRUE(t.churn.empty()) << t.churn.size() << " creations in decode that are no growth, "
                               << "the first: " << (t.churn.empty() ? "" : t.churn[0]);
  EXPECT_LE(t.growths, log_growths(steps));
  EXPECT_LE(t.late_frees, t.growths);  // each growth frees the store it replaced, nothing else
}

// As the benchmark fills a sequence (Engine::fill_synthetic, src/model/engine_cuda.cpp): the prompt
// in one call, end_prompt(), then decode.
TEST(SteadyDecodeStores, SnapkvSkvqBenchConfigMakesNoStorePerStep) {
  CountingBackend be;
  const CacheConfig cfg = bench_cfg("snapkv+skvq", kD);
  SnapkvSkvqCache cache(cfg, be), ref(cfg);
  Life lf;
  lf.end_prompt = true;
  const Tally t = run_life(cache, ref, be, lf, kH, kD);
  expect_steady(t, lf.steps);
  EXPECT_EQ(cache.stored_rows(), cfg.snap_budget + lf.steps);
}

TEST(SteadyDecodeStores, SnapkvSkvqPromptEndQueryScoringMakesNoStorePerStep) {
  for (const bool explicit_end : {false, true}) {
    SCOPED_TRACE(explicit_end ? "end_prompt()" : "the first single-token call ends the prompt");
    CountingBackend be;
    CacheConfig cfg = bench_cfg("snapkv+skvq", kD);
    cfg.snap_scoring = SnapScoring::kQuery;
    cfg.snap_evict_at = SnapEvictAt::kPromptEnd;
    cfg.snap_pool_kernel = 7;
    cfg.snap_keep_window = true;
    SnapkvSkvqCache cache(cfg, be), ref(cfg);
    Life lf;
    lf.prompt_calls = 3;
    lf.queries = true;
    lf.end_prompt = explicit_end;
    lf.first_steady = explicit_end ? 0 : 1;  // else the first call runs the prompt's selection
    const Tally t = run_life(cache, ref, be, lf, kH, kD);
    expect_steady(t, lf.steps);
  }
}

// A recent span longer than the window: the tail holds more rows than a flush moves it by.
TEST(SteadyDecodeStores, SnapkvSkvqLongRecentSpanMakesNoStorePerStep) {
  CountingBackend be;
  CacheConfig cfg = bench_cfg("snapkv+skvq", kD);
  cfg.skvq_recent = 200;
  SnapkvSkvqCache cache(cfg, be), ref(cfg);
  const Life lf;
  const Tally t = run_life(cache, ref, be, lf, kH, kD);
  expect_steady(t, lf.steps);
}

// The stores a snapkv+skvq cache keeps on such a backend stay within the planner's resident bound
// (src/model/memory_plan.cpp) after every call of a life, as the device test does
// (tests/cuda/test_cuda_skvq.cpp): here with the CPU's allocations, which hold no more than the
// device's.
TEST(SteadyDecodeStores, SnapkvSkvqResidentStaysWithinThePlan) {
  const ModelConfig mc = test::llama3_8b_layer();
  struct Case {
    const char* spec;
    int64_t prompt, step, gen;
  };
  const int64_t H = mc.n_kv_heads, D = mc.head_dim;
  for (const Case& c :
       {Case{"snapkv+skvq:budget=1024:bits_key=4:bits_value=4", 4096, 4096, 300},
        Case{"snapkv+skvq:budget=512:bits_value=2:key_axis=channel:evict_at=prompt_end", 1024, 512,
             140},
        Case{"snapkv+skvq:budget=256:recent=200:evict_at=prompt_end:scoring=query", 1000, 300,
             400}}) {
    SCOPED_TRACE(c.spec);
    CacheConfig cfg = parse_cache_arg(c.spec);
    MemoryPlanRequest req;
    req.model = mc;
    req.cache = cfg;
    req.prompt_tokens = c.prompt;
    req.max_new_tokens = c.gen;
    req.prefill_step = c.step;
    const MemoryPlan plan = plan_memory(req);
    cfg.head_dim = D;
    CountingBackend be;
    SnapkvSkvqCache cache(cfg, be);
    int64_t done = 0, peak = 0;
    auto feed = [&](int64_t n) {
      const uint64_t seed = static_cast<uint64_t>(done);
      const Tensor k = test::random_tensor(DType::kF16, 1, H, n, D, seed);
      const Tensor v = test::random_tensor(DType::kF16, 1, H, n, D, ~seed);
      const Tensor q = test::random_tensor(DType::kF32, 1, mc.n_heads, n, D, seed + 7);
      UpdateOptions o;
      const TensorView qv = q.view();
      o.queries = &qv;
      cache.update_and_fetch(k.view(), v.view(), o);
      done += n;
      const int64_t res = cache.stats().bytes_resident;
      peak = std::max(peak, res);
      ASSERT_LE(res, plan.cache_bytes_resident) << "after " << done << " tokens";
    };
    for (int64_t n : prefill_chunks(c.prompt, c.step)) feed(n);
    cache.end_prompt();
    for (int64_t i = 1; i < c.gen; ++i) feed(1);
    std::printf("[plan] %s: resident peak %lld <= plan %lld\n", c.spec,
                static_cast<long long>(peak), static_cast<long long>(plan.cache_bytes_resident));
  }
}

// The control: the skvq cache already keeps its tail's room on such a backend (7af284a).
TEST(SteadyDecodeStores, SkvqMakesNoStorePerStep) {
  for (const int64_t recent : {0, 200}) {
    SCOPED_TRACE("skvq_recent " + std::to_string(recent));
    CountingBackend be;
    CacheConfig cfg = bench_cfg("skvq", kD);
    cfg.skvq_recent = recent;
    SkvqCache cache(cfg, be), ref(cfg);
    const Life lf;
    const Tally t = run_life(cache, ref, be, lf, kH, kD);
    expect_steady(t, lf.steps);
  }
}

// The streaming cache moves its recent run back next to the sinks whenever it reaches the end of
// its store (every capacity - sinks - window steps): in non-overlapping pieces, so no scratch
// store on a device (an overlapping copy_range would count as churn here).
TEST(SteadyDecodeStores, StreamingMakesNoStorePerStep) {
  CountingBackend be;
  CacheConfig cfg;
  cfg.method = "streaming";
  cfg.head_dim = kD;
  cfg.streaming_n_sink = 4;
  cfg.streaming_window = 512;
  StreamingCache cache(cfg, be), ref(cfg);
  const Life lf;
  const Tally t = run_life(cache, ref, be, lf, kH, kD);
  expect_steady(t, lf.steps);
}

}  // namespace
}  // namespace vq
