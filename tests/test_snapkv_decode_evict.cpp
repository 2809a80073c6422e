// Tests of SnapKV's decode-time eviction (snap_decode_budget, veloxquant/snapkv_cache.h): a budget
// at least the length equals no eviction bit for bit; rows, positions and bits stay those the
// caller handed in, with sinks and the newest rows kept and the row count bounded by
// budget + every - 1; the kept rows are those snap_select_head picks with the recorded decode
// queries (an independent route through the per-head pipeline); save/load mid-generation
// continues bit-identically and older (version-1) files still load; bad settings and inputs are
// refused naming what was wrong; a backend of another device runs the option as the CPU does.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "kv/row_store.h"
#include "util/cpu_delegate_backend.h"
#include "util/test_util.h"
#include "veloxquant/builder.h"
#include "veloxquant/cache_config.h"
#include "veloxquant/error.h"
#include "veloxquant/memory_plan.h"
#include "veloxquant/snapkv.h"
#include "veloxquant/snapkv_cache.h"

namespace vq {
namespace {

constexpr int64_t kB = 2, kH = 2, kHq = 4, kD = 16;

CacheConfig dec_cfg(int64_t budget, int64_t every) {
  CacheConfig c;
  c.method = "snapkv";
  c.snap_budget = 48;
  c.snap_obs_window = 6;
  c.snap_n_sink = 3;
  c.snap_scoring = SnapScoring::kQuery;
  c.snap_pool_kernel = 3;
  c.snap_keep_window = true;
  c.snap_evict_at = SnapEvictAt::kPromptEnd;
  c.snap_decode_budget = budget;
  c.snap_decode_every = every;
  return c;
}

std::string saved(const KVCache& c) {
  std::ostringstream out;
  c.save(out);
  return out.str();
}

using test::HeadRows;
using test::view_head;

// A generation: a prompt of `prompt` tokens (two chunks), end_prompt, then `steps` decode calls,
// each with its fp32 queries [B, H_q, 1, D]. Inputs are recorded (fp16 K/V by position) so a test
// can check every stored row against what was handed in.
struct Gen {
  std::vector<Tensor> k, v, q;  // per call
  std::vector<int64_t> sizes;
  Gen(int64_t prompt, int64_t steps, uint64_t seed) {
    for (int64_t s : {prompt / 2, prompt - prompt / 2}) sizes.push_back(s);
    for (int64_t i = 0; i < steps; ++i) sizes.push_back(1);
    for (int64_t s : sizes) {
      k.push_back(test::random_tensor(DType::kF16, kB, kH, s, kD, seed++));
      v.push_back(test::random_tensor(DType::kF16, kB, kH, s, kD, seed++));
      q.push_back(test::random_tensor(DType::kF32, kB, kHq, s, kD, seed++));
    }
  }
  // Call i on cache c (end_prompt after the prompt's chunks).
  CacheView call(KVCache& c, size_t i) const {
    UpdateOptions o;
    const TensorView qv = q[i].view();
    o.queries = &qv;
    CacheView view = c.update_and_fetch(k[i].view(), v[i].view(), o);
    return view;
  }
  // fp16 bits of key / value element (b, h, c) at position p.
  uint16_t bits(bool values, int64_t b, int64_t h, int64_t p, int64_t c) const {
    for (size_t i = 0; i < sizes.size(); ++i) {
      if (p < sizes[i]) {
        const Tensor& t = values ? v[i] : k[i];
        return static_cast<const uint16_t*>(t.view().row(b, h, p))[c];
      }
      p -= sizes[i];
    }
    ADD_FAILURE() << "position beyond the run";
    return 0;
  }
};

TEST(SnapKVDecodeEvict, BudgetAtLeastLengthEqualsNoEviction) {
  const Gen run(40, 50, 7);
  for (int64_t every : {1, 5}) {
    SnapKVCache off(dec_cfg(0, 32)), big(dec_cfg(90, every)), exact(dec_cfg(90 - every + 1, every));
    for (size_t i = 0; i < run.sizes.size(); ++i) {
      const CacheView a = run.call(off, i), b = run.call(big, i), e = run.call(exact, i);
      for (int64_t bb = 0; bb < kB; ++bb)
        for (int64_t h = 0; h < kH; ++h) {
          ASSERT_EQ(view_head(a, bb, h), view_head(b, bb, h)) << "call " << i;
          // budget + every - 1 == the final length: still no eviction.
          ASSERT_EQ(view_head(a, bb, h), view_head(e, bb, h)) << "call " << i;
        }
    }
    EXPECT_EQ(off.stored_rows(), big.stored_rows());
    EXPECT_EQ(off.stored_rows(), exact.stored_rows());
  }
}

TEST(SnapKVDecodeEvict, RowsPositionsAndBoundsStayCorrect) {
  const int64_t budget = 20, every = 4;
  const CacheConfig c = dec_cfg(budget, every);
  const Gen run(40, 70, 21);
  SnapKVCache cache(c);
  int64_t evictions = 0;
  for (size_t i = 0; i < run.sizes.size(); ++i) {
    const int64_t before = cache.stored_rows();
    const CacheView view = run.call(cache, i);
    if (i == 1) cache.end_prompt();
    if (i < 2) continue;
    // The view returned holds every row stored before the call plus the new one (deferred).
    EXPECT_EQ(view.n_rows(), before + 1);
    const int64_t after = cache.stored_rows();
    EXPECT_LE(after, budget + every - 1) << "call " << i;
    if (after < before + 1) {
      ++evictions;
      EXPECT_EQ(after, budget);
    }
    const int64_t off = cache.offset();
    for (int64_t b = 0; b < kB; ++b)
      for (int64_t h = 0; h < kH; ++h) {
        const HeadRows r = view_head(cache.stored_view(), b, h);
        ASSERT_EQ(static_cast<int64_t>(r.pos.size()), after);
        for (size_t j = 0; j < r.pos.size(); ++j) {
          if (j > 0) {
            ASSERT_LT(r.pos[j - 1], r.pos[j]);
          }
          for (int64_t ch = 0; ch < kD; ++ch) {
            ASSERT_EQ(r.k[j * kD + ch], run.bits(false, b, h, r.pos[j], ch));
            ASSERT_EQ(r.v[j * kD + ch], run.bits(true, b, h, r.pos[j], ch));
          }
        }
        for (int32_t p = 0; p < 3; ++p) EXPECT_EQ(r.pos[static_cast<size_t>(p)], p);  // sinks
        // The decode window's rows (keep_window): the newest min(obs_window, decode calls).
        const int64_t w = std::min<int64_t>(c.snap_obs_window, static_cast<int64_t>(i) - 1);
        for (int64_t p = off - w; p < off; ++p)
          EXPECT_TRUE(std::find(r.pos.begin(), r.pos.end(), p) != r.pos.end()) << p;
        EXPECT_EQ(cache.stored_positions(b, h), r.pos);
      }
  }
  // The 40 prompt rows stay (prompt budget 48); the first decode call leaves 41 > 23 rows and
  // evicts to 20; from then on every `every`-th call evicts: 1 + 69 / 4 = 18 evictions.
  EXPECT_EQ(evictions, 1 + 69 / every);
}

TEST(SnapKVDecodeEvict, KeepsWhatThePipelineSelectsWithTheDecodeQueries) {
  // An eviction keeps the rows snap_select_head chooses over the stored rows (fp32 of the fp16
  // bits, true positions) with the last obs_window decode calls' queries at their positions.
  const int64_t budget = 16, every = 3;
  CacheConfig c = dec_cfg(budget, every);
  const Gen run(24, 30, 99);
  SnapKVCache cache(c);
  SnapSelectParams p = SnapSelectParams::from_config(c);
  p.budget = budget;
  int checked = 0;
  for (size_t i = 0; i < run.sizes.size(); ++i) {
    std::vector<HeadRows> pre;
    if (i >= 2)
      for (int64_t b = 0; b < kB; ++b)
        for (int64_t h = 0; h < kH; ++h) pre.push_back(view_head(cache.stored_view(), b, h));
    run.call(cache, i);
    if (i == 1) cache.end_prompt();
    if (i < 2 || cache.stored_rows() != budget || pre[0].pos.size() + 1 <= budget + every - 1)
      continue;
    const int64_t off = cache.offset();
    const int64_t w = std::min<int64_t>(c.snap_obs_window, static_cast<int64_t>(i) - 1);
    for (int64_t b = 0; b < kB; ++b)
      for (int64_t h = 0; h < kH; ++h) {
        HeadRows all = pre[static_cast<size_t>(b * kH + h)];
        all.pos.push_back(static_cast<int32_t>(off - 1));  // this call's row
        const int64_t n = static_cast<int64_t>(all.pos.size());
        std::vector<float> keys(static_cast<size_t>(n * kD));
        for (int64_t j = 0; j < n; ++j)
          for (int64_t ch = 0; ch < kD; ++ch) {
            const uint16_t bits = run.bits(false, b, h, all.pos[j], ch);
            keys[static_cast<size_t>(j * kD + ch)] = load_f32(&bits, DType::kF16, 0);
          }
        const int64_t rep = kHq / kH;
        std::vector<float> q(static_cast<size_t>(rep * w * kD));
        std::vector<int32_t> qpos(static_cast<size_t>(w));
        for (int64_t t = 0; t < w; ++t) {
          const size_t call = i - static_cast<size_t>(w - 1 - t);
          qpos[t] = static_cast<int32_t>(off - w + t);
          for (int64_t r = 0; r < rep; ++r)
            for (int64_t ch = 0; ch < kD; ++ch)
              q[static_cast<size_t>((r * w + t) * kD + ch)] =
                  run.q[call].view().at(b, h * rep + r, 0, ch);
        }
        SnapQueryWindow qw{q.data(), rep, w, qpos.data()};
        std::vector<int64_t> out(static_cast<size_t>(budget));
        SnapScratch scratch;
        ASSERT_EQ(snap_select_head(keys.data(), all.pos.data(), n, kD, &qw, p, out.data(), scratch),
                  budget);
        std::vector<int32_t> want;
        for (int64_t j : out) want.push_back(all.pos[static_cast<size_t>(j)]);
        ASSERT_EQ(cache.stored_positions(b, h), want) << "call " << i;
      }
    ++checked;
  }
  EXPECT_GE(checked, 5);
}

TEST(SnapKVDecodeEvict, SaveLoadMidGenerationContinuesBitIdentically) {
  const CacheConfig c = dec_cfg(18, 5);
  const Gen run(30, 60, 5);
  for (size_t cut : {size_t{2}, size_t{9}, size_t{33}}) {
    SnapKVCache a(c);
    for (size_t i = 0; i < cut; ++i) {
      run.call(a, i);
      if (i == 1) a.end_prompt();
    }
    std::stringstream file(saved(a));
    SnapKVCache b(c);
    b.load(file);
    EXPECT_EQ(saved(b), saved(a));
    for (size_t i = cut; i < run.sizes.size(); ++i) {
      const CacheView va = run.call(a, i), vb = run.call(b, i);
      if (i == 1) a.end_prompt(), b.end_prompt();
      for (int64_t bb = 0; bb < kB; ++bb)
        for (int64_t h = 0; h < kH; ++h)
          ASSERT_EQ(view_head(va, bb, h), view_head(vb, bb, h)) << "cut " << cut << " call " << i;
    }
    EXPECT_EQ(saved(a), saved(b));
  }
}

TEST(SnapKVDecodeEvict, StateVersionsAndSettingsChecked) {
  const Gen run(30, 10, 3);
  SnapKVCache with(dec_cfg(18, 5)), without(dec_cfg(0, 5));
  for (size_t i = 0; i < run.sizes.size(); ++i) run.call(with, i), run.call(without, i);
  const std::string fw = saved(with), fo = saved(without);
  // Frame version (u32 after the 8-byte magic): 2 with decode-time eviction, 1 without.
  EXPECT_EQ(static_cast<uint8_t>(fw[8]), 2);
  EXPECT_EQ(static_cast<uint8_t>(fo[8]), 1);
  auto refused = [](const std::string& file, const CacheConfig& c, const std::string& what) {
    SnapKVCache t(c);
    const std::string before = saved(t);
    std::istringstream in(file);
    try {
      t.load(in);
      ADD_FAILURE() << "loaded";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
    EXPECT_EQ(saved(t), before);  // nothing changed
  };
  refused(fw, dec_cfg(0, 5), "snap_decode_budget");
  refused(fo, dec_cfg(18, 5), "snap_decode_budget");
  refused(fw, dec_cfg(18, 4), "snap_decode_every");
  // Every truncation of the decode-eviction file is refused.
  for (size_t cut = 0; cut < fw.size(); cut += 97) refused(fw.substr(0, cut), dec_cfg(18, 5), "");
}

TEST(SnapKVDecodeEvict, BadSettingsAndInputRefused) {
  auto msg = [](const std::string& spec) {
    try {
      parse_cache_arg(spec);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(msg("snapkv:decode_budget=-1").find("snap_decode_budget: expected >= 0"),
            std::string::npos);
  EXPECT_NE(msg("snapkv:decode_budget=64:decode_every=0").find("snap_decode_every: expected >= 1"),
            std::string::npos);
  EXPECT_NE(
      msg("snapkv:decode_budget=4:n_sink=4").find("snap_n_sink: expected < snap_decode_budget"),
      std::string::npos);
  EXPECT_NE(msg("snapkv+skvq:decode_budget=64")
                .find("snap_decode_budget: expected 0 with method "
                      "snapkv+skvq"),
            std::string::npos);
  EXPECT_EQ(msg("snapkv:decode_budget=64:decode_every=8"), "accepted");
  const CacheConfig ok = parse_cache_arg("snapkv:decode_budget=64:decode_every=8");
  EXPECT_EQ(ok.snap_decode_budget, 64);
  EXPECT_EQ(ok.snap_decode_every, 8);

  // Decode queries of the wrong shape: refused before anything changes.
  SnapKVCache c(dec_cfg(18, 5));
  const Gen run(30, 3, 8);
  for (size_t i = 0; i < run.sizes.size(); ++i) run.call(c, i);
  const std::string before = saved(c);
  const Tensor k = test::random_tensor(DType::kF16, kB, kH, 1, kD, 1);
  const Tensor bad = test::random_tensor(DType::kF32, kB, 3, 1, kD, 2);  // 3 not a multiple of 2
  UpdateOptions o;
  const TensorView bv = bad.view();
  o.queries = &bv;
  try {
    c.update_and_fetch(k.view(), k.view(), o);
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("query heads H_q a multiple"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(saved(c), before);
}

// A backend that reports a device other than the CPU (everything else is the CPU's).
class OtherDeviceBackend final : public test::CpuDelegateBackend {
 public:
  kv::Device device() const override { return kv::Device::kCuda; }
  std::string name() const override { return "test-device"; }
};

TEST(SnapKVDecodeEvict, NonCpuBackendRunsTheOption) {
  // The decode query window is the backend's (RowBackend::make_query_window): a cache over a
  // backend that reports another device takes the option and stores what the CPU cache stores,
  // with the same state bytes, through several decode evictions.
  const OtherDeviceBackend other;
  SnapKVCache cpu(dec_cfg(18, 5)), dev(dec_cfg(18, 5), other);
  const Gen run(30, 40, 31);
  int64_t evictions = 0;
  for (size_t i = 0; i < run.sizes.size(); ++i) {
    const int64_t before = cpu.stored_rows();
    const CacheView a = run.call(cpu, i), b = run.call(dev, i);
    if (i == 1) {
      cpu.end_prompt();
      dev.end_prompt();
    }
    if (i >= 2 && cpu.stored_rows() < before + 1) ++evictions;
    for (int64_t bb = 0; bb < kB; ++bb)
      for (int64_t h = 0; h < kH; ++h) {
        ASSERT_EQ(view_head(a, bb, h), view_head(b, bb, h)) << "call " << i;
        ASSERT_EQ(cpu.stored_positions(bb, h), dev.stored_positions(bb, h)) << "call " << i;
      }
    ASSERT_EQ(saved(cpu), saved(dev)) << "call " << i;
    ASSERT_EQ(cpu.stats().bytes_resident, dev.stats().bytes_resident) << "call " << i;
  }
  EXPECT_GE(evictions, 5);
}

TEST(SnapKVDecodeEvict, EmptiedWindowSavesAndLoads) {
  // A multi-token call or a decode call without queries empties the decode window: the state
  // then holds no window (H_q 0, rows 0) and loads (an emptied window once kept its H_q and the
  // file was refused by its own cache's load).
  const Gen run(30, 6, 41);
  for (const bool multi : {true, false}) {
    SnapKVCache c(dec_cfg(18, 5));
    for (size_t i = 0; i < run.sizes.size(); ++i) run.call(c, i);
    const Tensor k = test::random_tensor(DType::kF16, kB, kH, multi ? 4 : 1, kD, 3);
    c.update_and_fetch(k.view(), k.view());  // no queries
    const std::string bytes = saved(c);
    SnapKVCache loaded(dec_cfg(18, 5));
    std::istringstream in(bytes);
    ASSERT_NO_THROW(loaded.load(in))
        << (multi ? "after a multi-token call" : "after a decode call");
    EXPECT_EQ(saved(loaded), bytes);
  }
}

TEST(SnapKVDecodeEvict, MemoryPlanPeakEqualsTheCachePeak) {
  // The planner replays decode-time eviction: its peak equals the cache's peak accounted bytes
  // (one cache = one layer, B = 1) over a prompt below the budget and a long decode.
  ModelConfig m;
  m.n_layers = 1;
  m.n_heads = kHq;
  m.n_kv_heads = kH;
  m.head_dim = kD;
  m.hidden_size = kHq * kD;
  m.intermediate_size = 8;
  m.vocab_size = 8;
  m.max_position_embeddings = 4096;
  for (int64_t every : {1, 6}) {
    CacheConfig c = dec_cfg(20, every);
    c.head_dim = kD;
    SnapKVCache cache(c);
    int64_t peak = 0, peak_res = 0;
    const int64_t prompt = 12, gen = 60;
    uint64_t seed = 40;
    for (int64_t i = 0; i < gen; ++i) {  // the prompt, then gen - 1 fed-back tokens
      const int64_t s = i == 0 ? prompt : 1;
      const Tensor k = test::random_tensor(DType::kF16, 1, kH, s, kD, seed++);
      const Tensor q = test::random_tensor(DType::kF32, 1, kHq, s, kD, seed++);
      UpdateOptions o;
      const TensorView qv = q.view();
      o.queries = &qv;
      cache.update_and_fetch(k.view(), k.view(), o);
      if (i == 0) cache.end_prompt();
      peak = std::max(peak, cache.stats().bytes_accounted);
      peak_res = std::max(peak_res, cache.stats().bytes_resident);
    }
    MemoryPlanRequest r;
    r.model = m;
    r.cache = c;
    r.prompt_tokens = prompt;
    r.max_new_tokens = gen;
    r.prefill_step = 512;
    const MemoryPlan p = plan_memory(r);
    EXPECT_TRUE(p.cache_bytes_exact);
    EXPECT_EQ(p.cache_bytes_peak, peak);
    EXPECT_GE(p.cache_bytes_resident, peak_res);
    // budget + every - 1 rows of fp16 K and V at most (2 bytes per element, seed's accounting).
    EXPECT_EQ(peak, (20 + every - 1) * kH * kD * 2 * 2);
  }
}

}  // namespace
}  // namespace vq
