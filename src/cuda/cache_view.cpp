// DeviceCacheView: a cache view whose rows live on the device, uploaded from a CPU CacheView or
// assembled from device pieces (see veloxquant/cuda.h).
//
// Upload merges neighbouring segments of one kind into one device segment: full-precision
// segments of one dtype become one [B, H, n, D] contiguous block; packed segments of one format
// and one set of transforms become one [B, H, n, row_stride] record block (records copied byte for
// byte, never re-quantized; channel-axis key runs listed in the segment's run starts). Positions
// stay implicit (first_pos + i) while the merged rows form one run, and become an explicit
// [B, H, n] int32 array otherwise.
#include <cuda_runtime_api.h>

#include <cstring>
#include <string>
#include <vector>

#include "cuda/check.h"
#include "veloxquant/cuda.h"

namespace vq::cuda {

int64_t DeviceSegment::bytes(int64_t batch, int64_t heads, int64_t head_dim) const {
  const int64_t bhn = batch * heads * n_rows;
  int64_t b = 0;
  if (packed) {
    b = bhn * (static_cast<int64_t>(k_fmt.row_stride) + v_fmt.row_stride);
  } else {
    b = 2 * bhn * head_dim * static_cast<int64_t>(dtype_size(dtype));
  }
  if (positions) b += bhn * 4;
  return b;
}

DeviceCacheView::DeviceCacheView(int64_t batch, int64_t n_kv_heads, int64_t head_dim)
    : batch_(batch), heads_(n_kv_heads), head_dim_(head_dim) {
  VQ_CHECK(batch >= 1 && n_kv_heads >= 1 && head_dim >= 1,
           "[cuda::DeviceCacheView] expected B, H_kv, D >= 1 but got " + std::to_string(batch) +
               ", " + std::to_string(n_kv_heads) + ", " + std::to_string(head_dim));
}

void DeviceCacheView::add_segment(const DeviceSegment& seg, std::vector<DeviceBuffer> owned) {
  VQ_CHECK(seg.n_rows >= 0,
           "[cuda::DeviceCacheView] expected n_rows >= 0 but got " + std::to_string(seg.n_rows));
  VQ_CHECK(seg.capacity == 0 || seg.capacity >= seg.n_rows,
           "[cuda::DeviceCacheView] expected capacity 0 or >= n_rows but got " +
               std::to_string(seg.capacity));
  if (seg.packed) {
    VQ_CHECK(seg.k_fmt.head_dim == head_dim_ && seg.v_fmt.head_dim == head_dim_,
             "[cuda::DeviceCacheView] expected packed formats of head_dim " +
                 std::to_string(head_dim_) + " but got " + std::to_string(seg.k_fmt.head_dim) +
                 " / " + std::to_string(seg.v_fmt.head_dim));
  } else {
    VQ_CHECK(seg.n_rows == 0 || (seg.keys && seg.values),
             "[cuda::DeviceCacheView] expected key and value rows but got a null pointer");
  }
  segs_.push_back(seg);
  for (auto& b : owned) owned_.push_back(std::move(b));
}

int64_t DeviceCacheView::n_rows() const {
  int64_t n = 0;
  for (const auto& s : segs_) n += s.n_rows;
  return n;
}

int64_t DeviceCacheView::bytes() const {
  int64_t n = 0;
  for (const auto& s : segs_) n += s.bytes(batch_, heads_, head_dim_);
  return n;
}

namespace {

bool same_format(const PackedRowFormat& a, const PackedRowFormat& b) {
  return a.head_dim == b.head_dim && a.group_size == b.group_size && a.n_groups == b.n_groups &&
         a.code_bytes == b.code_bytes && a.row_stride == b.row_stride &&
         a.spec.bits_x2 == b.spec.bits_x2 && a.meta == b.meta && a.axis == b.axis;
}

bool same_transform(const PackedTensor& a, const PackedTensor& b) {
  return a.perm == b.perm && a.signs == b.signs && a.rot_block == b.rot_block;
}

// Can segment b follow segment a inside one device segment?
bool mergeable(const ViewSegment& a, const ViewSegment& b) {
  if ((a.packed != nullptr) != (b.packed != nullptr)) return false;
  if (a.packed) {
    const PackedSegment& x = *a.packed;
    const PackedSegment& y = *b.packed;
    return same_format(x.keys.fmt, y.keys.fmt) && same_format(x.values.fmt, y.values.fmt) &&
           same_transform(x.keys, y.keys) && same_transform(x.values, y.values);
  }
  return a.keys.dtype == b.keys.dtype && a.values.dtype == b.values.dtype &&
         a.keys.dtype == a.values.dtype;
}

// Raw bytes of row (b, h, i) of a full-precision TensorView into dst (its own dtype).
void copy_fp_row(const TensorView& t, int64_t b, int64_t h, int64_t i, uint8_t* dst) {
  const int64_t d = t.shape[3];
  const size_t es = dtype_size(t.dtype);
  const uint8_t* src = static_cast<const uint8_t*>(t.row(b, h, i));
  if (t.stride[3] == 1) {
    std::memcpy(dst, src, static_cast<size_t>(d) * es);
    return;
  }
  for (int64_t c = 0; c < d; ++c)
    std::memcpy(dst + c * static_cast<int64_t>(es),
                src + c * t.stride[3] * static_cast<int64_t>(es), es);
}

}  // namespace

DeviceCacheView DeviceCacheView::upload(const CacheView& v, Stream s) {
  DeviceCacheView out(v.batch, v.n_kv_heads, v.head_dim);
  const int64_t B = v.batch, H = v.n_kv_heads, D = v.head_dim;
  size_t i0 = 0;
  while (i0 < v.segments.size()) {
    if (v.segments[i0].n_rows == 0) {
      ++i0;
      continue;
    }
    size_t i1 = i0 + 1;
    while (i1 < v.segments.size() &&
           (v.segments[i1].n_rows == 0 || mergeable(v.segments[i0], v.segments[i1])))
      ++i1;
    // Segments [i0, i1) become one device segment.
    int64_t n = 0;
    bool implicit = true;
    int64_t next_pos = v.segments[i0].first_pos;
    for (size_t k = i0; k < i1; ++k) {
      const ViewSegment& sg = v.segments[k];
      if (sg.n_rows == 0) continue;
      if (sg.positions || sg.first_pos != next_pos) implicit = false;
      next_pos = sg.first_pos + sg.n_rows;
      n += sg.n_rows;
    }
    DeviceSegment ds;
    ds.n_rows = n;
    ds.first_pos = v.segments[i0].first_pos;
    std::vector<DeviceBuffer> owned;
    if (!implicit) {
      std::vector<int32_t> pos(static_cast<size_t>(B * H * n));
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h) {
          int64_t r = 0;
          for (size_t k = i0; k < i1; ++k) {
            const ViewSegment& sg = v.segments[k];
            for (int64_t i = 0; i < sg.n_rows; ++i)
              pos[static_cast<size_t>((b * H + h) * n + r++)] = sg.position(b, h, i, H);
          }
        }
      owned.push_back(DeviceBuffer::from_vector(pos, s));
      ds.positions = owned.back().as<int32_t>();
    }
    const ViewSegment& first = v.segments[i0];
    if (first.packed) {
      const PackedSegment& ps = *first.packed;
      VQ_CHECK(ps.keys.fmt.head_dim == D && ps.values.fmt.head_dim == D,
               "[cuda::DeviceCacheView::upload] expected packed rows of head_dim " +
                   std::to_string(D) + " but got " + std::to_string(ps.keys.fmt.head_dim));
      VQ_CHECK(ps.values.fmt.axis == QuantAxis::kToken,
               "[cuda::DeviceCacheView::upload] expected token-axis packed values but got "
               "channel-axis value records");
      ds.packed = true;
      if (ps.keys.fmt.axis == QuantAxis::kChannel) {
        // Channel-axis keys: every merged segment's runs (one per segment, or its own list, host
        // memory in a CPU view) become the device segment's run starts.
        std::vector<int32_t> runs(1, 0);
        int64_t r0 = 0;
        for (size_t k = i0; k < i1; ++k) {
          const ViewSegment& sg = v.segments[k];
          if (sg.n_rows == 0) continue;
          const PackedTensor& t = sg.packed->keys;
          if (t.runs) {
            VQ_CHECK(t.n_runs >= 1 && t.runs[0] == 0 && t.runs[t.n_runs] == sg.n_rows,
                     "[cuda::DeviceCacheView::upload] expected channel-axis runs covering the "
                     "segment's " +
                         std::to_string(sg.n_rows) + " rows");
            for (int32_t r = 1; r <= t.n_runs; ++r)
              runs.push_back(static_cast<int32_t>(r0 + t.runs[r]));
          } else {
            runs.push_back(static_cast<int32_t>(r0 + sg.n_rows));
          }
          r0 += sg.n_rows;
        }
        owned.push_back(DeviceBuffer::from_vector(runs, s));
        ds.k_runs = owned.back().as<int32_t>();
        ds.k_n_runs = static_cast<int32_t>(runs.size() - 1);
      }
      ds.k_fmt = ps.keys.fmt;
      ds.v_fmt = ps.values.fmt;
      for (int kv = 0; kv < 2; ++kv) {
        const int64_t stride = kv == 0 ? ds.k_fmt.row_stride : ds.v_fmt.row_stride;
        std::vector<uint8_t> host(static_cast<size_t>(B * H * n * stride));
        for (int64_t b = 0; b < B; ++b)
          for (int64_t h = 0; h < H; ++h) {
            int64_t r = 0;
            for (size_t k = i0; k < i1; ++k) {
              const ViewSegment& sg = v.segments[k];
              const PackedTensor& t = kv == 0 ? sg.packed->keys : sg.packed->values;
              for (int64_t i = 0; i < sg.n_rows; ++i)
                std::memcpy(host.data() + ((b * H + h) * n + r++) * stride, t.record(b, h, i),
                            static_cast<size_t>(stride));
            }
          }
        owned.push_back(DeviceBuffer::from_vector(host, s));
        (kv == 0 ? ds.k_data : ds.v_data) = owned.back().as<uint8_t>();
        const PackedTensor& t = kv == 0 ? ps.keys : ps.values;
        if (t.perm) {
          owned.push_back(DeviceBuffer::from_host(t.perm, static_cast<size_t>(H * D) * 4, s));
          (kv == 0 ? ds.k_perm : ds.v_perm) = owned.back().as<int32_t>();
        }
        if (t.signs) {
          owned.push_back(DeviceBuffer::from_host(t.signs, static_cast<size_t>(H * D) * 4, s));
          (kv == 0 ? ds.k_signs : ds.v_signs) = owned.back().as<float>();
          (kv == 0 ? ds.k_rot_block : ds.v_rot_block) = t.rot_block;
        }
      }
    } else {
      ds.dtype = first.keys.dtype;
      const size_t es = dtype_size(ds.dtype);
      const int64_t row_bytes = D * static_cast<int64_t>(es);
      for (int kv = 0; kv < 2; ++kv) {
        std::vector<uint8_t> host(static_cast<size_t>(B * H * n * row_bytes));
        for (int64_t b = 0; b < B; ++b)
          for (int64_t h = 0; h < H; ++h) {
            int64_t r = 0;
            for (size_t k = i0; k < i1; ++k) {
              const ViewSegment& sg = v.segments[k];
              const TensorView& t = kv == 0 ? sg.keys : sg.values;
              VQ_CHECK(t.shape[3] == D && t.shape[2] >= sg.n_rows,
                       "[cuda::DeviceCacheView::upload] expected segment rows [B, H, n, " +
                           std::to_string(D) + "] but got a view of head_dim " +
                           std::to_string(t.shape[3]));
              for (int64_t i = 0; i < sg.n_rows; ++i)
                copy_fp_row(t, b, h, i, host.data() + ((b * H + h) * n + r++) * row_bytes);
            }
          }
        owned.push_back(DeviceBuffer::from_vector(host, s));
        (kv == 0 ? ds.keys : ds.values) = owned.back().data();
      }
    }
    out.add_segment(ds, std::move(owned));
    i0 = i1;
  }
  return out;
}

}  // namespace vq::cuda
