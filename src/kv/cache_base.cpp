// Default behaviour shared by every KVCache (docs/design.md §C1): the attention mask built from the
// stored positions, the trim refusal, file save/load, CacheStats::figure and merge_batch.
//
// Mask layout: [B, H_kv, N, T + N] where the key axis is the stored positions of (b, h) (T rows,
// ascending) followed by this call's N new positions offset() .. offset() + N - 1; query i has
// position offset() + i. visible = key_pos <= q_pos and, with a window, q_pos < key_pos + window.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <sstream>

#include "veloxquant/binary_io.h"
#include "veloxquant/cache.h"
#include "veloxquant/error.h"

namespace vq {

namespace {

std::string mask_kind_error(const KVCache& c, const std::string& what) {
  return "[make_mask] " + c.method() + " cache: " + what;
}

}  // namespace

Mask KVCache::make_mask(int64_t n_queries, int64_t window) const {
  VQ_CHECK(n_queries >= 1,
           "[make_mask] expected n_queries >= 1 but got " + std::to_string(n_queries));
  VQ_CHECK(window >= 0,
           "[make_mask] expected window >= 0 (0 = none) but got " + std::to_string(window));
  const int64_t off = offset();
  const int64_t n_stored = stored_rows();
  const int64_t last_q = off + n_queries - 1;
  // A window that cannot hide any key (every key position is >= 0) is the same as no window.
  const bool window_bites = window > 0 && last_q >= window;

  int64_t n_b = batch();
  int64_t n_h = n_kv_heads();
  if (n_b == 0 || n_h == 0) {
    VQ_CHECK(n_stored == 0,
             mask_kind_error(*this, "stores " + std::to_string(n_stored) +
                                        " rows but reports no batch()/n_kv_heads()"));
    n_b = 1;  // nothing stored yet: one mask row set shared by every (b, h)
    n_h = 1;
  }

  // Collect positions once; they decide between causal and explicit.
  std::vector<std::vector<int32_t>> pos(static_cast<size_t>(n_b * n_h));
  bool contiguous = n_stored == off;
  for (int64_t b = 0; b < n_b; ++b)
    for (int64_t h = 0; h < n_h; ++h) {
      auto& p = pos[static_cast<size_t>(b * n_h + h)];
      p = n_stored ? stored_positions(b, h) : std::vector<int32_t>{};
      VQ_CHECK(
          static_cast<int64_t>(p.size()) == n_stored,
          mask_kind_error(*this, "expected " + std::to_string(n_stored) +
                                     " stored positions for (b, h) = (" + std::to_string(b) + ", " +
                                     std::to_string(h) + ") but got " + std::to_string(p.size())));
      for (int64_t i = 0; contiguous && i < n_stored; ++i)
        if (p[static_cast<size_t>(i)] != i) contiguous = false;
    }

  Mask m;
  m.n_queries = n_queries;
  m.n_keys = n_stored + n_queries;
  if (!window_bites) {
    // Every stored position is < offset() <= every query position, so a single query sees all.
    if (n_queries == 1) {
      m.kind = Mask::Kind::kNone;
      return m;
    }
    if (contiguous) {
      m.kind = Mask::Kind::kCausal;
      return m;
    }
  }
  m.kind = Mask::Kind::kExplicit;
  m.batch = n_b;
  m.n_heads = n_h;
  m.data.assign(static_cast<size_t>(n_b * n_h * n_queries * m.n_keys), 0);
  for (int64_t bh = 0; bh < n_b * n_h; ++bh) {
    const auto& p = pos[static_cast<size_t>(bh)];
    for (int64_t i = 0; i < n_queries; ++i) {
      const int64_t q_pos = off + i;
      uint8_t* row = m.data.data() + (bh * n_queries + i) * m.n_keys;
      for (int64_t j = 0; j < m.n_keys; ++j) {
        const int64_t k_pos = j < n_stored ? p[static_cast<size_t>(j)] : off + (j - n_stored);
        const bool vis = k_pos <= q_pos && (window == 0 || q_pos < k_pos + window);
        row[j] = vis ? 1 : 0;
      }
    }
  }
  return m;
}

void KVCache::set_external_scores(const float*, int64_t, int64_t, int64_t) {
  throw Error(
      "[set_external_scores] expected a cache that selects by external scores (snapkv "
      "with snap_scoring=external) but got method " +
      method());
}

int64_t KVCache::trim(int64_t n) {
  throw Error("[trim] " + method() + " cache is not trimmable (asked to drop " + std::to_string(n) +
              " tokens); nothing was changed");
}

void KVCache::save_file(const std::string& path) const {
  std::ostringstream buf;
  save(buf);
  const std::string bytes = buf.str();
  // Write to a temporary name first, so a failed save never clobbers an existing good file.
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    VQ_CHECK(out.is_open(),
             "[save_file] expected a writable file but could not open '" + tmp + "'");
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.close();
    VQ_CHECK(!out.fail(), "[save_file] expected to write " + std::to_string(bytes.size()) +
                              " bytes to '" + tmp + "' but the write failed");
  }
  VQ_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0,
           "[save_file] expected to rename '" + tmp + "' to '" + path + "' but it failed");
}

void KVCache::load_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  VQ_CHECK(in.is_open(), "[load_file] expected a readable file but could not open '" + path + "'");
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  VQ_CHECK(!in.bad(), "[load_file] expected to read '" + path + "' but the read failed");
  {
    // Verify the framing first (checksum included) and refuse trailing bytes, so that this check
    // cannot fire after load() already replaced the cache's state.
    std::istringstream probe(bytes);
    const StateReader frame(probe, "");
    const auto consumed = probe.tellg();
    VQ_CHECK(consumed >= 0 && static_cast<size_t>(consumed) == bytes.size(),
             "[load_file] expected one state frame in '" + path + "' but " +
                 std::to_string(bytes.size() - static_cast<size_t>(std::max<std::streamoff>(
                                                   0, static_cast<std::streamoff>(consumed)))) +
                 " bytes follow it");
  }
  std::istringstream mem(bytes);
  load(mem);
}

double CacheStats::figure(const std::string& name) const {
  for (const auto& [k, v] : figures)
    if (k == name) return v;
  std::string known;
  for (const auto& f : figures) known += (known.empty() ? "" : ", ") + f.first;
  throw Error("[stats] expected a figure named one of {" + known + "} but got '" + name +
              "' (method " + method + ")");
}

std::unique_ptr<KVCache> KVCache::merge_into_batch(const std::vector<const KVCache*>&) const {
  throw Error("[merge_batch] " + method() +
              " cache cannot be merged into a batch (only full caches can); nothing was changed");
}

std::unique_ptr<KVCache> merge_batch(const std::vector<const KVCache*>& caches) {
  VQ_CHECK(!caches.empty(), "[merge_batch] expected at least one cache but got none");
  for (size_t i = 0; i < caches.size(); ++i)
    VQ_CHECK(caches[i] != nullptr,
             "[merge_batch] expected a cache at index " + std::to_string(i) + " but got null");
  for (const KVCache* c : caches)
    if (c->method() != "full")
      throw Error("[merge_batch] expected full caches but got a " + c->method() +
                  " cache: it cannot be merged into a batch (eviction/quantization state is "
                  "per sequence); nothing was changed");
  return caches[0]->merge_into_batch(caches);
}

CacheStats eviction_stats(const std::string& method, int64_t batch, int64_t heads, int64_t head_dim,
                          int64_t stored_rows, int64_t offset, bool seed_names) {
  CacheStats st;
  st.method = method;
  st.tokens_seen = offset;
  st.rows_stored = stored_rows;
  const int64_t bhd2 = batch * heads * head_dim * 2;  // bytes of one row of K (or V), all heads
  const int64_t kept = stored_rows * bhd2;
  const int64_t full = offset * bhd2;
  st.bytes_accounted = 2 * kept;
  st.fp16_bytes = 2 * full;
  const double tokens_kept = static_cast<double>(batch * heads * stored_rows);
  const double tokens_total = static_cast<double>(batch * heads * offset);
  const double kept_d = static_cast<double>(kept);
  const double full_d = static_cast<double>(full);
  if (seed_names) st.figures = {{"evicted_key_bytes", kept_d}, {"evicted_value_bytes", kept_d}};
  const std::vector<std::pair<std::string, double>> common = {
      {"kept_key_bytes", kept_d},
      {"kept_value_bytes", kept_d},
      {"full_key_bytes", full_d},
      {"full_value_bytes", full_d},
      {"eviction_ratio", kept > 0 ? full_d / kept_d : 1.0},
      {"tokens_kept", tokens_kept},
      {"tokens_total", tokens_total},
      {"keep_rate", tokens_total > 0 ? tokens_kept / tokens_total : 1.0},
  };
  st.figures.insert(st.figures.end(), common.begin(), common.end());
  return st;
}

}  // namespace vq
