// fastflow_cpu::decode_attention -- attention of a few new queries over a static KV cache, on CPU.
//
//     out = softmax(q k^T * scale + visibility) v      over the first `filled` cache slots only
//
// Semantics are ffl_backend/attention/reference.py's (the pure-torch reference every test uses):
// query i sits at position filled - Lq + i; key j is visible when j <= position, position - j < window
// (window > 0) and mask[b, 0, i, j] (optional boolean HF mask, padding); a query with no visible key
// gives zeros. GQA without repeating K/V: the `group` query heads of one KV head read each key once.
//
// Why a kernel of its own: at decode a layer's attention is little work, and the Python custom op
// around SDPA (slice to filled, mask, SDPA, copies) cost about as much again per layer in dispatch
// and allocations (docs/performance.md). A C++ op is one dispatcher call from Inductor's wrapper (one
// C++ call under cpp_wrapper), reads only the filled slots, and writes its output directly in the
// (B, Lq, Hq, D) order the o_proj reads (returned as a (B, Hq, Lq, D) view of it).
// Built with cpu_gemv.cpp into one library (cpu_lib.py); vectorized by the compiler (omp simd).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "cpu_kernels.h"

namespace {

// Keys per task at least: below this a thread's share costs less than waking it.
constexpr int64_t kMinKeysPerTask = 256;

template <typename T>
inline void widen(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}

inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t d = 0; d < n; ++d) acc += a[d] * b[d];
  return acc;
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) y[d] += alpha * x[d];
}

struct Shape {
  int64_t B, Hq, Hkv, Lq, S, D, group, filled, window;
  float scale;
};

// Strides (in elements) of the operands, so views of the cache and expanded masks need no copy.
struct Strides {
  int64_t qb, qh, qm, kb, kh, kn, vb, vh, vn, mb, mm;
};

// Partial softmax state of one query row over one range of keys.
struct Partial {
  float max = -std::numeric_limits<float>::infinity();
  float sum = 0.f;
};

// One task: batch b, KV head kvh, keys [lo, hi). Every query row of the group reads each key once.
template <typename T>
void attend_range(const T* q, const T* k, const T* v, const bool* mask, const Shape& s, const Strides& st,
                  int64_t b, int64_t kvh, int64_t lo, int64_t hi, Partial* parts, float* accs) {
  const int64_t rows = s.group * s.Lq, D = s.D;
  std::vector<float> qf(rows * D), kf(D), scores(rows * std::max<int64_t>(hi - lo, 1));
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t h = kvh * s.group + r / s.Lq, i = r % s.Lq;
    widen(q + b * st.qb + h * st.qh + i * st.qm, qf.data() + r * D, D);
  }
  const T* kbase = k + b * st.kb + kvh * st.kh;
  const T* vbase = v + b * st.vb + kvh * st.vh;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t j = lo; j < hi; ++j) {
    widen(kbase + j * st.kn, kf.data(), D);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = r % s.Lq, pos = s.filled - s.Lq + i;
      bool ok = j <= pos && (s.window <= 0 || pos - j < s.window);
      if (ok && mask != nullptr) ok = mask[b * st.mb + i * st.mm + j];
      scores[r * (hi - lo) + (j - lo)] = ok ? dot(qf.data() + r * D, kf.data(), D) * s.scale : neg_inf;
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* sc = scores.data() + r * (hi - lo);
    float m = neg_inf;
    for (int64_t j = 0; j < hi - lo; ++j) m = std::max(m, sc[j]);
    float total = 0.f;
    if (m != neg_inf) {
      for (int64_t j = 0; j < hi - lo; ++j) {
        sc[j] = std::exp(sc[j] - m);  // exp(-inf) = 0 for invisible keys
        total += sc[j];
      }
    }
    parts[r].max = m;
    parts[r].sum = total;
  }
  std::vector<float> vf(D);
  for (int64_t j = lo; j < hi; ++j) {
    widen(vbase + j * st.vn, vf.data(), D);
    for (int64_t r = 0; r < rows; ++r) {
      const float p = scores[r * (hi - lo) + (j - lo)];
      if (p != 0.f) axpy(p, vf.data(), accs + r * D, D);
    }
  }
}

// Merge the per-range partials of every query row and write out[b, i, h, :] (the (B, Lq, Hq, D) order).
template <typename T>
void merge(const std::vector<Partial>& parts, const std::vector<float>& accs, const Shape& s, int64_t splits,
           T* out) {
  const int64_t rows = s.group * s.Lq, D = s.D;
  std::vector<float> o(D);
  for (int64_t b = 0; b < s.B; ++b) {
    for (int64_t kvh = 0; kvh < s.Hkv; ++kvh) {
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t task0 = (b * s.Hkv + kvh) * splits;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < splits; ++t) m = std::max(m, parts[(task0 + t) * rows + r].max);
        std::fill(o.begin(), o.end(), 0.f);
        float total = 0.f;
        if (m != -std::numeric_limits<float>::infinity()) {
          for (int64_t t = 0; t < splits; ++t) {
            const Partial& p = parts[(task0 + t) * rows + r];
            if (p.sum == 0.f) continue;
            const float w = std::exp(p.max - m);
            total += p.sum * w;
            axpy(w, accs.data() + ((task0 + t) * rows + r) * D, o.data(), D);
          }
        }
        const float inv = total > 0.f ? 1.f / total : 0.f;  // no visible key: zeros, as the reference
        const int64_t h = kvh * s.group + r / s.Lq, i = r % s.Lq;
        T* dst = out + ((b * s.Lq + i) * s.Hq + h) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(o[d] * inv);
      }
    }
  }
}

template <typename T>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const bool* mask,
                           const Shape& s, const Strides& st, at::Tensor& out) {
  // Split the keys of each (batch, KV head) so that every thread has work once the cache is long.
  const int64_t heads = s.B * s.Hkv, threads = at::get_num_threads();
  const int64_t by_threads = (threads + heads - 1) / heads;
  const int64_t splits = std::max<int64_t>(1, std::min(by_threads, s.filled / kMinKeysPerTask));
  const int64_t tasks = heads * splits, rows = s.group * s.Lq;
  const int64_t split_len = (s.filled + splits - 1) / splits;
  std::vector<Partial> parts(tasks * rows);
  std::vector<float> accs(tasks * rows * s.D, 0.f);
  const T* qp = q.const_data_ptr<T>();
  const T* kp = k.const_data_ptr<T>();
  const T* vp = v.const_data_ptr<T>();
  const int team = static_cast<int>(std::min<int64_t>(threads, tasks));
  const int64_t first_key = s.window > 0 ? std::max<int64_t>(0, s.filled - s.Lq - s.window + 1) : 0;
#pragma omp parallel for num_threads(team) schedule(static) if (team > 1)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t head = t / splits, split = t % splits;
    const int64_t lo = std::max(first_key, split * split_len), hi = std::min(s.filled, (split + 1) * split_len);
    if (lo < hi) {
      attend_range<T>(qp, kp, vp, mask, s, st, head / s.Hkv, head % s.Hkv, lo, hi, parts.data() + t * rows,
                      accs.data() + t * rows * s.D);
    }
  }
  merge<T>(parts, accs, s, splits, out.mutable_data_ptr<T>());
}

// q (B, Hq, Lq, D); k_cache, v_cache (B, Hkv, S, D); filled: one integer element; mask: optional bool
// (B or 1, 1, Lq, >= filled). Innermost dims must be contiguous (a view of the cache is fine).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& filled, double scale, int64_t window,
                            const std::optional<at::Tensor>& mask) {
  TORCH_CHECK(q.dim() == 4 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "fastflow_cpu::decode_attention: q, k_cache, v_cache must be 4-D");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "fastflow_cpu::decode_attention: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "fastflow_cpu::decode_attention: q, k_cache, v_cache must share a dtype");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "fastflow_cpu::decode_attention: k/v cache shapes differ");
  TORCH_CHECK(q.stride(3) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "fastflow_cpu::decode_attention: the head dim must be contiguous");
  Shape s{q.size(0), q.size(1), k_cache.size(1), q.size(2), k_cache.size(2), q.size(3), 0, 0, window,
          static_cast<float>(scale)};
  TORCH_CHECK(k_cache.size(0) == s.B && k_cache.size(3) == s.D && s.Hkv > 0 && s.Hq % s.Hkv == 0,
              "fastflow_cpu::decode_attention: cache (B, Hkv, S, D) does not match q (B, Hq, Lq, D)");
  TORCH_CHECK(filled.numel() == 1 && !filled.is_floating_point(),
              "fastflow_cpu::decode_attention: filled must hold one integer");
  s.group = s.Hq / s.Hkv;
  s.filled = filled.item<int64_t>();
  TORCH_CHECK(s.filled >= s.Lq && s.filled <= s.S, "fastflow_cpu::decode_attention: filled = ", s.filled,
              " must be in [Lq, cache length] = [", s.Lq, ", ", s.S, "]");
  Strides st{q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
             v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), 0, 0};
  const bool* mask_ptr = nullptr;
  at::Tensor mask_bool;
  if (mask.has_value()) {
    TORCH_CHECK(mask->dim() == 4 && (mask->size(0) == 1 || mask->size(0) == s.B) && mask->size(2) == s.Lq &&
                    mask->size(3) >= s.filled,
                "fastflow_cpu::decode_attention: mask must be (B or 1, 1, Lq, >= filled), got ", mask->sizes());
    mask_bool = mask->scalar_type() == at::kBool ? *mask : mask->to(at::kBool);
    TORCH_CHECK(mask_bool.stride(3) == 1 || mask_bool.size(3) == 1, "fastflow_cpu::decode_attention: mask rows must be contiguous");
    st.mb = mask_bool.size(0) == 1 ? 0 : mask_bool.stride(0);
    st.mm = mask_bool.stride(2);
    mask_ptr = mask_bool.const_data_ptr<bool>();
  }
  // (B, Lq, Hq, D) memory, returned as its (B, Hq, Lq, D) view: o_proj reads the former.
  at::Tensor out = at::empty({s.B, s.Lq, s.Hq, s.D}, q.options());
  if (fastflow_cpu::null_kernels()) return out.zero_().transpose(1, 2);
  switch (q.scalar_type()) {
    case at::kFloat: decode_attention_impl<float>(q, k_cache, v_cache, mask_ptr, s, st, out); break;
    case at::kBFloat16: decode_attention_impl<c10::BFloat16>(q, k_cache, v_cache, mask_ptr, s, st, out); break;
    case at::kHalf: decode_attention_impl<c10::Half>(q, k_cache, v_cache, mask_ptr, s, st, out); break;
    default: TORCH_CHECK(false, "fastflow_cpu::decode_attention: unsupported dtype ", q.scalar_type());
  }
  return out.transpose(1, 2);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastflow_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor filled, float scale, int window, "
        "Tensor? mask) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastflow_cpu, CPU, m) { m.impl("decode_attention", &decode_attention); }
