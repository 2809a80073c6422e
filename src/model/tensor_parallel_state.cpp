// Sharded cache state (veloxquant/tensor_parallel.h): one frame of method "tensor_parallel"
// holding the plan (N, layers, query and KV heads, each rank's KV head range) and every rank's
// layer caches as their own frames (KVCache::save), in rank-major order.
//
// Loading is all-or-nothing: the plan is checked against the caller's before any cache is
// touched, and each cache's current state is kept in memory so that a cache frame refused
// halfway (another method, other settings) puts back the ones already loaded.
#include <sstream>

#include "veloxquant/binary_io.h"
#include "veloxquant/error.h"
#include "veloxquant/tensor_parallel.h"

namespace vq {

namespace {

constexpr const char* kMethod = "tensor_parallel";

void check_shape(const ShardPlan& plan, const RankCaches& caches, const char* op) {
  VQ_CHECK(static_cast<int64_t>(caches.size()) == plan.n_ranks,
           std::string("[") + op + "] expected caches of " + std::to_string(plan.n_ranks) +
               " ranks but got " + std::to_string(caches.size()));
  for (size_t r = 0; r < caches.size(); ++r) {
    VQ_CHECK(static_cast<int64_t>(caches[r].size()) == plan.n_layers,
             std::string("[") + op + "] expected " + std::to_string(plan.n_layers) +
                 " layer caches on rank " + std::to_string(r) + " but got " +
                 std::to_string(caches[r].size()));
    for (const auto& c : caches[r])
      VQ_CHECK(c != nullptr, std::string("[") + op + "] expected a cache per layer on rank " +
                                 std::to_string(r) + " but got nullptr");
  }
}

// "N = 2, 6 layers, 6 query heads, 2 KV heads, KV heads per rank 0+1, 1+1".
std::string describe(int64_t n, int64_t layers, int64_t hq, int64_t hkv,
                     const std::vector<ShardRange>& kv) {
  std::string s = "N = " + std::to_string(n) + ", " + std::to_string(layers) + " layers, " +
                  std::to_string(hq) + " query heads, " + std::to_string(hkv) +
                  " KV heads, KV heads per rank ";
  for (size_t r = 0; r < kv.size(); ++r)
    s += (r ? ", " : "") + std::to_string(kv[r].first) + "+" + std::to_string(kv[r].count);
  return s;
}

std::vector<ShardRange> kv_ranges(const ShardPlan& p) {
  std::vector<ShardRange> out;
  for (const RankShard& s : p.ranks) out.push_back(s.kv_heads);
  return out;
}

}  // namespace

void save_sharded_state(std::ostream& out, const ShardPlan& plan, const RankCaches& caches) {
  check_shape(plan, caches, "save_sharded_state");
  StateWriter w;
  w.i64(plan.n_ranks);
  w.i64(plan.n_layers);
  w.i64(plan.n_heads);
  w.i64(plan.n_kv_heads);
  for (const RankShard& s : plan.ranks) {
    w.i64(s.kv_heads.first);
    w.i64(s.kv_heads.count);
  }
  for (const auto& rank : caches)
    for (const auto& c : rank) {
      std::ostringstream os;
      c->save(os);
      w.str(os.str());
    }
  w.write(out, kMethod);
}

void load_sharded_state(std::istream& in, const ShardPlan& plan, RankCaches& caches) {
  const char* op = "load_sharded_state";
  check_shape(plan, caches, op);
  StateReader r(in, kMethod);
  const int64_t n = r.i64_in("N", 1, 1 << 20);
  const int64_t layers = r.i64_in("layers", 0, 1 << 20);
  const int64_t hq = r.i64_in("query heads", 1, 1 << 20);
  const int64_t hkv = r.i64_in("KV heads", 1, 1 << 20);
  std::vector<ShardRange> kv(static_cast<size_t>(n));
  for (auto& s : kv) {
    s.first = r.i64_in("KV head first", 0, hkv - 1);
    s.count = r.i64_in("KV head count", 1, hkv);
  }
  const std::string saved = describe(n, layers, hq, hkv, kv);
  const std::string mine =
      describe(plan.n_ranks, plan.n_layers, plan.n_heads, plan.n_kv_heads, kv_ranges(plan));
  VQ_CHECK(saved == mine, std::string("[") + op + "] expected a state sharded as " + mine +
                              " but the file holds " + saved + "; nothing was changed");
  std::vector<std::string> frames;
  for (int64_t i = 0; i < n * layers; ++i) frames.push_back(r.str());
  r.expect_end();
  // Every cache's current state, put back if any frame is refused.
  std::vector<std::string> backup;
  for (const auto& rank : caches)
    for (const auto& c : rank) {
      std::ostringstream os;
      c->save(os);
      backup.push_back(os.str());
    }
  size_t done = 0;
  try {
    for (auto& rank : caches)
      for (auto& c : rank) {
        std::istringstream is(frames[done]);
        c->load(is);
        ++done;
      }
  } catch (const Error& e) {
    size_t i = 0;
    for (auto& rank : caches)
      for (auto& c : rank) {
        if (i >= done) break;
        std::istringstream is(backup[i++]);
        c->load(is);
      }
    const int64_t per = plan.n_layers ? plan.n_layers : 1;
    throw Error(std::string("[") + op + "] rank " + std::to_string(done / per) + ", layer " +
                std::to_string(done % per) + ": " + e.what() + "; nothing was changed");
  }
}

}  // namespace vq
