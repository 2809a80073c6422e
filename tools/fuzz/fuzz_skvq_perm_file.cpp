// libFuzzer target for SKVQ permutation files (load_skvq_perm_file, veloxquant/skvq_cache.h):
// the input bytes are the file's text. The loader takes a path, so the bytes go to an in-memory
// file (memfd) opened through /proc/self/fd. When it loads, every list must be a permutation of
// 0..head_dim-1 per head and the set must round-trip through save_skvq_perm_file.
// The only acceptable failure is vq::Error. Seeds: tools/fuzz/corpus/fuzz_skvq_perm_file/.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "veloxquant/error.h"
#include "veloxquant/skvq_cache.h"

namespace {

// The same memfd for every run: rewritten, truncated to the input's size.
const std::string& memfd_path(const uint8_t* data, size_t size) {
  static const int fd = memfd_create("fuzz_skvq_perm", 0);
  static const std::string path = "/proc/self/fd/" + std::to_string(fd);
  if (fd < 0 || ftruncate(fd, 0) != 0 ||
      (size && pwrite(fd, data, size, 0) != static_cast<ssize_t>(size)))
    __builtin_trap();
  return path;
}

bool is_perm(const std::vector<int32_t>& p, int64_t heads, int64_t dim) {
  if (static_cast<int64_t>(p.size()) != heads * dim) return false;
  for (int64_t h = 0; h < heads; ++h) {
    std::vector<bool> seen(static_cast<size_t>(dim), false);
    for (int64_t c = 0; c < dim; ++c) {
      const int32_t x = p[static_cast<size_t>(h * dim + c)];
      if (x < 0 || x >= dim || seen[static_cast<size_t>(x)]) return false;
      seen[static_cast<size_t>(x)] = true;
    }
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > (1u << 20)) return 0;
  const std::string& path = memfd_path(data, size);
  vq::SkvqPermSet ps;
  try {
    ps = vq::load_skvq_perm_file(path);
  } catch (const vq::Error&) {
    return 0;  // refused with a message
  }
  if (ps.key.empty() || ps.key.size() != ps.value.size()) __builtin_trap();
  for (size_t l = 0; l < ps.key.size(); ++l)
    if (!is_perm(ps.key[l], ps.n_kv_heads, ps.head_dim) ||
        !is_perm(ps.value[l], ps.n_kv_heads, ps.head_dim))
      __builtin_trap();
  // Round trip through the writer (into the same memfd).
  const std::string back = memfd_path(nullptr, 0);
  vq::save_skvq_perm_file(back, ps);
  const vq::SkvqPermSet again = vq::load_skvq_perm_file(back);
  if (again.key != ps.key || again.value != ps.value || again.n_kv_heads != ps.n_kv_heads ||
      again.head_dim != ps.head_dim)
    __builtin_trap();
  return 0;
}
