// Shared by the fastflow_cpu sources that multiply small matrices in fp32 (cpu_gemm.cpp's prompt GEMMs,
// cpu_prefill_attention.cpp) and those that take softmaxes (cpu_attention.cpp): the register tile
// and a vectorizable e^x.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>

namespace fastflow_cpu {

constexpr int64_t kTileRows = 6;   // rows of the left operand per tile, broadcast one at a time
constexpr int64_t kTileCols = 16;  // columns per tile: two 8-lane vectors

// t (kTileRows x kTileCols, row-major) = a (kc x kTileRows: kTileRows values per k) times b (kc rows
// of kTileCols values, ldb apart), summed over k in fp32. 12 accumulators + 2 loads + 1 broadcast
// fill AVX2's 16 registers: per k, 2 vector loads and 6 broadcasts feed 12 FMAs (Goto/BLIS's
// Haswell shape). `Finish(i, lo, hi)` receives row i's two vectors (AVX2) -- the callers' epilogues.
#if defined(__AVX2__) && defined(__FMA__)
template <typename Finish>
inline void tile(int64_t kc, const float* a, const float* b, int64_t ldb, Finish&& finish) {
  // named accumulators: as an array GCC keeps them on the stack
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
#pragma GCC unroll 4
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
    __m256 x = _mm256_broadcast_ss(a);
    c00 = _mm256_fmadd_ps(x, b0, c00), c01 = _mm256_fmadd_ps(x, b1, c01);
    x = _mm256_broadcast_ss(a + 1);
    c10 = _mm256_fmadd_ps(x, b0, c10), c11 = _mm256_fmadd_ps(x, b1, c11);
    x = _mm256_broadcast_ss(a + 2);
    c20 = _mm256_fmadd_ps(x, b0, c20), c21 = _mm256_fmadd_ps(x, b1, c21);
    x = _mm256_broadcast_ss(a + 3);
    c30 = _mm256_fmadd_ps(x, b0, c30), c31 = _mm256_fmadd_ps(x, b1, c31);
    x = _mm256_broadcast_ss(a + 4);
    c40 = _mm256_fmadd_ps(x, b0, c40), c41 = _mm256_fmadd_ps(x, b1, c41);
    x = _mm256_broadcast_ss(a + 5);
    c50 = _mm256_fmadd_ps(x, b0, c50), c51 = _mm256_fmadd_ps(x, b1, c51);
    a += kTileRows, b += ldb;
  }
  finish(0, c00, c01), finish(1, c10, c11), finish(2, c20, c21);
  finish(3, c30, c31), finish(4, c40, c41), finish(5, c50, c51);
}
#endif

// The same product into t[kTileRows * kTileCols] (the portable path, and edge tiles).
inline void tile_to(int64_t kc, const float* a, const float* b, int64_t ldb, float* t) {
#if defined(__AVX2__) && defined(__FMA__)
  tile(kc, a, b, ldb, [&](int i, __m256 lo, __m256 hi) {
    _mm256_storeu_ps(t + i * kTileCols, lo);
    _mm256_storeu_ps(t + i * kTileCols + 8, hi);
  });
#else
  for (int64_t i = 0; i < kTileRows * kTileCols; ++i) t[i] = 0.0f;
  for (int64_t k = 0; k < kc; ++k)
    for (int64_t i = 0; i < kTileRows; ++i)
      for (int64_t j = 0; j < kTileCols; ++j) t[i * kTileCols + j] += a[k * kTileRows + i] * b[k * ldb + j];
#endif
}

// e^x for x <= 0 (and -inf), written so that the compiler vectorizes it (std::exp is a scalar call):
// e^x = 2^n e^f with n = round(x log2 e), |f| <= ln2 / 2, e^f by its degree-6 Taylor polynomial
// (relative error about 2^-22, at fp32's own rounding of the softmax's sums). Below -87.33 the
// result underflows fp32's normal range and is 0, as for -inf.
inline float exp_nonpositive(float x) {
  if (!(x > -87.33f)) return 0.f;
  // f = x - n ln2 in two steps (ln2's leading bits times n are exact): f keeps x's precision
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float f = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 1.f / 720.f;
  p = p * f + 1.f / 120.f;
  p = p * f + 1.f / 24.f;
  p = p * f + 1.f / 6.f;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
// exp_nonpositive on 8 lanes (GCC does not vectorize the scalar one's branch and bit cast).
inline __m256 exp_nonpositive8(__m256 x) {
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.33f), _CMP_GT_OQ);  // false for -inf, NaN
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.33f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f),
                                    _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x));
  __m256 p = _mm256_set1_ps(1.f / 720.f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(bits)), live);
}
#endif

// max(m, x[0..n)) (-inf entries allowed).
inline float max_of(const float* x, int64_t n, float m) {
  int64_t j = 0;
#if defined(__AVX2__)
  __m256 acc = _mm256_set1_ps(m);
  for (; j + 8 <= n; j += 8) acc = _mm256_max_ps(acc, _mm256_loadu_ps(x + j));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float v : lanes) m = v > m ? v : m;
#endif
  for (; j < n; ++j) m = x[j] > m ? x[j] : m;
  return m;
}

// y[j] = e^(x[j] - m) for j < n (x[j] - m <= 0), returns their sum.
inline float exp_shifted(float* x, int64_t n, float m) {
  int64_t j = 0;
  float sum = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(x + j), _mm256_set1_ps(m)));
    _mm256_storeu_ps(x + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float v : lanes) sum += v;
#endif
  for (; j < n; ++j) sum += (x[j] = exp_nonpositive(x[j] - m));
  return sum;
}

}  // namespace fastflow_cpu
