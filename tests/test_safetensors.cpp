// Safetensors loading: round trips in every supported dtype, shards, misaligned data, and every
// kind of bad file (truncated, offsets overlapping or past the end, size/shape mismatch, overflow,
// unsupported dtype, bad JSON, duplicates, limits) refused with a message naming the problem.
// Files are crafted byte by byte here so the parser is tested against the format, not against
// our own writer.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include "util/tiny_model.h"
#include "veloxquant/error.h"
#include "veloxquant/safetensors.h"

namespace vq {
namespace {

std::vector<uint8_t> raw_file(const std::string& header, const std::vector<uint8_t>& data,
                              uint64_t declared_len = UINT64_MAX) {
  const uint64_t n = declared_len == UINT64_MAX ? header.size() : declared_len;
  std::vector<uint8_t> out(8 + header.size() + data.size());
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<uint8_t>(n >> (8 * i));
  if (!header.empty()) std::memcpy(out.data() + 8, header.data(), header.size());
  if (!data.empty()) std::memcpy(out.data() + 8 + header.size(), data.data(), data.size());
  return out;
}

// Expects parsing to throw a vq::Error whose message contains every needle.
void expect_refused(const std::vector<uint8_t>& file, std::initializer_list<const char*> needles) {
  try {
    Safetensors::from_bytes(file.data(), file.size(), "bad.safetensors");
    FAIL() << "expected a vq::Error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("[safetensors]"), std::string::npos) << msg;
    for (const char* n : needles)
      EXPECT_NE(msg.find(n), std::string::npos) << msg << "\n  lacks: " << n;
  }
}

std::vector<uint8_t> floats_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> b(v.size() * 4);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

TEST(Safetensors, RoundTripEveryDtype) {
  const std::string dir = test::make_temp_dir("vq-st");
  std::vector<float> vals = {0.0f, -1.5f, 3.25f, 1e-3f, -7.0f, 65504.0f};
  std::vector<TensorToWrite> ts;
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    TensorToWrite w;
    w.name = std::string("t_") + dtype_name(t);
    w.dtype = t;
    w.shape = {2, 3};
    w.bytes.resize(vals.size() * dtype_size(t));
    from_f32(vals.data(), w.bytes.data(), t, vals.size());
    ts.push_back(w);
  }
  TensorToWrite scalar{"scalar", DType::kF32, {}, floats_bytes({42.0f})};
  TensorToWrite empty{"empty", DType::kF16, {0, 5}, {}};
  ts.push_back(scalar);
  ts.push_back(empty);
  save_safetensors(dir + "/a.safetensors", ts, {{"format", "pt"}});
  const Safetensors st = Safetensors::open_file(dir + "/a.safetensors");
  EXPECT_EQ(st.size(), 5u);
  EXPECT_EQ(st.metadata().at("format"), "pt");
  for (const auto& w : ts) {
    const TensorRef& r = st.get(w.name, w.shape);
    EXPECT_EQ(r.dtype, w.dtype);
    ASSERT_EQ(r.nbytes, w.bytes.size());
    if (r.nbytes) {
      EXPECT_EQ(std::memcmp(r.data, w.bytes.data(), r.nbytes), 0) << w.name;
    }
    EXPECT_EQ(reinterpret_cast<uintptr_t>(r.data) % dtype_size(r.dtype), 0u);
  }
  // The values read back are the stored values: fp32 exact, fp16/bf16 the rounded ones.
  const TensorRef& f16 = st.get("t_float16");
  for (size_t i = 0; i < vals.size(); ++i) EXPECT_EQ(f16.at(i), fp16_to_f32(f32_to_fp16(vals[i])));
  EXPECT_EQ(st.get("scalar").numel(), 1);
  EXPECT_EQ(st.get("scalar").at(0), 42.0f);
  EXPECT_EQ(st.get("empty").numel(), 0);
  std::filesystem::remove_all(dir);
}

TEST(Safetensors, MisalignedTensorGetsAlignedCopy) {
  // Header of odd length: the data section starts at an odd address, so the F32 tensor is
  // misaligned in the mapping and must be copied (values unchanged).
  std::string header = R"({"x":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}})";
  if ((8 + header.size()) % 2 == 0) header += " ";
  const auto file = raw_file(header, floats_bytes({1.0f, -2.0f, 0.5f}));
  const Safetensors st = Safetensors::from_bytes(file.data(), file.size());
  const TensorRef& r = st.get("x", {3});
  EXPECT_EQ(reinterpret_cast<uintptr_t>(r.data) % 4, 0u);
  EXPECT_EQ(r.at(0), 1.0f);
  EXPECT_EQ(r.at(1), -2.0f);
  EXPECT_EQ(r.at(2), 0.5f);
}

TEST(Safetensors, EveryTruncationRefused) {
  const std::string header = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                             R"("b":{"dtype":"BF16","shape":[2,2],"data_offsets":[8,16]}})";
  const auto file = raw_file(header, std::vector<uint8_t>(16, 0x3f));
  ASSERT_NO_THROW(Safetensors::from_bytes(file.data(), file.size()));
  for (size_t n = 0; n < file.size(); ++n) {
    std::vector<uint8_t> cut(file.begin(), file.begin() + static_cast<std::ptrdiff_t>(n));
    EXPECT_THROW(Safetensors::from_bytes(cut.data(), cut.size()), Error) << "prefix " << n;
  }
  // Specific messages: too short for the length, header past the file, data past the file.
  expect_refused(std::vector<uint8_t>(file.begin(), file.begin() + 5), {"at least 8 bytes"});
  expect_refused(std::vector<uint8_t>(file.begin(), file.begin() + 20), {"truncated"});
  expect_refused(std::vector<uint8_t>(file.begin(), file.end() - 1),
                 {"tensor 'b'", "runs past the data section"});
}

TEST(Safetensors, TruncatedFileOnDiskRefused) {
  const std::string dir = test::make_temp_dir("vq-st");
  save_safetensors(dir + "/m.safetensors", {{"w", DType::kF32, {4}, floats_bytes({1, 2, 3, 4})}});
  std::filesystem::resize_file(dir + "/m.safetensors",
                               std::filesystem::file_size(dir + "/m.safetensors") - 3);
  try {
    Safetensors::open_file(dir + "/m.safetensors");
    FAIL() << "expected a vq::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'w'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("m.safetensors"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}

TEST(Safetensors, OffsetsOverlappingOrPastTheFileRefused) {
  const std::vector<uint8_t> data(16, 0);
  expect_refused(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                          R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                          data),
                 {"overlaps", "'a'", "'b'"});
  // Identical ranges overlap too.
  expect_refused(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                          R"("b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
                          data),
                 {"overlaps"});
  expect_refused(raw_file(R"({"a":{"dtype":"F32","shape":[6],"data_offsets":[0,24]}})", data),
                 {"tensor 'a'", "runs past the data section of 16 bytes"});
  expect_refused(raw_file(R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[17,17]}})", data),
                 {"tensor 'a'", "runs past"});
  expect_refused(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", data),
                 {"tensor 'a'", "begin 8 > end 0"});
  expect_refused(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}})", data),
                 {"tensor 'a'", "non-negative integer"});
  expect_refused(
      raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[18446744073709551615,7]}})",
               data),
      {"tensor 'a'"});
  // Adjacent and gapped tensors are fine.
  const auto ok = raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                           R"("b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
                           data);
  EXPECT_NO_THROW(Safetensors::from_bytes(ok.data(), ok.size()));
}

TEST(Safetensors, SizeAndShapeMismatchesRefused) {
  const std::vector<uint8_t> data(64, 0);
  expect_refused(raw_file(R"({"w":{"dtype":"F16","shape":[3,2],"data_offsets":[0,16]}})", data),
                 {"tensor 'w'", "expected 12 bytes", "[3, 2]", "span 16"});
  // 2^40 x 2^40 elements overflow 64 bits: refused, never allocated.
  expect_refused(raw_file(R"({"w":{"dtype":"F32","shape":[1099511627776,1099511627776],)"
                          R"("data_offsets":[0,16]}})",
                          data),
                 {"tensor 'w'", "overflows 64 bits"});
  // 2^62 elements x 4 bytes overflow in the byte count.
  expect_refused(raw_file(R"({"w":{"dtype":"F32","shape":[4611686018427387904],)"
                          R"("data_offsets":[0,16]}})",
                          data),
                 {"tensor 'w'", "overflows"});
  // Zero elements, but the other dims multiply to 2^63: TensorRef::numel() and strides would
  // overflow int64 (UBSan reported it; before the fix the parser accepted the file).
  expect_refused(raw_file(R"({"w":{"dtype":"F32","shape":[4294967296,2147483648,0],)"
                          R"("data_offsets":[0,0]}})",
                          data),
                 {"tensor 'w'", "[4294967296,2147483648,0] x F32 overflows 64 bits",
                  "non-zero dims x the element size to fit int64"});
  // The same with dims that fit: a valid empty tensor. Its data starts at a misaligned address
  // (the header is not padded), which once took the aligned-copy path with a memcpy into a
  // null pointer (UBSan: "null pointer passed as argument 1").
  const auto empty = raw_file(R"({"w":{"dtype":"F32","shape":[4294967296,0,268435456],)"
                              R"("data_offsets":[0,0]}})",
                              data);
  const Safetensors st = Safetensors::from_bytes(empty.data(), empty.size());
  EXPECT_EQ(st.get("w").numel(), 0);
  expect_refused(raw_file(R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", data),
                 {"tensor 'w'", "non-negative integer"});
  expect_refused(raw_file(R"({"w":{"dtype":"F32","shape":[1,1,1,1,1,1,1,1,1],)"
                          R"("data_offsets":[0,4]}})",
                          data),
                 {"tensor 'w'", "rank <= 8"});
  expect_refused(raw_file(R"({"w":{"dtype":"I64","shape":[2],"data_offsets":[0,16]}})", data),
                 {"tensor 'w'", "expected dtype F32, F16 or BF16 but got I64"});
  expect_refused(raw_file(R"({"w":{"dtype":"F32","shape":[2]}})", data),
                 {"tensor 'w'", "data_offsets"});
  expect_refused(raw_file(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1}})", data),
                 {"tensor 'w'", "unexpected field 'x'"});
}

TEST(Safetensors, MalformedHeadersRefused) {
  const std::vector<uint8_t> data(8, 0);
  expect_refused(raw_file("{\"w\": [", data), {"not valid JSON"});
  // Where and why (issue 17: the message used to be only "header is not valid JSON").
  expect_refused(raw_file("{\"w\": [", data),
                 {"header not valid JSON: parse error at line 1, column 8:",
                  "unexpected end of input", "(byte 8)"});
  // A number too large for a double is a JSON error too (out_of_range, not parse_error): it
  // escaped as an nlohmann exception before (found by fuzz_safetensors).
  expect_refused(raw_file(R"({"w":{"dtype":"F32","shape":[1e999],"data_offsets":[0,4]}})", data),
                 {"header not valid JSON: number overflow parsing '1e999'"});
  expect_refused(raw_file("[1,2]", data), {"expected a JSON object"});
  expect_refused(raw_file(std::string(200, '[') + std::string(200, ']'), data), {"nests deeper"});
  expect_refused(raw_file(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                          R"("w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                          data),
                 {"'w'", "defined twice"});
  expect_refused(raw_file(R"({"__metadata__":{"a":1}})", data), {"__metadata__"});
  expect_refused(raw_file("{}", data, kSafetensorsMaxHeaderBytes + 1), {"exceeds the limit"});
  expect_refused(raw_file("{}", data, 1000), {"truncated"});
  // Brackets inside strings do not count as nesting.
  const auto ok =
      raw_file(R"({"__metadata__":{"k":"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[)"
               R"([[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}})",
               data);
  EXPECT_NO_THROW(Safetensors::from_bytes(ok.data(), ok.size()));
}

TEST(Safetensors, EntryCountCapped) {
  std::string header = "{";
  for (size_t i = 0; i < kSafetensorsMaxEntries + 1; ++i) {
    if (i) header += ",";
    header += "\"t" + std::to_string(i) + R"(":{"dtype":"F32","shape":[0],"data_offsets":[0,0]})";
  }
  header += "}";
  expect_refused(raw_file(header, {}), {"entries", "limit"});
}

TEST(Safetensors, LookupErrorsNameTheTensor) {
  const auto file = raw_file(R"({"w":{"dtype":"F32","shape":[2,1],"data_offsets":[0,8]}})",
                             std::vector<uint8_t>(8, 0));
  const Safetensors st = Safetensors::from_bytes(file.data(), file.size(), "m.safetensors");
  try {
    st.get("w", {1, 2});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'w': expected shape [1, 2] but got [2, 1]"),
              std::string::npos)
        << e.what();
  }
  try {
    st.get("missing");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'missing' not found in m.safetensors"),
              std::string::npos)
        << e.what();
  }
}

TEST(Safetensors, ShardsThroughIndex) {
  const std::string dir = test::make_temp_dir("vq-st");
  save_safetensors(dir + "/s1.safetensors", {{"a", DType::kF32, {2}, floats_bytes({1, 2})}});
  save_safetensors(dir + "/s2.safetensors", {{"b", DType::kF32, {1}, floats_bytes({3})}});
  auto write_index = [&](const std::string& text) {
    std::ofstream(dir + "/model.safetensors.index.json") << text;
  };
  write_index(R"({"metadata":{},"weight_map":{"a":"s1.safetensors","b":"s2.safetensors"}})");
  const Safetensors st = Safetensors::open_dir(dir);
  EXPECT_EQ(st.size(), 2u);
  EXPECT_EQ(st.get("a", {2}).at(1), 2.0f);
  EXPECT_EQ(st.get("b", {1}).at(0), 3.0f);
  EXPECT_EQ(st.tensor_bytes(), 12u);

  auto expect_dir_refused = [&](const char* needle) {
    try {
      Safetensors::open_dir(dir);
      FAIL() << "expected refusal containing " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  write_index(R"({"weight_map":{"a":"s1.safetensors","b":"s1.safetensors"}})");
  expect_dir_refused("tensor 'b' is listed in shard s1.safetensors but not found there");
  write_index(R"({"weight_map":{"a":"s1.safetensors","c":"s3.safetensors"}})");
  expect_dir_refused("s3.safetensors is missing");
  write_index(R"({"weight_map":{"a":"../s1.safetensors"}})");
  expect_dir_refused("expected a plain file name");
  write_index(R"({"weight_map":{"a":1}})");
  expect_dir_refused("expected a file name string");
  write_index(R"({"weight_map":)");
  expect_dir_refused("not valid JSON");
  expect_dir_refused(
      "not valid JSON: parse error at line 1, column 15: syntax error while "
      "parsing value - unexpected end of input; expected '[', '{', or a literal "
      "(byte 15)");
  // The same tensor in two shards.
  save_safetensors(dir + "/s2.safetensors", {{"a", DType::kF32, {1}, floats_bytes({3})}});
  write_index(R"({"weight_map":{"a":"s1.safetensors","x":"s2.safetensors"}})");
  expect_dir_refused("appears in both");
  std::filesystem::remove(dir + "/model.safetensors.index.json");
  expect_dir_refused("expected model.safetensors or model.safetensors.index.json");
  std::filesystem::remove_all(dir);
}

TEST(Safetensors, RandomBytesNeverCrash) {
  // Mutations of a valid file: every outcome is either a parse or a vq::Error.
  const std::string header =
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("b":{"dtype":"BF16","shape":[2,2],"data_offsets":[8,16]},"__metadata__":{"k":"v"}})";
  const auto file = raw_file(header, std::vector<uint8_t>(16, 0x11));
  std::mt19937_64 rng(7);
  int parsed = 0, refused = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    auto f = file;
    const int n_mut = 1 + static_cast<int>(rng() % 4);
    for (int m = 0; m < n_mut; ++m) f[rng() % f.size()] = static_cast<uint8_t>(rng());
    try {
      Safetensors::from_bytes(f.data(), f.size());
      ++parsed;
    } catch (const Error&) {
      ++refused;
    }
  }
  EXPECT_EQ(parsed + refused, 3000);
  EXPECT_GT(refused, 0);
}

}  // namespace
}  // namespace vq
