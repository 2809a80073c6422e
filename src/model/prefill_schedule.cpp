// The prefill schedule (see veloxquant/prefill_schedule.h): fixed chunks of `step`, then the
// remainder. Overflow-free for any int64 n and step (no n + step - 1).
#include "veloxquant/prefill_schedule.h"

#include <string>

#include "veloxquant/error.h"

namespace vq {

std::vector<int64_t> prefill_chunks(int64_t n, int64_t step) {
  VQ_CHECK(step >= 1, "[prefill] prefill_step_size: expected >= 1 but got " + std::to_string(step));
  VQ_CHECK(n >= 0, "[prefill] expected a non-negative prompt length but got " + std::to_string(n));
  std::vector<int64_t> chunks;
  if (n == 0) return chunks;
  const int64_t n_full = n / step, rest = n % step;
  chunks.reserve(static_cast<size_t>(n_full + (rest > 0 ? 1 : 0)));
  chunks.assign(static_cast<size_t>(n_full), step);
  if (rest > 0) chunks.push_back(rest);
  return chunks;
}

}  // namespace vq
