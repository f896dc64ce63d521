// fastflow_cpu::argmax -- index of the largest value along the last dim, for picking a decode step's
// greedy token from its logits (..., vocab) on CPU.
//
// Why: torch.argmax's index-tracking reduction is not vectorized on CPU (eager and Inductor alike),
// and over a vocabulary-sized row it is a visible part of a decode step (docs/performance.md); these
// two vectorizable passes -- the maximum, then its first position -- are an order of magnitude faster.
// Semantics are torch.argmax's: the first index of the maximum, and a NaN counts as the maximum (its
// first index wins). The reference is torch.argmax itself (tests/kernels/test_cpu_decode_kernels.py).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

// Widening written as bit operations (bf16 is the high half of an fp32), which the compiler
// vectorizes; c10::BFloat16's own conversion keeps this loop scalar.
inline float widen(float v) { return v; }
inline float widen(c10::Half v) { return static_cast<float>(v); }
inline float widen(c10::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T>
int64_t row_argmax(const T* x, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  int nan = 0;
#pragma omp simd reduction(max : best) reduction(| : nan)
  for (int64_t i = 0; i < n; ++i) {
    const float v = widen(x[i]);
    best = v > best ? v : best;
    nan |= (v != v);
  }
  for (int64_t i = 0; i < n; ++i) {
    const float v = widen(x[i]);
    if (nan ? v != v : v == best) return i;
  }
  return 0;  // n == 0 is rejected before
}

template <typename T>
void argmax_rows(const at::Tensor& x, at::Tensor& out) {
  const int64_t n = x.size(-1), rows = x.numel() / n;
  const T* p = x.const_data_ptr<T>();
  int64_t* o = out.mutable_data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) o[r] = row_argmax(p + r * n, n);
}

at::Tensor argmax(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && x.size(-1) > 0, "fastflow_cpu::argmax: a non-empty CPU tensor");
  const at::Tensor c = x.contiguous();
  at::Tensor out = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kLong));
  switch (c.scalar_type()) {
    case at::kFloat: argmax_rows<float>(c, out); break;
    case at::kBFloat16: argmax_rows<c10::BFloat16>(c, out); break;
    case at::kHalf: argmax_rows<c10::Half>(c, out); break;
    default: TORCH_CHECK(false, "fastflow_cpu::argmax: unsupported dtype ", c.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastflow_cpu, m) { m.def("argmax(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(fastflow_cpu, CPU, m) { m.impl("argmax", &argmax); }
