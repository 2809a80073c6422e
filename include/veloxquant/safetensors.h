// Safetensors checkpoints: a defensive header parser, memory-mapped files (one file or the shards
// listed by model.safetensors.index.json) and a small writer used by tests and tools.
//
// File layout: u64 little-endian header length N, N bytes of JSON {name: {dtype, shape,
// data_offsets: [begin, end]}, "__metadata__": {str: str}}, then the data section; offsets are
// relative to the data section. Tensors are row-major in their file dtype (F32, F16 or BF16; every
// other dtype is refused naming the tensor) and stay so: nothing is converted on load.
// Every length, offset and shape product is checked with overflow-safe arithmetic.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "veloxquant/dtype.h"

namespace vq {

// Limits of the header parser (a header past them is refused, never allocated).
inline constexpr uint64_t kSafetensorsMaxHeaderBytes = 100ull << 20;  // 100 MiB of JSON
inline constexpr size_t kSafetensorsMaxEntries = 1u << 17;            // tensors per file
inline constexpr size_t kSafetensorsMaxRank = 8;

// One tensor's header entry; offsets are relative to the data section.
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;  // row-major, outermost first; {} is a scalar
  uint64_t begin = 0;          // byte offset of the first element in the data section
  uint64_t end = 0;            // one past the last byte
  uint64_t nbytes() const { return end - begin; }
};

struct SafetensorsHeader {
  uint64_t header_bytes = 0;              // N
  uint64_t data_offset = 0;               // 8 + N: where the data section starts in the file
  std::vector<SafetensorsEntry> entries;  // in file order of data_offsets (ascending begin)
  std::map<std::string, std::string> metadata;
};

// Parses and validates the header of a whole file image [data, data + size): header length
// bound, JSON, entry count, dtype, shape rank and non-negativity, every [begin, end] inside the
// data section, shape x dtype size == end - begin, no two tensors overlapping, no duplicate
// names. `origin` names the file in error messages. Throws vq::Error; never reads past size.
SafetensorsHeader parse_safetensors_header(const uint8_t* data, size_t size,
                                           const std::string& origin = "<memory>");

// A tensor inside a loaded checkpoint: a pointer into the mapping (or into a small aligned copy
// when the file placed it at an address not aligned to its element size).
struct TensorRef {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  size_t nbytes = 0;
  std::string file;  // which file holds it

  int64_t numel() const;
  // Element i (row-major) as fp32.
  float at(size_t i) const { return load_f32(data, dtype, i); }
};

// "[a, b, c]" for messages.
std::string shape_string(const std::vector<int64_t>& shape);

// A read-only set of tensors from one safetensors file or several shards, memory-mapped.
class Safetensors {
 public:
  Safetensors();
  ~Safetensors();
  Safetensors(Safetensors&&) noexcept;
  Safetensors& operator=(Safetensors&&) noexcept;

  // One .safetensors file.
  static Safetensors open_file(const std::string& path);
  // A model folder: model.safetensors.index.json (its weight_map lists the shards; every shard
  // must exist and every tensor the index names must be in the shard it names) if present, else
  // model.safetensors.
  static Safetensors open_dir(const std::string& dir);
  // A file image held in memory (copied); used by fuzzing and tests.
  static Safetensors from_bytes(const uint8_t* data, size_t size,
                                const std::string& origin = "<memory>");

  bool contains(const std::string& name) const;
  // Throws vq::Error "[safetensors] tensor 'x' not found in <files>".
  const TensorRef& get(const std::string& name) const;
  // Same, and checks the shape: "[safetensors] tensor 'x': expected shape [a, b] but got [c]".
  const TensorRef& get(const std::string& name, const std::vector<int64_t>& expected_shape) const;
  std::vector<std::string> names() const;  // sorted
  size_t size() const;
  // Bytes of tensor data over every file (what a full read of the weights costs).
  uint64_t tensor_bytes() const;
  const std::map<std::string, std::string>& metadata() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Writer for tests and tools: tensors given as raw bytes in their dtype, row-major.
struct TensorToWrite {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};
// Writes a valid safetensors file (header padded with spaces to a multiple of 8 bytes, tensors in
// the given order). Throws vq::Error on a size mismatch or an I/O error.
void save_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

}  // namespace vq
