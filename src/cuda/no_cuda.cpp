// CUDA stubs for builds without VQ_CUDA: is_available() is false and every other entry point of
// veloxquant/cuda.h throws vq::Error "[cuda] CUDA backend not built (configure with
// -DVQ_CUDA=ON)". Destructors and moves of empty objects work, so code that only declares them
// still runs. The decode planner (decode_plan.cpp: plan_decode and match_plan on a fake
// DecodeContext) is plain C++ and is built in this configuration too.
#include <string>

#include "cuda/model_ops.cuh"
#include "veloxquant/cuda.h"
#include "veloxquant/cuda_cache.h"
#include "veloxquant/error.h"
#include "veloxquant/multi_gpu.h"

namespace vq::cuda {

namespace {
[[noreturn]] void not_built(const char* op) {
  throw Error(std::string("[") + op +
              "] expected the CUDA backend but got a build without it: CUDA backend not built "
              "(configure with -DVQ_CUDA=ON)");
}
}  // namespace

bool is_available() {
  return false;
}
int device_count() {
  return 0;
}
bool has_nccl() {
  return false;
}
void set_device(int) {
  not_built("cuda::set_device");
}
int current_device() {
  not_built("cuda::current_device");
}
DeviceGuard::DeviceGuard(int) : prev_(0) {
  not_built("cuda::DeviceGuard");
}
DeviceGuard::~DeviceGuard() = default;
std::unique_ptr<Communicator> make_device_reference_communicator(int64_t, Stream) {
  not_built("cuda::make_device_reference_communicator");
}
std::unique_ptr<Communicator> make_nccl_communicator(const std::vector<int>&,
                                                     const std::vector<Stream>&) {
  not_built("cuda::make_nccl_communicator");
}
DeviceInfo device_info() {
  not_built("cuda::device_info");
}
void synchronize(Stream) {
  not_built("cuda::synchronize");
}

DeviceBuffer::DeviceBuffer(size_t) {
  not_built("cuda::DeviceBuffer");
}
DeviceBuffer::~DeviceBuffer() = default;
DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept : p_(o.p_), n_(o.n_) {
  o.p_ = nullptr;
  o.n_ = 0;
}
DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  p_ = o.p_;
  n_ = o.n_;
  o.p_ = nullptr;
  o.n_ = 0;
  return *this;
}
void DeviceBuffer::upload(const void*, size_t, size_t, Stream) {
  not_built("cuda::upload");
}
void DeviceBuffer::download(void*, size_t, size_t, Stream) const {
  not_built("cuda::download");
}
void DeviceBuffer::fill_zero(Stream) {
  not_built("cuda::fill_zero");
}
DeviceBuffer DeviceBuffer::from_host(const void*, size_t, Stream) {
  not_built("cuda::DeviceBuffer::from_host");
}

int64_t DeviceSegment::bytes(int64_t, int64_t, int64_t) const {
  not_built("cuda::DeviceSegment::bytes");
}
DeviceCacheView::DeviceCacheView(int64_t, int64_t, int64_t) {
  not_built("cuda::DeviceCacheView");
}
DeviceCacheView DeviceCacheView::upload(const CacheView&, Stream) {
  not_built("cuda::DeviceCacheView::upload");
}
void DeviceCacheView::add_segment(const DeviceSegment&, std::vector<DeviceBuffer>) {
  not_built("cuda::DeviceCacheView::add_segment");
}
int64_t DeviceCacheView::n_rows() const {
  not_built("cuda::DeviceCacheView::n_rows");
}
int64_t DeviceCacheView::bytes() const {
  not_built("cuda::DeviceCacheView::bytes");
}

void* DecodeWorkspace::reserve(size_t) {
  not_built("cuda::DecodeWorkspace::reserve");
}

const DecodeContext& DecodeWorkspace::context() {
  not_built("cuda::DecodeWorkspace::context");
}
DecodeContext DecodeContext::current() {
  not_built("cuda::DecodeContext::current");
}
void decode_attention_run_batch(const std::vector<DecodeBatchItem>&, DecodeWorkspace&, Stream) {
  not_built("cuda::decode_attention_run_batch");
}
void decode_attention_run(const DecodePlan&, const float*, const DeviceCacheView&, float*,
                          DecodeWorkspace&, Stream) {
  not_built("cuda::decode_attention_run");
}
void decode_attention(const float*, int64_t, const DeviceCacheView&, const AttentionParams&, float*,
                      DecodeWorkspace&, Stream, const DecodeOptions&) {
  not_built("cuda::decode_attention");
}
std::vector<float> decode_attention_host(const std::vector<float>&, int64_t, const DeviceCacheView&,
                                         const AttentionParams&, const DecodeOptions&) {
  not_built("cuda::decode_attention_host");
}

size_t decode_typed_staging_bytes(int64_t, int64_t, int64_t) {
  not_built("cuda::decode_typed_staging_bytes");
}
void decode_attention_typed(const TensorView&, const DeviceCacheView&, const AttentionParams&,
                            const TensorView&, void*, DecodeWorkspace&, Stream) {
  not_built("cuda::decode_attention_typed");
}
void skvq_channel_perms(const TensorView&, int32_t*, Stream) {
  not_built("cuda::skvq_channel_perms");
}
void skvq_quantize_rows(const TensorView&, const PackedRowFormat&, const GroupQuantParams&,
                        const int32_t*, const float*, int32_t, uint8_t*, Stream, const double*) {
  not_built("cuda::skvq_quantize_rows");
}

void snap_scores(const TensorView&, const TensorView*, const int32_t*, const int32_t*, int64_t,
                 float*, Stream) {
  not_built("cuda::snap_scores");
}
void snap_pool(const float*, int64_t, int64_t, int64_t, int64_t, int64_t, PoolKind, float*,
               Stream) {
  not_built("cuda::snap_pool");
}
int64_t snap_select(const float*, int64_t, int64_t, int64_t, int64_t, int64_t, int32_t*, Stream) {
  not_built("cuda::snap_select");
}
int64_t snap_select_frames(const TensorView&, const TensorView*, const int32_t*, const int32_t*,
                           const SnapSelectParams&, int32_t*, DecodeWorkspace&, Stream) {
  not_built("cuda::snap_select_frames");
}
void gather_rows(const void*, int64_t, int64_t, int64_t, const int32_t*, int64_t, void*,
                 const int32_t*, int32_t, int32_t*, Stream) {
  not_built("cuda::gather_rows");
}

// ---- GPU-resident caches and prefill attention (veloxquant/cuda_cache.h) ----------------------

int64_t DeviceKVCache::trim(int64_t) {
  not_built("cuda::DeviceKVCache::trim");
}
void DeviceKVCache::merge_batch(const std::vector<const DeviceKVCache*>&) const {
  not_built("cuda::DeviceKVCache::merge_batch");
}
Mask DeviceKVCache::make_mask(int64_t, int64_t) const {
  not_built("cuda::DeviceKVCache::make_mask");
}
std::unique_ptr<DeviceKVCache> make_device_cache(const CacheConfig&, int64_t, int64_t, int64_t,
                                                 Stream, int64_t) {
  not_built("cuda::make_device_cache");
}
HostSegment download_segment(const DeviceCacheView&, size_t, Stream) {
  not_built("cuda::download_segment");
}
void prefill_attention(const float*, int64_t, int64_t, const DeviceCacheView&,
                       const AttentionParams&, float*, Stream) {
  not_built("cuda::prefill_attention");
}
std::vector<float> prefill_attention_host(const std::vector<float>&, int64_t, int64_t,
                                          const DeviceCacheView&, const AttentionParams&) {
  not_built("cuda::prefill_attention_host");
}

// ---- the CUDA engine's forward ops (cuda/model_ops.cuh) ---------------------------------------

void embed_rows(const int32_t*, int64_t, const void*, DType, int64_t, float*, Stream) {
  not_built("cuda::embed_rows");
}
void add_rmsnorm(const AddNormParams&, Stream) {
  not_built("cuda::add_rmsnorm");
}
void qkv_rope(const QkvRopeParams&, Stream) {
  not_built("cuda::qkv_rope");
}
void heads_to_tokens(const float*, const StepTokens&, int64_t, int64_t, void*, DType, Stream) {
  not_built("cuda::heads_to_tokens");
}
void swiglu(const float*, const float*, const float*, const float*, int64_t, int64_t, void*, DType,
            Stream, int64_t) {
  not_built("cuda::swiglu");
}
void add_bias(float*, const float*, int64_t, int64_t, Stream) {
  not_built("cuda::add_bias");
}
Blas::Blas(Stream) {
  not_built("cuda::Blas");
}
Blas::~Blas() = default;
void Blas::gemm(const void*, DType, int64_t, int64_t, const void*, int64_t, float*) {
  not_built("cuda::Blas::gemm");
}
void argmax_rows(const float*, int64_t, int64_t, int64_t, int32_t*, Stream) {
  not_built("cuda::argmax_rows");
}
void fill_uniform(void*, DType, int64_t, uint64_t, Stream) {
  not_built("cuda::fill_uniform");
}
PhaseEvents::~PhaseEvents() = default;
void PhaseEvents::mark(int, Stream) {
  not_built("cuda::PhaseEvents::mark");
}
void PhaseEvents::collect(std::vector<double>*, std::vector<double>*, std::vector<PhaseCounts>*) {
  not_built("cuda::PhaseEvents::collect");
}
Stream create_stream() {
  not_built("cuda::create_stream");
}
void destroy_stream(Stream) {}
void copy_to_device(void*, const void*, size_t, Stream) {
  not_built("cuda::copy_to_device");
}
void copy_to_host(void*, const void*, size_t, Stream) {
  not_built("cuda::copy_to_host");
}
void device_memory(size_t*, size_t*) {
  not_built("cuda::device_memory");
}
double device_copy_bandwidth(int64_t, Stream) {
  not_built("cuda::device_copy_bandwidth");
}

}  // namespace vq::cuda
