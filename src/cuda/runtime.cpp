// Device discovery, the error path of VQ_CUDA_CHECK, DeviceBuffer (plain cudaMalloc, size rounded
// up to 16 bytes so kernels may read whole 16-byte words at a buffer's end) and DecodeWorkspace.
#include <cuda_runtime_api.h>

#include <string>
#include <utility>

#include "cuda/check.h"
#include "cuda/counters.h"
#include "veloxquant/cuda.h"
#include "veloxquant/multi_gpu.h"

namespace vq::cuda {

namespace detail {

void throw_cuda_error(cudaError_t e, const char* call, const char* file, int line) {
  // Consume the thread's last error: a failure the caller catches and handles (a refused
  // allocation with a smaller fallback) must not resurface at the next VQ_CUDA_LAUNCH_CHECK,
  // which reads cudaGetLastError(). Sticky errors stay: the runtime returns them again anyway.
  (void)cudaGetLastError();
  throw Error(std::string("[cuda] expected ") + call + " to succeed but it failed at " + file +
              ":" + std::to_string(line) + ": " + cudaGetErrorName(e) + ": " +
              cudaGetErrorString(e));
}

}  // namespace detail

using detail::to_stream;

bool is_available() {
  return device_count() > 0;
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no device / no driver" status
    return 0;
  }
  return n;
}

void set_device(int device) {
  VQ_CUDA_CHECK(cudaSetDevice(device));
}

int current_device() {
  int d = 0;
  VQ_CUDA_CHECK(cudaGetDevice(&d));
  return d;
}

DeviceGuard::DeviceGuard(int device) : prev_(current_device()) {
  if (device != prev_) set_device(device);
}

DeviceGuard::~DeviceGuard() {
  try {
    if (current_device() != prev_) set_device(prev_);
  } catch (...) {  // a sticky device error: reported by the next checked call
  }
}

bool has_nccl() {
#ifdef VQ_NCCL
  return true;
#else
  return false;
#endif
}

#ifndef VQ_NCCL  // else src/cuda/nccl_communicator.cpp
std::unique_ptr<Communicator> make_nccl_communicator(const std::vector<int>&,
                                                     const std::vector<Stream>&) {
  throw Error(
      "[cuda] make_nccl_communicator: expected a build with NCCL but this one has none "
      "(configure with -DVQ_NCCL=ON)");
}
#endif

DeviceInfo device_info() {
  int dev = 0;
  VQ_CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp prop{};
  VQ_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  DeviceInfo info;
  info.name = prop.name;
  info.cc_major = prop.major;
  info.cc_minor = prop.minor;
  info.sm_count = prop.multiProcessorCount;
  info.l2_bytes = prop.l2CacheSize;
  info.global_bytes = static_cast<int64_t>(prop.totalGlobalMem);
  return info;
}

void synchronize(Stream s) {
  detail::count_sync();
  VQ_CUDA_CHECK(cudaStreamSynchronize(to_stream(s)));
}

namespace {

void release(void* p) {  // a DeviceBuffer's memory (cudaFree waits for the device: counted)
  if (!p) return;
  detail::count_free();
  (void)cudaFree(p);
}

}  // namespace

DeviceBuffer::DeviceBuffer(size_t bytes) {
  n_ = bytes;
  const size_t alloc = (bytes + 15) / 16 * 16 + 16;  // whole 16-byte words, plus one spare
  detail::count_malloc();
  VQ_CUDA_CHECK(cudaMalloc(&p_, alloc));
}

DeviceBuffer::~DeviceBuffer() {
  release(p_);  // never throws from a destructor
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept
    : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    release(p_);
    p_ = std::exchange(o.p_, nullptr);
    n_ = std::exchange(o.n_, 0);
  }
  return *this;
}

void DeviceBuffer::upload(const void* src, size_t bytes, size_t offset, Stream s) {
  VQ_CHECK(offset + bytes <= n_, "[cuda::upload] expected at most " + std::to_string(n_) +
                                     " bytes but got " + std::to_string(offset + bytes));
  if (bytes == 0) return;
  VQ_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(p_) + offset, src, bytes, cudaMemcpyHostToDevice,
                                to_stream(s)));
  synchronize(s);
}

void DeviceBuffer::download(void* dst, size_t bytes, size_t offset, Stream s) const {
  VQ_CHECK(offset + bytes <= n_, "[cuda::download] expected at most " + std::to_string(n_) +
                                     " bytes but got " + std::to_string(offset + bytes));
  if (bytes == 0) return;
  VQ_CUDA_CHECK(cudaMemcpyAsync(dst, static_cast<const char*>(p_) + offset, bytes,
                                cudaMemcpyDeviceToHost, to_stream(s)));
  synchronize(s);
}

void DeviceBuffer::fill_zero(Stream s) {
  if (p_) VQ_CUDA_CHECK(cudaMemsetAsync(p_, 0, (n_ + 15) / 16 * 16 + 16, to_stream(s)));
}

DeviceBuffer DeviceBuffer::from_host(const void* src, size_t bytes, Stream s) {
  DeviceBuffer b(bytes);
  b.upload(src, bytes, 0, s);
  return b;
}

void* DecodeWorkspace::reserve(size_t bytes) {
  if (buf_.size() < bytes || !buf_.data()) {
    buf_ = DeviceBuffer();  // free first: the new one may be large
    buf_ = DeviceBuffer(bytes < 4096 ? 4096 : bytes);
  }
  return buf_.data();
}

}  // namespace vq::cuda
