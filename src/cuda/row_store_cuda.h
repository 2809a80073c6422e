// The CUDA row backend (src/kv/row_store.h): cache policies built over it keep their rows in
// device memory and queue every copy, conversion, gather and SnapKV selection on stream s.
#pragma once

#include <memory>

#include "kv/row_store.h"
#include "veloxquant/cuda.h"

namespace vq::cuda {

std::unique_ptr<kv::RowBackend> make_row_backend(Stream s);

}  // namespace vq::cuda
