// Packed record stores (src/kv/row_store.h) on the CPU backend, exact against the scalar pieces
// they are made of (group_quant.h, packed.h, hadamard.h), and the two SKVQ policies over a
// backend that keeps one growing packed run (the layout the CUDA backend asks for), which must
// write the state bytes and hold the rows of the default CPU layout (one store per block).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "kv/row_store.h"
#include "util/cpu_delegate_backend.h"
#include "util/test_util.h"
#include "veloxquant/attention.h"
#include "veloxquant/error.h"
#include "veloxquant/group_quant.h"
#include "veloxquant/hadamard.h"
#include "veloxquant/packed.h"
#include "veloxquant/skvq_cache.h"
#include "veloxquant/snapkv_skvq_cache.h"

namespace vq {
namespace {

constexpr int64_t kB = 2, kH = 3, kD = 64;

// The CPU backend, except that a policy is asked to keep one packed run.
class OneRunBackend final : public test::CpuDelegateBackend {
 public:
  std::string name() const override { return "cpu (one packed run)"; }
  bool one_packed_run() const override { return true; }
};

struct Fixture {
  const kv::RowBackend& be = kv::cpu_backend();
  kv::PackedShape shape;
  GroupQuantParams qk, qv;
  std::vector<int32_t> pk, pv;
  std::vector<float> signs;
  std::unique_ptr<kv::PackedTransforms> tr;
  std::unique_ptr<kv::RowStore> rows;  // [F, 40, D] fp16 with positions 100..
  Tensor k, v;

  Fixture() {
    qk.bits = 2;
    qk.group_size = 16;
    qk.clip_search = true;
    qv.bits = 4;
    qv.group_size = 16;
    qv.meta = MetaType::kFP8E4M3;
    shape = {kB, kH, kD, make_row_format(kD, qk.bits, qk.group_size, qk.meta),
             make_row_format(kD, qv.bits, qv.group_size, qv.meta)};
    for (int64_t h = 0; h < kH; ++h) {
      std::vector<int32_t> p(kD);
      std::iota(p.begin(), p.end(), 0);
      std::rotate(p.begin(), p.begin() + 5 * (h + 1), p.end());
      pk.insert(pk.end(), p.begin(), p.end());
      std::reverse(p.begin(), p.end());
      pv.insert(pv.end(), p.begin(), p.end());
    }
    signs = hadamard_signs(7, kH * kD);
    tr = be.make_transforms(pk, pv, signs, static_cast<int32_t>(hadamard_block(kD)), false, {});
    k = test::random_tensor(DType::kF16, kB, kH, 40, kD, 11);
    v = test::random_tensor(DType::kF16, kB, kH, 40, kD, 12);
    rows = be.make({DType::kF16, kB, kH, kD}, 40, true);
    rows->write_block(k.view(), v.view(), 0, 40, 0);
    rows->fill_positions(0, 40, 100);
  }

  // The record of row i of frame f of block t, from the scalar pieces: fp32, rotate (keys only
  // here), permute, quantize one row.
  std::vector<uint8_t> reference(const Tensor& t, bool values, int64_t f, int64_t i) const {
    std::vector<float> x(kD), y(kD);
    convert_view_row(t.view(), f / kH, f % kH, i, x.data(), DType::kF32);
    const int64_t h = f % kH;
    if (!values) hadamard_rotate(x.data(), signs.data() + h * kD, kD, hadamard_block(kD));
    const std::vector<int32_t>& p = values ? pv : pk;
    for (int64_t j = 0; j < kD; ++j) y[j] = x[p[h * kD + j]];
    const PackedRowFormat& fmt = shape.format(values);
    std::vector<uint8_t> rec(fmt.row_stride);
    quantize_to_records(y.data(), 1, fmt, values ? qv : qk, rec.data(), fmt.row_stride, false);
    return rec;
  }
};

TEST(PackedStore, QuantizeIsTheScalarQuantizerOfTheTransformedRows) {
  Fixture fx;
  auto ps = fx.be.make_packed(fx.shape, 30, true);
  ps->quantize(*fx.rows, 5, 17, 3, fx.qk, fx.qv, *fx.tr);  // rows 5..21 -> records 3..19
  for (int kv = 0; kv < 2; ++kv) {
    const std::vector<uint8_t> got = ps->download(kv == 1, 3, 17);
    const int64_t st = fx.shape.format(kv == 1).row_stride;
    for (int64_t f = 0; f < kB * kH; ++f)
      for (int64_t i = 0; i < 17; ++i) {
        const std::vector<uint8_t> want = fx.reference(kv ? fx.v : fx.k, kv == 1, f, 5 + i);
        ASSERT_EQ(0, std::memcmp(got.data() + (f * 17 + i) * st, want.data(), st))
            << (kv ? "values" : "keys") << " frame " << f << " row " << i;
      }
  }
  const std::vector<int32_t> pos = ps->download_positions(3, 17);
  for (int64_t f = 0; f < kB * kH; ++f)
    for (int64_t i = 0; i < 17; ++i) EXPECT_EQ(pos[f * 17 + i], 105 + i);
}

TEST(PackedStore, CopyGatherDequantizeAndHostBytesAreExact) {
  Fixture fx;
  const int64_t F = kB * kH;
  auto a = fx.be.make_packed(fx.shape, 40, true);
  a->quantize(*fx.rows, 0, 40, 0, fx.qk, fx.qv, *fx.tr);
  // copy_range into a larger store at an offset, then a gather of every frame's own rows.
  auto b = fx.be.make_packed(fx.shape, 50, true);
  b->copy_range(*a, 10, 7, 25);
  std::vector<int32_t> idx(F * 4);
  for (int64_t f = 0; f < F; ++f)
    for (int64_t i = 0; i < 4; ++i) idx[f * 4 + i] = static_cast<int32_t>(7 + f + 3 * i);
  auto g = fx.be.make_packed(fx.shape, 4, true);
  g->gather(*b, *fx.be.upload_index(4, idx));
  for (int kv = 0; kv < 2; ++kv) {
    const int64_t st = fx.shape.format(kv == 1).row_stride;
    const std::vector<uint8_t> all = a->download(kv == 1, 0, 40), got = g->download(kv == 1, 0, 4);
    for (int64_t f = 0; f < F; ++f)
      for (int64_t i = 0; i < 4; ++i)
        EXPECT_EQ(0, std::memcmp(got.data() + (f * 4 + i) * st,
                                 all.data() + (f * 40 + 10 + f + 3 * i) * st, st));
  }
  const std::vector<int32_t> gp = g->download_positions(0, 4);
  for (int64_t f = 0; f < F; ++f)
    for (int64_t i = 0; i < 4; ++i) EXPECT_EQ(gp[f * 4 + i], 110 + f + 3 * i);
  // Keys dequantized into an fp32 row store: dequantize_row of the packed view, bit for bit.
  auto frame = fx.be.make({DType::kF32, kB, kH, kD}, 45, true);
  a->dequantize_keys(2, 30, *frame, 15, *fx.tr);
  const PackedSegment seg = a->segment(2, 30, DType::kF16, *fx.tr);
  std::vector<float> want(kD);
  const Tensor got = frame->download(false, 15, 30);
  for (int64_t f = 0; f < F; ++f)
    for (int64_t i = 0; i < 30; ++i) {
      dequantize_row(seg.keys, f / kH, f % kH, i, want.data());
      EXPECT_EQ(0, std::memcmp(static_cast<const float*>(got.data()) + (f * 30 + i) * kD,
                               want.data(), kD * 4));
    }
  EXPECT_EQ(frame->download_positions(15, 30), a->download_positions(2, 30));
  // Host bytes round-trip.
  auto c = fx.be.make_packed(fx.shape, 40, true);
  const std::vector<uint8_t> hk = a->download(false, 0, 40), hv = a->download(true, 0, 40);
  const std::vector<int32_t> hp = a->download_positions(0, 40);
  c->upload(hk.data(), hv.data(), hp.data(), 0, 40);
  EXPECT_EQ(c->download(false, 0, 40), hk);
  EXPECT_EQ(c->download(true, 0, 40), hv);
  EXPECT_EQ(c->download_positions(0, 40), hp);
}

// ---- the SKVQ policies over one packed run ----------------------------------------------------

std::string saved(const KVCache& c) {
  std::ostringstream out;
  c.save(out);
  return out.str();
}

// Every row each (b, h) attends to: positions and the dense (dequantized) keys and values.
void expect_same_rows(const CacheView& a, const CacheView& b, const std::string& what) {
  const DenseView da = dequantize_view(a, DType::kF32), db = dequantize_view(b, DType::kF32);
  ASSERT_EQ(a.n_rows(), b.n_rows()) << what;
  auto rows_of = [](const CacheView& v, int64_t bb, int64_t h) {
    std::vector<float> out;
    for (const ViewSegment& s : v.segments)
      for (int64_t i = 0; i < s.n_rows; ++i) {
        out.push_back(static_cast<float>(s.position(bb, h, i, v.n_kv_heads)));
        for (const TensorView* t : {&s.keys, &s.values})
          for (int64_t j = 0; j < v.head_dim; ++j) out.push_back(t->at(bb, h, i, j));
      }
    return out;
  };
  for (int64_t bb = 0; bb < a.batch; ++bb)
    for (int64_t h = 0; h < a.n_kv_heads; ++h)
      ASSERT_EQ(rows_of(da.view, bb, h), rows_of(db.view, bb, h))
          << what << " (" << bb << ", " << h << ")";
}

TEST(SkvqPolicies, OneRunLayoutWritesTheSameStateAndRows) {
  const OneRunBackend one_run;
  for (const char* method : {"skvq", "snapkv+skvq"}) {
    CacheConfig cfg;
    cfg.method = method;
    cfg.head_dim = kD;
    cfg.skvq_window = 16;
    cfg.skvq_n_sink = 4;
    cfg.skvq_group_size = 16;
    cfg.skvq_recent = 3;
    cfg.snap_budget = 40;
    cfg.snap_n_sink = 4;
    cfg.snap_obs_window = 8;
    auto make = [&](const kv::RowBackend& be) -> std::unique_ptr<KVCache> {
      if (std::string(method) == "skvq") return std::make_unique<SkvqCache>(cfg, be);
      return std::make_unique<SnapkvSkvqCache>(cfg, be);
    };
    auto a = make(kv::cpu_backend()), b = make(one_run);
    const Tensor k = test::random_tensor(DType::kF16, kB, kH, 140, kD, 31);
    const Tensor v = test::random_tensor(DType::kF16, kB, kH, 140, kD, 32);
    // A prompt, single tokens across several flushes, a multi-token call (an eviction with
    // packed rows for snapkv+skvq), more single tokens; then b reloads a's state and both go on.
    const std::vector<int64_t> cuts = {0,  37, 38, 39, 40, 41, 60,  61,  62,  63,  64,  65,  66,
                                       67, 68, 69, 70, 71, 72, 73,  74,  75,  90,  91,  92,  93,
                                       94, 95, 96, 97, 98, 99, 100, 101, 102, 103, 104, 105, 140};
    for (size_t c = 0; c + 1 < cuts.size(); ++c) {
      const std::string what = std::string(method) + " after row " + std::to_string(cuts[c + 1]);
      const TensorView kb = k.view().slice_tokens(cuts[c], cuts[c + 1]);
      const TensorView vb = v.view().slice_tokens(cuts[c], cuts[c + 1]);
      const CacheView va = a->update_and_fetch(kb, vb), vb2 = b->update_and_fetch(kb, vb);
      expect_same_rows(va, vb2, what + " (fetched view)");
      ASSERT_EQ(saved(*a), saved(*b)) << what;
      if (cuts[c + 1] == 90) {
        std::istringstream in(saved(*a));
        b = make(one_run);
        b->load(in);
        ASSERT_EQ(saved(*a), saved(*b)) << what << " reloaded";
      }
    }
    EXPECT_GT(a->stats().figure("packed_rows"), 0) << method;
  }
}

// Channel-axis keys on the one-run layout (the CUDA backend's): every block (a chunk, or its runs
// of skvq_key_rows rows, Settings::chunk_blocks) is quantized by itself inside the one run, and
// the view's packed segment lists the blocks' first records (PackedTensor::runs), which
// dequantize_row reads its metadata from. Rows, positions and state bytes equal the per-block
// layout's (the CPU's, one segment per block) after every call; the runs are its segments.
TEST(SkvqPolicies, OneRunLayoutOfChannelAxisKeysListsItsBlocks) {
  const OneRunBackend one_run;
  for (const char* method : {"skvq", "snapkv+skvq"})
    for (int64_t key_rows : {0, 5}) {
      CacheConfig cfg;
      cfg.method = method;
      cfg.head_dim = kD;
      cfg.skvq_window = 16;
      cfg.skvq_n_sink = 4;
      cfg.skvq_group_size = 16;
      cfg.skvq_recent = 3;
      cfg.skvq_key_axis = QuantAxis::kChannel;
      cfg.skvq_key_rows = key_rows;
      cfg.snap_budget = 40;
      cfg.snap_n_sink = 4;
      cfg.snap_obs_window = 8;
      cfg.snap_evict_at = SnapEvictAt::kPromptEnd;
      const bool snap = std::string(method) == "snapkv+skvq";
      auto make = [&](const kv::RowBackend& be) -> std::unique_ptr<KVCache> {
        if (!snap) return std::make_unique<SkvqCache>(cfg, be);
        return std::make_unique<SnapkvSkvqCache>(cfg, be);
      };
      auto a = make(kv::cpu_backend()), b = make(one_run);
      const Tensor k = test::random_tensor(DType::kF16, kB, kH, 130, kD, 41);
      const Tensor v = test::random_tensor(DType::kF16, kB, kH, 130, kD, 42);
      // a prompt of two calls (snapkv+skvq: its eviction at end_prompt), then single tokens
      std::vector<int64_t> cuts = {0, 30, 57};
      for (int64_t t = 58; t <= 130; ++t) cuts.push_back(t);
      for (size_t c = 0; c + 1 < cuts.size(); ++c) {
        const std::string what = std::string(method) + " key_rows " + std::to_string(key_rows) +
                                 " after row " + std::to_string(cuts[c + 1]);
        if (cuts[c] == 57) {
          a->end_prompt();
          b->end_prompt();
        }
        const TensorView kb = k.view().slice_tokens(cuts[c], cuts[c + 1]);
        const TensorView vb = v.view().slice_tokens(cuts[c], cuts[c + 1]);
        const CacheView va = a->update_and_fetch(kb, vb), vo = b->update_and_fetch(kb, vb);
        expect_same_rows(va, vo, what);
        ASSERT_EQ(saved(*a), saved(*b)) << what;
        // the one run's blocks are the per-block layout's packed segments, in order
        std::vector<int32_t> want(1, 0);
        for (const ViewSegment& sg : va.segments)
          if (sg.packed) want.push_back(static_cast<int32_t>(want.back() + sg.n_rows));
        int n_packed = 0;
        for (const ViewSegment& sg : vo.segments) {
          if (!sg.packed) continue;
          ++n_packed;
          const PackedTensor& t = sg.packed->keys;
          ASSERT_NE(t.runs, nullptr) << what;
          ASSERT_EQ(std::vector<int32_t>(t.runs, t.runs + t.n_runs + 1), want) << what;
        }
        ASSERT_EQ(n_packed, want.size() > 1 ? 1 : 0) << what;
      }
      EXPECT_GT(a->stats().figure("packed_rows"), 0) << method;
    }
}

// channel_run_start: the first record of the run holding record i (runs [n_runs + 1]).
TEST(PackedFormat, ChannelRunStartFindsEachRecordsRun) {
  const std::vector<int32_t> runs = {0, 12, 17, 22, 28};
  for (int64_t i = 0; i < 28; ++i) {
    int32_t want = 0;
    for (size_t r = 0; r + 1 < runs.size(); ++r)
      if (runs[r] <= i) want = runs[r];
    EXPECT_EQ(channel_run_start(runs.data(), 4, i), want) << i;
  }
  EXPECT_EQ(channel_run_start(nullptr, 0, 9), 0);
  const std::vector<int32_t> one = {0, 5};
  EXPECT_EQ(channel_run_start(one.data(), 1, 4), 0);
}

// SkvqCache::reserve: on the one-run layout the packed run is made once, at the first flush, with
// every record of the reserved length (skvq_packed_rows rounded up to 64) and never copied; on
// both layouts the stored rows, positions, state bytes and attention outputs equal an unreserved
// cache's at every call (K2V2, K4V4, and channel-axis keys on the per-block layout, whose views
// give one packed segment per chunk).
TEST(SkvqPolicies, ReserveChangesNoRowPositionOrOutput) {
  const OneRunBackend one_run;
  struct Case {
    const char* name;
    double kbits, vbits;
    bool channel;
  };
  constexpr int64_t kT = 300, kHq = 2 * kH;
  const std::vector<int64_t> cuts = {0, 70, 71, 72, 140, 141, 200, 201, 202, 203, 264, kT};
  for (const Case& cs : {Case{"K2V2", 2, 2, false}, Case{"K4V4", 4, 4, false},
                         Case{"K2V2 channel keys", 2, 2, true}})
    for (const kv::RowBackend* be :
         {&kv::cpu_backend(), static_cast<const kv::RowBackend*>(&one_run)}) {
      if (cs.channel && be == &one_run) continue;
      CacheConfig cfg;
      cfg.method = "skvq";
      cfg.head_dim = kD;
      cfg.skvq_window = 16;
      cfg.skvq_n_sink = 4;
      cfg.skvq_group_size = 16;
      cfg.skvq_recent = 3;
      cfg.skvq_bits_key = cs.kbits;
      cfg.skvq_bits_value = cs.vbits;
      if (cs.channel) cfg.skvq_key_axis = QuantAxis::kChannel;
      SkvqCache a(cfg, *be), b(cfg, *be);
      b.reserve(kT);
      EXPECT_EQ(b.reserved(), kT);
      EXPECT_EQ(b.packed_capacity(), 0);  // nothing allocated by reserve()
      const int64_t want_cap = round_up(std::max<int64_t>(skvq_packed_rows(cfg, kT), 64), 64);
      const Tensor k = test::random_tensor(DType::kF16, kB, kH, kT, kD, 41);
      const Tensor v = test::random_tensor(DType::kF16, kB, kH, kT, kD, 42);
      const Tensor q = test::random_tensor(DType::kF32, kB, kHq, 1, kD, 43);
      for (size_t c = 0; c + 1 < cuts.size(); ++c) {
        const std::string what = std::string(cs.name) + " on " + be->name() + " after row " +
                                 std::to_string(cuts[c + 1]);
        const TensorView kb = k.view().slice_tokens(cuts[c], cuts[c + 1]);
        const TensorView vb = v.view().slice_tokens(cuts[c], cuts[c + 1]);
        const CacheView va = a.update_and_fetch(kb, vb), vr = b.update_and_fetch(kb, vb);
        expect_same_rows(va, vr, what);
        ASSERT_EQ(saved(a), saved(b)) << what;
        for (int64_t h = 0; h < kH; ++h)
          EXPECT_EQ(a.stored_positions(1, h), b.stored_positions(1, h));
        AttentionParams ap;
        ap.q_pos0 = cuts[c + 1] - 1;
        std::vector<float> oa(static_cast<size_t>(kB * kHq * kD)), ob(oa.size());
        attention(q.view(), va, ap, oa.data());
        attention(q.view(), vr, ap, ob.data());
        ASSERT_EQ(0, std::memcmp(oa.data(), ob.data(), oa.size() * sizeof(float))) << what;
        EXPECT_EQ(a.stats().bytes_accounted, b.stats().bytes_accounted) << what;
        if (be == &one_run && b.quantized_tokens() > 0) {
          EXPECT_EQ(b.packed_capacity(), want_cap) << what << ": one run, never grown";
        }
      }
    }
}

// A reservation outlives load() (the loaded run is made with it) and is refused out of range.
TEST(SkvqPolicies, ReserveSurvivesLoadAndRefusesBadRows) {
  const OneRunBackend one_run;
  CacheConfig cfg;
  cfg.method = "skvq";
  cfg.head_dim = kD;
  cfg.skvq_window = 16;
  cfg.skvq_n_sink = 4;
  cfg.skvq_group_size = 16;
  SkvqCache a(cfg, one_run), b(cfg, one_run);
  const Tensor k = test::random_tensor(DType::kF16, kB, kH, 100, kD, 51);
  a.update_and_fetch(k.view(), k.view());
  b.reserve(1000);
  std::istringstream in(saved(a));
  b.load(in);
  EXPECT_EQ(saved(a), saved(b));
  EXPECT_EQ(b.packed_capacity(), round_up(skvq_packed_rows(cfg, 1000), 64));
  EXPECT_THROW(b.reserve(-1), Error);
  EXPECT_THROW(b.reserve(int64_t{1} << 31), Error);
  EXPECT_EQ(b.reserved(), 1000);  // unchanged by the refusals
}

// Protected rows (skvq_protect) on the one-run layout (the CUDA backend's): the one packed run's
// segment carries positions for its whole capacity (INT32_MAX for a protected row), rebuilt when
// the run grows; rows, positions and state bytes equal the per-block layout's after
// every call, also after a reload. Query scoring with GQA queries and key-proxy scoring, values
// protected or their codes' values, token- and channel-axis keys.
TEST(SkvqPolicies, OneRunLayoutOfProtectedRows) {
  const OneRunBackend one_run;
  constexpr int64_t kT = 200, kHq = 2 * kH;
  const std::vector<int64_t> cuts = {0, 37, 70, 71, 72, 73, 120, 121, 150, 151, 152, 170, kT};
  for (const SnapScoring scoring : {SnapScoring::kQuery, SnapScoring::kKeyProxy})
    for (const bool values : {true, false})
      for (const bool channel : {false, true}) {
        CacheConfig cfg;
        cfg.method = "skvq";
        cfg.head_dim = kD;
        cfg.skvq_window = 16;
        cfg.skvq_n_sink = 4;
        cfg.skvq_group_size = 16;
        cfg.skvq_recent = 3;
        cfg.skvq_protect = 0.1;
        cfg.skvq_protect_scoring = scoring;
        cfg.skvq_protect_obs_window = 8;
        cfg.skvq_protect_pool_kernel = 3;
        cfg.skvq_protect_values = values;
        if (channel) {
          cfg.skvq_key_axis = QuantAxis::kChannel;
          cfg.skvq_key_rows = 8;
        }
        const std::string name = std::string(scoring == SnapScoring::kQuery ? "query" : "proxy") +
                                 (values ? " values" : " codes' values") +
                                 (channel ? " channel keys" : "");
        auto a = std::make_unique<SkvqCache>(cfg), b = std::make_unique<SkvqCache>(cfg, one_run);
        const Tensor k = test::random_tensor(DType::kF16, kB, kH, kT, kD, 51);
        const Tensor v = test::random_tensor(DType::kF16, kB, kH, kT, kD, 52);
        const Tensor q = test::random_tensor(DType::kF32, kB, kHq, kT, kD, 53);
        for (size_t c = 0; c + 1 < cuts.size(); ++c) {
          const std::string what = name + " after row " + std::to_string(cuts[c + 1]);
          const TensorView kb = k.view().slice_tokens(cuts[c], cuts[c + 1]);
          const TensorView vb = v.view().slice_tokens(cuts[c], cuts[c + 1]);
          const TensorView qb = q.view().slice_tokens(cuts[c], cuts[c + 1]);
          UpdateOptions o;
          o.queries = &qb;
          const CacheView va = a->update_and_fetch(kb, vb, o), vr = b->update_and_fetch(kb, vb, o);
          expect_same_rows(va, vr, what);
          ASSERT_EQ(a->protection_pending(), b->protection_pending()) << what;
          if (!a->protection_pending()) {
            ASSERT_EQ(saved(*a), saved(*b)) << what;
          }
          EXPECT_EQ(a->protected_rows(), b->protected_rows()) << what;
          for (int64_t h = 0; h < kH; ++h)
            EXPECT_EQ(a->protected_positions(1, h), b->protected_positions(1, h)) << what;
          EXPECT_EQ(a->stats().bytes_accounted, b->stats().bytes_accounted) << what;
          if (cuts[c + 1] == 120) {  // both reload the other's state
            std::istringstream ia(saved(*b)), ib(saved(*a));
            a = std::make_unique<SkvqCache>(cfg);
            b = std::make_unique<SkvqCache>(cfg, one_run);
            a->load(ia);
            b->load(ib);
            ASSERT_EQ(saved(*a), saved(*b)) << what << " reloaded";
          }
        }
        // 0.1 of the 70-row prompt: 7 protected rows per (b, h), and the run grew after them.
        EXPECT_EQ(b->protected_rows(), 7) << name;
        EXPECT_GT(b->packed_capacity(), 64) << name;
      }
}

}  // namespace
}  // namespace vq
