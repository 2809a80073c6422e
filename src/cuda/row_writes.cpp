// The row-write batches of veloxquant/cuda_row_writes.h: per stream, whether a batch is open, the
// blocks of the update_and_fetch call in progress (only rows converted from them are recorded:
// a policy's own temporaries may be freed before a flush) and the recorded items, launched in
// groups of kRowWritesPerLaunch (device_cache_kernels.cuh). One mutex guards the table; the
// engine's ranks each use their own stream.
#include <mutex>
#include <unordered_map>
#include <vector>

#include "cuda/check.h"
#include "cuda/device_cache_kernels.cuh"
#include "cuda/device_cache_util.h"
#include "veloxquant/cuda_row_writes.h"

namespace vq::cuda {
namespace {

struct StreamWrites {
  int open = 0;                     // batches open on the stream
  const void* sources[2] = {};      // the update call's key / value blocks, or nullptr
  bool in_update = false;           // inside a PolicyDeviceCache::update_and_fetch
  std::vector<RowWriteItem> items;  // recorded, not yet launched
};

std::mutex& table_mutex() {
  static std::mutex m;
  return m;
}
std::unordered_map<Stream, StreamWrites>& table() {
  static std::unordered_map<Stream, StreamWrites> t;
  return t;
}

// Launches the items (the caller holds the mutex) and clears them.
void launch(StreamWrites& w, Stream s) {
  RowWriteItems group;
  for (size_t i = 0; i < w.items.size(); ++i) {
    group.item[group.count++] = w.items[i];
    if (group.count == kRowWritesPerLaunch || i + 1 == w.items.size()) {
      row_writes_launch(group, detail::to_stream(s));
      group.count = 0;
    }
  }
  w.items.clear();
}

}  // namespace

RowWriteBatch::RowWriteBatch(Stream s) : stream_(s) {
  std::lock_guard<std::mutex> lock(table_mutex());
  ++table()[s].open;
}

RowWriteBatch::~RowWriteBatch() {
  try {
    flush();
  } catch (...) {  // a device error: the next checked call on the stream reports it
  }
  std::lock_guard<std::mutex> lock(table_mutex());
  auto it = table().find(stream_);
  if (it != table().end() && --it->second.open <= 0 && it->second.items.empty()) table().erase(it);
}

void RowWriteBatch::flush() {
  detail::flush_row_writes(stream_);
}

namespace detail {

void flush_row_writes(Stream s) {
  std::lock_guard<std::mutex> lock(table_mutex());
  auto it = table().find(s);
  if (it == table().end() || it->second.items.empty()) return;
  launch(it->second, s);
}

bool record_row_write(const ConvertRowsParams& p, int kind, int32_t first, Stream s) {
  std::lock_guard<std::mutex> lock(table_mutex());
  auto it = table().find(s);
  if (it == table().end() || it->second.open == 0 || !it->second.in_update) return false;
  StreamWrites& w = it->second;
  if (kind == 0 && p.src != w.sources[0] && p.src != w.sources[1]) {
    launch(w, s);  // a temporary source: in order, now
    return false;
  }
  w.items.push_back({p, kind, first});
  return true;
}

UpdateCall::UpdateCall(Stream s, const void* keys, const void* values) : stream_(s) {
  std::lock_guard<std::mutex> lock(table_mutex());
  auto it = table().find(s);
  if (it == table().end() || it->second.open == 0) return;
  it->second.sources[0] = keys;
  it->second.sources[1] = values;
  it->second.in_update = true;
  active_ = true;
}

UpdateCall::~UpdateCall() {
  if (!active_) return;
  std::lock_guard<std::mutex> lock(table_mutex());
  auto it = table().find(stream_);
  if (it == table().end()) return;
  it->second.sources[0] = it->second.sources[1] = nullptr;
  it->second.in_update = false;
}

}  // namespace detail
}  // namespace vq::cuda
