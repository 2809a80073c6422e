// The op test harness (issue 12 item 5, docs: tests/test_backend_ops.cpp): every case of every op
// is one Check holding its parameters (a vars() string) and compared with the metric its op
// declares:
//   * exact       codes, metadata bytes, indices, selections: bit for bit (NaN == NaN);
//   * bound       a per-element error bound derived from the op's arithmetic (attention, matmul,
//                 Hadamard, SnapKV scores, dequantization): |got - ref| <= bound[i];
//   * elementwise |got - ref| <= atol + rtol |ref| (per-dtype values chosen by the op);
//   * nmse        sum (got - ref)^2 / sum ref^2 <= max.
// Every non-exact comparison fails on a NaN/Inf mismatch (got non-finite where ref is finite,
// or the other way round); every case fails when its reference is all zeros unless the case
// says zeros are what it expects. Each case prints one line; each op keeps its worst error as a
// percentage of its tolerance, printed by a summary after the last test. No case ever accepts
// "a fraction of the elements within tolerance": one element over its bound fails the case.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

namespace vq::harness {

constexpr double kU = 0x1p-24;  // fp32 unit roundoff
// gamma_n = n u / (1 - n u): the classic bound on n fp32 roundings in a chain.
inline double gamma_n(double n) {
  return n * kU / (1.0 - n * kU);
}

// True when the harness should run its reduced table: under AddressSanitizer (GCC's
// __SANITIZE_ADDRESS__, clang's address_sanitizer feature) or with VQ_HARNESS=small in the
// environment; VQ_HARNESS=full forces the whole table.
bool small_sweep();

// "name=value,name=value" parameter strings.
class Vars {
 public:
  template <typename T>
  Vars& operator()(const char* name, const T& value) {
    if (!first_) os_ << ',';
    first_ = false;
    os_ << name << '=' << value;
    return *this;
  }
  std::string str() const { return os_.str(); }

 private:
  std::ostringstream os_;
  bool first_ = true;
};

// One case of one op. Comparisons accumulate; the destructor prints the case line and records
// the op's worst ratio (error / tolerance) in the summary.
class Check {
 public:
  Check(std::string op, std::string backend, std::string vars);
  ~Check();
  Check(const Check&) = delete;
  Check& operator=(const Check&) = delete;

  // Zeros in the reference are expected (a fully masked query, an all-zero input).
  void allow_zero_reference() { zero_ok_ = true; }

  // Exact: n elements of a and b bit for bit (floats: NaN equals NaN, -0 differs from +0).
  void exact_bytes(const void* got, const void* ref, size_t n_bytes, const char* what);
  void exact(const std::vector<float>& got, const std::vector<float>& ref, const char* what);
  void exact(const std::vector<int64_t>& got, const std::vector<int64_t>& ref, const char* what);
  void exact(const std::vector<int32_t>& got, const std::vector<int32_t>& ref, const char* what);
  void exact(const std::vector<uint8_t>& got, const std::vector<uint8_t>& ref, const char* what);

  // Per-element bound: |got[i] - ref[i]| <= bound[i].
  void bounded(const float* got, const double* ref, const double* bound, size_t n,
               const char* what);
  void bounded(const std::vector<float>& got, const std::vector<double>& ref,
               const std::vector<double>& bound, const char* what) {
    expect_size(got.size(), ref.size(), bound.size(), what);
    bounded(got.data(), ref.data(), bound.data(), std::min(got.size(), ref.size()), what);
  }
  // |got - ref| <= atol + rtol |ref|.
  void elementwise(const float* got, const double* ref, size_t n, double atol, double rtol,
                   const char* what);
  // sum (got - ref)^2 / sum ref^2 <= max_nmse.
  void nmse(const float* got, const double* ref, size_t n, double max_nmse, const char* what);

  // A failed invariant (duplicate index, unsorted selection, wrong count ...).
  void fail(const std::string& msg);
  void expect(bool ok, const std::string& msg) {
    if (!ok) fail(msg);
  }

  bool ok() const { return ok_; }
  double worst() const { return worst_; }

 private:
  void note(double ratio);
  void expect_size(size_t a, size_t b, size_t c, const char* what);
  void reference_nonzero(bool any_nonzero, const char* what);

  std::string op_, backend_, vars_;
  std::string metric_;
  double worst_ = 0;  // error / tolerance, worst element of the case
  bool ok_ = true;
  bool zero_ok_ = false;
  int reported_ = 0;
};

// Per-op summary (cases, failures, worst % of tolerance), printed once after the last test.
void print_summary();

}  // namespace vq::harness
