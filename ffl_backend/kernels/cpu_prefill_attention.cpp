// fastflow_cpu::prefill_attention -- a prompt's causal attention on CPU, in fp32 register tiles.
//
//     out = softmax(q k^T * scale + visibility) v
//
// q (B, Hq, Lq, D), k / v (B, Hkv, n, D) (views of a cache are fine: the last dim contiguous), GQA
// without repeating K/V. Query i sits at position n - Lq + i and sees key j when j <= position and,
// with window > 0, position - j < window (attention/reference.py's rules without a mask). The
// reference is attention/prefill.py's SDPA path; tests compare both with float64.
//
// Why: torch's CPU flash attention ran far below the FMA peak, a large share of a long prompt once the
// linears took fastflow's GEMM (cpu_gemm.cpp; docs/performance.md#decode-attention-packed-linears-and-prompts).
// This is FlashAttention's loop on the GEMM's register tile (cpu_tile.h): K and V are widened to fp32
// once per call (K as panels of 16 keys, transposed), each task takes kBQ query rows of one head,
// computes scores for kBK keys at a time with tiles over D, updates the online softmax (running max and
// sum per row, e^x vectorized), and adds probabilities times V with tiles over the keys. Blocks past
// the causal bound or before the window are skipped. Built with the other sources into one library (cpu_lib.py).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu_tile.h"

namespace {

using fastflow_cpu::exp_nonpositive;
constexpr int64_t kMR = fastflow_cpu::kTileRows, kNR = fastflow_cpu::kTileCols;
constexpr int64_t kBQ = 8 * kMR;  // query rows per task
constexpr int64_t kBK = 4 * kNR;  // keys per block of scores

template <typename T>
inline float as_float(T v) {
  return static_cast<float>(v);
}

struct Layout {
  int64_t B, Hq, Hkv, Lq, n, D, window;
  float scale;
};

// K of one (batch, kv head) as panels of kNR keys: p[(key / kNR) * D * kNR + d * kNR + key % kNR];
// keys past n are zeros. V as fp32 rows, then zero rows up to a whole block.
template <typename T>
void widen_kv(const T* k, const T* v, int64_t sk, int64_t sv, const Layout& s, float* kp, float* vf) {
  const int64_t keys = (s.n + kBK - 1) / kBK * kBK;
  for (int64_t key = 0; key < keys; ++key) {
    float* kcol = kp + (key / kNR) * s.D * kNR + key % kNR;
    float* vrow = vf + key * s.D;
    for (int64_t d = 0; d < s.D; ++d) {
      kcol[d * kNR] = key < s.n ? as_float(k[key * sk + d]) : 0.0f;
      vrow[d] = key < s.n ? as_float(v[key * sv + d]) : 0.0f;
    }
  }
}

// Rows [i0, i0 + rows) of one head: scores, online softmax and P V for every visible key block.
template <typename T>
void query_block(const T* q, int64_t sq, const float* kp, const float* vf, const Layout& s, int64_t i0, int64_t rows,
                 T* out, int64_t so) {
  const int64_t panels = (rows + kMR - 1) / kMR, offset = s.n - s.Lq;
  float qp[kBQ * 256], pp[kBQ * kBK], scores[kBQ * kBK], acc[kBQ * 256], tile[kMR * kNR];
  float row_max[kBQ], row_sum[kBQ];
  // q rows as panels of kMR (scaled once here), zeros past `rows`
  for (int64_t i = 0; i < panels * kMR; ++i)
    for (int64_t d = 0; d < s.D; ++d)
      qp[(i / kMR) * s.D * kMR + d * kMR + i % kMR] = i < rows ? as_float(q[(i0 + i) * sq + d]) * s.scale : 0.0f;
  std::fill(acc, acc + panels * kMR * s.D, 0.0f);
  std::fill(row_max, row_max + kBQ, -std::numeric_limits<float>::infinity());
  std::fill(row_sum, row_sum + kBQ, 0.0f);
  const int64_t last_pos = offset + i0 + rows - 1;
  const int64_t first_key = s.window > 0 ? std::max<int64_t>(0, offset + i0 - s.window + 1) : 0;
  for (int64_t j0 = first_key / kBK * kBK; j0 <= last_pos; j0 += kBK) {
    const int64_t key_panels = std::min(kBK, (last_pos + 1 - j0 + kNR - 1) / kNR * kNR) / kNR;
    const int64_t width = key_panels * kNR;
    for (int64_t ip = 0; ip < panels; ++ip)
      for (int64_t jp = 0; jp < key_panels; ++jp) {
        fastflow_cpu::tile_to(s.D, qp + ip * s.D * kMR, kp + (j0 / kNR + jp) * s.D * kNR, kNR, tile);
        for (int64_t i = 0; i < kMR; ++i)
          std::copy_n(tile + i * kNR, kNR, scores + (ip * kMR + i) * kBK + jp * kNR);
      }
    for (int64_t i = 0; i < panels * kMR; ++i) {
      float* sc = scores + i * kBK;
      const int64_t pos = offset + i0 + i;
      const int64_t lo = s.window > 0 ? pos - s.window + 1 : 0;  // visible keys: [lo, pos]
      if (i >= rows || pos < j0 || lo >= j0 + width) {  // a padding row, or no visible key in this block
        std::fill(sc, sc + width, 0.0f);
        continue;
      }
      // keys outside [lo, pos] only in the diagonal block and at the window's edge
      for (int64_t j = std::max<int64_t>(0, pos + 1 - j0); j < width; ++j) sc[j] = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < std::min(width, lo - j0); ++j) sc[j] = -std::numeric_limits<float>::infinity();
      const float m = fastflow_cpu::max_of(sc, width, row_max[i]);
      const float alpha = exp_nonpositive(row_max[i] - m);
      row_sum[i] = row_sum[i] * alpha + fastflow_cpu::exp_shifted(sc, width, m);
      row_max[i] = m;
      float* a = acc + i * s.D;
#pragma omp simd
      for (int64_t d = 0; d < s.D; ++d) a[d] *= alpha;
    }
    for (int64_t ip = 0; ip < panels; ++ip) {
      float* p = pp + ip * kBK * kMR;  // probabilities as a panel: kMR rows per key
      for (int64_t j = 0; j < width; ++j)
        for (int64_t i = 0; i < kMR; ++i) p[j * kMR + i] = scores[(ip * kMR + i) * kBK + j];
      for (int64_t d0 = 0; d0 < s.D; d0 += kNR) {
        fastflow_cpu::tile_to(width, p, vf + j0 * s.D + d0, s.D, tile);
        for (int64_t i = 0; i < kMR; ++i) {
          float* a = acc + (ip * kMR + i) * s.D + d0;
#pragma omp simd
          for (int64_t j = 0; j < kNR; ++j) a[j] += tile[i * kNR + j];
        }
      }
    }
  }
  for (int64_t i = 0; i < rows; ++i) {
    const float inv = row_sum[i] > 0.0f ? 1.0f / row_sum[i] : 0.0f;  // a row with no visible key: zeros
    for (int64_t d = 0; d < s.D; ++d) out[(i0 + i) * so + d] = static_cast<T>(acc[i * s.D + d] * inv);
  }
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Layout& s, at::Tensor& out) {
  const int64_t group = s.Hq / s.Hkv, keys = (s.n + kBK - 1) / kBK * kBK;
  std::vector<float> kp(s.B * s.Hkv * keys * s.D), vf(s.B * s.Hkv * keys * s.D);
  const T *qd = q.const_data_ptr<T>(), *kd = k.const_data_ptr<T>(), *vd = v.const_data_ptr<T>();
  T* od = out.mutable_data_ptr<T>();
  at::parallel_for(0, s.B * s.Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / s.Hkv, h = bh % s.Hkv;
      widen_kv(kd + b * k.stride(0) + h * k.stride(1), vd + b * v.stride(0) + h * v.stride(1), k.stride(2),
               v.stride(2), s, kp.data() + bh * keys * s.D, vf.data() + bh * keys * s.D);
    }
  });
  const int64_t blocks = (s.Lq + kBQ - 1) / kBQ;
  at::parallel_for(0, s.B * s.Hq * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      // the longest blocks (latest queries: the most keys) first, so the split between threads evens out
      const int64_t block = blocks - 1 - task % blocks, bh = task / blocks, b = bh / s.Hq, h = bh % s.Hq;
      const int64_t kv = b * s.Hkv + h / group, i0 = block * kBQ;
      query_block(qd + b * q.stride(0) + h * q.stride(1), q.stride(2), kp.data() + kv * keys * s.D,
                  vf.data() + kv * keys * s.D, s, i0, std::min(kBQ, s.Lq - i0),
                  od + b * out.stride(0) + h * out.stride(1), out.stride(2));
    }
  });
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                             int64_t window) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.device().is_cpu(),
              "fastflow_cpu::prefill_attention: q, k, v must be 4-D CPU tensors (B, H, L, D)");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "fastflow_cpu::prefill_attention: q, k, v must share one dtype");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "fastflow_cpu::prefill_attention: the head dim must be contiguous");
  const Layout s{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), window, static_cast<float>(scale)};
  TORCH_CHECK(s.Hkv > 0 && s.Hq % s.Hkv == 0 && k.size(0) == s.B && v.sizes() == k.sizes() && k.size(3) == s.D,
              "fastflow_cpu::prefill_attention: k and v must be (B, Hkv, n, D) with Hq a multiple of Hkv");
  TORCH_CHECK(s.D % kNR == 0 && s.D <= 256, "fastflow_cpu::prefill_attention: head dim must be a multiple of 16, <= 256");
  TORCH_CHECK(s.n >= s.Lq, "fastflow_cpu::prefill_attention: fewer keys than queries");
  at::Tensor out = at::empty(q.sizes(), q.options());
  if (q.numel() == 0) return out;
  switch (q.scalar_type()) {
    case at::kFloat: run<float>(q, k, v, s, out); break;
    case at::kBFloat16: run<c10::BFloat16>(q, k, v, s, out); break;
    case at::kHalf: run<c10::Half>(q, k, v, s, out); break;
    default: TORCH_CHECK(false, "fastflow_cpu::prefill_attention: float32, bfloat16 or float16 only");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastflow_cpu, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, float scale, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastflow_cpu, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
