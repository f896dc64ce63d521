// fastflow_cpu::gemm (int8 weights) and int4_gemm for bf16 activations on CPUs with AMX: a short
// prompt's quantized linears.
//
// Why: a 16-row prompt multiplies every weight by 16 rows. torch's int8 kernel and cpu_gemm.cpp's
// fp32 tiles run that on vector FMAs, several times slower than reading the weight
// (docs/performance.md#prompts-on-amx), and widening the whole weight to bf16 for oneDNN's AMX GEMM
// costs four passes over memory. Here each weight block is widened to bf16 in L1
// right before one tile multiply (TDPBF16PS: 16 x 16 outputs, 32 products each, exact, summed in
// fp32), so the weight is read once and the multiply is nearly free. A prompt of more than 16 rows is
// taken 16 rows at a time, one pass over the weight each. Four weight blocks share each x tile (tiles
// 0-3 accumulate, 4 holds x, 5-7 the weight).
//
// int8: codes are exact in bf16. The weight is the left operand (A: 16 weight rows x 32 K values,
// row-major as it lies, so the widened block needs no transpose) and the prompt the right one (B: x in
// bf16 pairs, packed once per pass); C (weight rows x prompt rows) is transposed on the way out.
// int4: the layout holds 16 rows to a 64-byte chunk of 8 K values (4 bytes a row), so the weight is the
// right operand: a B row is one (K, K + 4) pair for each of the 16 weight rows -- a shift, two masks and
// a table lookup (q -> bf16(q - 8), exact) per 32 values -- and x the left one, its K values paired to
// match. Each group's tiles (G a multiple of 32) are then scaled in fp32: y += s * C_g + z' * sum_g(x).
#include "cpu_gemm_amx.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <omp.h>

#if defined(__x86_64__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cstring>
#include <vector>

namespace fastflow_cpu {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
namespace {

constexpr int64_t kT = 16;      // rows of a tile: 16 weight rows per A, 16 prompt rows per B and C
constexpr int64_t kKT = 32;     // K values per tile step (16 bf16 pairs: 64 bytes a row)
constexpr int64_t kBlocks = 4;  // weight blocks (of 16 rows) per x tile

struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

void configure_tiles() {  // per thread, per call: every tile 16 rows of 64 bytes
  TileConfig cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = kT, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

bool request_tile_state() {  // Linux grants AMX's tile data per process, on request (arch_prctl)
  constexpr long kRequestPermission = 0x1023, kTileData = 18;
  return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
}

// x rows [m0, m0 + 16) as B tiles, one per K step: b[s][r][i][j] = x[m0 + i][32 s + 2 r + j] (zeros past M, K)
void pack_x(const uint16_t* x, int64_t M, int64_t K, int64_t m0, uint16_t* b) {
  const int64_t steps = (K + kKT - 1) / kKT;
  std::memset(b, 0, steps * kT * kT * 2 * sizeof(uint16_t));
  for (int64_t i = 0; i < std::min(kT, M - m0); ++i) {
    const uint16_t* row = x + (m0 + i) * K;
    for (int64_t k = 0; k < K; ++k) b[(k / kKT) * kT * kT * 2 + ((k % kKT) / 2) * kT * 2 + i * 2 + (k & 1)] = row[k];
  }
}

// Weight rows [n0, n0 + 16) x K values [k0, k0 + 32) widened to bf16, 64 bytes a row (zeros past N, K)
inline void widen_block(const int8_t* w, int64_t N, int64_t K, int64_t n0, int64_t k0, uint16_t* a) {
  if (n0 + kT <= N && k0 + kKT <= K) {
    for (int64_t r = 0; r < kT; ++r) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (n0 + r) * K + k0));
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
      _mm512_storeu_si512(a + r * kKT, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
    return;
  }
  for (int64_t r = 0; r < kT; ++r)
    for (int64_t k = 0; k < kKT; ++k)
      a[r * kKT + k] = n0 + r < N && k0 + k < K ? c10::BFloat16(static_cast<float>(w[(n0 + r) * K + k0 + k])).x : 0;
}

// C tiles 0..blocks-1 (weight rows n0 + 16 b + r, prompt rows m0 + i) scaled, biased, rounded into y
void store_outputs(const float* c, int64_t blocks, int64_t n0, int64_t N, int64_t m0, int64_t M, const float* scale,
                   const float* bias, uint16_t* y) {
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t r = 0; r < kT && n0 + b * kT + r < N; ++r) {
      const int64_t n = n0 + b * kT + r;
      const float s = scale ? scale[n] : 1.0f, add = bias ? bias[n] : 0.0f;
      for (int64_t i = 0; i < std::min(kT, M - m0); ++i)
        y[(m0 + i) * N + n] = c10::BFloat16(c[(b * kT + r) * kT + i] * s + add).x;
    }
}

// Accumulator tiles 0-3: zeroed, and stored as 4 consecutive 16 x 16 fp32 blocks of c
inline void zero_accumulators() {
  _tile_zero(0);  // tile macros are asm statements with the tile number spelled in: one per statement
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

inline void store_accumulators(float* c) {
  _tile_stored(0, c, 64);
  _tile_stored(1, c + kT * kT, 64);
  _tile_stored(2, c + 2 * kT * kT, 64);
  _tile_stored(3, c + 3 * kT * kT, 64);
}

// One K step of up to kBlocks weight blocks against the x tile already in tile 4: block b is made by
// fill(b, buf + b * 512) and multiplied into accumulator b, the weight as A (int8) or as B (int4)
template <bool kWeightIsA, class Fill>
inline void multiply_blocks(int64_t blocks, uint16_t* buf, Fill fill) {
  fill(0, buf);
  _tile_loadd(5, buf, 64);
  if constexpr (kWeightIsA) _tile_dpbf16ps(0, 5, 4); else _tile_dpbf16ps(0, 4, 5);
  if (blocks > 1) {
    fill(1, buf + kT * kKT);
    _tile_loadd(6, buf + kT * kKT, 64);
    if constexpr (kWeightIsA) _tile_dpbf16ps(1, 6, 4); else _tile_dpbf16ps(1, 4, 6);
  }
  if (blocks > 2) {
    fill(2, buf + 2 * kT * kKT);
    _tile_loadd(7, buf + 2 * kT * kKT, 64);
    if constexpr (kWeightIsA) _tile_dpbf16ps(2, 7, 4); else _tile_dpbf16ps(2, 4, 7);
  }
  if (blocks > 3) {
    fill(3, buf + 3 * kT * kKT);
    _tile_loadd(5, buf + 3 * kT * kKT, 64);
    if constexpr (kWeightIsA) _tile_dpbf16ps(3, 5, 4); else _tile_dpbf16ps(3, 4, 5);
  }
}

// Up to kBlocks int8 weight blocks from n0 against the packed x tiles `xb` (x as B), into c
void int8_blocks(const int8_t* w, int64_t N, int64_t K, int64_t n0, const uint16_t* xb, uint16_t* a, float* c) {
  const int64_t steps = (K + kKT - 1) / kKT, blocks = std::min(kBlocks, (N - n0 + kT - 1) / kT);
  zero_accumulators();
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(4, xb + s * kT * kT * 2, 64);
    multiply_blocks<true>(blocks, a, [&](int64_t b, uint16_t* out) { widen_block(w, N, K, n0 + b * kT, s * kKT, out); });
  }
  store_accumulators(c);
}


// ---- int4 ----------------------------------------------------------------------------------------

// x rows [m0, m0 + 16) as A tiles matching int4 B rows: per K step of 32, A[i][2p + h] = x[i][32 s + 8 c +
// j + 4 h] with p = 4 c + j (chunk c, byte j); and each row's sum over each group, in fp32 (zeros past M)
void pack_x_int4(const uint16_t* x, int64_t M, int64_t K, int64_t G, int64_t m0, uint16_t* a, float* sums) {
  const int64_t steps = K / kKT, groups = K / G;
  std::memset(a, 0, steps * kT * kKT * sizeof(uint16_t));
  std::memset(sums, 0, groups * kT * sizeof(float));
  for (int64_t i = 0; i < std::min(kT, M - m0); ++i) {
    const uint16_t* row = x + (m0 + i) * K;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t s = k / kKT, c = (k % kKT) / 8, j = k % 4, h = (k % 8) / 4;
      a[s * kT * kKT + i * kKT + 2 * (4 * c + j) + h] = row[k];
      sums[(k / G) * kT + i] += c10::BFloat16(row[k], c10::BFloat16::from_bits()).operator float();
    }
  }
}

// B tile for weight block `block`, K step s: row 4 c + j holds, per weight row n, bf16(q - 8) of K values
// 8 c + j (low nibble of byte j) and 8 c + j + 4 (high nibble)
inline void unpack_int4(const uint8_t* codes, int64_t chunks, int64_t block, int64_t s, __m512i lookup,
                        uint16_t* b) {
  const uint8_t* src = codes + (block * chunks + s * 4) * 64;
  const __m512i low = _mm512_set1_epi32(0xF), high = _mm512_set1_epi32(0xF0);
  for (int c = 0; c < 4; ++c) {
    const __m512i chunk = _mm512_loadu_si512(src + c * 64);  // dword n: weight row n's 4 bytes
    for (int j = 0; j < 4; ++j) {
      const __m512i u = _mm512_srli_epi32(chunk, 8 * j);
      const __m512i pair = _mm512_or_si512(_mm512_and_si512(u, low), _mm512_slli_epi32(_mm512_and_si512(u, high), 12));
      _mm512_storeu_si512(b + (4 * c + j) * 32, _mm512_permutexvar_epi16(pair, lookup));
    }
  }
}

struct Int4Layout {
  const uint8_t* codes;
  const uint16_t* table;
  int64_t chunks, groups, group_size;
};

// acc[b][i][:] += s * C_b[i][:] + z' * sums[i] for the group g of blocks first..first+blocks-1
void scale_group(const Int4Layout& w, int64_t first, int64_t blocks, int64_t g, const float* c, const float* sums,
                 float* acc) {
  for (int64_t b = 0; b < blocks; ++b) {
    const uint16_t* sz = w.table + ((first + b) * w.groups + g) * 2 * kT;
    const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(sz))), 16));
    const __m512 z = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(sz + kT))), 16));
    for (int64_t i = 0; i < kT; ++i) {
      float* out = acc + (b * kT + i) * kT;
      const __m512 v = _mm512_fmadd_ps(s, _mm512_loadu_ps(c + (b * kT + i) * kT), _mm512_loadu_ps(out));
      _mm512_storeu_ps(out, _mm512_fmadd_ps(z, _mm512_set1_ps(sums[i]), v));
    }
  }
}

// Up to kBlocks int4 weight blocks from `first` against the packed x tiles `xa` (x as A), into acc
void int4_blocks(const Int4Layout& w, int64_t first, int64_t blocks, const uint16_t* xa, const float* sums,
                 __m512i lookup, uint16_t* b, float* c, float* acc) {
  const int64_t steps_per_group = w.group_size / kKT;
  std::memset(acc, 0, kBlocks * kT * kT * sizeof(float));
  for (int64_t g = 0; g < w.groups; ++g) {
    zero_accumulators();
    for (int64_t s = g * steps_per_group; s < (g + 1) * steps_per_group; ++s) {
      _tile_loadd(4, xa + s * kT * kKT, 64);
      multiply_blocks<false>(blocks, b, [&](int64_t i, uint16_t* out) {
        unpack_int4(w.codes, w.chunks, first + i, s, lookup, out);
      });
    }
    store_accumulators(c);
    scale_group(w, first, blocks, g, c, sums + g * kT, acc);
  }
}

__m512i int4_lookup() {  // words 0..15: bf16(q - 8), exact
  alignas(64) uint16_t values[32] = {};
  for (int q = 0; q < 16; ++q) values[q] = c10::BFloat16(static_cast<float>(q - 8)).x;
  return _mm512_load_si512(values);
}

}  // namespace

bool gemm_amx_ready() {
  static const bool granted = request_tile_state();
  return granted;
}

void gemm_amx_int8(const uint16_t* x, int64_t M, int64_t K, const int8_t* w, int64_t N, const float* scale,
                   const float* bias, uint16_t* y) {
  const int64_t groups = (N + kBlocks * kT - 1) / (kBlocks * kT);
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), groups));
  std::vector<uint16_t> xb(((K + kKT - 1) / kKT) * kT * kT * 2);
  for (int64_t m0 = 0; m0 < M; m0 += kT) {
    pack_x(x, M, K, m0, xb.data());
#pragma omp parallel num_threads(threads)
    {
      alignas(64) uint16_t a[kBlocks * kT * kKT];
      alignas(64) float c[kBlocks * kT * kT];
      configure_tiles();
      const int64_t t = omp_get_thread_num();
      for (int64_t g = groups * t / threads; g < groups * (t + 1) / threads; ++g) {
        const int64_t n0 = g * kBlocks * kT;
        int8_blocks(w, N, K, n0, xb.data(), a, c);
        store_outputs(c, std::min(kBlocks, (N - n0 + kT - 1) / kT), n0, N, m0, M, scale, bias, y);
      }
      _tile_release();
    }
  }
}

void gemm_amx_int4(const uint16_t* x, int64_t M, int64_t K, const uint8_t* codes, const uint16_t* table,
                   int64_t group_size, int64_t N, const float* bias, uint16_t* y) {
  const Int4Layout w{codes, table, K / 8, K / group_size, group_size};
  const int64_t blocks = N / kT, units = (blocks + kBlocks - 1) / kBlocks;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), units));
  std::vector<uint16_t> xa(K / kKT * kT * kKT);
  std::vector<float> sums(w.groups * kT);
  for (int64_t m0 = 0; m0 < M; m0 += kT) {
    pack_x_int4(x, M, K, group_size, m0, xa.data(), sums.data());
#pragma omp parallel num_threads(threads)
    {
      alignas(64) uint16_t b[kBlocks * kT * kKT];
      alignas(64) float c[kBlocks * kT * kT], acc[kBlocks * kT * kT];
      const __m512i lookup = int4_lookup();
      configure_tiles();
      const int64_t t = omp_get_thread_num();
      for (int64_t u = units * t / threads; u < units * (t + 1) / threads; ++u) {
        const int64_t first = u * kBlocks, count = std::min(kBlocks, blocks - first);
        int4_blocks(w, first, count, xa.data(), sums.data(), lookup, b, c, acc);
        for (int64_t bb = 0; bb < count; ++bb)
          for (int64_t i = 0; i < std::min(kT, M - m0); ++i)
            for (int64_t r = 0; r < kT; ++r) {
              const int64_t n = (first + bb) * kT + r;
              y[(m0 + i) * N + n] = c10::BFloat16(acc[(bb * kT + i) * kT + r] + (bias ? bias[n] : 0.0f)).x;
            }
      }
      _tile_release();
    }
  }
}

#else

bool gemm_amx_ready() { return false; }

void gemm_amx_int8(const uint16_t*, int64_t, int64_t, const int8_t*, int64_t, const float*, const float*, uint16_t*) {}

void gemm_amx_int4(const uint16_t*, int64_t, int64_t, const uint8_t*, const uint16_t*, int64_t, int64_t, const float*,
                   uint16_t*) {}

#endif

}  // namespace fastflow_cpu
