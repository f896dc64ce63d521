// fastflow_cpu::gemv_q16 -- the int8 decode GEMV with integer dot products.
//
//     y[m, n] = float(sum_k q[m, k] * w[n, k]) * step[m] * scale[n] + bias[n]
//     q[m, k] = round_half_even(x[m, k] * (32767 / max_k |x[m, k]|)),   step[m] = max_k |x[m, k]| / 32767
//
// Each activation row is quantized once per call to int16 with one scale (error at most 2^-16 of the
// row's largest |x|: finer than bf16's own rounding for every value above 1/128 of that largest), and
// the sums of int16 x int8 products are exact in integers: every instruction-set path gives the same
// bits. Why: a small batch's decode step with fp32 FMAs costs per 16 weights two conversions plus one
// FMA per row, and at 4 rows that arithmetic, not memory, bounds the GEMV (timed over 30 SmolLM2-135M
// int8 layers at 1 to 8 rows, float and this kernel: benchmarks/results/cpu_gemv_layers_rows_cpu_xeon.json,
// docs/performance.md#cpu-decode-gemvs). AVX512-VNNI's `vpdpwssd` multiplies 32
// int16 pairs and adds them into 16 int32 lanes in one instruction, after one widening per 32
// weights shared by all rows. Without VNNI, `vpmaddwd` + `vpaddd` do the same (AVX-512, AVX2).
// Lane sums stay below 2^31 within a segment of K (kSegment, per instruction set); longer rows are summed in
// segments into int64. Weight rows go in tiles -- AVX-512: four (two above four x rows); AVX2: four
// for one or two x rows, two for three or four (16 registers) -- so that each x load serves the whole
// tile and one add tree reduces its sums, where a row at a time paid a load per row and a reduction
// per row (the A/B: benchmarks/results/cpu_decode_kernels_*ab_cpu_xeon.json). The pure-torch
// reference is cpu_gemv.py's `gemv_q16_ref`.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_kernels.h"

namespace {

constexpr float kInt16Max = 32767.f;
// |q w| <= 32767 * 128 < 2^22 and a lane adds two per step, so a lane may take 512 steps: with 16
// lanes (AVX-512) 8192 values of K keep |sum| < 2^31; with AVX2's 8 lanes, 4096.
constexpr int64_t kSegment = 8192;
constexpr int64_t kSegmentAvx2 = 4096;

struct Int16Rows {
  std::vector<int16_t> q;  // M rows of `stride` values; zeros past K
  std::vector<float> step;
  int64_t stride;
};

Int16Rows quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t stride = (K + 31) / 32 * 32;
  Int16Rows rows{std::vector<int16_t>(M * stride, 0), std::vector<float>(M), stride};
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    float largest = 0.f;
    for (int64_t k = 0; k < K; ++k) largest = std::max(largest, std::fabs(xm[k]));
    const float inv = largest > 0.f ? kInt16Max / largest : 0.f;
    int16_t* qm = rows.q.data() + m * stride;
    for (int64_t k = 0; k < K; ++k) {
      qm[k] = static_cast<int16_t>(std::clamp(std::nearbyint(xm[k] * inv), -kInt16Max, kInt16Max));
    }
    rows.step[m] = largest > 0.f ? largest / kInt16Max : 0.f;
  }
  return rows;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
inline __m512i madd(__m512i acc, __m512i w, __m512i x) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, w, x);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
}

inline int64_t lane_sum(__m512i v) {  // 16 int32 lanes, exactly
  const __m512i lo = _mm512_cvtepi32_epi64(_mm512_castsi512_si256(v));
  const __m512i hi = _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(v, 1));
  return _mm512_reduce_add_epi64(_mm512_add_epi64(lo, hi));
}

// M int16 rows of x (row stride `stride`, zero-padded) times one int8 weight row: out[m * ostride].
// Two accumulators per row, over alternate 32-value steps: a row's `vpdpwssd` chain (5 cycles of
// latency each) no longer bounds a step.
template <int M>
void rows_dot(const int16_t* x, int64_t stride, const int8_t* w, int64_t K, int64_t* out, int64_t ostride) {
  const int64_t near = fastflow_cpu::near_prefetch(), far = fastflow_cpu::far_prefetch();  // int8: bytes
  int64_t total[M] = {};
  for (int64_t k0 = 0; k0 < K; k0 += kSegment) {
    const int64_t end = std::min(K, k0 + kSegment);
    __m512i acc[2][M];
    for (int m = 0; m < M; ++m) acc[0][m] = acc[1][m] = _mm512_setzero_si512();
    int64_t k = k0;
    for (; k + 64 <= end; k += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(w + k + near), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + k + far), _MM_HINT_T1);
      const __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k)));
      const __m512i w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k + 32)));
      for (int m = 0; m < M; ++m) {
        acc[0][m] = madd(acc[0][m], w0, _mm512_loadu_si512(x + m * stride + k));
        acc[1][m] = madd(acc[1][m], w1, _mm512_loadu_si512(x + m * stride + k + 32));
      }
    }
    for (; k < end; k += 32) {
      const __mmask32 mask = end - k >= 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((1u << (end - k)) - 1);
      const __m512i wv = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask, w + k));
      for (int m = 0; m < M; ++m) acc[0][m] = madd(acc[0][m], wv, _mm512_loadu_si512(x + m * stride + k));
    }
    for (int m = 0; m < M; ++m) total[m] += lane_sum(acc[0][m]) + lane_sum(acc[1][m]);
  }
  for (int m = 0; m < M; ++m) out[m * ostride] = total[m];
}

// The exact sums of four accumulators, [a, b, c, d], as int64: one add tree across all four, where
// four separate lane sums would cost four trees.
inline void lane_sums4(__m512i a, __m512i b, __m512i c, __m512i d, int64_t* out) {
  const auto wide = [](__m512i v) {
    return _mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(v)),
                            _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(v, 1)));
  };
  const __m512i A = wide(a), B = wide(b), C = wide(c), D = wide(d);
  // each 128-bit lane: [part of a, part of b], [part of c, part of d]
  const __m512i ab = _mm512_add_epi64(_mm512_unpacklo_epi64(A, B), _mm512_unpackhi_epi64(A, B));
  const __m512i cd = _mm512_add_epi64(_mm512_unpacklo_epi64(C, D), _mm512_unpackhi_epi64(C, D));
  // [ab0 + ab1, ab2 + ab3, cd0 + cd1, cd2 + cd3] in 128-bit lanes, then the low and high halves of
  // [ab01, cd01, ab23, cd23] added: [a, b, c, d]
  const __m512i sum = _mm512_add_epi64(_mm512_shuffle_i64x2(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                                       _mm512_shuffle_i64x2(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_shuffle_i64x2(sum, sum, _MM_SHUFFLE(3, 1, 2, 0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm256_add_epi64(_mm512_castsi512_si256(order), _mm512_extracti64x4_epi64(order, 1)));
}

// M int16 rows of x times NT consecutive weight rows (row stride K): out[m * ostride + n]. Each x load
// serves NT weight rows and the NT x M sums share their reductions (rows_dot: one row, two lane sums
// per x row). One accumulator per pair: NT x M >= 4 independent chains already hide the latency.
template <int M, int NT>
void tile_dot(const int16_t* x, int64_t stride, const int8_t* w, int64_t K, int64_t* out, int64_t ostride) {
  static_assert(NT == 2 || NT == 4, "lane_sums4 reduces two or four weight rows");
  const int64_t near = fastflow_cpu::near_prefetch(), far = fastflow_cpu::far_prefetch();  // int8: bytes
  int64_t total[M][4] = {};
  for (int64_t k0 = 0; k0 < K; k0 += kSegment) {
    const int64_t end = std::min(K, k0 + kSegment);
    __m512i acc[NT][M];
    for (int n = 0; n < NT; ++n)
      for (int m = 0; m < M; ++m) acc[n][m] = _mm512_setzero_si512();
    int64_t k = k0;
    for (; k + 64 <= end; k += 64) {
      __m512i w0[NT], w1[NT];
      for (int n = 0; n < NT; ++n) {
        const int8_t* row = w + n * K + k;
        _mm_prefetch(reinterpret_cast<const char*>(row + near), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(row + far), _MM_HINT_T1);
        w0[n] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)));
        w1[n] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32)));
      }
      for (int m = 0; m < M; ++m) {
        const __m512i x0 = _mm512_loadu_si512(x + m * stride + k), x1 = _mm512_loadu_si512(x + m * stride + k + 32);
        for (int n = 0; n < NT; ++n) acc[n][m] = madd(madd(acc[n][m], w0[n], x0), w1[n], x1);
      }
    }
    for (; k < end; k += 32) {
      const __mmask32 mask = end - k >= 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((1u << (end - k)) - 1);
      for (int n = 0; n < NT; ++n) {
        const __m512i wv = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask, w + n * K + k));
        for (int m = 0; m < M; ++m) acc[n][m] = madd(acc[n][m], wv, _mm512_loadu_si512(x + m * stride + k));
      }
    }
    const __m512i zero = _mm512_setzero_si512();
    for (int m = 0; m < M; ++m) {
      int64_t part[4];
      lane_sums4(acc[0][m], acc[1][m], NT == 4 ? acc[NT - 2][m] : zero, NT == 4 ? acc[NT - 1][m] : zero, part);
      for (int n = 0; n < NT; ++n) total[m][n] += part[n];
    }
  }
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < NT; ++n) out[m * ostride + n] = total[m][n];
}

// `count` consecutive weight rows: tiles of four (two for more than four x rows: registers), then one by one.
template <int M>
void run_dot(const int16_t* x, int64_t stride, const int8_t* w, int64_t K, int64_t count, int64_t* out,
             int64_t ostride) {
  constexpr int NT = M <= 4 ? 4 : 2;
  int64_t n = 0;
  for (; n + NT <= count; n += NT) tile_dot<M, NT>(x, stride, w + n * K, K, out + n, ostride);
  for (; n < count; ++n) rows_dot<M>(x, stride, w + n * K, K, out + n, ostride);
}
#elif defined(__AVX2__)
inline int64_t lane_sum(__m256i v) {  // 8 int32 lanes, exactly
  const __m256i wide = _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(v)),
                                        _mm256_cvtepi32_epi64(_mm256_extracti128_si256(v, 1)));
  const __m128i pair = _mm_add_epi64(_mm256_castsi256_si128(wide), _mm256_extracti128_si256(wide, 1));
  return _mm_cvtsi128_si64(pair) + _mm_extract_epi64(pair, 1);
}

// The same at 16 values per step; the last K % 16 values one at a time.
template <int M>
void rows_dot(const int16_t* x, int64_t stride, const int8_t* w, int64_t K, int64_t* out, int64_t ostride) {
  const int64_t near = fastflow_cpu::near_prefetch(), far = fastflow_cpu::far_prefetch();  // int8: bytes
  int64_t total[M] = {};
  for (int64_t k0 = 0; k0 < K; k0 += kSegmentAvx2) {
    const int64_t end = std::min(K, k0 + kSegmentAvx2);
    __m256i acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_si256();
    int64_t k = k0;
    for (; k + 16 <= end; k += 16) {
      if (k % 64 == 0) {
        _mm_prefetch(reinterpret_cast<const char*>(w + k + near), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(w + k + far), _MM_HINT_T1);
      }
      const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k)));
      for (int m = 0; m < M; ++m) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + m * stride + k));
        acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(wv, xv));
      }
    }
    for (int m = 0; m < M; ++m) {
      total[m] += lane_sum(acc[m]);
      for (int64_t j = k; j < end; ++j) total[m] += static_cast<int64_t>(x[m * stride + j]) * w[j];
    }
  }
  for (int m = 0; m < M; ++m) out[m * ostride] = total[m];
}

// The exact sums of four accumulators as int64 [a, b, c, d], one add tree across them (see AVX-512).
inline void lane_sums4(__m256i a, __m256i b, __m256i c, __m256i d, int64_t* out) {
  const auto wide = [](__m256i v) {
    return _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(v)),
                            _mm256_cvtepi32_epi64(_mm256_extracti128_si256(v, 1)));
  };
  const __m256i A = wide(a), B = wide(b), C = wide(c), D = wide(d);
  const __m256i ab = _mm256_add_epi64(_mm256_unpacklo_epi64(A, B), _mm256_unpackhi_epi64(A, B));  // [a b | a b]
  const __m256i cd = _mm256_add_epi64(_mm256_unpacklo_epi64(C, D), _mm256_unpackhi_epi64(C, D));  // [c d | c d]
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm256_add_epi64(_mm256_permute2x128_si256(ab, cd, 0x20),
                                       _mm256_permute2x128_si256(ab, cd, 0x31)));
}

// M int16 rows of x times NT consecutive weight rows (row stride K), 16 values per step: each x load
// serves NT weight rows and their sums share one reduction (16 registers: NT x M accumulators <= 8).
template <int M, int NT>
void tile_dot(const int16_t* x, int64_t stride, const int8_t* w, int64_t K, int64_t* out, int64_t ostride) {
  static_assert(NT == 2 || NT == 4, "lane_sums4 reduces two or four weight rows");
  const int64_t near = fastflow_cpu::near_prefetch(), far = fastflow_cpu::far_prefetch();  // int8: bytes
  int64_t total[M][4] = {};
  for (int64_t k0 = 0; k0 < K; k0 += kSegmentAvx2) {
    const int64_t end = std::min(K, k0 + kSegmentAvx2);
    __m256i acc[NT][M];
    for (int n = 0; n < NT; ++n)
      for (int m = 0; m < M; ++m) acc[n][m] = _mm256_setzero_si256();
    int64_t k = k0;
    for (; k + 16 <= end; k += 16) {
      __m256i wv[NT];
      for (int n = 0; n < NT; ++n) {
        const int8_t* row = w + n * K + k;
        if (k % 64 == 0) {
          _mm_prefetch(reinterpret_cast<const char*>(row + near), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(row + far), _MM_HINT_T1);
        }
        wv[n] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
      }
      for (int m = 0; m < M; ++m) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + m * stride + k));
        for (int n = 0; n < NT; ++n) acc[n][m] = _mm256_add_epi32(acc[n][m], _mm256_madd_epi16(wv[n], xv));
      }
    }
    const __m256i zero = _mm256_setzero_si256();
    for (int m = 0; m < M; ++m) {
      int64_t part[4];
      lane_sums4(acc[0][m], acc[1][m], NT == 4 ? acc[NT - 2][m] : zero, NT == 4 ? acc[NT - 1][m] : zero, part);
      for (int n = 0; n < NT; ++n) {
        total[m][n] += part[n];
        for (int64_t j = k; j < end; ++j) total[m][n] += static_cast<int64_t>(x[m * stride + j]) * w[n * K + j];
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < NT; ++n) out[m * ostride + n] = total[m][n];
}

// `count` consecutive weight rows: tiles of four for one or two x rows, of two for three or four,
// one by one above (registers), and for the rows a tile leaves over.
template <int M>
void run_dot(const int16_t* x, int64_t stride, const int8_t* w, int64_t K, int64_t count, int64_t* out,
             int64_t ostride) {
  constexpr int NT = M <= 2 ? 4 : 2;
  int64_t n = 0;
  if constexpr (M <= 4) {
    for (; n + NT <= count; n += NT) tile_dot<M, NT>(x, stride, w + n * K, K, out + n, ostride);
  }
  for (; n < count; ++n) rows_dot<M>(x, stride, w + n * K, K, out + n, ostride);
}
#else
// Portable path: the same integer sums.
template <int M>
void rows_dot(const int16_t* x, int64_t stride, const int8_t* w, int64_t K, int64_t* out, int64_t ostride) {
  for (int m = 0; m < M; ++m) {
    int64_t total = 0;
    for (int64_t k = 0; k < K; ++k) total += static_cast<int64_t>(x[m * stride + k]) * w[k];
    out[m * ostride] = total;
  }
}
#endif

#if !(defined(__AVX512F__) && defined(__AVX512BW__)) && !defined(__AVX2__)
template <int M>
void run_dot(const int16_t* x, int64_t stride, const int8_t* w, int64_t K, int64_t count, int64_t* out,
             int64_t ostride) {
  for (int64_t n = 0; n < count; ++n) rows_dot<M>(x, stride, w + n * K, K, out + n, ostride);
}
#endif

void dot_run(const Int16Rows& x, int64_t M, const int8_t* w, int64_t K, int64_t count, int64_t* out, int64_t ostride) {
  const int16_t* q = x.q.data();
  switch (M) {
    case 1: run_dot<1>(q, x.stride, w, K, count, out, ostride); break;
    case 2: run_dot<2>(q, x.stride, w, K, count, out, ostride); break;
    case 3: run_dot<3>(q, x.stride, w, K, count, out, ostride); break;
    case 4: run_dot<4>(q, x.stride, w, K, count, out, ostride); break;
    case 5: run_dot<5>(q, x.stride, w, K, count, out, ostride); break;
    case 6: run_dot<6>(q, x.stride, w, K, count, out, ostride); break;
    case 7: run_dot<7>(q, x.stride, w, K, count, out, ostride); break;
    default: run_dot<8>(q, x.stride, w, K, count, out, ostride); break;
  }
}

// The operands and result of fastflow_cpu::gemv, for int8 weights.
at::Tensor gemv_q16(const at::Tensor& x, at::TensorList weights, at::TensorList scales, at::TensorList biases) {
  const std::vector<int64_t> first_row =
      fastflow_cpu::gemv_first_rows("fastflow_cpu::gemv_q16", x, weights, scales, biases, {at::kChar},
                                    "int8");
  const int64_t K = x.size(-1), M = x.numel() / K, total = first_row.back();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = total;
  if (fastflow_cpu::null_kernels()) return at::zeros(shape, x.options());
  const Int16Rows q = quantize_rows(fastflow_cpu::as_floats(x).data(), M, K);
  std::vector<const int8_t*> ptrs;
  for (const auto& w : weights) ptrs.push_back(w.const_data_ptr<int8_t>());
  std::vector<int64_t> sums(M * total);
  const auto run = [&](size_t i, int64_t local, int64_t count, int64_t r) {
    dot_run(q, M, ptrs[i] + local * K, K, count, sums.data() + r, total);
  };
  fastflow_cpu::for_each_run(first_row, K, at::get_num_threads(), run);
  std::vector<float> y32(M * total);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t r = 0; r < total; ++r) y32[m * total + r] = static_cast<float>(sums[m * total + r]) * q.step[m];
  }
  fastflow_cpu::apply_scales_biases(y32, M, first_row, scales, biases);
  at::Tensor out = at::empty(shape, x.options());
  fastflow_cpu::store_floats(y32, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastflow_cpu, m) {
  m.def("gemv_q16(Tensor x, Tensor[] weights, Tensor[] scales, Tensor[] biases) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastflow_cpu, CPU, m) { m.impl("gemv_q16", &gemv_q16); }
