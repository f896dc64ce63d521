// fastflow_cpu::gemm, int4_gemm -- a prompt's linears on CPUs without bf16 matrix instructions.
//
//     gemm(x, w, scale?, bias?)                 = (x @ w.T) * scale + bias     w bf16 / fp16 / int8 (N, K)
//     int4_gemm(x, packed, scale_zeros, bias?, G) = x @ W.T + bias               W in int4_gemv's layout
//
// fp32 products and sums, one rounding to x's dtype (the references: cpu_gemm.py). Why: on an AVX2 CPU
// (AMD Zen 2/3, Intel before Ice Lake) torch has no bf16 GEMM -- it emulates one, far below the FMA
// peak (docs/performance.md#decode-attention-packed-linears-and-prompts) -- and the quantized kernels it
// has are GEMVs run row after row. This is a cache-blocked fp32 GEMM in the usual shape (Goto / BLIS):
// x is packed once per call into fp32 panels of kMR rows, the
// weight block by block (kKC values of kNR rows) into fp32 panels -- bf16 -> fp32 is a shift, int8 a convert, int4 a
// (q - 8) * s + z' per value -- and a kMR x kNR register tile of FMAs runs over them, kMR values of x
// broadcast against two vectors of a panel per step. Widening is one pass over the weight per call,
// paid back by every row of the prompt. Sums over K blocks before the last wait in an fp32 buffer; the
// last block's tile adds the scale and bias and rounds to x's dtype in registers.
//
// Paths (compile time, -march): AVX2 + FMA (also what AVX-512 builds run) and portable C++; with AMX, bf16 x
// against int8 or int4 (G % 32 == 0) weights take tile multiplies instead (cpu_gemm_amx.cpp, chosen at run time).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <omp.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "cpu_gemm_amx.h"
#include "cpu_tile.h"

namespace {

constexpr int64_t kMR = fastflow_cpu::kTileRows;  // rows of x per register tile
constexpr int64_t kNR = fastflow_cpu::kTileCols;  // weight rows per register tile (int4_gemv's block of 16)
constexpr int64_t kKC = 256;  // K per block: a kKC x kNR weight panel (16 KB) stays in L1
constexpr int64_t kMC = 96;   // rows of x per block: kMC x kKC of packed x (96 KB) stays in L2
constexpr int64_t kNC = 256;  // weight rows a thread widens per block (256 KB of panels in L2)

// Scratch that lives as long as its thread: no page faults and no allocation per call.
float* scratch(std::vector<float>& buffer, int64_t n) {
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
  return buffer.data();
}

inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The next panel's bytes into L2 while this one is widened: weights stream from DRAM, and packing
// them at the latency of each miss left a 16-row prompt at half the speed of cache-resident weights.
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 2);
}

// ---- weights: kNR rows from n0, K values [k0, k0 + kc), as a panel p[k * kNR + r] ----------------
#if defined(__AVX2__)
inline void transpose8(__m256* r) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

inline __m256 load8(const uint16_t* p, bool half) {  // 8 bf16 or fp16 values as fp32
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if (half) return _mm256_cvtph_ps(raw);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline __m256 load8(const int8_t* p, bool) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif

inline float widen(uint16_t v, bool half) { return half ? static_cast<float>(c10::Half(v, c10::Half::from_bits())) : bf16_to_float(v); }
inline float widen(int8_t v, bool) { return static_cast<float>(v); }

// Row-major (N, K) bf16 / fp16 / int8 weights: 8 x 8 blocks transposed in registers.
template <typename T>
struct RowMajorWeight {
  const T* w;
  int64_t N, K;
  bool half;  // fp16 rather than bf16 (uint16_t storage)

  void operator()(int64_t n0, int64_t k0, int64_t kc, float* p) const {
    for (int64_t r = n0 + kNR; r < std::min(N, n0 + 2 * kNR); ++r) prefetch(w + r * K + k0, kc * sizeof(T));
    for (int64_t half_block = 0; half_block < kNR; half_block += 8) {
      const int64_t r0 = n0 + half_block;
      int64_t k = 0;
#if defined(__AVX2__)
      if (r0 + 8 <= N) {
        for (; k + 8 <= kc; k += 8) {
          __m256 v[8];
          for (int i = 0; i < 8; ++i) v[i] = load8(w + (r0 + i) * K + k0 + k, half);
          transpose8(v);
          for (int j = 0; j < 8; ++j) _mm256_storeu_ps(p + (k + j) * kNR + half_block, v[j]);
        }
      }
#endif
      for (; k < kc; ++k)
        for (int64_t i = 0; i < 8; ++i)
          p[k * kNR + half_block + i] = r0 + i < N ? widen(w[(r0 + i) * K + k0 + k], half) : 0.0f;
    }
  }
};

// int4_gemv's layout (int4_layout.py): per block of 16 rows and chunk of 8 K values, 64 bytes -- row r's
// 4 bytes hold K values j (low nibble) and j + 4 (high); the (N/16, K/G, 2, 16) table holds s, z'.
// The 16 rows of a block are already the panel's lanes: no transpose.
struct Int4Weight {
  const uint8_t* codes;
  const uint16_t* table;  // bf16
  int64_t chunks, groups, group_size, total_bytes;

  void operator()(int64_t n0, int64_t k0, int64_t kc, float* p) const {
    const int64_t b = n0 / kNR;
    if ((b + 1) * chunks * 64 < total_bytes) prefetch(codes + ((b + 1) * chunks + k0 / 8) * 64, kc * 8);
    for (int64_t c = k0 / 8; c < (k0 + kc) / 8; ++c) {
      const uint8_t* src = codes + (b * chunks + c) * 64;
      const uint16_t* sz = table + (b * groups + c * 8 / group_size) * 2 * kNR;
      float* out = p + (c * 8 - k0) * kNR;
#if defined(__AVX2__)
      for (int h = 0; h < 2; ++h) {
        const __m256i lanes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32 * h));
        const __m256 s = load8(sz + 8 * h, false), z = load8(sz + kNR + 8 * h, false);
        const __m256i mask = _mm256_set1_epi32(0xF), eight = _mm256_set1_epi32(8);
        for (int j = 0; j < 4; ++j) {
          const __m256i lo = _mm256_and_si256(_mm256_srli_epi32(lanes, 8 * j), mask);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(lanes, 8 * j + 4), mask);
          _mm256_storeu_ps(out + j * kNR + 8 * h, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(lo, eight)), s, z));
          _mm256_storeu_ps(out + (j + 4) * kNR + 8 * h,
                           _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(hi, eight)), s, z));
        }
      }
#else
      for (int64_t r = 0; r < kNR; ++r) {
        const float s = bf16_to_float(sz[r]), z = bf16_to_float(sz[kNR + r]);
        for (int j = 0; j < 4; ++j) {
          const uint8_t byte = src[r * 4 + j];
          out[j * kNR + r] = static_cast<float>(static_cast<int>(byte & 0xF) - 8) * s + z;
          out[(j + 4) * kNR + r] = static_cast<float>(static_cast<int>(byte >> 4) - 8) * s + z;
        }
      }
#endif
    }
  }
};

// ---- the register tile --------------------------------------------------------------------------
struct Epilogue {
  const float* scale;  // per output column, padded to whole tiles (or null)
  const float* bias;   // likewise
};

inline void store_value(float v, float* out) { *out = v; }
inline void store_value(float v, c10::BFloat16* out) { *out = c10::BFloat16(v); }
inline void store_value(float v, c10::Half* out) { *out = c10::Half(v); }

#if defined(__AVX2__) && defined(__FMA__)
inline void store16(__m256 lo, __m256 hi, float* out) {
  _mm256_storeu_ps(out, lo);
  _mm256_storeu_ps(out + 8, hi);
}

inline __m256i round_bf16(__m256 v) {  // the bf16 bits in each 32-bit lane, rounded to nearest even
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)), 16);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);  // a NaN stays a (quiet) NaN, as in c10's cast
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
}

inline void store16(__m256 lo, __m256 hi, c10::BFloat16* out) {
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(round_bf16(lo), round_bf16(hi)), 0xD8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), packed);
}

inline void store16(__m256 lo, __m256 hi, c10::Half* out) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 8), _mm256_cvtps_ph(hi, _MM_FROUND_TO_NEAREST_INT));
}
#endif

// One kMR x kNR tile over kc values of K: a = a panel of x (kMR values per k), b = a weight panel.
// Sums of earlier K blocks wait in c (ldc apart); after the last block the tile is scaled, biased and
// stored to y (rows x cols of it: the matrix's edge may cut it). The epilogue's vectors are padded,
// so reads never cut.
template <typename Out>
void tile(int64_t kc, const float* a, const float* b, float* c, int64_t ldc, bool first, bool last,
          const Epilogue& epi, int64_t col, Out* y, int64_t ldy, int64_t rows, int64_t cols) {
  float t[kMR * kNR];
#if defined(__AVX2__) && defined(__FMA__)
  const bool whole = rows == kMR && cols == kNR;
  fastflow_cpu::tile(kc, a, b, kNR, [&](int i, __m256 lo, __m256 hi) {
    if (!first) {
      lo = _mm256_add_ps(lo, _mm256_loadu_ps(c + i * ldc));
      hi = _mm256_add_ps(hi, _mm256_loadu_ps(c + i * ldc + 8));
    }
    if (!last) return store16(lo, hi, c + i * ldc);
    if (epi.scale) {
      lo = _mm256_mul_ps(lo, _mm256_loadu_ps(epi.scale + col));
      hi = _mm256_mul_ps(hi, _mm256_loadu_ps(epi.scale + col + 8));
    }
    if (epi.bias) {
      lo = _mm256_add_ps(lo, _mm256_loadu_ps(epi.bias + col));
      hi = _mm256_add_ps(hi, _mm256_loadu_ps(epi.bias + col + 8));
    }
    if (whole) return store16(lo, hi, y + i * ldy);
    store16(lo, hi, t + i * kNR);
  });
  if (!last || whole) return;
#else
  fastflow_cpu::tile_to(kc, a, b, kNR, t);
  for (int64_t i = 0; i < kMR; ++i)
    for (int64_t j = 0; j < kNR; ++j) {
      float& v = t[i * kNR + j];
      if (!first) v += c[i * ldc + j];
      if (!last) c[i * ldc + j] = v;
      else v = (epi.scale ? v * epi.scale[col + j] : v) + (epi.bias ? epi.bias[col + j] : 0.0f);
    }
  if (!last) return;
#endif
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) store_value(t[i * kNR + j], y + i * ldy + j);
}

// ---- the driver --------------------------------------------------------------------------------
// y (M, N) = x @ W.T with W given by `pack`; xp: x in panels of kMR rows (`pack_x`).
template <typename Pack, typename Out>
void gemm_rows(const float* xp, int64_t M, int64_t N, int64_t K, const Pack& pack, const Epilogue& epi, Out* y) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (N + kNR - 1) / kNR));
  // N split into equal kNR-aligned parts, each thread's share in blocks of at most kNC rows
  const int64_t per_thread = (N + threads - 1) / threads;
  const int64_t blocks_per_thread = (per_thread + kNC - 1) / kNC;
  const int64_t nc = ((per_thread + blocks_per_thread - 1) / blocks_per_thread + kNR - 1) / kNR * kNR;
  const int64_t n_blocks = (N + nc - 1) / nc, n_pad = (N + kNR - 1) / kNR * kNR;
  // K in equal blocks of at most kKC (a short last block would run at a fraction of the tile's speed)
  const int64_t k_blocks = (K + kKC - 1) / kKC, kb = ((K + k_blocks - 1) / k_blocks + 7) / 8 * 8;
  thread_local std::vector<float> partial_buffer;  // sums over the K blocks before the last
  float* partial = k_blocks == 1 ? nullptr : scratch(partial_buffer, (M + kMR - 1) / kMR * kMR * n_pad);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t jb = 0; jb < n_blocks; ++jb) {
    thread_local std::vector<float> panel_buffer;
    const int64_t n0 = jb * nc, panels = (std::min(nc, N - n0) + kNR - 1) / kNR;
    float* panel = scratch(panel_buffer, panels * kb * kNR);
    for (int64_t k0 = 0; k0 < K; k0 += kb) {
      const int64_t kc = std::min(kb, K - k0);
      for (int64_t jp = 0; jp < panels; ++jp) pack(n0 + jp * kNR, k0, kc, panel + jp * kb * kNR);
      for (int64_t m0 = 0; m0 < M; m0 += kMC) {
        for (int64_t jp = 0; jp < panels; ++jp) {
          const int64_t col = n0 + jp * kNR;
          for (int64_t i0 = m0; i0 < std::min(M, m0 + kMC); i0 += kMR) {
            tile(kc, xp + i0 * K + k0 * kMR, panel + jp * kb * kNR, partial ? partial + i0 * n_pad + col : nullptr, n_pad,
                 k0 == 0, k0 + kc == K, epi, col, y + i0 * N + col, N, std::min(kMR, M - i0), std::min(kNR, N - col));
          }
        }
      }
    }
  }
}

// ---- ops ---------------------------------------------------------------------------------------
// A scale or bias as fp32, zeros up to whole tiles (the tile reads kNR at a time); empty if absent.
std::vector<float> floats_of(const std::optional<at::Tensor>& t, int64_t N, const char* name) {
  if (!t.has_value()) return {};
  TORCH_CHECK(t->dim() == 1 && t->size(0) == N && t->is_floating_point() && t->device().is_cpu(),
              "fastflow_cpu::gemm: ", name, " must be a floating-point CPU vector of ", N, " values");
  const at::Tensor f = t->contiguous().to(at::kFloat);
  std::vector<float> out((N + kNR - 1) / kNR * kNR, 0.0f);
  std::copy_n(f.const_data_ptr<float>(), N, out.begin());
  return out;
}

// Rows [m0, m0 + kMR) of x (M, K) as a panel p[k * kMR + i] in fp32; rows past M are zeros.
template <typename T>
void pack_x_panel(const T* x, int64_t M, int64_t K, int64_t m0, float* p) {
  const int64_t rows = std::min(kMR, M - m0);
  for (int64_t i = 0; i < kMR; ++i) {
    const T* row = x + (m0 + i) * K;
    for (int64_t k = 0; k < K; ++k) p[k * kMR + i] = i < rows ? static_cast<float>(row[k]) : 0.0f;
  }
}

// x (M, K) as panels of kMR rows (ceil(M / kMR) of K x kMR), what the register tile broadcasts from.
const float* pack_x(const at::Tensor& x, int64_t M, int64_t K, std::vector<float>& buffer) {
  const int64_t panels = (M + kMR - 1) / kMR;
  float* xp = scratch(buffer, panels * kMR * K);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      switch (x.scalar_type()) {
        case at::kFloat: pack_x_panel(x.const_data_ptr<float>(), M, K, p * kMR, xp + p * kMR * K); break;
        case at::kBFloat16: pack_x_panel(x.const_data_ptr<c10::BFloat16>(), M, K, p * kMR, xp + p * kMR * K); break;
        default: pack_x_panel(x.const_data_ptr<c10::Half>(), M, K, p * kMR, xp + p * kMR * K); break;
      }
    }
  });
  return xp;
}

// y for x (..., K) against N weight rows: (..., N), x's dtype
at::Tensor empty_output(const at::Tensor& x, int64_t N) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return at::empty(shape, x.options());
}

template <typename Pack>
at::Tensor run(const at::Tensor& x_in, int64_t N, const Pack& pack, const std::vector<float>& scale,
               const std::vector<float>& bias) {
  TORCH_CHECK(x_in.device().is_cpu() && (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16 ||
                                         x_in.scalar_type() == at::kHalf),
              "fastflow_cpu::gemm: x must be a float32, bfloat16 or float16 CPU tensor");
  const at::Tensor x = x_in.contiguous();
  const int64_t K = x.size(-1), M = x.numel() / std::max<int64_t>(K, 1);
  at::Tensor y = empty_output(x, N);
  if (M == 0 || N == 0) return y;
  thread_local std::vector<float> x_buffer;
  const float* xp = pack_x(x, M, K, x_buffer);
  const Epilogue epi{scale.empty() ? nullptr : scale.data(), bias.empty() ? nullptr : bias.data()};
  switch (x.scalar_type()) {
    case at::kFloat: gemm_rows(xp, M, N, K, pack, epi, y.mutable_data_ptr<float>()); break;
    case at::kBFloat16: gemm_rows(xp, M, N, K, pack, epi, y.mutable_data_ptr<c10::BFloat16>()); break;
    default: gemm_rows(xp, M, N, K, pack, epi, y.mutable_data_ptr<c10::Half>()); break;
  }
  return y;
}

// bf16 x and int8 weights where AMX runs: tile multiplies over blocks widened in L1 (cpu_gemm_amx.cpp)
at::Tensor gemm_amx_int8(const at::Tensor& x_in, const at::Tensor& w, const std::vector<float>& scale,
                         const std::vector<float>& bias) {
  const at::Tensor x = x_in.contiguous();
  const int64_t N = w.size(0), K = w.size(1), M = x.numel() / std::max<int64_t>(K, 1);
  at::Tensor y = empty_output(x, N);
  if (M == 0 || N == 0) return y;
  fastflow_cpu::gemm_amx_int8(reinterpret_cast<const uint16_t*>(x.const_data_ptr()), M, K, w.const_data_ptr<int8_t>(),
                              N, scale.empty() ? nullptr : scale.data(), bias.empty() ? nullptr : bias.data(),
                              reinterpret_cast<uint16_t*>(y.mutable_data_ptr()));
  return y;
}

// bf16 x and int4 weights (G a multiple of 32) where AMX runs (cpu_gemm_amx.cpp)
at::Tensor gemm_amx_int4(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scale_zeros,
                         const std::vector<float>& bias, int64_t group_size) {
  const at::Tensor x = x_in.contiguous();
  const int64_t N = packed.size(0) * kNR, K = packed.size(1) * 8, M = x.numel() / std::max<int64_t>(K, 1);
  at::Tensor y = empty_output(x, N);
  if (M == 0) return y;
  fastflow_cpu::gemm_amx_int4(reinterpret_cast<const uint16_t*>(x.const_data_ptr()), M, K,
                              packed.const_data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scale_zeros.const_data_ptr()),
                              group_size, N, bias.empty() ? nullptr : bias.data(), reinterpret_cast<uint16_t*>(y.mutable_data_ptr()));
  return y;
}

at::Tensor gemm(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& scale,
                const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu() && x.dim() >= 1 && weight.size(1) == x.size(-1),
              "fastflow_cpu::gemm: weight must be a CPU (N, K) matrix with K = x.size(-1)");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  const std::vector<float> s = floats_of(scale, N, "scale"), b = floats_of(bias, N, "bias");
  if (x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kChar && fastflow_cpu::gemm_amx_ready())
    return gemm_amx_int8(x, w, s, b);
  switch (w.scalar_type()) {
    case at::kBFloat16:
    case at::kHalf: {
      const auto* data = reinterpret_cast<const uint16_t*>(w.const_data_ptr());
      return run(x, N, RowMajorWeight<uint16_t>{data, N, K, w.scalar_type() == at::kHalf}, s, b);
    }
    case at::kChar: return run(x, N, RowMajorWeight<int8_t>{w.const_data_ptr<int8_t>(), N, K, false}, s, b);
    default: TORCH_CHECK(false, "fastflow_cpu::gemm: weight must be bfloat16, float16 or int8, got ", w.scalar_type());
  }
}

at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_zeros,
                     const std::optional<at::Tensor>& bias, int64_t group_size) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 64 && packed.scalar_type() == at::kByte,
              "fastflow_cpu::int4_gemm: packed must be (N/16, K/8, 64) uint8");
  const int64_t blocks = packed.size(0), chunks = packed.size(1), K = chunks * 8, N = blocks * kNR;
  TORCH_CHECK(group_size > 0 && group_size % 8 == 0 && K % group_size == 0 && x.size(-1) == K,
              "fastflow_cpu::int4_gemm: K = x.size(-1) must be packed.size(1) * 8, a multiple of group_size (a multiple of 8)");
  const int64_t groups = K / group_size;
  TORCH_CHECK(scale_zeros.scalar_type() == at::kBFloat16 && scale_zeros.dim() == 4 && scale_zeros.size(0) == blocks &&
                  scale_zeros.size(1) == groups && scale_zeros.size(2) == 2 && scale_zeros.size(3) == kNR,
              "fastflow_cpu::int4_gemm: scale_zeros must be (N/16, K/G, 2, 16) bf16");
  static_assert(kKC % 8 == 0, "int4 panels are whole chunks of 8");
  const at::Tensor p = packed.contiguous(), sz = scale_zeros.contiguous();
  if (x.scalar_type() == at::kBFloat16 && group_size % 32 == 0 && fastflow_cpu::gemm_amx_ready())
    return gemm_amx_int4(x, p, sz, floats_of(bias, N, "bias"), group_size);
  const Int4Weight pack{p.const_data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(sz.const_data_ptr()), chunks,
                        groups, group_size, p.numel()};
  return run(x, N, pack, {}, floats_of(bias, N, "bias"));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastflow_cpu, m) {
  m.def("gemm(Tensor x, Tensor weight, Tensor? scale, Tensor? bias) -> Tensor");
  m.def("int4_gemm(Tensor x, Tensor packed, Tensor scale_zeros, Tensor? bias, int group_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastflow_cpu, CPU, m) {
  m.impl("gemm", &gemm);
  m.impl("int4_gemm", &int4_gemm);
}
