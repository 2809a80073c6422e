// Safetensors: defensive header parser, memory-mapped single files and shard sets, and a writer.
//
// The parser treats the file as untrusted: the 8-byte length is bounded by the file and by
// kSafetensorsMaxHeaderBytes, the JSON nesting depth is bounded before parsing, entries are
// capped, every product and sum is overflow-checked (__builtin_*_overflow), offsets must lie in
// the data section, sizes must equal shape x dtype size, and tensors must not overlap.
// Mapped tensors are used in place; one whose address is not aligned to its element size (the
// format does not promise alignment) gets a small aligned copy, still in its file dtype.
#include "veloxquant/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "model/json_text.h"
#include "veloxquant/error.h"

namespace vq {

namespace {

using json = nlohmann::json;

constexpr int kMaxJsonDepth = 64;  // a valid header nests 3 deep

[[noreturn]] void fail(const std::string& origin, const std::string& msg) {
  throw Error("[safetensors] " + origin + ": " + msg);
}

// Nesting depth of a JSON text, ignoring brackets inside strings; stops early past the limit so
// a hostile header cannot drive the parser into deep recursion.
bool json_depth_ok(const char* p, size_t n, int limit) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < n; ++i) {
    const char c = p[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > limit) return false;
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return true;
}

// SAX pass that records the first repeated key of the top-level object (linear time; nlohmann's
// DOM parser with a callback rescans objects and is quadratic in the entry count).
struct TopLevelKeys : nlohmann::json_sax<json> {
  int depth = 0;
  std::set<std::string> seen;
  std::string duplicate;
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override {
    ++depth;
    return true;
  }
  bool end_object() override {
    --depth;
    return true;
  }
  bool start_array(std::size_t) override {
    ++depth;
    return true;
  }
  bool end_array() override {
    --depth;
    return true;
  }
  bool key(string_t& k) override {
    if (depth == 1 && !seen.insert(k).second && duplicate.empty()) duplicate = k;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override {
    return false;  // the DOM parse below reports it
  }
};

bool dtype_from_safetensors(const std::string& s, DType* out) {
  if (s == "F32") {
    *out = DType::kF32;
  } else if (s == "F16") {
    *out = DType::kF16;
  } else if (s == "BF16") {
    *out = DType::kBF16;
  } else {
    return false;
  }
  return true;
}

const char* dtype_to_safetensors(DType t) {
  switch (t) {
    case DType::kF32:
      return "F32";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
  }
  return "?";
}

uint64_t read_u64_le(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Reads a non-negative integer that fits in uint64 from a JSON value, or fails naming `what`.
uint64_t json_u64(const json& v, const std::string& origin, const std::string& what) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer()) {
    const int64_t x = v.get<int64_t>();
    if (x >= 0) return static_cast<uint64_t>(x);
  }
  fail(origin, what + ": expected a non-negative integer but got " + v.dump());
}

}  // namespace

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

SafetensorsHeader parse_safetensors_header(const uint8_t* data, size_t size,
                                           const std::string& origin) {
  if (size < 8)
    fail(origin,
         "expected at least 8 bytes (header length) but the file has " + std::to_string(size));
  SafetensorsHeader h;
  h.header_bytes = read_u64_le(data);
  if (h.header_bytes > kSafetensorsMaxHeaderBytes)
    fail(origin, "header length " + std::to_string(h.header_bytes) + " exceeds the limit of " +
                     std::to_string(kSafetensorsMaxHeaderBytes) + " bytes");
  if (h.header_bytes > size - 8)
    fail(origin, "truncated: header length " + std::to_string(h.header_bytes) + " but only " +
                     std::to_string(size - 8) + " bytes follow");
  h.data_offset = 8 + h.header_bytes;
  const uint64_t data_size = size - h.data_offset;
  const char* text = reinterpret_cast<const char*>(data + 8);
  const size_t text_len = static_cast<size_t>(h.header_bytes);
  if (!json_depth_ok(text, text_len, kMaxJsonDepth))
    fail(origin, "header JSON nests deeper than " + std::to_string(kMaxJsonDepth));
  // Duplicate top-level names are refused (a DOM parser keeps only one of them silently).
  TopLevelKeys keys;
  json::sax_parse(text, text + text_len, &keys, json::input_format_t::json, /*strict=*/true);
  const std::string duplicate = keys.duplicate;
  const size_t n_tensors = keys.seen.size() - keys.seen.count("__metadata__");
  if (n_tensors > kSafetensorsMaxEntries)
    fail(origin, "header has " + std::to_string(n_tensors) + " tensor entries; the limit is " +
                     std::to_string(kSafetensorsMaxEntries));
  json root = detail::parse_json_text(text, text + text_len,
                                      [&](const std::string& m) { fail(origin, "header " + m); });
  if (!duplicate.empty()) fail(origin, "tensor '" + duplicate + "' is defined twice");
  if (!root.is_object())
    fail(origin, "header: expected a JSON object but got " + std::string(root.type_name()));

  for (auto it = root.begin(); it != root.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) fail(origin, "__metadata__: expected an object of strings");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string())
          fail(origin, "__metadata__['" + m.key() + "']: expected a string but got " +
                           std::string(m.value().type_name()));
        h.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string where = "tensor '" + name + "'";
    if (!v.is_object()) fail(origin, where + ": expected an object but got " + v.type_name());
    for (auto f = v.begin(); f != v.end(); ++f)
      if (f.key() != "dtype" && f.key() != "shape" && f.key() != "data_offsets")
        fail(origin, where + ": unexpected field '" + f.key() + "'");
    if (!v.contains("dtype") || !v["dtype"].is_string())
      fail(origin, where + ": expected a string field 'dtype'");
    if (!v.contains("shape") || !v["shape"].is_array())
      fail(origin, where + ": expected an array field 'shape'");
    if (!v.contains("data_offsets") || !v["data_offsets"].is_array() ||
        v["data_offsets"].size() != 2)
      fail(origin, where + ": expected 'data_offsets' as [begin, end]");

    SafetensorsEntry e;
    e.name = name;
    const std::string dt = v["dtype"].get<std::string>();
    if (!dtype_from_safetensors(dt, &e.dtype))
      fail(origin, where + ": expected dtype F32, F16 or BF16 but got " + dt);
    const json& shape = v["shape"];
    if (shape.size() > kSafetensorsMaxRank)
      fail(origin, where + ": expected rank <= " + std::to_string(kSafetensorsMaxRank) +
                       " but got " + std::to_string(shape.size()));
    // The product of the non-zero dims, times the element size, must fit int64 even when another
    // dim is 0: TensorRef::numel() and the users' strides are int64.
    const uint64_t es = dtype_size(e.dtype);
    uint64_t nonzero_bytes = es;
    bool empty = false;
    for (const json& d : shape) {
      const uint64_t dim = json_u64(d, origin, where + " shape");
      if (dim == 0) {
        empty = true;
      } else if (__builtin_mul_overflow(nonzero_bytes, dim, &nonzero_bytes) ||
                 nonzero_bytes > static_cast<uint64_t>(INT64_MAX)) {
        fail(origin, where + ": shape " + shape.dump() + " x " + dt +
                         " overflows 64 bits: expected its non-zero dims x the element size to "
                         "fit int64");
      }
      e.shape.push_back(static_cast<int64_t>(dim));
    }
    const uint64_t expected_bytes = empty ? 0 : nonzero_bytes;
    e.begin = json_u64(v["data_offsets"][0], origin, where + " data_offsets[0]");
    e.end = json_u64(v["data_offsets"][1], origin, where + " data_offsets[1]");
    if (e.begin > e.end)
      fail(origin, where + ": data_offsets begin " + std::to_string(e.begin) + " > end " +
                       std::to_string(e.end));
    if (e.end > data_size)
      fail(origin, where + ": data_offsets end " + std::to_string(e.end) +
                       " runs past the data section of " + std::to_string(data_size) +
                       " bytes (truncated file?)");
    if (e.end - e.begin != expected_bytes)
      fail(origin, where + ": expected " + std::to_string(expected_bytes) + " bytes for shape " +
                       shape_string(e.shape) + " " + dt + " but data_offsets span " +
                       std::to_string(e.end - e.begin));
    h.entries.push_back(std::move(e));
  }

  // No overlaps: sort by begin; each non-empty tensor must start at or after the previous end.
  std::sort(h.entries.begin(), h.entries.end(), [](const auto& a, const auto& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  const SafetensorsEntry* prev = nullptr;
  for (const auto& e : h.entries) {
    if (e.nbytes() == 0) continue;
    if (prev && e.begin < prev->end)
      fail(origin, "tensor '" + e.name + "' [" + std::to_string(e.begin) + ", " +
                       std::to_string(e.end) + ") overlaps tensor '" + prev->name + "' [" +
                       std::to_string(prev->begin) + ", " + std::to_string(prev->end) + ")");
    prev = &e;
  }
  return h;
}

int64_t TensorRef::numel() const {
  // 0 when any dim is 0 (whatever the others are); the parser guarantees the rest fits int64,
  // a hand-built ref that overflows is refused.
  for (int64_t d : shape)
    if (d == 0) return 0;
  int64_t n = 1;
  for (int64_t d : shape)
    if (d < 0 || __builtin_mul_overflow(n, d, &n))
      throw Error("[safetensors] tensor '" + name +
                  "': expected a shape whose element count fits "
                  "int64 but got " +
                  shape_string(shape));
  return n;
}

namespace {

// A read-only mapping of a whole file (or an owned copy of bytes).
class Mapping {
 public:
  static std::shared_ptr<Mapping> map_file(const std::string& path) {
    auto m = std::make_shared<Mapping>();
    m->path_ = path;
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw Error("[safetensors] cannot open " + path + ": " + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      const int err = errno;
      ::close(fd);
      throw Error("[safetensors] cannot stat " + path + ": " + std::strerror(err));
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      throw Error("[safetensors] " + path + ": expected a regular file");
    }
    m->size_ = static_cast<size_t>(st.st_size);
    if (m->size_ > 0) {
      void* p = ::mmap(nullptr, m->size_, PROT_READ, MAP_PRIVATE, fd, 0);
      if (p == MAP_FAILED) {
        const int err = errno;
        ::close(fd);
        throw Error("[safetensors] cannot map " + path + ": " + std::strerror(err));
      }
      m->base_ = static_cast<const uint8_t*>(p);
      m->mapped_ = true;
    }
    ::close(fd);
    return m;
  }
  static std::shared_ptr<Mapping> copy_bytes(const uint8_t* data, size_t size,
                                             const std::string& origin) {
    auto m = std::make_shared<Mapping>();
    m->path_ = origin;
    m->owned_.resize((size + 7) / 8 + 1);
    if (size) std::memcpy(m->owned_.data(), data, size);
    m->base_ = reinterpret_cast<const uint8_t*>(m->owned_.data());
    m->size_ = size;
    return m;
  }
  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    if (mapped_) ::munmap(const_cast<uint8_t*>(base_), size_);
  }
  const uint8_t* base() const { return base_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const uint8_t* base_ = nullptr;
  size_t size_ = 0;
  bool mapped_ = false;
  std::vector<uint64_t> owned_;
};

}  // namespace

struct Safetensors::Impl {
  std::vector<std::shared_ptr<Mapping>> files;
  std::map<std::string, TensorRef> tensors;
  std::map<std::string, std::string> metadata;
  std::vector<std::vector<uint64_t>> aligned_copies;  // for misaligned tensors only
  uint64_t tensor_bytes = 0;

  // Adds every tensor of one mapped file; `only` (if non-null) must each be present.
  void add_file(std::shared_ptr<Mapping> m) {
    const SafetensorsHeader h = parse_safetensors_header(m->base(), m->size(), m->path());
    for (const auto& e : h.entries) {
      if (tensors.count(e.name))
        throw Error("[safetensors] tensor '" + e.name + "' appears in both " +
                    tensors[e.name].file + " and " + m->path());
      TensorRef r;
      r.name = e.name;
      r.dtype = e.dtype;
      r.shape = e.shape;
      r.nbytes = static_cast<size_t>(e.nbytes());
      r.file = m->path();
      const uint8_t* p = m->base() + h.data_offset + e.begin;
      // An empty tensor needs no copy (memcpy into the empty vector's null data is undefined).
      if (r.nbytes > 0 && reinterpret_cast<uintptr_t>(p) % dtype_size(e.dtype) != 0) {
        aligned_copies.emplace_back((r.nbytes + 7) / 8);
        std::memcpy(aligned_copies.back().data(), p, r.nbytes);
        p = reinterpret_cast<const uint8_t*>(aligned_copies.back().data());
      }
      r.data = p;
      tensor_bytes += e.nbytes();
      tensors.emplace(e.name, std::move(r));
    }
    for (const auto& [k, v] : h.metadata) metadata[k] = v;
    files.push_back(std::move(m));
  }

  std::string file_list() const {
    std::string s;
    for (size_t i = 0; i < files.size(); ++i) s += (i ? ", " : "") + files[i]->path();
    return files.empty() ? "<no files>" : s;
  }
};

Safetensors::Safetensors() : impl_(std::make_unique<Impl>()) {}
Safetensors::~Safetensors() = default;
Safetensors::Safetensors(Safetensors&&) noexcept = default;
Safetensors& Safetensors::operator=(Safetensors&&) noexcept = default;

Safetensors Safetensors::open_file(const std::string& path) {
  Safetensors s;
  s.impl_->add_file(Mapping::map_file(path));
  return s;
}

Safetensors Safetensors::from_bytes(const uint8_t* data, size_t size, const std::string& origin) {
  Safetensors s;
  s.impl_->add_file(Mapping::copy_bytes(data, size, origin));
  return s;
}

Safetensors Safetensors::open_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  const fs::path single = fs::path(dir) / "model.safetensors";
  if (!fs::exists(index)) {
    if (!fs::exists(single))
      throw Error("[safetensors] " + dir +
                  ": expected model.safetensors or model.safetensors.index.json but found "
                  "neither");
    return open_file(single.string());
  }
  std::ifstream in(index, std::ios::binary);
  if (!in) throw Error("[safetensors] cannot read " + index.string());
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  const std::string origin = index.string();
  if (!json_depth_ok(text.data(), text.size(), kMaxJsonDepth))
    fail(origin, "JSON nests deeper than " + std::to_string(kMaxJsonDepth));
  const json root = detail::parse_json_text(text.data(), text.data() + text.size(),
                                            [&](const std::string& m) { fail(origin, m); });
  if (!root.is_object() || !root.contains("weight_map") || !root["weight_map"].is_object())
    fail(origin, "expected an object with a 'weight_map' object");
  std::map<std::string, std::string> tensor_to_shard;
  std::set<std::string> shards;
  for (auto it = root["weight_map"].begin(); it != root["weight_map"].end(); ++it) {
    if (!it.value().is_string())
      fail(origin, "weight_map['" + it.key() + "']: expected a file name string");
    const std::string shard = it.value().get<std::string>();
    if (shard.empty() || shard.find('/') != std::string::npos ||
        shard.find('\\') != std::string::npos || shard == "." || shard == "..")
      fail(origin,
           "weight_map['" + it.key() + "']: expected a plain file name but got '" + shard + "'");
    tensor_to_shard[it.key()] = shard;
    shards.insert(shard);
  }
  Safetensors s;
  for (const auto& shard : shards) {
    const fs::path p = fs::path(dir) / shard;
    if (!fs::exists(p)) fail(origin, "lists shard " + shard + " but " + p.string() + " is missing");
    s.impl_->add_file(Mapping::map_file(p.string()));
  }
  for (const auto& [name, shard] : tensor_to_shard) {
    auto it = s.impl_->tensors.find(name);
    const std::string expected_file = (fs::path(dir) / shard).string();
    if (it == s.impl_->tensors.end())
      fail(origin, "tensor '" + name + "' is listed in shard " + shard + " but not found there");
    if (it->second.file != expected_file)
      fail(origin, "tensor '" + name + "': expected in " + expected_file + " but found in " +
                       it->second.file);
  }
  return s;
}

bool Safetensors::contains(const std::string& name) const {
  return impl_->tensors.count(name) > 0;
}

const TensorRef& Safetensors::get(const std::string& name) const {
  auto it = impl_->tensors.find(name);
  if (it == impl_->tensors.end())
    throw Error("[safetensors] tensor '" + name + "' not found in " + impl_->file_list());
  return it->second;
}

const TensorRef& Safetensors::get(const std::string& name,
                                  const std::vector<int64_t>& expected_shape) const {
  const TensorRef& r = get(name);
  if (r.shape != expected_shape)
    throw Error("[safetensors] tensor '" + name + "': expected shape " +
                shape_string(expected_shape) + " but got " + shape_string(r.shape) + " in " +
                r.file);
  return r;
}

std::vector<std::string> Safetensors::names() const {
  std::vector<std::string> out;
  out.reserve(impl_->tensors.size());
  for (const auto& [k, v] : impl_->tensors) out.push_back(k);
  return out;
}

size_t Safetensors::size() const {
  return impl_->tensors.size();
}
uint64_t Safetensors::tensor_bytes() const {
  return impl_->tensor_bytes;
}
const std::map<std::string, std::string>& Safetensors::metadata() const {
  return impl_->metadata;
}

void save_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) {
    json m = json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    header["__metadata__"] = m;
  }
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    uint64_t numel = 1;
    for (int64_t d : t.shape) {
      VQ_CHECK(d >= 0, "[save_safetensors] tensor '" + t.name + "': expected non-negative shape");
      numel *= static_cast<uint64_t>(d);
    }
    VQ_CHECK(numel * dtype_size(t.dtype) == t.bytes.size(),
             "[save_safetensors] tensor '" + t.name + "': expected " +
                 std::to_string(numel * dtype_size(t.dtype)) + " bytes but got " +
                 std::to_string(t.bytes.size()));
    VQ_CHECK(!header.contains(t.name), "[save_safetensors] duplicate tensor '" + t.name + "'");
    header[t.name] = {{"dtype", dtype_to_safetensors(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  std::string text = header.dump();
  while ((8 + text.size()) % 8 != 0) text.push_back(' ');
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  VQ_CHECK(out.good(), "[save_safetensors] cannot write " + path);
  uint8_t len[8];
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(n >> (8 * i));
  out.write(reinterpret_cast<const char*>(len), 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const auto& t : tensors)
    out.write(reinterpret_cast<const char*>(t.bytes.data()),
              static_cast<std::streamsize>(t.bytes.size()));
  VQ_CHECK(out.good(), "[save_safetensors] write failed: " + path);
}

}  // namespace vq
