// fastflow_cpu::gemv -- one activation row times a weight matrix, for CPU decode steps.
//
//     y[n] = (sum_k x[k] * w[n, k]) * scale[n] + bias[n]      (fp32 accumulation, one rounding to x's dtype)
//
// w is int8 (weight-only per-output-channel quantization; `scale` is the channel scale) or bf16.
// One call may take several weights that read the same x (q/k/v, gate/up): one parallel loop.
// fastflow_cpu::int4_gemv -- the same for group-wise int4 weights in a layout of its own (below).
// Built and loaded at run time by cpu_lib.py; the pure-torch references are cpu_gemv.py's `gemv_ref`
// and int4_layout.py's `int4_gemv_ref`.
//
// Why a hand-written loop: at batch 1 every weight byte is read once per token, so the step is a
// stream of GEMVs. Inductor's loop for the same expression (one row, one accumulator, no prefetch)
// streams the weights at a fraction of this one's rate, from L3 and from DRAM. Nearly all of the gain
// is software prefetch (2 and 18 KB ahead by default): the hardware prefetcher does not run far enough
// ahead of a small shared VM's loads from the (large, shared) L3 and DRAM. Four accumulators per row
// break the FMA latency chain. Figures: docs/performance.md#cpu-decode-gemvs.
//
// Each loop has three paths, chosen at compile time (-march=native, or FFL_CPU_MARCH): AVX-512 (with
// VNNI for int4), AVX2 + FMA (AMD Zen 2/3 and older Intel: 8 lanes, int4 through vpmaddubsw), and
// portable C++. All compute the same integer sums for int4; tests/kernels/test_cpu_isa_paths.py builds
// and checks each path the test machine can run.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <omp.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <atomic>
#include <utility>
#include <vector>

#include "cpu_kernels.h"

namespace {

// How far ahead of the current load to prefetch by default, in weight elements: near into L1, far into L2 (the
// L2 tracks more outstanding misses than L1's fill buffers, so the far stream keeps more of DRAM's
// latency hidden). These defaults were the fastest of the distances timed in C over SmolLM2-shaped
// int8 weights, L3-resident and DRAM-bound (the figures: docs/performance.md#cpu-decode-gemvs);
// autotune.tune_prefetch times other distances on each machine (set_prefetch).
constexpr int64_t kNearPrefetchElements = 4 * 576;
constexpr int64_t kFarPrefetchElements = 32 * 576;
std::atomic<int64_t> near_prefetch_elements{kNearPrefetchElements};
std::atomic<int64_t> far_prefetch_elements{kFarPrefetchElements};
using fastflow_cpu::far_prefetch;
using fastflow_cpu::near_prefetch;
using fastflow_cpu::as_floats;
using fastflow_cpu::check_vector;
using fastflow_cpu::kMaxRows;
using fastflow_cpu::kMinParallelElements;
using fastflow_cpu::store_floats;

#if defined(__AVX2__)
// 8 bf16 as fp32 (bf16 is the high half of an fp32): the AVX2 gemv and int4 paths both read them
inline __m256 load8_bf16(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// 16 weights from p (the first `m` lanes of mask) as fp32.
inline __m512 load16(const int8_t* p, __mmask16 m) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
}
inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  // bf16 is the high half of an fp32: widen to 32 bits and shift.
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

template <typename W>
float row_dot(const float* x, const W* w, int64_t K) {
  const char* near = reinterpret_cast<const char*>(w + near_prefetch());
  const char* far = reinterpret_cast<const char*>(w + far_prefetch());
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  const __mmask16 all = 0xFFFF;
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    // one prefetch per 64 bytes of weights
    for (int64_t b = 0; b < 64 * static_cast<int64_t>(sizeof(W)); b += 64) {
      _mm_prefetch(near + k * sizeof(W) + b, _MM_HINT_T0);
      _mm_prefetch(far + k * sizeof(W) + b, _MM_HINT_T1);
    }
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), load16(w + k, all), a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 16), load16(w + k + 16, all), a1);
    a2 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 32), load16(w + k + 32, all), a2);
    a3 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 48), load16(w + k + 48, all), a3);
  }
  for (; k < K; k += 16) {
    const int64_t left = K - k;
    const __mmask16 m = left >= 16 ? all : static_cast<__mmask16>((1u << left) - 1);
    a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + k), load16(w + k, m), a0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

// M rows of x (row stride K) times one weight row: the weights load once for all M rows (a small
// batch's decode step reads each weight once, as batch 1 does); out[m * stride] = x_m . w.
template <int M, typename W>
void rows_dot(const float* x, const W* w, int64_t K, float* out, int64_t stride) {
  const char* near = reinterpret_cast<const char*>(w + near_prefetch());
  const char* far = reinterpret_cast<const char*>(w + far_prefetch());
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    if ((k * static_cast<int64_t>(sizeof(W))) % 64 == 0) {
      _mm_prefetch(near + k * sizeof(W), _MM_HINT_T0);
      _mm_prefetch(far + k * sizeof(W), _MM_HINT_T1);
    }
    const __m512 wv = load16(w + k, 0xFFFF);
    for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k), wv, acc[m]);
  }
  if (k < K) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1);
    const __m512 wv = load16(w + k, mask);
    for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, x + m * K + k), wv, acc[m]);
  }
  for (int m = 0; m < M; ++m) out[m * stride] = _mm512_reduce_add_ps(acc[m]);
}
#elif defined(__AVX2__) && defined(__FMA__)
// The same loop at 8 lanes (AVX2 machines, AMD Zen 2/3 among them).
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 load8(const c10::BFloat16* p) { return load8_bf16(p); }

inline float sum8(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}

template <typename W>
float row_dot(const float* x, const W* w, int64_t K) {
  const char* near = reinterpret_cast<const char*>(w + near_prefetch());
  const char* far = reinterpret_cast<const char*>(w + far_prefetch());
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    for (int64_t b = 0; b < 32 * static_cast<int64_t>(sizeof(W)); b += 64) {
      _mm_prefetch(near + k * sizeof(W) + b, _MM_HINT_T0);
      _mm_prefetch(far + k * sizeof(W) + b, _MM_HINT_T1);
    }
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), load8(w + k), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), load8(w + k + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 16), load8(w + k + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 24), load8(w + k + 24), a3);
  }
  float tail = 0.f;
  for (; k < K; ++k) tail += x[k] * static_cast<float>(w[k]);
  return sum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3))) + tail;
}

// M rows of x (row stride K) times one weight row, the weights loaded once (see the AVX-512 path).
template <int M, typename W>
void rows_dot(const float* x, const W* w, int64_t K, float* out, int64_t stride) {
  const char* near = reinterpret_cast<const char*>(w + near_prefetch());
  const char* far = reinterpret_cast<const char*>(w + far_prefetch());
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    if ((k * static_cast<int64_t>(sizeof(W))) % 64 == 0) {
      _mm_prefetch(near + k * sizeof(W), _MM_HINT_T0);
      _mm_prefetch(far + k * sizeof(W), _MM_HINT_T1);
    }
    const __m256 wv = load8(w + k);
    for (int m = 0; m < M; ++m) acc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k), wv, acc[m]);
  }
  for (int m = 0; m < M; ++m) {
    float tail = 0.f;
    for (int64_t j = k; j < K; ++j) tail += x[m * K + j] * static_cast<float>(w[j]);
    out[m * stride] = sum8(acc[m]) + tail;
  }
}
#else
inline float to_float(int8_t v) { return static_cast<float>(v); }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }

// Portable path (no AVX-512): the compiler vectorizes the reduction (omp simd permits reordering).
template <typename W>
float row_dot(const float* x, const W* w, int64_t K) {
  __builtin_prefetch(w + near_prefetch());
  __builtin_prefetch(w + far_prefetch(), 0, 2);
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t k = 0; k < K; ++k) {
    acc += x[k] * to_float(w[k]);
  }
  return acc;
}

template <int M, typename W>
void rows_dot(const float* x, const W* w, int64_t K, float* out, int64_t stride) {
  for (int m = 0; m < M; ++m) out[m * stride] = row_dot(x + m * K, w, K);
}
#endif

// Up to kMaxRows rows of x times one weight row, into out[m * stride].
template <typename W>
void dot_rows(const float* x, int64_t M, const W* w, int64_t K, float* out, int64_t stride) {
  switch (M) {
    case 1: out[0] = row_dot(x, w, K); break;
    case 2: rows_dot<2>(x, w, K, out, stride); break;
    case 3: rows_dot<3>(x, w, K, out, stride); break;
    case 4: rows_dot<4>(x, w, K, out, stride); break;
    case 5: rows_dot<5>(x, w, K, out, stride); break;
    case 6: rows_dot<6>(x, w, K, out, stride); break;
    case 7: rows_dot<7>(x, w, K, out, stride); break;
    default: rows_dot<8>(x, w, K, out, stride); break;
  }
}

template <typename W>
void gemv_all(const float* x, int64_t M, const std::vector<at::Tensor>& weights,
              const std::vector<int64_t>& first_row, int64_t K, float* y) {
  std::vector<const W*> ptrs;
  for (const auto& w : weights) ptrs.push_back(w.const_data_ptr<W>());
  fastflow_cpu::for_each_row(first_row, K, at::get_num_threads(), [&](size_t i, int64_t local, int64_t r) {
    dot_rows(x, M, ptrs[i] + local * K, K, y + r, first_row.back());
  });
}

// weights: one or more (N_i, K) matrices of one dtype, all multiplied by the same row x; scales and
// biases: empty, or one (N_i,) vector per weight. Returns the outputs concatenated along the last
// dim (shaped like x with sum N_i features); callers slice it. One tensor rather than a list:
// Inductor's cpp_wrapper mishandles a custom op's one-element Tensor[] result (torch 2.13: segfault).
at::Tensor gemv(const at::Tensor& x, at::TensorList weights, at::TensorList scales, at::TensorList biases) {
  const std::vector<int64_t> first_row =
      fastflow_cpu::gemv_first_rows("fastflow_cpu::gemv", x, weights, scales, biases, {at::kChar, at::kBFloat16},
                                    "int8 or bfloat16");
  const int64_t K = x.size(-1), M = x.numel() / K, total = first_row.back();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = total;
  if (fastflow_cpu::null_kernels()) return at::zeros(shape, x.options());
  std::vector<float> y32(M * total);
  if (fastflow_cpu::gemv_bf16_dot(x, weights, first_row, y32.data())) {
    // bf16 x and weights, AVX512-BF16: products taken as they load (cpu_gemv_bf16.cpp)
  } else if (weights[0].scalar_type() == at::kChar) {
    gemv_all<int8_t>(as_floats(x).data(), M, weights.vec(), first_row, K, y32.data());
  } else {
    gemv_all<c10::BFloat16>(as_floats(x).data(), M, weights.vec(), first_row, K, y32.data());
  }
  fastflow_cpu::apply_scales_biases(y32, M, first_row, scales, biases);
  at::Tensor out = at::empty(shape, x.options());
  store_floats(y32, out);
  return out;
}

// ---- int4_gemv: group-wise int4 weights in the 16-row interleaved layout (int4_layout.py) ----------
//
// packed (N/16, K/8, 64) bytes: byte 4i+b of chunk c of row block r holds code (16r+i, 8c+b) in its low
// nibble and (16r+i, 8c+4+b) in its high nibble; scale_zeros (N/16, K/G, 2, 16) bf16 holds, per row block
// and group, torch's CPU int4 grid w = (q - 8) * s + z': the 16 rows' s, then their z'. Lanes are rows,
// so AVX512-VNNI `vpdpbusd` (unsigned byte x signed byte, 4 products summed per 32-bit lane) takes the
// codes as they load -- one AND and one shift per 128 weights, no horizontal sums. x is read as int16
// per group (max error 2^-16 of the group's largest |x|, finer than the bf16 rounding torch's int4
// kernel applies) split into two signed bytes, x16 = 256 hi + lo: two VNNI products per code, exact
// integer sums. Per group: y += s * sx * sum(q * x16) + (z' - 8 s) * sum(x).
constexpr int64_t kInt4Rows = 16, kInt4ChunkK = 8, kInt4ChunkBytes = 64;
constexpr float kInt16Max = 32639.f;  // 127 * 256 + 127: both bytes stay in [-128, 127]

struct QuantizedRow {  // one activation row read as per-group int16, split into bytes
  std::vector<int8_t> hi, lo;
  std::vector<float> step, sum;  // per group: x = step * x16; sum of the x16 * step
};

#if defined(__AVX512F__) && defined(__AVX512BW__)
// Vectorized per group: G is a multiple of 8; 16 lanes at a time, a masked tail for G % 16 == 8.
void quantize_group(const float* xg, int64_t G, int8_t* hi, int8_t* lo, float* step, float* sum) {
  __m512 largest = _mm512_setzero_ps();
  for (int64_t k = 0; k < G; k += 16) {
    const __mmask16 m = G - k >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (G - k)) - 1);
    largest = _mm512_max_ps(largest, _mm512_abs_ps(_mm512_maskz_loadu_ps(m, xg + k)));
  }
  const float top = _mm512_reduce_max_ps(largest);
  const __m512 inv = _mm512_set1_ps(top > 0.f ? kInt16Max / top : 0.f);
  const __m512i bound = _mm512_set1_epi32(32639), rounding = _mm512_set1_epi32(128);
  __m512i total = _mm512_setzero_si512();
  for (int64_t k = 0; k < G; k += 16) {
    const __mmask16 m = G - k >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (G - k)) - 1);
    __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, xg + k), inv));  // to nearest even
    v = _mm512_max_epi32(_mm512_min_epi32(v, bound), _mm512_sub_epi32(_mm512_setzero_si512(), bound));
    const __m512i high = _mm512_srai_epi32(_mm512_add_epi32(v, rounding), 8);
    const __m512i low = _mm512_sub_epi32(v, _mm512_slli_epi32(high, 8));
    _mm_mask_storeu_epi8(hi + k, m, _mm512_cvtepi32_epi8(high));
    _mm_mask_storeu_epi8(lo + k, m, _mm512_cvtepi32_epi8(low));
    total = _mm512_add_epi32(total, v);
  }
  *step = top > 0.f ? top / kInt16Max : 0.f;
  *sum = static_cast<float>(_mm512_reduce_add_epi32(total)) * *step;
}
#elif defined(__AVX2__)
// 8 lanes at a time (G is a multiple of 8); the same roundings as the other paths.
void quantize_group(const float* xg, int64_t G, int8_t* hi, int8_t* lo, float* step, float* sum) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 largest = _mm256_setzero_ps();
  for (int64_t k = 0; k < G; k += 8) {
    largest = _mm256_max_ps(largest, _mm256_and_ps(_mm256_loadu_ps(xg + k), magnitude));
  }
  __m128 top4 = _mm_max_ps(_mm256_castps256_ps128(largest), _mm256_extractf128_ps(largest, 1));
  top4 = _mm_max_ps(top4, _mm_movehl_ps(top4, top4));
  const float top = _mm_cvtss_f32(_mm_max_ss(top4, _mm_movehdup_ps(top4)));
  const __m256 inv = _mm256_set1_ps(top > 0.f ? kInt16Max / top : 0.f);
  const __m256i bound = _mm256_set1_epi32(32639), rounding = _mm256_set1_epi32(128);
  __m256i total = _mm256_setzero_si256();
  for (int64_t k = 0; k < G; k += 8) {
    __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xg + k), inv));  // to nearest even
    v = _mm256_max_epi32(_mm256_min_epi32(v, bound), _mm256_sub_epi32(_mm256_setzero_si256(), bound));
    const __m256i high = _mm256_srai_epi32(_mm256_add_epi32(v, rounding), 8);
    const __m256i low = _mm256_sub_epi32(v, _mm256_slli_epi32(high, 8));
    for (const auto& [part, out] : {std::pair{high, hi + k}, std::pair{low, lo + k}}) {
      // 8 int32 in [-128, 127] to 8 bytes: the saturating packs change no value
      const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(part), _mm256_extracti128_si256(part, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packs_epi16(words, words));
    }
    total = _mm256_add_epi32(total, v);
  }
  __m128i total4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  total4 = _mm_add_epi32(total4, _mm_shuffle_epi32(total4, 0x4E));
  total4 = _mm_add_epi32(total4, _mm_shuffle_epi32(total4, 0xB1));
  *step = top > 0.f ? top / kInt16Max : 0.f;
  *sum = static_cast<float>(_mm_cvtsi128_si32(total4)) * *step;
}
#else
void quantize_group(const float* xg, int64_t G, int8_t* hi, int8_t* lo, float* step, float* sum) {
  float largest = 0.f;
  for (int64_t k = 0; k < G; ++k) largest = std::max(largest, std::fabs(xg[k]));
  const float inv = largest > 0.f ? kInt16Max / largest : 0.f;
  int64_t total = 0;
  for (int64_t k = 0; k < G; ++k) {
    const int32_t v = std::clamp(static_cast<int32_t>(std::nearbyint(xg[k] * inv)), -32639, 32639);
    const int32_t high = (v + 128) >> 8;
    hi[k] = static_cast<int8_t>(high);
    lo[k] = static_cast<int8_t>(v - high * 256);
    total += v;
  }
  *step = largest > 0.f ? largest / kInt16Max : 0.f;
  *sum = static_cast<float>(total) * *step;
}
#endif

QuantizedRow quantize_row(const float* x, int64_t K, int64_t G) {
  QuantizedRow q{std::vector<int8_t>(K), std::vector<int8_t>(K), std::vector<float>(K / G), std::vector<float>(K / G)};
  for (int64_t g = 0; g < K / G; ++g) {
    quantize_group(x + g * G, G, &q.hi[g * G], &q.lo[g * G], &q.step[g], &q.sum[g]);
  }
  return q;
}

inline float bf16_value(const c10::BFloat16* p, int64_t i) { return static_cast<float>(p[i]); }

// 4 bytes of x as one int32, to broadcast to every lane (the 4 products a lane sums)
inline int32_t four_bytes(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
inline __m512 load16_bf16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// 16 outputs of one row block.
void int4_block(const uint8_t* w, const c10::BFloat16* sz, const QuantizedRow& x, int64_t K, int64_t G, float* y) {
  const int64_t near = near_prefetch() / 2, far = far_prefetch() / 2;  // bytes: two codes each
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const int64_t chunks = G / kInt4ChunkK;
  __m512 acc = _mm512_setzero_ps();
  for (int64_t g = 0; g < K / G; ++g) {
    __m512i dot_hi = _mm512_setzero_si512(), dot_lo = _mm512_setzero_si512();
    for (int64_t c = 0; c < chunks; ++c) {
      const uint8_t* p = w + (g * chunks + c) * kInt4ChunkBytes;
      _mm_prefetch(reinterpret_cast<const char*>(p + near), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p + far), _MM_HINT_T1);
      const __m512i raw = _mm512_loadu_si512(p);
      const __m512i first = _mm512_and_si512(raw, nibble);                       // k = 8c .. 8c+3
      const __m512i second = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);  // k = 8c+4 .. 8c+7
      const int64_t k = g * G + c * kInt4ChunkK;
      dot_hi = _mm512_dpbusd_epi32(dot_hi, first, _mm512_set1_epi32(four_bytes(&x.hi[k])));
      dot_hi = _mm512_dpbusd_epi32(dot_hi, second, _mm512_set1_epi32(four_bytes(&x.hi[k + 4])));
      dot_lo = _mm512_dpbusd_epi32(dot_lo, first, _mm512_set1_epi32(four_bytes(&x.lo[k])));
      dot_lo = _mm512_dpbusd_epi32(dot_lo, second, _mm512_set1_epi32(four_bytes(&x.lo[k + 4])));
    }
    const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(dot_hi, 8), dot_lo);  // sum(q * x16), exact
    const __m512 s = load16_bf16(sz + g * 2 * kInt4Rows), zp = load16_bf16(sz + g * 2 * kInt4Rows + kInt4Rows);
    const __m512 offset = _mm512_fmadd_ps(s, _mm512_set1_ps(-8.f), zp);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s, _mm512_set1_ps(x.step[g])), acc);
    acc = _mm512_fmadd_ps(offset, _mm512_set1_ps(x.sum[g]), acc);
  }
  _mm512_storeu_ps(y, acc);
}
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 has no VNNI: `vpmaddubsw` (unsigned x signed bytes, adjacent pairs summed to int16) then
// `vpmaddwd` by ones (pairs of int16 to int32) does what one `vpdpbusd` does. A 64-byte chunk is two
// vectors: rows 0-7 and rows 8-15. One chunk adds at most 2 * 2 * 15 * 128 = 7680 to an int16 lane, so
// four chunks sum in int16 before one widening (30720 < 32767): 12 of 16 `vpmaddwd` saved.
constexpr int64_t kInt16Chunks = 4;

// codes . x of one chunk for 8 rows, in int16 pairs: the first and second nibbles against their 4 bytes
inline __m256i chunk_pairs(__m256i first, __m256i second, __m256i x_first, __m256i x_second) {
  return _mm256_add_epi16(_mm256_maddubs_epi16(first, x_first), _mm256_maddubs_epi16(second, x_second));
}

inline __m256i widen_add(__m256i sum32, __m256i pairs16) {
  return _mm256_add_epi32(sum32, _mm256_madd_epi16(pairs16, _mm256_set1_epi16(1)));
}

void int4_block(const uint8_t* w, const c10::BFloat16* sz, const QuantizedRow& x, int64_t K, int64_t G, float* y) {
  const int64_t near = near_prefetch() / 2, far = far_prefetch() / 2;  // bytes: two codes each
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const int64_t chunks = G / kInt4ChunkK;
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t g = 0; g < K / G; ++g) {
    __m256i dot_hi[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}, dot_lo[2] = {dot_hi[0], dot_hi[0]};
    for (int64_t c0 = 0; c0 < chunks; c0 += kInt16Chunks) {
      __m256i hi16[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}, lo16[2] = {hi16[0], hi16[0]};
      for (int64_t c = c0; c < std::min(chunks, c0 + kInt16Chunks); ++c) {
        const uint8_t* p = w + (g * chunks + c) * kInt4ChunkBytes;
        _mm_prefetch(reinterpret_cast<const char*>(p + near), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(p + far), _MM_HINT_T1);
        const int64_t k = g * G + c * kInt4ChunkK;
        const __m256i hi_first = _mm256_set1_epi32(four_bytes(&x.hi[k]));
        const __m256i hi_second = _mm256_set1_epi32(four_bytes(&x.hi[k + 4]));
        const __m256i lo_first = _mm256_set1_epi32(four_bytes(&x.lo[k]));
        const __m256i lo_second = _mm256_set1_epi32(four_bytes(&x.lo[k + 4]));
        for (int h = 0; h < 2; ++h) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h));
          const __m256i first = _mm256_and_si256(raw, nibble);
          const __m256i second = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
          hi16[h] = _mm256_add_epi16(hi16[h], chunk_pairs(first, second, hi_first, hi_second));
          lo16[h] = _mm256_add_epi16(lo16[h], chunk_pairs(first, second, lo_first, lo_second));
        }
      }
      for (int h = 0; h < 2; ++h) {
        dot_hi[h] = widen_add(dot_hi[h], hi16[h]);
        dot_lo[h] = widen_add(dot_lo[h], lo16[h]);
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256i dot = _mm256_add_epi32(_mm256_slli_epi32(dot_hi[h], 8), dot_lo[h]);  // sum(q * x16), exact
      const c10::BFloat16* rows = sz + g * 2 * kInt4Rows + 8 * h;
      const __m256 s = load8_bf16(rows), zp = load8_bf16(rows + kInt4Rows);
      const __m256 offset = _mm256_fmadd_ps(s, _mm256_set1_ps(-8.f), zp);
      acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(s, _mm256_set1_ps(x.step[g])), acc[h]);
      acc[h] = _mm256_fmadd_ps(offset, _mm256_set1_ps(x.sum[g]), acc[h]);
    }
  }
  _mm256_storeu_ps(y, acc[0]);
  _mm256_storeu_ps(y + 8, acc[1]);
}
#else
// Portable path: the same integer sums, one lane at a time.
void int4_block(const uint8_t* w, const c10::BFloat16* sz, const QuantizedRow& x, int64_t K, int64_t G, float* y) {
  const int64_t chunks = G / kInt4ChunkK;
  for (int64_t i = 0; i < kInt4Rows; ++i) {
    float acc = 0.f;
    for (int64_t g = 0; g < K / G; ++g) {
      int64_t dot = 0;
      for (int64_t c = 0; c < chunks; ++c) {
        const uint8_t* p = w + (g * chunks + c) * kInt4ChunkBytes + 4 * i;
        const int64_t k = g * G + c * kInt4ChunkK;
        for (int64_t b = 0; b < 4; ++b) {
          dot += (p[b] & 0xF) * (256 * x.hi[k + b] + x.lo[k + b]);
          dot += (p[b] >> 4) * (256 * x.hi[k + 4 + b] + x.lo[k + 4 + b]);
        }
      }
      const float s = bf16_value(sz, g * 2 * kInt4Rows + i), zp = bf16_value(sz, g * 2 * kInt4Rows + kInt4Rows + i);
      acc += static_cast<float>(dot) * (s * x.step[g]) + (zp - 8.f * s) * x.sum[g];
    }
    y[i] = acc;
  }
}
#endif

// x (..., K) rows times the int4 matrix -> (..., N) in x's dtype; bias (N,) or none. Threads split the
// row blocks; each block (a few KB of codes) meets every row of x while it sits in L1, so M rows cost
// one pass over the weights plus M times the arithmetic (prefill), not M passes.
at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_zeros,
                     const std::optional<at::Tensor>& bias, int64_t group_size) {
  const int64_t K = x.size(-1), blocks = packed.size(0), N = blocks * kInt4Rows, G = group_size;
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && scale_zeros.device().is_cpu(),
              "fastflow_cpu::int4_gemv: CPU tensors only");
  TORCH_CHECK(G > 0 && G % kInt4ChunkK == 0 && K % G == 0, "fastflow_cpu::int4_gemv: group size ", G,
              " must be a multiple of 8 dividing K = ", K);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(1) == K / kInt4ChunkK && packed.size(2) == kInt4ChunkBytes,
              "fastflow_cpu::int4_gemv: packed must be a contiguous (N/16, K/8, 64) uint8 tensor");
  TORCH_CHECK(scale_zeros.scalar_type() == at::kBFloat16 && scale_zeros.is_contiguous() &&
                  scale_zeros.sizes() == at::IntArrayRef({blocks, K / G, 2, kInt4Rows}),
              "fastflow_cpu::int4_gemv: scale_zeros must be a contiguous (N/16, K/G, 2, 16) bf16 tensor");
  if (bias) check_vector(*bias, N, "fastflow_cpu::int4_gemv", "bias");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  if (fastflow_cpu::null_kernels()) return at::zeros(shape, x.options());
  const at::Tensor rows = x.reshape({-1, K});
  const std::vector<float> x32 = as_floats(rows);
  const std::vector<float> b = bias ? as_floats(*bias) : std::vector<float>();
  const int64_t M = rows.size(0);
  std::vector<float> y32(M * N);
  const uint8_t* w = packed.const_data_ptr<uint8_t>();
  const c10::BFloat16* sz = scale_zeros.const_data_ptr<c10::BFloat16>();
  const int64_t grain = std::max<int64_t>(1, kMinParallelElements / (kInt4Rows * std::max<int64_t>(K, 1)));
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), (blocks + grain - 1) / grain));
  std::vector<QuantizedRow> q;
  for (int64_t m = 0; m < M; ++m) q.push_back(quantize_row(x32.data() + m * K, K, G));
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < blocks; ++r) {
    for (int64_t m = 0; m < M; ++m) {
      int4_block(w + r * (K / kInt4ChunkK) * kInt4ChunkBytes, sz + r * (K / G) * 2 * kInt4Rows, q[m], K, G,
                 y32.data() + m * N + r * kInt4Rows);
    }
  }
  for (int64_t m = 0; m < static_cast<int64_t>(b.empty() ? 0 : M); ++m) {
    for (int64_t n = 0; n < N; ++n) y32[m * N + n] += b[n];
  }
  at::Tensor out = at::empty(shape, x.options());
  store_floats(y32, out);
  return out;
}

std::atomic<bool> null_kernels_on{false};

bool set_null_kernels(bool on) { return null_kernels_on.exchange(on); }

std::vector<int64_t> set_prefetch(int64_t near, int64_t far) {
  TORCH_CHECK(near >= 0 && far >= 0, "fastflow_cpu::set_prefetch: distances must be >= 0");
  return {near_prefetch_elements.exchange(near), far_prefetch_elements.exchange(far)};
}

}  // namespace

bool fastflow_cpu::null_kernels() { return null_kernels_on.load(std::memory_order_relaxed); }
int64_t fastflow_cpu::near_prefetch() { return near_prefetch_elements.load(std::memory_order_relaxed); }
int64_t fastflow_cpu::far_prefetch() { return far_prefetch_elements.load(std::memory_order_relaxed); }

TORCH_LIBRARY(fastflow_cpu, m) {
  m.def("gemv(Tensor x, Tensor[] weights, Tensor[] scales, Tensor[] biases) -> Tensor");
  m.def("int4_gemv(Tensor x, Tensor packed, Tensor scale_zeros, Tensor? bias, int group_size) -> Tensor");
  // Benchmark switch (cpu_kernels.h): returns the previous setting.
  m.def("set_null_kernels(bool on) -> bool", &set_null_kernels);
  // Prefetch distances in weight elements (cpu_kernels.h): returns the previous [near, far].
  m.def("set_prefetch(int near, int far) -> int[]", &set_prefetch);
}

TORCH_LIBRARY_IMPL(fastflow_cpu, CPU, m) {
  m.impl("gemv", &gemv);
  m.impl("int4_gemv", &int4_gemv);
}
