// fastflow_cpu::attention_decode -- attention of a few new queries over a static KV cache, on CPU.
//
//     out = softmax(q k^T * scale + visibility) v      over the first `filled` cache slots only
//
// Semantics are ffl_backend/attention/reference.py's (the pure-torch reference every test uses):
// query i sits at position filled - Lq + i; key j is visible when j <= position, position - j < window
// (window > 0) and mask[b, 0, i, j] (optional boolean HF mask, padding); a query with no visible key
// gives zeros. GQA without repeating K/V: the `group` query heads of one KV head read each key once.
//
// Why a kernel of its own: at decode a layer's attention is little work, and the Python custom op
// around SDPA (slice to filled, mask, SDPA, copies) cost about as much again per layer in dispatch
// and allocations (docs/performance.md). A C++ op is one dispatcher call from Inductor's wrapper (one
// C++ call under cpp_wrapper), reads only the filled slots, and writes its output directly in the
// (B, Lq, Hq, D) order the o_proj reads (returned as a (B, Hq, Lq, D) view of it).
// Keys are taken four at a time (AVX2 where built for it, else loops the compiler vectorizes): the
// four scores of a query row reduced by one horizontal-add tree, four values accumulated per load of
// the output row. One dot per key with its own reduction was a chain of dependent scalar adds (the
// A/B: benchmarks/results/cpu_decode_kernels_ab_cpu_xeon.json). Built with cpu_gemv.cpp into one
// library (cpu_lib.py).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <vector>

#include "cpu_kernels.h"
#include "cpu_tile.h"

namespace {

using fastflow_cpu::exp_nonpositive;

// Keys per task at least: below this a thread's share costs less than waking it.
constexpr int64_t kMinKeysPerTask = 64;

template <typename T>
inline void widen(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}

// A cached row of D values as fp32. Float caches: widened. Quantized caches (attention/kv_quant.py):
// D int8 or fp8 e4m3 values, padded to a multiple of 4 bytes, then the row's fp32 scale.
template <typename T>
inline void load_row(const T* row, float* dst, int64_t D) {
  widen(row, dst, D);
}

inline float row_scale(const void* row, int64_t D) {
  float scale;
  std::memcpy(&scale, static_cast<const char*>(row) + (D + 3) / 4 * 4, sizeof(scale));
  return scale;
}

inline void load_row(const int8_t* row, float* dst, int64_t D) {
  const float scale = row_scale(row, D);
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(row[d]) * scale;
}

// e4m3 byte b = s eeee mmm is (-1)^s 2^(e-7) (1 + m/8), or m 2^-9 for e = 0 (subnormal). Shifted into a
// half's bits, s << 15 | eeee mmm << 7 is that value times 2^-8 (subnormals included), and F16C
// widens 8 halves per instruction; a 256-entry table lookup was much slower (benchmarks/kv_cache_attention_cpu.py;
// docs/performance.md#decode-attention-packed-linears-and-prompts). The scalar formula serves the tail
// and non-F16C builds.
inline float e4m3_to_float(uint32_t b) {
  const uint32_t e = (b >> 3) & 15u, m = b & 7u;
  const float mag = std::ldexp(static_cast<float>(e != 0 ? (m | 8u) : m), static_cast<int>(e != 0 ? e : 1u) - 10);
  return (b & 0x80u) != 0 ? -mag : mag;
}

inline void load_row(const c10::Float8_e4m3fn* row, float* dst, int64_t D) {
  const float scale = row_scale(row, D);
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(row);
  int64_t d = 0;
#if defined(__AVX2__) && defined(__F16C__)
  const __m256 factor = _mm256_set1_ps(256.f * scale);
  const __m128i sign = _mm_set1_epi16(0x80), magnitude = _mm_set1_epi16(0x7F);
  for (; d + 8 <= D; d += 8) {
    const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + d)));
    const __m128i half = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, sign), 8),
                                      _mm_slli_epi16(_mm_and_si128(w, magnitude), 7));
    _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_cvtph_ps(half), factor));
  }
#endif
  for (; d < D; ++d) dst[d] = e4m3_to_float(bytes[d]) * scale;
}

// Keys are handled kBlock at a time: widened once into fp32 for every query row of the group, their
// scores reduced together and their values accumulated with the output row held in registers.
constexpr int64_t kBlock = 4;

#if defined(__AVX2__) && defined(__FMA__)
static_assert(kBlock == 4, "the AVX2 block helpers take four keys");

// q . k_i for the kBlock keys at k (row stride D) into out[0..3]. One accumulator per key and one
// horizontal-add tree for all four: a single dot's reduction is a serial add chain.
inline void dots_block(const float* q, const float* k, int64_t D, float* out) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  const int64_t whole = D / 8 * 8;
  for (int64_t d = 0; d < whole; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + d), a0);
    a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + D + d), a1);
    a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 2 * D + d), a2);
    a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 3 * D + d), a3);
  }
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  for (int64_t d = whole; d < D; ++d) {
    for (int64_t i = 0; i < kBlock; ++i) out[i] += q[d] * k[i * D + d];
  }
}

// acc[0..D) += sum_i p[i] * v_i over the kBlock values at v (row stride D).
inline void axpy_block(const float* p, const float* v, int64_t D, float* acc) {
  const __m256 p0 = _mm256_set1_ps(p[0]), p1 = _mm256_set1_ps(p[1]), p2 = _mm256_set1_ps(p[2]),
               p3 = _mm256_set1_ps(p[3]);
  const int64_t whole = D / 8 * 8;
  for (int64_t d = 0; d < whole; d += 8) {
    __m256 o = _mm256_loadu_ps(acc + d);
    o = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v + d), o);
    o = _mm256_fmadd_ps(p1, _mm256_loadu_ps(v + D + d), o);
    o = _mm256_fmadd_ps(p2, _mm256_loadu_ps(v + 2 * D + d), o);
    o = _mm256_fmadd_ps(p3, _mm256_loadu_ps(v + 3 * D + d), o);
    _mm256_storeu_ps(acc + d, o);
  }
  for (int64_t d = whole; d < D; ++d) {
    acc[d] += p[0] * v[d] + p[1] * v[D + d] + p[2] * v[2 * D + d] + p[3] * v[3 * D + d];
  }
}
#else
inline void dots_block(const float* q, const float* k, int64_t D, float* out) {
  for (int64_t i = 0; i < kBlock; ++i) {
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t d = 0; d < D; ++d) acc += q[d] * k[i * D + d];
    out[i] = acc;
  }
}

inline void axpy_block(const float* p, const float* v, int64_t D, float* acc) {
  for (int64_t i = 0; i < kBlock; ++i) {
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) acc[d] += p[i] * v[i * D + d];
  }
}
#endif

// max of v[0..n), -inf for none; a serial max chain costs 4 cycles per score.
inline float largest(const float* v, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
#if defined(__AVX2__)
  __m256 m8 = _mm256_set1_ps(m);
  for (; j + 8 <= n; j += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(v + j));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
#endif
  for (; j < n; ++j) m = std::max(m, v[j]);
  return m;
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) y[d] += alpha * x[d];
}

struct Shape {
  int64_t B, Hq, Hkv, Lq, S, D, group, filled, window;
  float scale;
};

// Strides (in elements) of the operands, so views of the cache and expanded masks need no copy.
struct Strides {
  int64_t qb, qh, qm, kb, kh, kn, vb, vh, vn, mb, mm;
};

// Partial softmax state of one query row over one range of keys.
struct Partial {
  float max = -std::numeric_limits<float>::infinity();
  float sum = 0.f;
};

// One task: batch b, KV head kvh, keys [lo, hi). Every query row of the group reads each key once.
// Keys are padded to whole blocks (zero keys and values, scored invisible).
template <typename T, typename KV>
void attend_range(const T* q, const KV* k, const KV* v, const bool* mask, const Shape& s, const Strides& st,
                  int64_t b, int64_t kvh, int64_t lo, int64_t hi, Partial* parts, float* accs) {
  const int64_t rows = s.group * s.Lq, D = s.D, n = hi - lo, padded = (n + kBlock - 1) / kBlock * kBlock;
  std::vector<float> qf(rows * D), block(kBlock * D), scores(rows * padded);
  std::vector<int64_t> position(s.Lq);  // per query position i (row r of the group is position r % Lq)
  std::vector<const bool*> mask_row(s.Lq, nullptr);
  for (int64_t i = 0; i < s.Lq; ++i) {
    position[i] = s.filled - s.Lq + i;
    if (mask != nullptr) mask_row[i] = mask + b * st.mb + i * st.mm;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t h = kvh * s.group + r / s.Lq, i = r % s.Lq;
    widen(q + b * st.qb + h * st.qh + i * st.qm, qf.data() + r * D, D);
  }
  const KV* kbase = k + b * st.kb + kvh * st.kh;
  const KV* vbase = v + b * st.vb + kvh * st.vh;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const auto load_block = [&](const KV* base, int64_t stride, int64_t j0) {
    for (int64_t i = 0; i < kBlock; ++i) {
      if (j0 + i < hi) {
        load_row(base + (j0 + i) * stride, block.data() + i * D, D);
      } else {
        std::fill_n(block.data() + i * D, D, 0.f);
      }
    }
  };
  std::vector<char> visible(s.Lq * kBlock);  // per query position and key of the block
  for (int64_t j0 = lo; j0 < hi; j0 += kBlock) {
    load_block(kbase, st.kn, j0);
    for (int64_t i = 0; i < s.Lq; ++i) {  // the query rows of one position share their visibility
      for (int64_t c = 0; c < kBlock; ++c) {
        const int64_t j = j0 + c, pos = position[i];
        bool ok = j < hi && j <= pos && (s.window <= 0 || pos - j < s.window);
        if (ok && mask_row[i] != nullptr) ok = mask_row[i][j];
        visible[i * kBlock + c] = ok;
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* sc = scores.data() + r * padded + (j0 - lo);
      const char* seen = visible.data() + (r % s.Lq) * kBlock;
      dots_block(qf.data() + r * D, block.data(), D, sc);
      for (int64_t c = 0; c < kBlock; ++c) sc[c] = seen[c] ? sc[c] * s.scale : neg_inf;
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* sc = scores.data() + r * padded;
    const float m = largest(sc, padded);
    float total = 0.f;
    if (m != neg_inf) {
#pragma omp simd reduction(+ : total)
      for (int64_t j = 0; j < padded; ++j) {
        sc[j] = exp_nonpositive(sc[j] - m);  // exp(-inf) = 0 for invisible keys
        total += sc[j];
      }
    } else {
      std::fill_n(sc, padded, 0.f);
    }
    parts[r].max = m;
    parts[r].sum = total;
  }
  for (int64_t j0 = lo; j0 < hi; j0 += kBlock) {
    load_block(vbase, st.vn, j0);
    for (int64_t r = 0; r < rows; ++r) {
      const float* p = scores.data() + r * padded + (j0 - lo);
      if (std::any_of(p, p + kBlock, [](float x) { return x != 0.f; })) axpy_block(p, block.data(), D, accs + r * D);
    }
  }
}

// Merge the per-range partials of every query row and write out[b, i, h, :] (the (B, Lq, Hq, D) order).
template <typename T>
void merge(const std::vector<Partial>& parts, const std::vector<float>& accs, const Shape& s, int64_t splits,
           T* out) {
  const int64_t rows = s.group * s.Lq, D = s.D;
  std::vector<float> o(D);
  for (int64_t b = 0; b < s.B; ++b) {
    for (int64_t kvh = 0; kvh < s.Hkv; ++kvh) {
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t task0 = (b * s.Hkv + kvh) * splits;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < splits; ++t) m = std::max(m, parts[(task0 + t) * rows + r].max);
        std::fill(o.begin(), o.end(), 0.f);
        float total = 0.f;
        if (m != -std::numeric_limits<float>::infinity()) {
          for (int64_t t = 0; t < splits; ++t) {
            const Partial& p = parts[(task0 + t) * rows + r];
            if (p.sum == 0.f) continue;
            const float w = std::exp(p.max - m);
            total += p.sum * w;
            axpy(w, accs.data() + ((task0 + t) * rows + r) * D, o.data(), D);
          }
        }
        const float inv = total > 0.f ? 1.f / total : 0.f;  // no visible key: zeros, as the reference
        const int64_t h = kvh * s.group + r / s.Lq, i = r % s.Lq;
        T* dst = out + ((b * s.Lq + i) * s.Hq + h) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(o[d] * inv);
      }
    }
  }
}

template <typename T, typename KV>
void attention_decode_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const bool* mask,
                           const Shape& s, const Strides& st, at::Tensor& out) {
  // Split the keys of each (batch, KV head) so that every thread has work once the cache is long.
  // The fewest splits that give every thread as many tasks (heads = 3, 2 threads: 2 splits, 6 tasks).
  const int64_t heads = s.B * s.Hkv, threads = at::get_num_threads();
  const int64_t balanced = threads / std::gcd(heads, threads);
  const int64_t splits = std::max<int64_t>(1, std::min(balanced, s.filled / kMinKeysPerTask));
  const int64_t tasks = heads * splits, rows = s.group * s.Lq;
  const int64_t split_len = (s.filled + splits - 1) / splits;
  std::vector<Partial> parts(tasks * rows);
  std::vector<float> accs(tasks * rows * s.D, 0.f);
  const T* qp = q.const_data_ptr<T>();
  const KV* kp = k.const_data_ptr<KV>();
  const KV* vp = v.const_data_ptr<KV>();
  const int team = static_cast<int>(std::min<int64_t>(threads, tasks));
  const int64_t first_key = s.window > 0 ? std::max<int64_t>(0, s.filled - s.Lq - s.window + 1) : 0;
#pragma omp parallel for num_threads(team) schedule(static) if (team > 1)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t head = t / splits, split = t % splits;
    const int64_t lo = std::max(first_key, split * split_len), hi = std::min(s.filled, (split + 1) * split_len);
    if (lo < hi) {
      attend_range<T, KV>(qp, kp, vp, mask, s, st, head / s.Hkv, head % s.Hkv, lo, hi, parts.data() + t * rows,
                      accs.data() + t * rows * s.D);
    }
  }
  merge<T>(parts, accs, s, splits, out.mutable_data_ptr<T>());
}

// The cache's element type: q's own, or a quantized format.
template <typename T>
void dispatch_cache(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const bool* mask, const Shape& s,
                    const Strides& st, at::Tensor& out) {
  switch (k.scalar_type()) {
    case at::kChar: attention_decode_impl<T, int8_t>(q, k, v, mask, s, st, out); break;
    case at::kFloat8_e4m3fn: attention_decode_impl<T, c10::Float8_e4m3fn>(q, k, v, mask, s, st, out); break;
    default: attention_decode_impl<T, T>(q, k, v, mask, s, st, out);
  }
}

// q (B, Hq, Lq, D); k_cache, v_cache (B, Hkv, S, D), or (B, Hkv, S, packed_width(D)) int8/fp8 rows; filled: one integer element; mask: optional bool
// (B or 1, 1, Lq, >= filled). Innermost dims must be contiguous (a view of the cache is fine).
at::Tensor attention_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& filled, double scale, int64_t window,
                            const std::optional<at::Tensor>& mask) {
  TORCH_CHECK(q.dim() == 4 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "fastflow_cpu::attention_decode: q, k_cache, v_cache must be 4-D");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "fastflow_cpu::attention_decode: CPU tensors only");
  const bool quantized = k_cache.scalar_type() == at::kChar || k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && (quantized || q.scalar_type() == k_cache.scalar_type()),
              "fastflow_cpu::attention_decode: k_cache and v_cache must share q's dtype, or one int8/fp8 format");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "fastflow_cpu::attention_decode: k/v cache shapes differ");
  TORCH_CHECK(q.stride(3) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "fastflow_cpu::attention_decode: the head dim must be contiguous");
  Shape s{q.size(0), q.size(1), k_cache.size(1), q.size(2), k_cache.size(2), q.size(3), 0, 0, window,
          static_cast<float>(scale)};
  const int64_t width = quantized ? (s.D + 3) / 4 * 4 + 4 : s.D;  // packed rows: values, pad, fp32 scale
  TORCH_CHECK(k_cache.size(0) == s.B && k_cache.size(3) == width && s.Hkv > 0 && s.Hq % s.Hkv == 0,
              "fastflow_cpu::attention_decode: cache (B, Hkv, S, ", width, ") does not match q (B, Hq, Lq, D)");
  TORCH_CHECK(filled.numel() == 1 && !filled.is_floating_point(),
              "fastflow_cpu::attention_decode: filled must hold one integer");
  s.group = s.Hq / s.Hkv;
  s.filled = filled.item<int64_t>();
  TORCH_CHECK(s.filled >= s.Lq && s.filled <= s.S, "fastflow_cpu::attention_decode: filled = ", s.filled,
              " must be in [Lq, cache length] = [", s.Lq, ", ", s.S, "]");
  Strides st{q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
             v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), 0, 0};
  const bool* mask_ptr = nullptr;
  at::Tensor mask_bool;
  if (mask.has_value()) {
    TORCH_CHECK(mask->dim() == 4 && (mask->size(0) == 1 || mask->size(0) == s.B) && mask->size(2) == s.Lq &&
                    mask->size(3) >= s.filled,
                "fastflow_cpu::attention_decode: mask must be (B or 1, 1, Lq, >= filled), got ", mask->sizes());
    mask_bool = mask->scalar_type() == at::kBool ? *mask : mask->to(at::kBool);
    TORCH_CHECK(mask_bool.stride(3) == 1 || mask_bool.size(3) == 1, "fastflow_cpu::attention_decode: mask rows must be contiguous");
    st.mb = mask_bool.size(0) == 1 ? 0 : mask_bool.stride(0);
    st.mm = mask_bool.stride(2);
    mask_ptr = mask_bool.const_data_ptr<bool>();
  }
  // (B, Lq, Hq, D) memory, returned as its (B, Hq, Lq, D) view: o_proj reads the former.
  at::Tensor out = at::empty({s.B, s.Lq, s.Hq, s.D}, q.options());
  if (fastflow_cpu::null_kernels()) return out.zero_().transpose(1, 2);
  switch (q.scalar_type()) {
    case at::kFloat: dispatch_cache<float>(q, k_cache, v_cache, mask_ptr, s, st, out); break;
    case at::kBFloat16: dispatch_cache<c10::BFloat16>(q, k_cache, v_cache, mask_ptr, s, st, out); break;
    case at::kHalf: dispatch_cache<c10::Half>(q, k_cache, v_cache, mask_ptr, s, st, out); break;
    default: TORCH_CHECK(false, "fastflow_cpu::attention_decode: unsupported dtype ", q.scalar_type());
  }
  return out.transpose(1, 2);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastflow_cpu, m) {
  m.def("attention_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor filled, float scale, int window, "
        "Tensor? mask) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastflow_cpu, CPU, m) { m.impl("attention_decode", &attention_decode); }
