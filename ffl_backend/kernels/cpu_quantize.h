// What cpu_quantize.cpp's quantizers compute with: a vector of fp32 lanes (one quantization group each),
// the reference's elementwise operations on it bit for bit, and ATen's order of `.sum(-1)`.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

// After the includes, so that only the quantizers' own code compiles without contraction: torch rounds
// every product before adding it, and a fused multiply-add would not.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace fastflow_cpu::quantize {

// GCC/Clang vector types one register wide, whatever -march allows (wider ones are split into scalar
// code for selects and compares: measured 7x slower on AVX2); + - * / are the IEEE lane operations,
// comparisons give lane masks (0 / -1) and `mask ? a : b` selects.
#if defined(__AVX512F__)
constexpr int64_t kVectorBytes = 64;
#elif defined(__AVX__)
constexpr int64_t kVectorBytes = 32;
#else
constexpr int64_t kVectorBytes = 16;
#endif
typedef float V __attribute__((vector_size(kVectorBytes)));
typedef int32_t VI __attribute__((vector_size(kVectorBytes)));
typedef uint32_t VU __attribute__((vector_size(kVectorBytes)));
constexpr int64_t kLanes = kVectorBytes / 4;  // quantization groups at a time
// The sums below take their terms from lambdas; unless all of it is inlined into one loop body, every
// term is a call passing vectors through memory (measured 3x slower).
#define FFL_INLINE __attribute__((always_inline)) inline
#define FFL_LAMBDA __attribute__((always_inline))
constexpr float kScaleEps = 1e-12f;  // numerics.SCALE_EPS

inline V splat(float x) {
  V v;
  for (int64_t l = 0; l < kLanes; ++l) v[l] = x;
  return v;
}

// torch.round for |x| < 2^22: x + 1.5 * 2^23 rounds to an integer in the current (nearest-even) mode.
// One add and one subtract on every -march level (SSE2 has no round instruction). A larger |x| comes out
// of the same sign and beyond 2^21 in size, so a clamp to a small range after it gives torch's result.
constexpr float kRoundMagic = 12582912.f;
inline float round_half_even(float x) { return (x + kRoundMagic) - kRoundMagic; }

// torch.round(x).clamp(lo, hi): half to even, a NaN stays NaN.
inline V round_clamp(V x, float lo, float hi) {
  const V r = (x + kRoundMagic) - kRoundMagic;
  const V a = r < lo ? splat(lo) : r;
  return a > hi ? splat(hi) : a;
}

inline V clamp_min_eps(V x) { return x < kScaleEps ? splat(kScaleEps) : x; }      // NaN stays NaN
inline V nan_max(V a, V b) { return ((a != a) | (b != b)) ? a + b : (a < b ? b : a); }  // torch.maximum
inline VI is_finite(V x) { return ((VI)x & 0x7FFFFFFF) < 0x7F800000; }

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) {  // bf16 is the high half of an fp32
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float widen(c10::Half v) { return static_cast<float>(v); }

// x rounded to the storage dtype and back, as tensor.to(dtype).to(torch.float32).
inline V round_to_storage(V x, at::ScalarType dtype) {
  if (dtype == at::kBFloat16) {  // c10's round_to_nearest_even
    const VU b = (VU)x;
    const VU r = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
    return x != x ? x : (V)r;
  }
  if (dtype == at::kHalf) {
#if defined(__F16C__)
    float f[kLanes];
    std::memcpy(f, &x, sizeof f);
    for (int64_t l = 0; l < kLanes; l += 8)
      _mm256_storeu_ps(f + l, _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(f + l), _MM_FROUND_TO_NEAREST_INT)));
    std::memcpy(&x, f, sizeof f);
#else
    for (int64_t l = 0; l < kLanes; ++l) x[l] = static_cast<float>(c10::Half(x[l]));
#endif
  }
  return x;
}

// numerics.stored_scale: clamp_min(eps), round to the storage dtype, clamp_min(eps).
inline V stored_scale(V x, at::ScalarType dtype) { return clamp_min_eps(round_to_storage(clamp_min_eps(x), dtype)); }

// Several sums carried together (one pass computes a candidate's codes once for all of them).
template <int N>
struct Sums {
  V v[N];
  Sums operator+(const Sums& o) const {
    Sums r;
    for (int i = 0; i < N; ++i) r.v[i] = v[i] + o.v[i];
    return r;
  }
};

// --- ATen's order of `.sum(-1)` over a contiguous fp32 row (SumKernel.cpp, torch 2.13; measured: the
// same on every ATen CPU capability) -----------------------------------------------------------------
// Rows of at least 8 elements are read as 8-lane vectors: per vector lane, the vectors are summed as
// four interleaved partial sums (each in a cascade of chunks of 16 or more), then added in order; the
// scalar tail comes first into the result, then the 8 lanes in order. Shorter rows take the same
// four-partial scheme on scalars. ATen starts every partial sum at 0; here it starts at its first term:
// that changes only the sign of a zero, and the final `0 + ...` (ATen's output starts at 0) undoes it.

constexpr int64_t ceil_log2(int64_t x) {
  int64_t bits = 0;
  for (uint64_t v = static_cast<uint64_t>(x - 1); v; v >>= 1) ++bits;
  return x <= 2 ? 1 : bits;
}

template <typename T, typename At>
FFL_INLINE T cascade_sum(At at, int64_t size) {  // one column of ATen's multi_row_sum; size >= 1
  constexpr int64_t levels = 4;
  const int64_t power = std::max<int64_t>(4, ceil_log2(size) / levels), step = int64_t{1} << power;
  if (size < step) {  // a running sum: the case of every group size below 512
    T s = at(0);
    for (int64_t i = 1; i < size; ++i) s = s + at(i);
    return s;
  }
  T acc[levels] = {};
  int64_t i = 0;
  while (i + step <= size) {
    for (int64_t j = 0; j < step; ++j, ++i) acc[0] = acc[0] + at(i);
    for (int64_t j = 1; j < levels; ++j) {
      acc[j] = acc[j] + acc[j - 1];
      acc[j - 1] = T{};
      if (i & ((step - 1) << (j * power))) break;
    }
  }
  for (; i < size; ++i) acc[0] = acc[0] + at(i);
  for (int64_t j = 1; j < levels; ++j) acc[0] = acc[0] + acc[j];
  return acc[0];
}

template <typename T, typename At>
FFL_INLINE T row_sum(At at, int64_t size) {  // ATen's row_sum: four interleaved partial sums, then the rest; size >= 1
  const int64_t ilp = size / 4;
  if (ilp == 0) {
    T s = at(0);
    for (int64_t i = 1; i < size; ++i) s = s + at(i);
    return s;
  }
  T s = cascade_sum<T>([&](int64_t i) FFL_LAMBDA { return at(i * 4); }, ilp);
  for (int64_t i = ilp * 4; i < size; ++i) s = s + at(i);
  for (int64_t k = 1; k < 4; ++k) s = s + cascade_sum<T>([&](int64_t i) FFL_LAMBDA { return at(i * 4 + k); }, ilp);
  return s;
}

// The sum of value(e) over e < G, in ATen's order. kG: G known at compile time (else 0, and G is used).
template <int64_t kG, typename T, typename Value>
FFL_INLINE T torch_order_sum(int64_t G, Value value) {
  constexpr int64_t kVector = 8;
  if constexpr (kG != 0) G = kG;
  T total{};
  if (G < kVector) return total + row_sum<T>(value, G);
  const int64_t vectors = G / kVector;
  for (int64_t e = vectors * kVector; e < G; ++e) total = total + value(e);
  for (int64_t t = 0; t < kVector; ++t)
    total = total + row_sum<T>([&](int64_t j) FFL_LAMBDA { return value(j * kVector + t); }, vectors);
  return total;
}

}  // namespace fastflow_cpu::quantize
