// fastflow_cpu::quantize_int8 / quantize_int4 -- weight quantizers in one pass over the weight, equal
// to their pure-torch references (numerics.quantize_int8, numerics.quantize_int4, and the fitted int4
// grid search of kernels/cpu_quantize.py, whose method quant/int4_fit.py describes).
//
// Why: the references are dozens of elementwise torch passes per candidate grid over ~1 MB blocks, each
// with its own allocation and OpenMP region (~85 s per billion weights on 2 cores, far worse beside
// another busy process); the arithmetic is ~500 flops per weight, seconds per billion in registers.
//
// Layout of the int4 work: as many groups at a time as one register has fp32 lanes (kLanes: 16 with
// AVX-512, 8 with AVX2, 4 with SSE; cpu_quantize.h), one group per lane, the block transposed so that
// element e of all its groups is one vector. Every per-group quantity -- a candidate's codes, its
// least-squares sums, its scale, its error -- is then one vector, computed in registers from the
// weights, with no horizontal reduction and no temporary tensor. One parallel region per call, its
// threads taking chunks of blocks as they finish (parallel_chunks).
//
// Exactness: every value is the reference's fp32 operation in the reference's order: true divisions,
// round half to even, NaN-propagating clamps, storage rounding as tensor.to(dtype) does it, and no fused
// multiply-adds (torch rounds each product); sums over a group follow ATen's sum order. So codes,
// scales and zero points are bit-equal to the reference (tests/kernels/test_cpu_quantize.py).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <omp.h>

#include <atomic>
#include <optional>
#include <tuple>

#include "cpu_quantize.h"  // last: its pragma turns off contraction in this file's code only

namespace fastflow_cpu::quantize {
namespace {

// Weights per unit of work a thread takes: ~1 ms of the fitted search, ~20 us of int8.
constexpr int64_t kChunkWeights = 1 << 16;

// fn(begin, end) over chunks of [0, total), in one parallel region of as many threads as torch uses,
// each thread taking the next chunk when done with its last: a thread slowed by another process on its
// core takes fewer (with a static split the call would wait for it, twice as long beside a busy process).
template <typename Fn>
void parallel_chunks(int64_t total, int64_t chunk, const Fn& fn) {
  const int64_t chunks = (total + chunk - 1) / chunk;
  if (chunks <= 0) return;
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), chunks));
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(threads) if (threads > 1)
  for (int64_t c = next++; c < chunks; c = next++) fn(c * chunk, std::min(total, (c + 1) * chunk));
}

struct Int4Job {
  int64_t G, groups_per_row;
  bool symmetric;
  at::ScalarType dtype;      // of the stored scale and zero
  const float* importance;   // (K,) channel weights, or nullptr: each weight's square + its group's mean square
  std::vector<float> steps;  // levels a candidate's range spans; empty: the [min, max] grid only
  bool packed;               // codes two to a byte (numerics.pack_int4), else one per byte
};

// kLanes groups (flattened indices first, first + 1, ... over the (N, K / G) groups). kG: the group size
// when known at compile time (32, 64, 128: ATen's sum order then unrolls to straight-line code), else 0.
template <int64_t kG>
class Int4Block {
 public:
  explicit Int4Block(const Int4Job& job)
      : job_(job), G_(kG ? kG : job.G), x_(G_), w_(job.steps.empty() ? 0 : G_), codes_(kLanes * G_) {}

  // The groups into the lanes, element e of every group in x_[e]; lanes past `count` hold zeros.
  template <typename T>
  void load(const T* weight, int64_t first, int64_t count) {
    first_ = first;
    std::fill(x_.begin(), x_.end(), V{});
    for (int64_t l = 0; l < count; ++l) {
      const T* src = weight + (first + l) * G_;
      for (int64_t e = 0; e < G_; ++e) x_[e][l] = widen(src[e]);
    }
  }

  // Each lane's grid: [min, max], then (with steps) the candidate of least weighted error.
  void fit() {
    V lo = x_[0], hi = x_[0];
    for (int64_t e = 1; e < G_; ++e) {  // amin / amax: a NaN wins
      const V v = x_[e];
      lo = (((v < lo) | (v != v)) & (lo == lo)) ? v : lo;
      hi = (((v > hi) | (v != v)) & (hi == hi)) ? v : hi;
    }
    // numerics.int4_scale_zero; asymmetric grids span [min(lo, 0), max(hi, 0)]
    const V clo = lo > 0.f ? splat(0.f) : lo, chi = hi < 0.f ? splat(0.f) : hi;
    best_s_ = stored_scale(job_.symmetric ? nan_max(-lo / 8.f, hi / 7.f) : (chi - clo) / 15.f, job_.dtype);
    best_z_ = job_.symmetric ? splat(8.f) : round_to_storage(-clo / best_s_, job_.dtype);
    if (!job_.steps.empty()) search(lo, hi, clo, chi);
  }

  // Codes round(w / scale + zero) of the chosen grids; scale and zero as fp32 values of the storage dtype.
  // A block's codes start at an even flat index (first_ * G_, first_ a multiple of kLanes) and end at
  // one (the next block's start, or N * K, even when packed): packed, no byte is shared between blocks.
  void store(int64_t count, uint8_t* codes, float* scales, float* zeros) {
    for (int64_t e = 0; e < G_; ++e) {
      const V q = round_clamp(x_[e] / best_s_ + best_z_, 0.f, 15.f);
      for (int64_t l = 0; l < count; ++l)
        codes_[l * G_ + e] = q[l] == q[l] ? static_cast<uint8_t>(q[l]) : 0;  // NaN -> 0, as torch's cast
    }
    const int64_t n = count * G_;
    if (job_.packed) {
      uint8_t* dst = codes + first_ * G_ / 2;
      for (int64_t i = 0; i < n / 2; ++i) dst[i] = codes_[2 * i] | static_cast<uint8_t>(codes_[2 * i + 1] << 4);
    } else {
      std::copy_n(codes_.begin(), n, codes + first_ * G_);
    }
    for (int64_t l = 0; l < count; ++l) {
      scales[first_ + l] = best_s_[l];
      zeros[first_ + l] = best_z_[l];
    }
  }

 private:
  // cpu_quantize.fit_groups, step for step.
  void search(V lo, V hi, V clo, V chi) {
    const bool sym = job_.symmetric;
    weights();
    const V* x = x_.data();
    const V* w = w_.data();
    V best_err = error(best_s_, best_z_);
    const V span = sym ? nan_max(-lo / 8.f, hi / 7.f) * 15.f : chi - clo;
    const V origin = sym ? -8.f * span / 15.f : clo;
    const V inverse = 1.f / clamp_min_eps(span);  // `steps / span` is torch's reciprocal(span) * steps
    Sums<2> totals{};                             // sum w, sum w * x (asymmetric grids)
    if (!sym) totals = sum<Sums<2>>([&](int64_t e) FFL_LAMBDA { return Sums<2>{{w[e], w[e] * x[e]}}; });
    for (const float steps : job_.steps) {
      const V mult = inverse * steps;
      V scale, offset;
      if (sym) {  // codes about 8: scale = sum w c x / sum w c c
        const Sums<2> s = sum<Sums<2>>([&](int64_t e) FFL_LAMBDA {
          const V c = round_clamp((x[e] - origin) * mult, 0.f, 15.f) - 8.f;
          const V wc = w[e] * c;
          return Sums<2>{{wc * x[e], wc * c}};
        });
        scale = s.v[0] / s.v[1];
        offset = -8.f * scale;
      } else {  // the 2x2 normal equations of (scale, offset)
        const Sums<3> s = sum<Sums<3>>([&](int64_t e) FFL_LAMBDA {
          const V c = round_clamp((x[e] - origin) * mult, 0.f, 15.f);
          const V wc = w[e] * c;
          return Sums<3>{{wc, wc * c, wc * x[e]}};
        });
        const V sw = totals.v[0], sx = totals.v[1], sc = s.v[0], scc = s.v[1], scx = s.v[2];
        const V det = sw * scc - sc * sc;
        scale = (sw * scx - sx * sc) / det;
        offset = (scc * sx - sc * scx) / det;
      }
      const VI ok = is_finite(scale) & (scale > 0.f) & is_finite(offset);
      scale = stored_scale(ok ? scale : best_s_, job_.dtype);
      const V zero = sym ? best_z_ : round_to_storage(ok ? -offset / scale : best_z_, job_.dtype);
      const V err = error(scale, zero);
      const VI better = err < best_err;
      best_s_ = better ? scale : best_s_;
      best_z_ = better ? zero : best_z_;
      best_err = better ? err : best_err;
    }
  }

  // Each weight's share of the error: its channel's importance, or its square + its group's mean square.
  void weights() {
    if (job_.importance != nullptr) {
      for (int64_t l = 0; l < kLanes; ++l) {
        const float* imp = job_.importance + ((first_ + l) % job_.groups_per_row) * G_;
        for (int64_t e = 0; e < G_; ++e) w_[e][l] = imp[e];
      }
      return;
    }
    const V* x = x_.data();
    const V mean = sum<V>([&](int64_t e) FFL_LAMBDA { return x[e] * x[e]; }) / static_cast<float>(G_);
    for (int64_t e = 0; e < G_; ++e) w_[e] = x[e] * x[e] + mean;
  }

  // sum of w * ((round(x / s + z) clamped - z) * s - x)^2 per lane (cpu_quantize._weighted_error).
  V error(V s, V z) const {
    const V* x = x_.data();
    const V* w = w_.data();
    return sum<V>([&](int64_t e) FFL_LAMBDA {
      const V d = (round_clamp(x[e] / s + z, 0.f, 15.f) - z) * s - x[e];
      return d * d * w[e];
    });
  }

  template <typename T, typename Value>
  T sum(Value value) const {
    return torch_order_sum<kG, T>(G_, value);
  }

  const Int4Job& job_;
  const int64_t G_;
  int64_t first_ = 0;
  std::vector<V> x_, w_;  // (G,) vectors of kLanes groups: the weights, and each weight's share of the error
  std::vector<uint8_t> codes_;  // the block's codes in the weight's order
  V best_s_, best_z_;
};

template <int64_t kG, typename T>
void int4_blocks(const T* weight, int64_t groups, const Int4Job& job, uint8_t* codes, float* scales, float* zeros) {
  const int64_t blocks = (groups + kLanes - 1) / kLanes;
  parallel_chunks(blocks, std::max<int64_t>(1, kChunkWeights / (kLanes * job.G)), [&](int64_t begin, int64_t end) {
    Int4Block<kG> block(job);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t count = std::min(kLanes, groups - b * kLanes);
      block.load(weight, b * kLanes, count);
      block.fit();
      block.store(count, codes, scales, zeros);
    }
  });
}

template <typename T>
void int4_groups(const at::Tensor& w, const Int4Job& job, uint8_t* codes, float* scales, float* zeros) {
  const T* weight = w.const_data_ptr<T>();
  const int64_t groups = w.numel() / job.G;
  switch (job.G) {  // the group sizes of Int4Config, unrolled; any other that divides K at run time
    case 32: int4_blocks<32>(weight, groups, job, codes, scales, zeros); break;
    case 64: int4_blocks<64>(weight, groups, job, codes, scales, zeros); break;
    case 128: int4_blocks<128>(weight, groups, job, codes, scales, zeros); break;
    default: int4_blocks<0>(weight, groups, job, codes, scales, zeros);
  }
}

// w (N, K) fp32/bf16/fp16 -> (codes uint8 (N, K) or packed (N, K / 2), scale, zero (N, K / G) in
// scale_dtype). steps: the candidates of the fitted search (empty: [min, max] grids); importance: (K,)
// channel weights or None.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_int4(const at::Tensor& w, int64_t group_size, bool symmetric,
                                                             at::ScalarType scale_dtype, at::ArrayRef<double> steps,
                                                             const std::optional<at::Tensor>& importance, bool packed) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2, "fastflow_cpu::quantize_int4: a CPU (N, K) weight");
  TORCH_CHECK(group_size > 0 && w.size(1) % group_size == 0, "fastflow_cpu::quantize_int4: group_size ", group_size,
              " does not divide in_features ", w.size(1));
  TORCH_CHECK(!packed || w.size(1) % 2 == 0, "fastflow_cpu::quantize_int4: packing needs an even in_features");
  const at::Tensor src = w.contiguous();
  at::Tensor imp;
  if (importance.has_value()) {
    imp = importance->to(at::kFloat).contiguous();
    TORCH_CHECK(imp.device().is_cpu() && imp.numel() == w.size(1), "fastflow_cpu::quantize_int4: importance (K,)");
  }
  const Int4Job job{group_size, w.size(1) / group_size, symmetric, scale_dtype,
                    imp.defined() ? imp.const_data_ptr<float>() : nullptr, std::vector<float>(steps.begin(), steps.end()),
                    packed};
  at::Tensor codes = at::empty({w.size(0), packed ? w.size(1) / 2 : w.size(1)}, w.options().dtype(at::kByte));
  at::Tensor scale = at::empty({w.size(0), job.groups_per_row}, w.options().dtype(at::kFloat));
  at::Tensor zero = at::empty(scale.sizes(), scale.options());
  uint8_t* q = codes.mutable_data_ptr<uint8_t>();
  float *s = scale.mutable_data_ptr<float>(), *z = zero.mutable_data_ptr<float>();
  if (w.numel() > 0) {
    switch (src.scalar_type()) {
      case at::kFloat: int4_groups<float>(src, job, q, s, z); break;
      case at::kBFloat16: int4_groups<c10::BFloat16>(src, job, q, s, z); break;
      case at::kHalf: int4_groups<c10::Half>(src, job, q, s, z); break;
      default: TORCH_CHECK(false, "fastflow_cpu::quantize_int4: unsupported dtype ", src.scalar_type());
    }
  }
  return {codes, scale.to(scale_dtype), zero.to(scale_dtype)};  // exact: the values are the dtype's
}

// --- int8 per row ----------------------------------------------------------------------------------

template <typename T>
void int8_rows(const at::Tensor& w, at::ScalarType scale_dtype, int8_t* codes, float* scales) {
  const int64_t N = w.size(0), K = w.size(1);
  const T* weight = w.const_data_ptr<T>();
  parallel_chunks(N, std::max<int64_t>(1, kChunkWeights / std::max<int64_t>(K, 1)), [&](int64_t begin, int64_t end) {
    std::vector<float> row(K);
    for (int64_t r = begin; r < end; ++r) {
      const T* src = weight + r * K;
      float amax = 0.f;
      int nan = 0;
#pragma omp simd reduction(max : amax) reduction(| : nan)
      for (int64_t k = 0; k < K; ++k) {
        row[k] = widen(src[k]);
        const float a = std::fabs(row[k]);
        amax = a > amax ? a : amax;
        nan |= a != a;
      }
      // numerics.quantize_int8: scale = stored(amax / 127); a NaN anywhere makes it NaN, as torch's amax
      const float s = stored_scale(splat(nan ? NAN : amax / 127.f), scale_dtype)[0];
      int8_t* dst = codes + r * K;
#pragma omp simd
      for (int64_t k = 0; k < K; ++k) {
        float q = round_half_even(row[k] / s);  // |row / s| <= 127 but for NaN / inf
        q = q < -127.f ? -127.f : q;
        q = q > 127.f ? 127.f : q;
        dst[k] = q == q ? static_cast<int8_t>(q) : 0;
      }
      scales[r] = s;
    }
  });
}

// w (N, K) fp32/bf16/fp16 -> (codes int8 (N, K), scale (N,) in scale_dtype).
std::tuple<at::Tensor, at::Tensor> quantize_int8(const at::Tensor& w, at::ScalarType scale_dtype) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2, "fastflow_cpu::quantize_int8: a CPU (N, K) weight");
  const at::Tensor src = w.contiguous();
  at::Tensor codes = at::empty(w.sizes(), w.options().dtype(at::kChar));
  at::Tensor scale = at::empty({w.size(0)}, w.options().dtype(at::kFloat));
  int8_t* q = codes.mutable_data_ptr<int8_t>();
  float* s = scale.mutable_data_ptr<float>();
  switch (src.scalar_type()) {
    case at::kFloat: int8_rows<float>(src, scale_dtype, q, s); break;
    case at::kBFloat16: int8_rows<c10::BFloat16>(src, scale_dtype, q, s); break;
    case at::kHalf: int8_rows<c10::Half>(src, scale_dtype, q, s); break;
    default: TORCH_CHECK(false, "fastflow_cpu::quantize_int8: unsupported dtype ", src.scalar_type());
  }
  return {codes, scale.to(scale_dtype)};
}

}  // namespace
}  // namespace fastflow_cpu::quantize

TORCH_LIBRARY_FRAGMENT(fastflow_cpu, m) {
  m.def("quantize_int8(Tensor w, ScalarType scale_dtype) -> (Tensor, Tensor)");
  m.def("quantize_int4(Tensor w, int group_size, bool symmetric, ScalarType scale_dtype, float[] steps, "
        "Tensor? importance, bool packed) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fastflow_cpu, CPU, m) {
  m.impl("quantize_int8", &fastflow_cpu::quantize::quantize_int8);
  m.impl("quantize_int4", &fastflow_cpu::quantize::quantize_int4);
}
