// The op test harness's checks and per-op summary (see harness.h).
#include "ops_harness/harness.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>

namespace vq::harness {
namespace {

struct OpStats {
  std::string metric;
  int64_t cases = 0, failed = 0;
  double worst = 0;
  std::string worst_vars;
};

std::mutex g_mu;
std::map<std::string, OpStats>& stats() {
  static std::map<std::string, OpStats> s;
  return s;
}

// Prints the summary when the test program ends (after the last test).
class SummaryEnv : public ::testing::Environment {
 public:
  void TearDown() override { print_summary(); }
};
[[maybe_unused]] ::testing::Environment* const g_env =
    ::testing::AddGlobalTestEnvironment(new SummaryEnv);

constexpr int kMaxReported = 5;  // failing elements printed per case

bool finite_mismatch(double got, double ref) {
  if (std::isnan(ref) || std::isnan(got)) return std::isnan(ref) != std::isnan(got);
  if (std::isinf(ref) || std::isinf(got)) return got != ref;
  return false;
}

}  // namespace

bool small_sweep() {
  const char* e = std::getenv("VQ_HARNESS");
  if (e && std::strcmp(e, "full") == 0) return false;
  if (e && std::strcmp(e, "small") == 0) return true;
#if defined(__SANITIZE_ADDRESS__)
  return true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
  return true;
#endif
#endif
  return false;
}

Check::Check(std::string op, std::string backend, std::string vars)
    : op_(std::move(op)), backend_(std::move(backend)), vars_(std::move(vars)) {}

Check::~Check() {
  if (metric_.empty()) fail("the case compared nothing");
  if (ok_)
    std::printf("  %-28s %-4s %s: OK (%s, %.1f%% of tolerance)\n", op_.c_str(), backend_.c_str(),
                vars_.c_str(), metric_.c_str(), 100 * worst_);
  else
    std::printf("  %-28s %-4s %s: FAIL (%s, over tolerance)\n", op_.c_str(), backend_.c_str(),
                vars_.c_str(), metric_.c_str());
  std::lock_guard<std::mutex> lock(g_mu);
  OpStats& s = stats()[op_ + " [" + backend_ + "]"];
  std::istringstream tokens(metric_);  // "bound+exact" -> each metric once per op
  for (std::string t; std::getline(tokens, t, '+');)
    if (("+" + s.metric + "+").find("+" + t + "+") == std::string::npos)
      s.metric += (s.metric.empty() ? "" : "+") + t;
  ++s.cases;
  s.failed += ok_ ? 0 : 1;
  if (s.cases == 1 || worst_ > s.worst) {  // the first case of the worst ratio
    s.worst = worst_;
    s.worst_vars = vars_;
  }
}

void Check::note(double ratio) {
  if (std::isnan(ratio)) ratio = 1e30;
  worst_ = std::max(worst_, ratio);
}

void Check::fail(const std::string& msg) {
  ok_ = false;
  worst_ = std::max(worst_, 1e30);
  if (reported_++ < kMaxReported)
    ADD_FAILURE() << op_ << " [" << backend_ << "] " << vars_ << ": " << msg;
}

void Check::expect_size(size_t a, size_t b, size_t c, const char* what) {
  if (a != b || a != c)
    fail(std::string(what) + ": sizes differ (" + std::to_string(a) + ", " + std::to_string(b) +
         ", " + std::to_string(c) + ")");
}

void Check::reference_nonzero(bool any_nonzero, const char* what) {
  if (!any_nonzero && !zero_ok_) fail(std::string(what) + ": the reference is all zeros");
}

void Check::exact_bytes(const void* got, const void* ref, size_t n_bytes, const char* what) {
  if (metric_.find("exact") == std::string::npos) metric_ += metric_.empty() ? "exact" : "+exact";
  const auto* a = static_cast<const uint8_t*>(got);
  const auto* b = static_cast<const uint8_t*>(ref);
  bool nonzero = false;
  int64_t bad = 0;
  size_t first = 0;
  for (size_t i = 0; i < n_bytes; ++i) {
    nonzero |= b[i] != 0;
    if (a[i] != b[i] && bad++ == 0) first = i;
  }
  if (bad)
    fail(std::string(what) + ": " + std::to_string(bad) + " of " + std::to_string(n_bytes) +
         " bytes differ, first at byte " + std::to_string(first) + " (got " +
         std::to_string(a[first]) + ", want " + std::to_string(b[first]) + ")");
  reference_nonzero(nonzero || n_bytes == 0, what);
}

namespace {
template <typename T>
void exact_vec(Check& c, const std::vector<T>& got, const std::vector<T>& ref, const char* what) {
  if (got.size() != ref.size()) {
    c.fail(std::string(what) + ": got " + std::to_string(got.size()) + " elements, want " +
           std::to_string(ref.size()));
    return;
  }
  c.exact_bytes(got.data(), ref.data(), got.size() * sizeof(T), what);
}
}  // namespace

void Check::exact(const std::vector<float>& got, const std::vector<float>& ref, const char* what) {
  // NaN == NaN whatever its payload: compare canonicalised copies.
  std::vector<float> a = got, b = ref;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    if (std::isnan(a[i]) && std::isnan(b[i])) a[i] = b[i];
  exact_vec(*this, a, b, what);
}
void Check::exact(const std::vector<int64_t>& got, const std::vector<int64_t>& ref,
                  const char* what) {
  exact_vec(*this, got, ref, what);
}
void Check::exact(const std::vector<int32_t>& got, const std::vector<int32_t>& ref,
                  const char* what) {
  exact_vec(*this, got, ref, what);
}
void Check::exact(const std::vector<uint8_t>& got, const std::vector<uint8_t>& ref,
                  const char* what) {
  exact_vec(*this, got, ref, what);
}

void Check::bounded(const float* got, const double* ref, const double* bound, size_t n,
                    const char* what) {
  if (metric_.find("bound") == std::string::npos) metric_ += metric_.empty() ? "bound" : "+bound";
  bool nonzero = false;
  for (size_t i = 0; i < n; ++i) {
    const double g = got[i], r = ref[i];
    nonzero |= r != 0.0 && !std::isnan(r);
    if (finite_mismatch(g, r)) {
      fail(std::string(what) + "[" + std::to_string(i) + "]: non-finite mismatch, got " +
           std::to_string(g) + ", want " + std::to_string(r));
      continue;
    }
    if (!std::isfinite(r)) continue;  // the same NaN/Inf on both sides
    const double err = std::abs(g - r), tol = bound[i];
    if (!(err <= tol)) {
      char buf[256];
      std::snprintf(buf, sizeof buf, "%s[%zu]: got %.9g, want %.9g, |err| %.3g > bound %.3g", what,
                    i, g, r, err, tol);
      fail(buf);
      continue;
    }
    if (tol > 0) note(err / tol);
  }
  reference_nonzero(nonzero || n == 0, what);
}

void Check::elementwise(const float* got, const double* ref, size_t n, double atol, double rtol,
                        const char* what) {
  std::vector<double> bound(n);
  for (size_t i = 0; i < n; ++i) bound[i] = atol + rtol * std::abs(ref[i]);
  const std::string before = metric_;
  bounded(got, ref, bound.data(), n, what);
  metric_ = before;
  if (metric_.find("atol_rtol") == std::string::npos)
    metric_ += metric_.empty() ? "atol_rtol" : "+atol_rtol";
}

void Check::nmse(const float* got, const double* ref, size_t n, double max_nmse, const char* what) {
  if (metric_.find("nmse") == std::string::npos) metric_ += metric_.empty() ? "nmse" : "+nmse";
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    if (finite_mismatch(got[i], ref[i])) {
      fail(std::string(what) + "[" + std::to_string(i) + "]: non-finite mismatch");
      return;
    }
    if (!std::isfinite(ref[i])) continue;
    num += (got[i] - ref[i]) * (got[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  reference_nonzero(den > 0 || n == 0, what);
  const double e = den > 0 ? num / den : num;
  if (!(e <= max_nmse)) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "%s: nmse %.3g > %.3g", what, e, max_nmse);
    fail(buf);
    return;
  }
  note(e / max_nmse);
}

void print_summary() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (stats().empty()) return;
  std::printf("\n[backend-ops] per op: cases, failures, metric, worst error as %% of tolerance\n");
  for (const auto& [op, s] : stats()) {
    if (s.worst >= 1e29)
      std::printf("  %-36s %5lld cases %3lld failed  %-18s worst: over tolerance (first: %s)\n",
                  op.c_str(), static_cast<long long>(s.cases), static_cast<long long>(s.failed),
                  s.metric.c_str(), s.worst_vars.c_str());
    else
      std::printf("  %-36s %5lld cases %3lld failed  %-18s worst %6.1f%% (%s)\n", op.c_str(),
                  static_cast<long long>(s.cases), static_cast<long long>(s.failed),
                  s.metric.c_str(), 100 * s.worst, s.worst_vars.c_str());
  }
  std::fflush(stdout);
}

}  // namespace vq::harness
