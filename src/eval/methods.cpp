// Method lists for the evaluation engine ("full,snapkv:budget=256,...") and the memory figures of
// a set of per-layer caches. The only extension over config_from_spec: "streaming:budget=N"
// becomes streaming_window = N - streaming_n_sink, so a streaming budget counts sinks like
// SnapKV's does.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "eval/eval_internal.h"
#include "veloxquant/error.h"
#include "veloxquant/eval.h"

namespace vq {

namespace {

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    const size_t p = s.find(sep, start);
    out.push_back(s.substr(start, p == std::string::npos ? std::string::npos : p - start));
    if (p == std::string::npos) break;
    start = p + 1;
  }
  return out;
}

std::string trim(const std::string& s) {
  const size_t a = s.find_first_not_of(" \t\n");
  if (a == std::string::npos) return "";
  const size_t b = s.find_last_not_of(" \t\n");
  return s.substr(a, b - a + 1);
}

EvalMethod parse_one(const std::string& spec) {
  std::vector<std::string> parts = split(spec, ':');
  const std::string method = parts[0];
  int64_t streaming_budget = -1;
  double keep = 0;
  std::string rest = method;
  for (size_t i = 1; i < parts.size(); ++i) {
    const std::string& a = parts[i];
    if (a.rfind("keep=", 0) == 0) {
      VQ_CHECK(method == "snapkv" || method == "snapkv+skvq" || method == "streaming",
               "[eval] method '" + spec +
                   "': keep=<fraction> applies to snapkv, snapkv+skvq and streaming only");
      const std::string v = a.substr(5);
      char* end = nullptr;
      keep = std::strtod(v.c_str(), &end);
      VQ_CHECK(
          !v.empty() && end && *end == '\0' && keep > 0 && keep <= 1,
          "[eval] method '" + spec + "': expected keep=<fraction in (0, 1]> but got '" + a + "'");
      continue;
    }
    if (method == "streaming" && (a.rfind("budget=", 0) == 0)) {
      const std::string v = a.substr(7);
      char* end = nullptr;
      const long long n = std::strtoll(v.c_str(), &end, 10);
      VQ_CHECK(!v.empty() && end && *end == '\0' && n >= 1,
               "[eval] method '" + spec + "': expected budget=<integer >= 1> but got '" + a + "'");
      streaming_budget = n;
      continue;
    }
    rest += ":" + a;
  }
  EvalMethod m;
  m.label = spec;
  m.family = method;
  m.cfg = config_from_spec(rest);
  if (streaming_budget >= 0) {
    VQ_CHECK(streaming_budget > m.cfg.streaming_n_sink,
             "[eval] method '" + spec + "': expected budget > streaming_n_sink (" +
                 std::to_string(m.cfg.streaming_n_sink) + ") but got " +
                 std::to_string(streaming_budget));
    m.cfg.streaming_window = streaming_budget - m.cfg.streaming_n_sink;
  }
  m.keep_fraction = keep;
  validate(m.cfg);
  return m;
}

}  // namespace

std::vector<EvalMethod> parse_eval_methods(const std::string& list) {
  std::vector<EvalMethod> out;
  for (const std::string& raw : split(list, ',')) {
    const std::string spec = trim(raw);
    VQ_CHECK(!spec.empty(), "[eval] expected a comma-separated list of method specs but got '" +
                                list + "' (an empty entry)");
    out.push_back(parse_one(spec));
  }
  return out;
}

CacheConfig config_for_context(const EvalMethod& m, int64_t n_context) {
  CacheConfig c = m.cfg;
  if (m.keep_fraction <= 0) return c;
  VQ_CHECK(n_context >= 1,
           "[eval] expected a context of at least one token but got " + std::to_string(n_context));
  const int64_t budget =
      std::max<int64_t>(1, std::llround(m.keep_fraction * static_cast<double>(n_context)));
  if (m.family == "streaming") {
    // Sinks count in the budget; a budget at or below the sinks keeps sinks + one recent row.
    c.streaming_window = std::max<int64_t>(1, budget - c.streaming_n_sink);
  } else {
    c.snap_budget = budget;
  }
  validate(c);
  return c;
}

int64_t memory_step(const TextEvalOptions& opts) {
  return opts.prefill >= opts.decode ? 0 : opts.decode - 1;
}

double MemoryFigures::ratio_to_fp16() const {
  return fp16_bytes ? static_cast<double>(bytes_accounted) / static_cast<double>(fp16_bytes) : 1.0;
}

double MemoryFigures::resident_to_fp16() const {
  return fp16_bytes ? static_cast<double>(bytes_resident) / static_cast<double>(fp16_bytes) : 1.0;
}

namespace eval_detail {

MemoryFigures memory_of(const std::vector<std::unique_ptr<KVCache>>& caches) {
  MemoryFigures m;
  double rows = 0;
  for (const auto& c : caches) {
    const CacheStats st = c->stats();
    m.context = st.tokens_seen;
    rows += static_cast<double>(st.rows_stored);
    m.bytes_accounted += st.bytes_accounted;
    m.bytes_resident += st.bytes_resident;
    m.fp16_bytes += st.fp16_bytes;
  }
  m.rows_kept = caches.empty() ? 0.0 : rows / static_cast<double>(caches.size());
  return m;
}

}  // namespace eval_detail

}  // namespace vq
