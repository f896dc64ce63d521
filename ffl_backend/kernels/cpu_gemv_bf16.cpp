// fastflow_cpu::gemv's path for bf16 activations and bf16 weights on CPUs with AVX512-BF16 (Intel
// Cooper Lake / Sapphire Rapids and later, AMD Zen 4 and later).
//
// `vdpbf16ps` multiplies 32 bf16 pairs and adds each lane's two products into 16 fp32 lanes: a
// product of two bf16 values is exact in fp32, and the adds are fp32 with round-to-nearest-even, so
// these are the op's numerics ("products and sums in fp32") in another summation order -- except
// that the instruction flushes fp32 denormals to zero (inputs and results), which a sum of decode
// activations times weights never needs. Why: the general path widens every weight to fp32 (two
// instructions per 16) and issues one FMA per 16 weights per row; here one instruction per 32
// weights per row takes the weights as they load, and weight rows go four at a time (two above four
// x rows), each x load serving all of them (the A/B: benchmarks/results/cpu_decode_kernels_ab_cpu_xeon.json).
// One row stays on the fp32 path: the weight stream alone bounds it, and this path measured slower there.
// Where the CPU or the build lacks AVX512-BF16, `gemv_bf16_dot` returns false and gemv keeps its
// fp32 path. The reference is cpu_gemv.py's `gemv_ref`.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <vector>

#include "cpu_kernels.h"

namespace {

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
inline __m512bh load32(const c10::BFloat16* p, __mmask32 m) {
  return reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(m, p));
}

inline __mmask32 tail_mask(int64_t left) {
  return left >= 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((1u << left) - 1);
}

// M >= 2 rows of x (row stride K) times one weight row, the weights loaded once for all rows.
template <int M>
void rows_dot(const c10::BFloat16* x, const c10::BFloat16* w, int64_t K, float* out, int64_t stride) {
  const char* near = reinterpret_cast<const char*>(w + fastflow_cpu::near_prefetch());
  const char* far = reinterpret_cast<const char*>(w + fastflow_cpu::far_prefetch());
  __m512 acc[2][M];
  for (int m = 0; m < M; ++m) acc[0][m] = acc[1][m] = _mm512_setzero_ps();
  const __mmask32 all = 0xFFFFFFFFu;
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    for (int64_t b = 0; b < 128; b += 64) {
      _mm_prefetch(near + 2 * k + b, _MM_HINT_T0);
      _mm_prefetch(far + 2 * k + b, _MM_HINT_T1);
    }
    const __m512bh w0 = load32(w + k, all), w1 = load32(w + k + 32, all);
    for (int m = 0; m < M; ++m) {
      acc[0][m] = _mm512_dpbf16_ps(acc[0][m], load32(x + m * K + k, all), w0);
      acc[1][m] = _mm512_dpbf16_ps(acc[1][m], load32(x + m * K + k + 32, all), w1);
    }
  }
  for (; k < K; k += 32) {
    const __mmask32 mask = tail_mask(K - k);
    const __m512bh wv = load32(w + k, mask);
    for (int m = 0; m < M; ++m) acc[0][m] = _mm512_dpbf16_ps(acc[0][m], load32(x + m * K + k, mask), wv);
  }
  for (int m = 0; m < M; ++m) out[m * stride] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][m], acc[1][m]));
}

// The four sums of four fp32 accumulators, [a, b, c, d]: one add tree across all four.
inline __m128 lane_sums4(__m512 a, __m512 b, __m512 c, __m512 d) {
  // per 128-bit lane: [a0 + a2, b0 + b2, a1 + a3, b1 + b3] and the same of c, d
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
                                    _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

// M rows of x times NT consecutive weight rows (row stride K): out[m * stride + n]. Each x load
// serves NT weight rows, and their sums share one reduction.
template <int M, int NT>
void tile_dot(const c10::BFloat16* x, const c10::BFloat16* w, int64_t K, float* out, int64_t stride) {
  static_assert(NT == 2 || NT == 4, "lane_sums4 reduces two or four weight rows");
  const int64_t near = fastflow_cpu::near_prefetch(), far = fastflow_cpu::far_prefetch();
  __m512 acc[NT][M];
  for (int n = 0; n < NT; ++n)
    for (int m = 0; m < M; ++m) acc[n][m] = _mm512_setzero_ps();
  const __mmask32 all = 0xFFFFFFFFu;
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512bh wv[NT];
    for (int n = 0; n < NT; ++n) {
      const c10::BFloat16* row = w + n * K + k;
      _mm_prefetch(reinterpret_cast<const char*>(row + near), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(row + far), _MM_HINT_T1);
      wv[n] = load32(row, all);
    }
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = load32(x + m * K + k, all);
      for (int n = 0; n < NT; ++n) acc[n][m] = _mm512_dpbf16_ps(acc[n][m], xv, wv[n]);
    }
  }
  if (k < K) {
    const __mmask32 mask = tail_mask(K - k);
    for (int n = 0; n < NT; ++n) {
      const __m512bh wv = load32(w + n * K + k, mask);
      for (int m = 0; m < M; ++m) acc[n][m] = _mm512_dpbf16_ps(acc[n][m], load32(x + m * K + k, mask), wv);
    }
  }
  const __m512 zero = _mm512_setzero_ps();
  for (int m = 0; m < M; ++m) {
    float part[4];
    _mm_storeu_ps(part, lane_sums4(acc[0][m], acc[1][m], NT == 4 ? acc[NT - 2][m] : zero,
                                   NT == 4 ? acc[NT - 1][m] : zero));
    for (int n = 0; n < NT; ++n) out[m * stride + n] = part[n];
  }
}

// `count` consecutive weight rows: tiles of four (two above four x rows: registers), then one by one.
template <int M>
void run_dot(const c10::BFloat16* x, const c10::BFloat16* w, int64_t K, int64_t count, float* out, int64_t stride) {
  constexpr int NT = M <= 4 ? 4 : 2;
  int64_t n = 0;
  for (; n + NT <= count; n += NT) tile_dot<M, NT>(x, w + n * K, K, out + n, stride);
  for (; n < count; ++n) rows_dot<M>(x, w + n * K, K, out + n, stride);
}

void dot_run(const c10::BFloat16* x, int64_t M, const c10::BFloat16* w, int64_t K, int64_t count, float* out,
             int64_t stride) {
  switch (M) {
    case 2: run_dot<2>(x, w, K, count, out, stride); break;
    case 3: run_dot<3>(x, w, K, count, out, stride); break;
    case 4: run_dot<4>(x, w, K, count, out, stride); break;
    case 5: run_dot<5>(x, w, K, count, out, stride); break;
    case 6: run_dot<6>(x, w, K, count, out, stride); break;
    case 7: run_dot<7>(x, w, K, count, out, stride); break;
    default: run_dot<8>(x, w, K, count, out, stride); break;
  }
}
#endif

}  // namespace

namespace fastflow_cpu {

bool gemv_bf16_dot(const at::Tensor& x, at::TensorList weights, const std::vector<int64_t>& first_row, float* y) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  const int64_t K = x.size(-1), M = x.numel() / K;
  // one row: the weight stream alone bounds the GEMV, and the fp32 path streams it faster here
  if (M < 2 || x.scalar_type() != at::kBFloat16 || weights[0].scalar_type() != at::kBFloat16) return false;
  const at::Tensor xc = x.contiguous();
  const c10::BFloat16* xp = xc.const_data_ptr<c10::BFloat16>();
  std::vector<const c10::BFloat16*> ptrs;
  for (const auto& w : weights) ptrs.push_back(w.const_data_ptr<c10::BFloat16>());
  for_each_run(first_row, K, at::get_num_threads(), [&](size_t i, int64_t local, int64_t count, int64_t r) {
    dot_run(xp, M, ptrs[i] + local * K, K, count, y + r, first_row.back());
  });
  return true;
#else
  (void)x, (void)weights, (void)first_row, (void)y;
  return false;
#endif
}

}  // namespace fastflow_cpu
