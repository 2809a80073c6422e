// A row backend for tests that forwards every store and op to the CPU backend (src/kv/row_store.h)
// and lets a test change what a policy reads from the backend: its device, its name, whether it
// asks for one packed run.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "kv/row_store.h"

namespace vq::test {

class CpuDelegateBackend : public kv::RowBackend {
 public:
  kv::Device device() const override { return cpu().device(); }
  std::string name() const override { return cpu().name(); }
  std::unique_ptr<kv::RowStore> make(const kv::RowShape& s, int64_t cap, bool pos) const override {
    return cpu().make(s, cap, pos);
  }
  std::unique_ptr<kv::QueryRows> keep_queries(const TensorView& q, int64_t rows) const override {
    return cpu().keep_queries(q, rows);
  }
  std::unique_ptr<kv::QueryRows> upload_queries(int64_t b, int64_t hq, int64_t rows, int64_t d,
                                                const std::vector<float>& q) const override {
    return cpu().upload_queries(b, hq, rows, d, q);
  }
  std::unique_ptr<kv::QueryWindow> make_query_window(int64_t b, int64_t hq, int64_t d,
                                                     int64_t max_rows,
                                                     const std::vector<float>& q) const override {
    return cpu().make_query_window(b, hq, d, max_rows, q);
  }
  std::unique_ptr<kv::RowIndex> snap_select(const kv::RowStore& rows, int64_t n,
                                            const TensorView* q, int64_t q_first,
                                            const SnapSelectParams& p) const override {
    return cpu().snap_select(rows, n, q, q_first, p);
  }
  std::vector<int32_t> snap_select_rows(const kv::RowStore& rows, int64_t n, const TensorView* q,
                                        int64_t q_first, int64_t obs_window, int64_t pool_kernel,
                                        int64_t lo, int64_t hi, int64_t k) const override {
    return cpu().snap_select_rows(rows, n, q, q_first, obs_window, pool_kernel, lo, hi, k);
  }
  std::unique_ptr<kv::RowIndex> upload_index(int64_t count,
                                             const std::vector<int32_t>& idx) const override {
    return cpu().upload_index(count, idx);
  }
  std::unique_ptr<kv::PackedStore> make_packed(const kv::PackedShape& s, int64_t cap,
                                               bool pos) const override {
    return cpu().make_packed(s, cap, pos);
  }
  std::unique_ptr<kv::PackedTransforms> make_transforms(
      const std::vector<int32_t>& pk, const std::vector<int32_t>& pv,
      const std::vector<float>& signs, int32_t block, bool rv,
      const std::vector<double>& ku) const override {
    return cpu().make_transforms(pk, pv, signs, block, rv, ku);
  }
  std::vector<int32_t> channel_perms(const kv::RowStore& rows, int64_t row0, int64_t n,
                                     bool values) const override {
    return cpu().channel_perms(rows, row0, n, values);
  }
  bool one_packed_run() const override { return cpu().one_packed_run(); }
  bool keeps_tail_room() const override { return cpu().keeps_tail_room(); }
  void synchronize() const override { cpu().synchronize(); }

 protected:
  static const kv::RowBackend& cpu() { return kv::cpu_backend(); }
};

}  // namespace vq::test
