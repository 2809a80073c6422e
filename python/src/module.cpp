// veloxquant._veloxquant: the nanobind extension behind the Python package (python/veloxquant).
//
// It exposes the cache configuration parser (veloxquant/cache_config.h) and two classes per
// layer. LayerCache owns a KVCache (veloxquant/cache.h) and runs one attention step over it:
// update_and_fetch of this call's keys/values (with the real queries, for SnapKV's query scoring)
// then the fused attention of src/ops over the returned CacheView (packed segments read in
// place: no dequantized copy of the cache). DeviceLayerCache does the same for CUDA tensors with
// a vq::cuda::DeviceKVCache (veloxquant/cuda_cache.h) and the CUDA attention over its
// DeviceCacheView (decode_attention for one query per head, prefill_attention otherwise), all on
// the caller's stream (torch's current stream). Tensors cross as DLPack arrays (torch tensors):
// the views point at the tensors' own memory, [B, H, S, D] with any element strides; nothing is
// copied.
// Errors: vq::Error from parsing or from validating a step's input becomes ValueError; from
// loading a state or any other operation RuntimeError. Both carry the library's message.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "ops/packed_decode.h"
#include "veloxquant/attention.h"
#include "veloxquant/builder.h"
#include "veloxquant/cache.h"
#include "veloxquant/cache_config.h"
#include "veloxquant/cuda.h"
#include "veloxquant/cuda_cache.h"
#include "veloxquant/error.h"
#include "veloxquant/multi_gpu.h"
#include "veloxquant/tensor.h"

namespace nb = nanobind;

namespace {

using Array = nb::ndarray<>;

#ifdef VQ_HAVE_CUDA
constexpr bool kBuiltWithCuda = true;
#else
constexpr bool kBuiltWithCuda = false;
#endif

std::string dims_str(const Array& a) {
  std::string s = "[";
  for (size_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + "]";
}

const char* device_name(int32_t type) {
  return type == nb::device::cpu::value    ? "CPU"
         : type == nb::device::cuda::value ? "CUDA"
                                           : "other";
}

// A [B, H, S, D] array of fp32, fp16 or bf16 on device `device_type` (DLPack's code; for CUDA
// also on ordinal `device_id`) as a TensorView over the same memory.
vq::TensorView to_view(const Array& a, const char* what,
                       int32_t device_type = nb::device::cpu::value, int32_t device_id = 0) {
  const std::string op = std::string("[veloxquant.Cache] ") + what;
  if (a.device_type() != device_type)
    throw nb::value_error((op + ": expected a " + device_name(device_type) +
                           " tensor (this layer's storage) but got a " +
                           device_name(a.device_type()) + " tensor (DLPack device type " +
                           std::to_string(a.device_type()) + ")")
                              .c_str());
  if (device_type == nb::device::cuda::value && a.device_id() != device_id)
    throw nb::value_error(
        (op + ": expected a tensor on cuda:" + std::to_string(device_id) +
         " (this layer's storage) but got one on cuda:" + std::to_string(a.device_id()))
            .c_str());
  if (a.ndim() != 4)
    throw nb::value_error((op + ": expected 4 dims [B, H, S, D] but got " + dims_str(a)).c_str());
  vq::TensorView v;
  const nb::dlpack::dtype t = a.dtype();
  if (t == nb::dtype<float>())
    v.dtype = vq::DType::kF32;
  else if (t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float) && t.bits == 16 &&
           t.lanes == 1)
    v.dtype = vq::DType::kF16;
  else if (t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) && t.bits == 16 &&
           t.lanes == 1)
    v.dtype = vq::DType::kBF16;
  else
    throw nb::value_error((op + ": expected float32, float16 or bfloat16 but got DLPack code " +
                           std::to_string(t.code) + " with " + std::to_string(t.bits) + " bits")
                              .c_str());
  v.data = a.data();
  for (int i = 0; i < 4; ++i) {
    v.shape[i] = static_cast<int64_t>(a.shape(i));
    v.stride[i] = a.stride(i);
  }
  return v;
}

// The checks of one attention step's queries and output against its keys (both layer kinds).
// typed: a CUDA decode step (one query per sequence), whose queries may be float16, bfloat16 or
// float32 with any strides and whose out is contiguous in the queries' dtype
// (cuda::decode_attention_typed); otherwise both are contiguous float32.
void check_step(const vq::TensorView& k, const vq::TensorView& qv, const vq::TensorView& ov,
                const Array& q, const Array& out, int64_t window, bool typed = false) {
  const char* op = "[veloxquant.Cache] ";
  auto fail = [&](const std::string& m) { throw nb::value_error((op + m).c_str()); };
  if (!typed && (qv.dtype != vq::DType::kF32 || !qv.is_contiguous()))
    fail("queries: expected contiguous float32 but got " + std::string(dtype_name(qv.dtype)) +
         (qv.is_contiguous() ? "" : " (strided)"));
  const char* out_kind = typed ? "contiguous, of the queries' dtype and" : "contiguous float32 of";
  if (ov.dtype != (typed ? qv.dtype : vq::DType::kF32) || !ov.is_contiguous() ||
      ov.shape != qv.shape)
    fail(std::string("out: expected ") + out_kind + " the queries' shape " + dims_str(q) +
         " but got " + dims_str(out) + " " + dtype_name(ov.dtype));
  if (qv.shape[0] != k.shape[0] || qv.shape[2] != k.shape[2] || qv.shape[3] != k.shape[3])
    fail("queries: expected [" + std::to_string(k.shape[0]) + ", H_q, " +
         std::to_string(k.shape[2]) + ", " + std::to_string(k.shape[3]) +
         "] (the keys' B, S, D) but got " + dims_str(q));
  if (window < 0) fail("window: expected >= 0 but got " + std::to_string(window));
}

nb::dict stats_dict(const vq::CacheStats& s) {
  nb::dict d;
  d["method"] = s.method;
  d["tokens_seen"] = s.tokens_seen;
  d["rows_stored"] = s.rows_stored;
  d["bytes_accounted"] = s.bytes_accounted;
  d["bytes_resident"] = s.bytes_resident;
  d["fp16_bytes"] = s.fp16_bytes;
  nb::dict f;
  for (const auto& [name, value] : s.figures) f[name.c_str()] = value;
  d["figures"] = f;
  return d;
}

// Runs fn; a vq::Error it throws becomes a ValueError (input the library refused).
template <typename F>
auto as_value_error(F&& fn) {
  try {
    return fn();
  } catch (const vq::Error& e) {
    throw nb::value_error(e.what());
  }
}

// The config of a layer: the JSON the Python side built (method + fields), with head_dim and the
// layer's KV heads this cache holds (CacheConfig::kv_head_first / kv_heads_total: a tensor-parallel
// rank's share; 0, 0 = not sharded). layer: the model layer the cache serves (veloxquant.Cache
// gives each of its layers its index). Its entries of the per-layer lists (skvq_layer_bits_key /
// skvq_layer_key_rows / skvq_layer_bits_value) and of skvq_perm_file are taken when the cache is
// made, by the C++ builders' functions (make_layer_cache, cuda::make_device_cache's layer); with no
// layer given the per-layer lists are refused (every layer would silently take entry 0) and the
// cache is layer 0's otherwise.
vq::CacheConfig layer_config(const std::string& config_json, int64_t head_dim,
                             int64_t kv_head_first, int64_t kv_heads_total,
                             std::optional<int64_t> layer) {
  return as_value_error([&] {
    vq::CacheConfig cfg = vq::config_from_json(config_json);
    VQ_CHECK(head_dim >= 1 && head_dim <= vq::kMaxCacheHeadDim,
             "[veloxquant.Cache] head_dim: expected 1.." + std::to_string(vq::kMaxCacheHeadDim) +
                 " but got " + std::to_string(head_dim));
    cfg.head_dim = head_dim;
    cfg.kv_head_first = kv_head_first;
    cfg.kv_heads_total = kv_heads_total;
    vq::check_cache_config(cfg);
    VQ_CHECK(
        !layer || *layer >= 0,
        "[veloxquant.Cache] layer: expected >= 0 (the model layer this cache serves) but got " +
            std::to_string(layer.value_or(0)));
    VQ_CHECK(layer || (cfg.skvq_layer_bits_key.empty() && cfg.skvq_layer_key_rows.empty() &&
                       cfg.skvq_layer_bits_value.empty()),
             "[veloxquant.Cache] layer: expected the model layer this cache serves (layer=i: "
             "entry i of skvq_layer_bits_key '" +
                 cfg.skvq_layer_bits_key + "', skvq_layer_key_rows '" + cfg.skvq_layer_key_rows +
                 "' and skvq_layer_bits_value '" + cfg.skvq_layer_bits_value +
                 "') but got none; veloxquant.Cache gives each of its layers its index");
    return cfg;
  });
}

// What both layer kinds expose of their cache C (vq::KVCache or vq::cuda::DeviceKVCache: the same
// protocol): sizes, positions, the prompt end, trimming, statistics and the state file (the CPU
// cache's format for both: a device layer's state loads into a CPU layer and back).
template <typename C>
class LayerBase {
 public:
  std::string method() const { return cache_->method(); }
  int64_t offset() const { return cache_->offset(); }
  int64_t stored_rows() const { return cache_->stored_rows(); }
  int64_t batch() const { return cache_->batch(); }
  int64_t n_kv_heads() const { return cache_->n_kv_heads(); }
  std::vector<int32_t> stored_positions(int64_t b, int64_t h) const {
    return as_value_error([&] {
      VQ_CHECK(b >= 0 && b < cache_->batch() && h >= 0 && h < cache_->n_kv_heads(),
               "[veloxquant.Cache] stored_positions: expected b < " +
                   std::to_string(cache_->batch()) + " and h < " +
                   std::to_string(cache_->n_kv_heads()) + " but got b " + std::to_string(b) +
                   ", h " + std::to_string(h));
      return cache_->stored_positions(b, h);
    });
  }
  void end_prompt() { cache_->end_prompt(); }
  bool is_trimmable() const { return cache_->is_trimmable(); }
  int64_t trim(int64_t n) { return cache_->trim(n); }
  nb::dict stats() const { return stats_dict(cache_->stats()); }
  // The model layer this cache serves (None: not given, the cache is layer 0's).
  std::optional<int64_t> layer() const { return layer_; }

  nb::bytes save() const {
    std::ostringstream os(std::ios::binary);
    cache_->save(os);
    const std::string b = os.str();
    return nb::bytes(b.data(), b.size());
  }
  // All-or-nothing (KVCache::load, DeviceKVCache::load): a refused state leaves the cache as it
  // was.
  void load(const nb::bytes& data) {
    std::istringstream is(std::string(data.c_str(), data.size()), std::ios::binary);
    cache_->load(is);
  }

  // Binds the members above on Layer, a class derived from this one.
  template <typename Layer>
  static void bind(nb::class_<Layer>& c) {
    c.def_prop_ro("method", &Layer::method)
        .def_prop_ro("offset", &Layer::offset)
        .def_prop_ro("stored_rows", &Layer::stored_rows)
        .def_prop_ro("batch", &Layer::batch)
        .def_prop_ro("n_kv_heads", &Layer::n_kv_heads)
        .def("stored_positions", &Layer::stored_positions)
        .def("end_prompt", &Layer::end_prompt)
        .def("is_trimmable", &Layer::is_trimmable)
        .def("trim", &Layer::trim)
        .def("stats", &Layer::stats)
        .def_prop_ro("layer", &Layer::layer)
        .def("save", &Layer::save)
        .def("load", &Layer::load);
  }

 protected:
  std::unique_ptr<C> cache_;
  std::optional<int64_t> layer_;
};

// One layer's cache (one KVCache of the configured method).
class LayerCache : public LayerBase<vq::KVCache> {
 public:
  LayerCache(const std::string& config_json, int64_t head_dim, int64_t kv_head_first,
             int64_t kv_heads_total, std::optional<int64_t> layer) {
    layer_ = layer;
    const vq::CacheConfig cfg =
        layer_config(config_json, head_dim, kv_head_first, kv_heads_total, layer);
    // build_caches' cache of this layer: a list without an entry for it is refused, naming it.
    cache_ = as_value_error([&] { return vq::make_layer_cache(cfg, layer.value_or(0)); });
  }

  // One attention step: appends keys/values [B, H_kv, S, D] and writes attention of the queries
  // q [B, H_q, S, D] (fp32, contiguous; positions offset() .. offset() + S - 1) over every stored
  // row and the new ones into out [B, H_q, S, D] (fp32, contiguous). scale 0 = 1/sqrt(D); window
  // 0 = none. pass_queries hands q to the cache (SnapKV's query scoring).
  void attend(const Array& keys, const Array& values, const Array& q, const Array& out, float scale,
              int64_t window, bool pass_queries) {
    const vq::TensorView k = to_view(keys, "keys");
    const vq::TensorView v = to_view(values, "values");
    const vq::TensorView qv = to_view(q, "queries");
    const vq::TensorView ov = to_view(out, "out");
    check_step(k, qv, ov, q, out, window);
    nb::gil_scoped_release unlocked;
    as_value_error([&] {
      vq::AttentionParams ap;
      ap.scale = scale;
      ap.window = window;
      ap.q_pos0 = cache_->offset();  // read before the update (docs/design.md §C1)
      vq::UpdateOptions uo;
      uo.queries = pass_queries ? &qv : nullptr;
      const vq::CacheView view = cache_->update_and_fetch(k, v, uo);
      vq::attention(qv, view, ap, static_cast<float*>(ov.data));
      return 0;
    });
  }
};

// One layer's cache on a CUDA device: a DeviceKVCache of the configured method, made for the
// first step's B, H_kv and D on the stream and device the Python side passes (torch's current
// stream and the tensors' device); every later step must use the same ones. Same protocol as
// LayerCache; the attention is the CUDA backend's over the fetched DeviceCacheView.
class DeviceLayerCache : public LayerBase<vq::cuda::DeviceKVCache> {
 public:
  DeviceLayerCache(const std::string& config_json, int64_t head_dim, int64_t batch,
                   int64_t n_kv_heads, uintptr_t stream, int32_t device, int64_t kv_head_first,
                   int64_t kv_heads_total, std::optional<int64_t> layer)
      : stream_(stream), device_(device) {
    layer_ = layer;
    if (!kBuiltWithCuda)
      throw std::runtime_error(
          "[veloxquant.Cache] this veloxquant was built without CUDA: reinstall with VQ_CUDA=ON "
          "pip install .");
    const vq::CacheConfig cfg =
        layer_config(config_json, head_dim, kv_head_first, kv_heads_total, layer);
    cache_ = as_value_error([&] {
      return vq::cuda::make_device_cache(cfg, batch, n_kv_heads, head_dim, as_stream(stream),
                                         layer.value_or(0));
    });
  }

  void attend(const Array& keys, const Array& values, const Array& q, const Array& out, float scale,
              int64_t window, bool pass_queries, uintptr_t stream) {
    constexpr int32_t cuda = nb::device::cuda::value;
    const vq::TensorView k = to_view(keys, "keys", cuda, device_);
    const vq::TensorView v = to_view(values, "values", cuda, device_);
    const vq::TensorView qv = to_view(q, "queries", cuda, device_);
    const vq::TensorView ov = to_view(out, "out", cuda, device_);
    // One query per sequence: q and out in the model's dtype, converted on the device
    // (cuda::decode_attention_typed), so Python makes no fp32 copies around a decode step.
    const bool typed = qv.shape[2] == 1;
    check_step(k, qv, ov, q, out, window, typed);
    if (stream != stream_)
      throw nb::value_error(("[veloxquant.Cache] stream: expected the CUDA stream this layer was "
                             "made on (" +
                             std::to_string(stream_) + ") but got " + std::to_string(stream) +
                             ": run every step of one cache on one stream")
                                .c_str());
    nb::gil_scoped_release unlocked;
    as_value_error([&] {
      const vq::cuda::DeviceGuard on_device(device_);  // the tensors' device, restored after
      const int64_t n_q_heads = qv.shape[1], n = qv.shape[2];
      vq::AttentionParams ap;
      ap.scale = scale;
      ap.window = window;
      ap.q_pos0 = cache_->offset();  // read before the update (docs/design.md §C1)
      // The shapes the attention kernels support (D, H_q / H_kv), checked before the update so
      // that a refused step stores nothing: the planner's checks on an empty view (host only).
      vq::cuda::decode_attention_plan(
          ws_.context(), n_q_heads,
          vq::cuda::DeviceCacheView(cache_->batch(), cache_->n_kv_heads(), cache_->head_dim()), ap);
      vq::cuda::DeviceUpdateOptions uo;
      uo.queries = pass_queries ? &qv : nullptr;
      const vq::cuda::DeviceCacheView view = cache_->update_and_fetch(k, v, uo);
      if (typed) {
        const size_t need =
            vq::cuda::decode_typed_staging_bytes(qv.shape[0], n_q_heads, qv.shape[3]);
        if (staging_.size() < need) staging_ = vq::cuda::DeviceBuffer(need);
        vq::cuda::decode_attention_typed(qv, view, ap, ov, staging_.data(), ws_,
                                         as_stream(stream_));
      } else {
        vq::cuda::prefill_attention(static_cast<const float*>(qv.data), n_q_heads, n, view, ap,
                                    static_cast<float*>(ov.data), as_stream(stream_));
      }
      return 0;
    });
  }

  int32_t device() const { return device_; }
  uintptr_t stream() const { return stream_; }

 private:
  static vq::cuda::Stream as_stream(uintptr_t s) { return reinterpret_cast<vq::cuda::Stream>(s); }

  vq::cuda::DecodeWorkspace ws_;
  vq::cuda::DeviceBuffer staging_;  // decode_attention_typed's fp32 q and out
  uintptr_t stream_ = 0;
  int32_t device_ = 0;
};

}  // namespace

NB_MODULE(_veloxquant, m) {
  m.doc() = "veloxquant C++ core: cache configuration and per-layer compressed KV caches";

  m.def("cache_methods", [] { return vq::cache_methods(); });
  m.def(
      "parse_spec",
      [](const std::string& spec) {
        return as_value_error([&] { return vq::config_to_json(vq::parse_cache_arg(spec)); });
      },
      nb::arg("spec"), "Compact spec ('snapkv+skvq:budget=256') -> the config as JSON.");
  m.def(
      "normalize_config",
      [](const std::string& json) {
        return as_value_error([&] { return vq::config_to_json(vq::config_from_json(json)); });
      },
      nb::arg("json"), "JSON object of fields (with 'method') -> the checked config as JSON.");
  m.def("method_fields", [](const std::string& method) {
    return as_value_error([&] { return vq::cache_method_fields(method); });
  });
  m.def(
      "check_layer_lists",
      [](const std::string& json, int64_t n_layers) {
        as_value_error([&] {
          vq::check_layer_lists(vq::config_from_json(json), n_layers, "veloxquant.Cache");
          return 0;
        });
      },
      nb::arg("json"), nb::arg("n_layers"),
      "Refuses (ValueError) per-layer lists of neither 0 nor n_layers entries (build_caches' "
      "rule).");
  m.def("cuda_available", [] { return vq::cuda::is_available(); });
  m.def(
      "_set_cpu_attention_isa",
      [](const std::string& name) {
        using vq::detail::CpuIsa;
        for (CpuIsa isa : {CpuIsa::kPortable, CpuIsa::kAvx2, CpuIsa::kAvx2Int8, CpuIsa::kAvx512,
                           CpuIsa::kAvx512Vnni, CpuIsa::kAvx512Bf16})
          if (name == vq::detail::isa_name(isa)) {
            vq::detail::set_attention_isa(isa);
            return std::string(vq::detail::isa_name(vq::detail::attention_isa()));
          }
        throw nb::value_error(
            ("[veloxquant] isa: expected a CPU instruction set name but got " + name).c_str());
      },
      nb::arg("name"),
      "Tests: the instruction set of the CPU packed decode kernels (capped to the CPU's); "
      "returns the one in use.");
  m.def(
      "cuda_built", [] { return kBuiltWithCuda; }, "True when built with VQ_CUDA=ON.");

  nb::class_<LayerCache> layer(m, "LayerCache");
  layer
      .def(nb::init<const std::string&, int64_t, int64_t, int64_t, std::optional<int64_t>>(),
           nb::arg("config_json"), nb::arg("head_dim"), nb::arg("kv_head_first") = 0,
           nb::arg("kv_heads_total") = 0, nb::arg("layer") = nb::none())
      .def("attend", &LayerCache::attend, nb::arg("keys"), nb::arg("values"), nb::arg("queries"),
           nb::arg("out"), nb::arg("scale"), nb::arg("window"), nb::arg("pass_queries"));
  LayerCache::bind(layer);

  nb::class_<DeviceLayerCache> device_layer(m, "DeviceLayerCache");
  device_layer
      .def(nb::init<const std::string&, int64_t, int64_t, int64_t, uintptr_t, int32_t, int64_t,
                    int64_t, std::optional<int64_t>>(),
           nb::arg("config_json"), nb::arg("head_dim"), nb::arg("batch"), nb::arg("n_kv_heads"),
           nb::arg("stream"), nb::arg("device"), nb::arg("kv_head_first") = 0,
           nb::arg("kv_heads_total") = 0, nb::arg("layer") = nb::none())
      .def("attend", &DeviceLayerCache::attend, nb::arg("keys"), nb::arg("values"),
           nb::arg("queries"), nb::arg("out"), nb::arg("scale"), nb::arg("window"),
           nb::arg("pass_queries"), nb::arg("stream"))
      .def_prop_ro("device", &DeviceLayerCache::device)
      .def_prop_ro("stream", &DeviceLayerCache::stream);
  DeviceLayerCache::bind(device_layer);
}
