// fastflow_cpu::quantize_kv -- K or V rows quantized to the packed int8 / fp8 (e4m3) cache format of
// ffl_backend/attention/kv_quant.py: per row (D values) the D quantized values, zero pad to a multiple
// of 4 bytes, the row's fp32 scale = max |x| / 127 (int8) or / 448 (e4m3), 1 for an all-zero row.
//
// Why: an eager prompt writes every layer's K and V through kv_quant.quantize_kv_bytes, a dozen torch
// ops each with its own pass and allocation; one pass per row here. Inside compiled decode steps
// Inductor fuses the same torch code, so this op serves only eager calls. Bitwise equal to the
// pure-torch definition: the same fp32 division, round-half-to-even (nearbyint), clamp, and c10's
// e4m3 conversion (tests/attention/test_kv_quant.py).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

template <typename T>
void quantize_rows(const T* x, int8_t* out, int64_t rows, int64_t D, int64_t width, bool fp8) {
  const float largest = fp8 ? 448.f : 127.f;
  at::parallel_for(0, rows, 256, [&](int64_t begin, int64_t end) {
    std::vector<float> v(D);
    for (int64_t r = begin; r < end; ++r) {
      const T* src = x + r * D;
      int8_t* dst = out + r * width;
      float amax = 0.f;
#pragma omp simd reduction(max : amax)
      for (int64_t d = 0; d < D; ++d) {
        v[d] = static_cast<float>(src[d]);
        amax = std::max(amax, std::fabs(v[d]));
      }
      const float scale = amax > 0.f ? amax / largest : 1.f;
      if (fp8) {
        for (int64_t d = 0; d < D; ++d) {
          const float y = std::min(std::max(v[d] / scale, -largest), largest);
          dst[d] = static_cast<int8_t>(c10::Float8_e4m3fn(y).x);
        }
      } else {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) {
          dst[d] = static_cast<int8_t>(std::nearbyint(std::min(std::max(v[d] / scale, -largest), largest)));
        }
      }
      std::fill(dst + D, dst + width - 4, int8_t{0});
      std::memcpy(dst + width - 4, &scale, sizeof(scale));
    }
  });
}

// x (..., D) float / bf16 / fp16 -> (..., packed_width(D)) int8 bytes.
at::Tensor quantize_kv(const at::Tensor& x, bool fp8) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && x.size(-1) > 0, "fastflow_cpu::quantize_kv: a CPU tensor (..., D)");
  const at::Tensor src = x.contiguous();
  const int64_t D = src.size(-1), width = (D + 3) / 4 * 4 + 4, rows = D ? src.numel() / D : 0;
  std::vector<int64_t> shape(src.sizes().begin(), src.sizes().end());
  shape.back() = width;
  at::Tensor out = at::empty(shape, src.options().dtype(at::kChar));
  int8_t* dst = out.mutable_data_ptr<int8_t>();
  switch (src.scalar_type()) {
    case at::kFloat: quantize_rows(src.const_data_ptr<float>(), dst, rows, D, width, fp8); break;
    case at::kBFloat16: quantize_rows(src.const_data_ptr<c10::BFloat16>(), dst, rows, D, width, fp8); break;
    case at::kHalf: quantize_rows(src.const_data_ptr<c10::Half>(), dst, rows, D, width, fp8); break;
    default: TORCH_CHECK(false, "fastflow_cpu::quantize_kv: unsupported dtype ", src.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastflow_cpu, m) { m.def("quantize_kv(Tensor x, bool fp8) -> Tensor"); }

TORCH_LIBRARY_IMPL(fastflow_cpu, CPU, m) { m.impl("quantize_kv", &quantize_kv); }
