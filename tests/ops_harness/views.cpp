// Host cache views for the op harness (see views.h).
#include "ops_harness/views.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <sstream>

#include "veloxquant/group_quant.h"
#include "veloxquant/hadamard.h"

namespace vq::harness {

std::string PackedSpec::str() const {
  std::ostringstream o;
  o << 'K' << kbits << 'V' << vbits << 'g' << group
    << (meta == MetaType::kF16   ? "m16"
        : meta == MetaType::kF32 ? "m32"
                                 : "m8")
    << (perm ? "p" : "") << (rot ? "r" : "");
  return o.str();
}

std::string SegSpec::str() const {
  std::ostringstream o;
  if (packed)
    o << pk.str();
  else
    o << dtype_name(dtype) << (strided ? "s" : "");
  o << 'x' << n << (explicit_pos ? "e" : "");
  return o.str();
}

std::string segs_str(const std::vector<SegSpec>& segs) {
  std::ostringstream o;
  for (size_t i = 0; i < segs.size(); ++i) o << (i ? "+" : "") << segs[i].str();
  return segs.empty() ? "none" : o.str();
}

std::unique_ptr<HostView> make_view(int64_t B, int64_t H, int64_t D,
                                    const std::vector<SegSpec>& segs, uint64_t seed) {
  auto hv = std::make_unique<HostView>();
  CacheView& v = hv->view;
  v.batch = B;
  v.n_kv_heads = H;
  v.head_dim = D;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  // Heterogeneous channels (outlier channels as real keys have), shared by every segment.
  std::vector<float> ch(static_cast<size_t>(D));
  for (auto& c : ch) c = 0.25f + 1.5f * std::abs(nd(rng));
  int64_t p = 0;  // next free position
  for (const SegSpec& s : segs) {
    ViewSegment seg;
    seg.n_rows = s.n;
    if (s.explicit_pos) {
      hv->ints.emplace_back(static_cast<size_t>(B * H * s.n));
      auto& pos = hv->ints.back();
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t i = 0; i < s.n; ++i)
            pos[static_cast<size_t>((b * H + h) * s.n + i)] =
                static_cast<int32_t>(p + 2 * i + (b + h) % 2);
      seg.positions = pos.data();
      p += 2 * s.n + 1;
    } else {
      seg.first_pos = p;
      p += s.n;
    }
    if (!s.packed) {
      for (int kv = 0; kv < 2; ++kv) {
        const int64_t es = static_cast<int64_t>(dtype_size(s.dtype));
        const int64_t stride_c = s.strided ? 2 : 1, off = s.strided ? 1 : 0;
        const int64_t numel = B * H * s.n * D;
        // The gaps of a strided buffer hold NaN bit patterns: reading them would show.
        hv->bytes.emplace_back(static_cast<size_t>((numel * stride_c + off + 1) * es), 0xFF);
        auto& buf = hv->bytes.back();
        std::vector<float> row(static_cast<size_t>(D));
        for (int64_t r = 0; r < B * H * s.n; ++r) {
          for (int64_t d = 0; d < D; ++d) row[d] = nd(rng) * (kv == 0 ? ch[d] : 1.0f);
          for (int64_t d = 0; d < D; ++d)
            from_f32(&row[d], buf.data() + ((r * D + d) * stride_c + off) * es, s.dtype, 1);
        }
        TensorView t;
        t.data = buf.data() + off * es;
        t.dtype = s.dtype;
        t.shape = {B, H, s.n, D};
        t.stride = {H * s.n * D * stride_c, s.n * D * stride_c, D * stride_c, stride_c};
        (kv == 0 ? seg.keys : seg.values) = t;
      }
      v.segments.push_back(seg);
      continue;
    }
    auto ps = std::make_unique<PackedSegment>();
    ps->batch = B;
    ps->n_heads = H;
    ps->n_rows = s.n;
    ps->head_dim = D;
    ps->out_dtype = DType::kF16;
    for (int kv = 0; kv < 2; ++kv) {
      PackedTensor& t = kv == 0 ? ps->keys : ps->values;
      const double bits = kv == 0 ? s.pk.kbits : s.pk.vbits;
      t.fmt = make_row_format(D, bits, s.pk.group, s.pk.meta);
      if (s.pk.perm) {
        hv->ints.emplace_back(static_cast<size_t>(H * D));
        auto& pm = hv->ints.back();
        for (int64_t h = 0; h < H; ++h) {
          std::iota(pm.begin() + h * D, pm.begin() + (h + 1) * D, 0);
          std::shuffle(pm.begin() + h * D, pm.begin() + (h + 1) * D, rng);
        }
        t.perm = pm.data();
      }
      if (s.pk.rot) {
        hv->floats.push_back(hadamard_signs(seed * 31 + kv, H * D));
        t.signs = hv->floats.back().data();
        t.rot_block = static_cast<int32_t>(hadamard_block(D));
      }
      hv->bytes.emplace_back(static_cast<size_t>(B * H * s.n * t.fmt.row_stride + 16), 0);
      auto& buf = hv->bytes.back();
      t.data = buf.data();
      t.stride_h = s.n * t.fmt.row_stride;
      t.stride_b = H * t.stride_h;
      GroupQuantParams gp;
      gp.bits = bits;
      gp.group_size = s.pk.group;
      gp.meta = s.pk.meta;
      std::vector<float> row(static_cast<size_t>(D)), tmp(static_cast<size_t>(D));
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t i = 0; i < s.n; ++i) {
            for (int64_t d = 0; d < D; ++d) row[d] = nd(rng) * (kv == 0 ? ch[d] : 1.0f);
            if (t.transformed()) transform_row(t, h, row.data(), tmp.data());
            quantize_to_records(row.data(), 1, t.fmt, gp, buf.data() + (t.record(b, h, i) - t.data),
                                t.fmt.row_stride, false);
          }
    }
    seg.packed = ps.get();
    hv->packed.push_back(std::move(ps));
    v.segments.push_back(seg);
  }
  hv->span = p;
  return hv;
}

}  // namespace vq::harness
