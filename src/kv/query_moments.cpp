// The query-moment file (veloxquant/query_moments.h): checks, writer and reader.
#include "veloxquant/query_moments.h"

#include <xxhash.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>

#include "veloxquant/error.h"

namespace vq {

namespace {

constexpr char kMagic[8] = {'V', 'Q', 'Q', 'M', 'O', 'M', 'N', 'T'};
constexpr uint32_t kVersion = 1;
constexpr int64_t kHeaderBytes = 8 + 4 + 4 * 8;
constexpr int64_t kMaxDim = 4096, kMaxCount = 1 << 20;

// Throws "[query_moments_file] <where>expected ... but got ..." for the first problem of set.
void check_set(const QueryMomentSet& set, const std::string& where) {
  const std::string pre = "[query_moments_file] " + where;
  VQ_CHECK(set.head_dim >= 1 && set.head_dim <= kMaxDim && set.n_kv_heads >= 1 &&
               set.n_kv_heads <= kMaxCount && !set.layers.empty() &&
               static_cast<int64_t>(set.layers.size()) <= kMaxCount && set.n_tokens >= 1,
           pre +
               "expected 1..1048576 layers and KV heads, head_dim 1..4096 and >= 1 calibration "
               "token but got " +
               std::to_string(set.layers.size()) + " layers, " + std::to_string(set.n_kv_heads) +
               " heads, head_dim " + std::to_string(set.head_dim) + ", " +
               std::to_string(set.n_tokens) + " tokens");
  const int64_t d = set.head_dim, per = set.n_kv_heads * d * d;
  for (size_t l = 0; l < set.layers.size(); ++l) {
    const std::vector<double>& m = set.layers[l];
    VQ_CHECK(static_cast<int64_t>(m.size()) == per, pre + "expected " + std::to_string(per) +
                                                        " values for layer " + std::to_string(l) +
                                                        " but got " + std::to_string(m.size()));
    for (int64_t h = 0; h < set.n_kv_heads; ++h)
      for (int64_t i = 0; i < d; ++i)
        for (int64_t j = 0; j < d; ++j) {
          const double v = m[static_cast<size_t>((h * d + i) * d + j)];
          const std::string at = "layer " + std::to_string(l) + " head " + std::to_string(h) +
                                 " entry (" + std::to_string(i) + ", " + std::to_string(j) + ")";
          VQ_CHECK(std::isfinite(v), pre + "expected finite moments but " + at + " is not");
          VQ_CHECK(i != j || v > 0.0,
                   pre + "expected a positive diagonal but " + at + " is " + std::to_string(v));
          VQ_CHECK(v == m[static_cast<size_t>((h * d + j) * d + i)],
                   pre + "expected symmetric moments but " + at + " differs from its transpose");
        }
  }
}

template <typename T>
void put(std::string& out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out.append(b, sizeof(T));
}

template <typename T>
T get(const std::string& in, size_t& at) {
  T v;
  std::memcpy(&v, in.data() + at, sizeof(T));
  at += sizeof(T);
  return v;
}

}  // namespace

void save_query_moment_file(const std::string& path, const QueryMomentSet& set) {
  check_set(set, "");
  std::string out(kMagic, sizeof(kMagic));
  put<uint32_t>(out, kVersion);
  put<int64_t>(out, static_cast<int64_t>(set.layers.size()));
  put<int64_t>(out, set.n_kv_heads);
  put<int64_t>(out, set.head_dim);
  put<int64_t>(out, set.n_tokens);
  for (const auto& m : set.layers)
    for (const double v : m) put<double>(out, v);
  put<uint64_t>(out, XXH64(out.data(), out.size(), 0));
  std::ofstream f(path, std::ios::binary);
  VQ_CHECK(f.good(),
           "[query_moments_file] expected a writable file but could not open '" + path + "'");
  f.write(out.data(), static_cast<std::streamsize>(out.size()));
  VQ_CHECK(f.good(), "[query_moments_file] expected to write '" + path + "' but the write failed");
}

QueryMomentSet load_query_moment_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  VQ_CHECK(f.good(),
           "[query_moments_file] expected a readable file but could not open '" + path + "'");
  const std::string in((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const std::string pre = "[query_moments_file] '" + path + "': ";
  VQ_CHECK(static_cast<int64_t>(in.size()) >= kHeaderBytes + 8 &&
               std::memcmp(in.data(), kMagic, sizeof(kMagic)) == 0,
           pre +
               "expected a query-moment file (magic VQQMOMNT, written by veloxquant calibrate "
               "--query-moments) but got " +
               std::to_string(in.size()) + " bytes without that header");
  size_t at = sizeof(kMagic);
  const auto version = get<uint32_t>(in, at);
  VQ_CHECK(version == kVersion,
           pre + "expected format version 1 but got " + std::to_string(version));
  QueryMomentSet set;
  const auto n_layers = get<int64_t>(in, at);
  set.n_kv_heads = get<int64_t>(in, at);
  set.head_dim = get<int64_t>(in, at);
  set.n_tokens = get<int64_t>(in, at);
  VQ_CHECK(n_layers >= 1 && n_layers <= kMaxCount && set.n_kv_heads >= 1 &&
               set.n_kv_heads <= kMaxCount && set.head_dim >= 1 && set.head_dim <= kMaxDim,
           pre + "expected 1..1048576 layers and KV heads and head_dim 1..4096 but got " +
               std::to_string(n_layers) + ", " + std::to_string(set.n_kv_heads) + ", " +
               std::to_string(set.head_dim));
  const int64_t per = set.n_kv_heads * set.head_dim * set.head_dim;  // < 2^44
  VQ_CHECK(per <= ((int64_t{1} << 60) / 8) / n_layers,
           pre + "expected a file below 2^60 bytes but its header's sizes ask for more");
  const int64_t want = kHeaderBytes + n_layers * per * 8 + 8;
  VQ_CHECK(static_cast<int64_t>(in.size()) == want,
           pre + "expected " + std::to_string(want) + " bytes for its header's sizes but got " +
               std::to_string(in.size()) + " (truncated or extended)");
  uint64_t sum;
  std::memcpy(&sum, in.data() + in.size() - 8, 8);
  VQ_CHECK(sum == XXH64(in.data(), in.size() - 8, 0),
           pre + "expected its checksum to match but it does not (the file is corrupt)");
  set.layers.resize(static_cast<size_t>(n_layers));
  for (auto& m : set.layers) {
    m.resize(static_cast<size_t>(per));
    std::memcpy(m.data(), in.data() + at, static_cast<size_t>(per) * 8);
    at += static_cast<size_t>(per) * 8;
  }
  check_set(set, "'" + path + "': ");
  return set;
}

}  // namespace vq
