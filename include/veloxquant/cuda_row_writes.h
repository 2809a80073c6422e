// Row writes of many caches' updates in one launch (issue 13: a decode step appends one row per
// sequence and layer; launched one by one those writes cost more than they move).
//
// While a RowWriteBatch is open on a stream, the CUDA caches' update_and_fetch on that stream
// record the conversions of the call's own key / value rows into their stores (and the position
// runs they write) instead of launching them; flush() launches everything recorded so far, in
// order, in a few launches (src/cuda/row_writes.cpp). Every other operation of a cache or row
// store on that stream (growth copies, quantization, selection, downloads, state files, a store's
// destruction) flushes first, so a policy never reads a row still pending. What the batch cannot
// see: the views update_and_fetch returns point at rows that may still be pending, so the holder
// of the batch flushes before it launches attention over them (src/model/engine_cuda.cpp). The
// caller's key / value blocks must stay unchanged until the flush. Results are bit for bit those
// of the unbatched writes (the same conversion per element). Closing the batch flushes.
#pragma once

#include "veloxquant/cuda.h"

namespace vq::cuda {

class RowWriteBatch {
 public:
  explicit RowWriteBatch(Stream s);
  ~RowWriteBatch();
  RowWriteBatch(const RowWriteBatch&) = delete;
  RowWriteBatch& operator=(const RowWriteBatch&) = delete;
  // Launches the recorded writes (none: nothing happens).
  void flush();

 private:
  Stream stream_;
};

}  // namespace vq::cuda
