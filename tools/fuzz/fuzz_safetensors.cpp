// libFuzzer target for the safetensors header parser and loader: the input bytes are a whole
// .safetensors file image. When it loads, every tensor's first and last element is read (the
// parser promised they lie inside the buffer) and shape x dtype is re-checked against the byte
// length. The only acceptable failure is vq::Error; a crash, a sanitizer report or another
// exception is a bug. Seeds: scripts/fuzz_smoke.sh writes a few valid files to start from.
#include <cstddef>
#include <cstdint>

#include "veloxquant/error.h"
#include "veloxquant/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const vq::Safetensors st = vq::Safetensors::from_bytes(data, size, "fuzz.safetensors");
    for (const auto& name : st.names()) {
      const vq::TensorRef& t = st.get(name);
      const int64_t n = t.numel();
      if (static_cast<uint64_t>(n) * vq::dtype_size(t.dtype) != t.nbytes) __builtin_trap();
      if (n > 0) {
        volatile float first = t.at(0);
        volatile float last = t.at(static_cast<size_t>(n - 1));
        (void)first;
        (void)last;
      }
    }
  } catch (const vq::Error&) {
    // Refused with a message: the expected outcome for malformed files.
  }
  return 0;
}
