// Host entry points of the SKVQ flush on the device (veloxquant/cuda.h): validation and the
// parameter blocks of skvq_flush.cuh.
#include <cmath>
#include <string>

#include "cuda/check.h"
#include "cuda/skvq_flush.cuh"
#include "veloxquant/cuda.h"

namespace vq::cuda {

namespace {

std::string shape_str(const TensorView& t) {
  return "[" + std::to_string(t.shape[0]) + ", " + std::to_string(t.shape[1]) + ", " +
         std::to_string(t.shape[2]) + ", " + std::to_string(t.shape[3]) + "]";
}

void check_rows(const TensorView& rows, const char* op) {
  VQ_CHECK(rows.shape[0] >= 1 && rows.shape[1] >= 1 && rows.shape[2] >= 0 && rows.shape[3] >= 1,
           std::string("[") + op + "] expected rows [B>=1, H>=1, n>=0, D>=1] but got " +
               shape_str(rows));
  VQ_CHECK(rows.is_contiguous(),
           std::string("[") + op + "] expected contiguous device rows but got strides " +
               std::to_string(rows.stride[0]) + ", " + std::to_string(rows.stride[1]) + ", " +
               std::to_string(rows.stride[2]) + ", " + std::to_string(rows.stride[3]));
  VQ_CHECK(rows.data != nullptr || rows.numel() == 0,
           std::string("[") + op + "] expected device rows but got nullptr");
}

}  // namespace

void skvq_channel_perms(const TensorView& rows, int32_t* perm, Stream s) {
  check_rows(rows, "skvq_channel_perms");
  VQ_CHECK(perm != nullptr, "[skvq_channel_perms] expected a device perm buffer but got nullptr");
  SkvqPermParams p;
  p.rows = rows.data;
  p.dtype = static_cast<int>(rows.dtype);
  p.batch = static_cast<int32_t>(rows.shape[0]);
  p.n_heads = static_cast<int32_t>(rows.shape[1]);
  p.n = rows.shape[2];
  p.head_dim = static_cast<int32_t>(rows.shape[3]);
  p.perm = perm;
  skvq_channel_perms_launch(p, detail::to_stream(s));
}

void skvq_quantize_rows(const TensorView& rows, const PackedRowFormat& fmt,
                        const GroupQuantParams& gp, const int32_t* perm, const float* signs,
                        int32_t rot_block, uint8_t* records, Stream s, const double* key_u) {
  check_rows(rows, "skvq_quantize_rows");
  const int64_t D = rows.shape[3];
  check_params(gp, D);
  const bool channel = fmt.axis == QuantAxis::kChannel;
  VQ_CHECK(fmt.head_dim == D && (channel || fmt.group_size == gp.group_size) &&
               fmt.spec.bits_x2 == code_spec_from_bits(gp.bits).bits_x2 && fmt.meta == gp.meta,
           "[skvq_quantize_rows] expected a row format matching the rows and the quantizer");
  // Channel-axis records: each (b, h)'s n rows are one chunk, which must hold its 2D metadata.
  VQ_CHECK(!channel || rows.shape[2] == 0 || rows.shape[2] * fmt.n_groups >= 2 * D,
           "[skvq_quantize_rows] expected a chunk of at least " +
               std::to_string((2 * D + fmt.n_groups - 1) / fmt.n_groups) +
               " rows for channel-axis records (its metadata lives in its records) but got " +
               std::to_string(rows.shape[2]));
  VQ_CHECK(records != nullptr || rows.numel() == 0,
           "[skvq_quantize_rows] expected device records but got nullptr");
  SkvqQuantParams p;
  p.rows = rows.data;
  p.dtype = static_cast<int>(rows.dtype);
  p.n_rows_total = rows.shape[0] * rows.shape[1] * rows.shape[2];
  p.rows_per_head = rows.shape[2] > 0 ? rows.shape[2] : 1;
  p.n_heads = static_cast<int32_t>(rows.shape[1]);
  p.head_dim = static_cast<int32_t>(D);
  p.perm = perm;
  p.signs = signs;
  if (signs) {
    VQ_CHECK(rot_block >= 1 && D % rot_block == 0 && (rot_block & (rot_block - 1)) == 0,
             "[skvq_quantize_rows] expected a power-of-two rotation block dividing " +
                 std::to_string(D) + " but got " + std::to_string(rot_block));
    p.rot_block = rot_block;
    p.rot_norm = static_cast<float>(1.0 / std::sqrt(static_cast<double>(rot_block)));
  }
  p.channel = channel ? 1 : 0;
  p.group_size = static_cast<int32_t>(channel ? rows.shape[2] : gp.group_size);
  p.n_groups = fmt.n_groups;
  p.levels = static_cast<float>(fmt.spec.levels());
  p.bits = fmt.spec.bits();
  p.ternary = fmt.spec.ternary() ? 1 : 0;
  p.meta = static_cast<int32_t>(fmt.meta);
  const ClipAlphas al = clip_alphas(gp);
  p.n_alpha = al.n;
  for (int i = 0; i < al.n; ++i) p.alpha[i] = al.a[static_cast<size_t>(i)];
  VQ_CHECK(key_u == nullptr || channel,
           "[skvq_quantize_rows] expected error-feedback factors only for channel-axis records");
  p.key_u = key_u;
  p.code_bytes = fmt.code_bytes;
  p.packed_bytes = static_cast<int32_t>(packed_code_bytes(D, fmt.spec));
  p.row_stride = fmt.row_stride;
  p.records = records;
  skvq_quantize_launch(p, detail::to_stream(s));
}

}  // namespace vq::cuda
