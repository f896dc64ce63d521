// fastflow_cpu::int4_widen -- an int4_gemv weight (int4_layout.py: 16 rows to a vector) widened to a
// bf16 (N, K) matrix, for prompt processing: one oneDNN bf16 GEMM over many rows (AMX / AVX-512-BF16
// where present) then beats multiplying the codes row by row, and widening costs one pass over the
// codes. Values: w = (q - 8) * s + z' in fp32, one rounding to bf16 (the reference: int4_layout.py's
// `int4_widen_ref`).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <omp.h>

#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kRows = 16, kChunk = 8;  // int4_layout.py's INT4_ROWS, INT4_CHUNK

inline float widen_bf16(c10::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to nearest even, as torch's fp32 -> bf16 cast (finite values: these are weights).
inline uint16_t narrow_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

at::Tensor int4_widen(const at::Tensor& packed, const at::Tensor& scale_zeros, int64_t group_size) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kRows * kChunk / 2 && packed.scalar_type() == at::kByte,
              "fastflow_cpu::int4_widen: packed must be (N/16, K/8, 64) uint8");
  TORCH_CHECK(group_size % kChunk == 0, "fastflow_cpu::int4_widen: group_size must be a multiple of 8");
  const int64_t blocks = packed.size(0), chunks = packed.size(1), k = chunks * kChunk, groups = k / group_size;
  TORCH_CHECK(scale_zeros.scalar_type() == at::kBFloat16 && scale_zeros.dim() == 4 &&
                  scale_zeros.size(0) == blocks && scale_zeros.size(1) == groups && scale_zeros.size(2) == 2 &&
                  scale_zeros.size(3) == kRows,
              "fastflow_cpu::int4_widen: scale_zeros must be (N/16, K/G, 2, 16) bf16");
  const at::Tensor p = packed.contiguous(), sz = scale_zeros.contiguous();
  at::Tensor out = at::empty({blocks * kRows, k}, packed.options().dtype(at::kBFloat16));
  const uint8_t* codes = p.const_data_ptr<uint8_t>();
  const c10::BFloat16* table = sz.const_data_ptr<c10::BFloat16>();
  uint16_t* w = reinterpret_cast<uint16_t*>(out.mutable_data_ptr<c10::BFloat16>());
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t g = c * kChunk / group_size;
      const uint8_t* src = codes + (b * chunks + c) * (kRows * kChunk / 2);
      const c10::BFloat16* s = table + ((b * groups + g) * 2) * kRows;
      for (int64_t r = 0; r < kRows; ++r) {
        const float scale = widen_bf16(s[r]), zero = widen_bf16(s[kRows + r]);
        uint16_t* row = w + (b * kRows + r) * k + c * kChunk;
#pragma omp simd
        for (int64_t j = 0; j < kChunk / 2; ++j) {
          const uint8_t byte = src[r * (kChunk / 2) + j];
          row[j] = narrow_bf16(static_cast<float>(static_cast<int>(byte & 0xF) - 8) * scale + zero);
          row[j + kChunk / 2] = narrow_bf16(static_cast<float>(static_cast<int>(byte >> 4) - 8) * scale + zero);
        }
      }
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastflow_cpu, m) { m.def("int4_widen(Tensor packed, Tensor scale_zeros, int group_size) -> Tensor"); }

TORCH_LIBRARY_IMPL(fastflow_cpu, CPU, m) { m.impl("int4_widen", &int4_widen); }
