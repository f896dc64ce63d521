// fastflow_cpu::int4_layout_pack / int4_layout_unpack: an int4 weight's portable codes to and from the
// layout of int4_gemv / int4_gemm / int4_widen (kernels/int4_layout.py says what the layout is; its
// pure-torch reference `int4_layout_from_portable_ref` is what the tests compare with, byte for byte).
//
// Portable codes (numerics.pack_int4): row n, byte i = code 2i | code 2i+1 << 4. Layout: rows in blocks
// of 16, K in chunks of 8; per (block b, chunk c) 64 bytes, row r's 4 at byte 4r, byte j = code c*8+j |
// code c*8+4+j << 4. So one chunk of one row is one 32-bit word on both sides, its nibbles permuted
// (to_layout / from_layout below), and a block is a (16 rows, K/8) -> (K/8, 16) transpose of words.
// The scale/zero table: (N/16, K/G, 2, 16) bf16 of s = scale and z' = (8 - zero) * s in fp32, each
// rounded to bf16 to nearest even (quant_linear.int4_cpu_scale_zeros then int4_layout.int4_layout).
//
// One pass over the codes in place of torch's unpack / stack / permute / pack (~10 s per billion
// weights, several temporaries the size of the unpacked weight): memory-bound, no temporaries.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <tuple>

namespace fastflow_cpu::int4_layout {
namespace {

constexpr int64_t kRows = 16, kChunk = 8;  // int4_layout.INT4_ROWS, INT4_CHUNK
constexpr int64_t kGrainWeights = 1 << 18;  // weights per parallel_for unit: ~0.1 ms of work

// Portable word [k0|k1<<4, k2|k3<<4, k4|k5<<4, k6|k7<<4] (bytes, low first) -> layout word
// [k0|k4<<4, k1|k5<<4, k2|k6<<4, k3|k7<<4].
inline uint32_t to_layout(uint32_t p) {
  const uint32_t lo = p & 0x0F0F0F0Fu, hi = (p >> 4) & 0x0F0F0F0Fu;  // [k0 k2 k4 k6], [k1 k3 k5 k7]
  const uint32_t a = lo | (lo >> 12), b = hi | (hi >> 12);             // low bytes: [k0|k4, k2|k6], [k1|k5, k3|k7]
  return (a & 0xFFu) | ((b & 0xFFu) << 8) | ((a & 0xFF00u) << 8) | ((b & 0xFF00u) << 16);
}

// The inverse of to_layout.
inline uint32_t from_layout(uint32_t o) {
  const uint32_t lo = o & 0x0F0F0F0Fu, hi = (o >> 4) & 0x0F0F0F0Fu;  // [k0 k1 k2 k3], [k4 k5 k6 k7]
  const uint32_t c = lo | (lo >> 4), d = hi | (hi >> 4);               // bytes 0, 2: [k0|k1, k2|k3], [k4|k5, k6|k7]
  return (c & 0xFFu) | ((c >> 8) & 0xFF00u) | ((d & 0xFFu) << 16) | ((d << 8) & 0xFF000000u);
}

// 16 words at once (a 64-byte line: one row's 16 chunks, or one chunk's 16 rows); the same operations.
typedef uint32_t Words __attribute__((vector_size(64)));
constexpr int64_t kTile = 16;
static_assert(kTile == kRows, "a tile is square");

inline Words to_layout(Words p) {
  const Words lo = p & 0x0F0F0F0Fu, hi = (p >> 4) & 0x0F0F0F0Fu;
  const Words a = lo | (lo >> 12), b = hi | (hi >> 12);
  return (a & 0xFFu) | ((b & 0xFFu) << 8) | ((a & 0xFF00u) << 8) | ((b & 0xFF00u) << 16);
}

inline Words from_layout(Words o) {
  const Words lo = o & 0x0F0F0F0Fu, hi = (o >> 4) & 0x0F0F0F0Fu;
  const Words c = lo | (lo >> 4), d = hi | (hi >> 4);
  return (c & 0xFFu) | ((c >> 8) & 0xFF00u) | ((d & 0xFFu) << 16) | ((d << 8) & 0xFF000000u);
}

// tile[i][j] -> line j (64 bytes at out + j * stride) word i: plain word copies (element access on
// vector types goes through memory one lane at a time).
inline void transpose_out(const Words* tile, uint8_t* out, int64_t stride = 4 * kTile) {
  uint32_t in[kTile][kTile], t[kTile][kTile];
  std::memcpy(in, tile, sizeof in);
  for (int64_t i = 0; i < kTile; ++i)
    for (int64_t j = 0; j < kTile; ++j) t[j][i] = in[i][j];
  for (int64_t j = 0; j < kTile; ++j) std::memcpy(out + j * stride, t[j], sizeof t[j]);
}

inline uint32_t load_word(const uint8_t* p) {  // any alignment: a weight mapped from a file sits anywhere
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store_word(uint8_t* p, uint32_t v) { std::memcpy(p, &v, sizeof v); }

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }
inline float widen(c10::Half v) { return static_cast<float>(v); }

// fp32 -> bf16 bits, to nearest even: c10::BFloat16's rounding (and torch's vectorised .to(bfloat16)
// but for the bits of a NaN, which stays a NaN).
inline uint16_t bf16_bits(float f) {
  if (f != f) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

int64_t grain(int64_t weights_per_block) { return std::max<int64_t>(1, kGrainWeights / std::max<int64_t>(1, weights_per_block)); }

template <typename T>
void scale_zero_table(const T* scale, const T* zero, int64_t blocks, int64_t groups, uint16_t* out) {
  // z' = (8 - zero) * s: two fp32 roundings, as torch's `(8.0 - zero.float()) * s` (no fused multiply-add
  // can form: the product is not added to anything)
  at::parallel_for(0, blocks, grain(kRows * groups * 32), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t g = 0; g < groups; ++g) {
        uint16_t* dst = out + (b * groups + g) * 2 * kRows;
        for (int64_t r = 0; r < kRows; ++r) {
          const int64_t i = (b * kRows + r) * groups + g;
          const float s = widen(scale[i]), z = widen(zero[i]);
          dst[r] = bf16_bits(s);
          dst[kRows + r] = bf16_bits((8.f - z) * s);
        }
      }
  });
}

void check_layout_shape(int64_t n, int64_t k, int64_t group_size, const char* op) {
  TORCH_CHECK(n > 0 && n % kRows == 0, "fastflow_cpu::", op, ": out_features ", n, " is not a positive multiple of 16");
  TORCH_CHECK(group_size > 0 && group_size % kChunk == 0 && k % group_size == 0, "fastflow_cpu::", op,
              ": group_size ", group_size, " must be a multiple of 8 dividing in_features ", k);
}

// qweight (N, K/2) uint8 portable codes, scale and zero (N, K/G) -> (packed (N/16, K/8, 64) uint8,
// scale_zeros (N/16, K/G, 2, 16) bf16): int4_layout.int4_layout_from_portable_ref, in one pass.
std::tuple<at::Tensor, at::Tensor> int4_layout_pack(const at::Tensor& qweight, const at::Tensor& scale,
                                                    const at::Tensor& zero, int64_t group_size) {
  TORCH_CHECK(qweight.device().is_cpu() && qweight.dim() == 2 && qweight.scalar_type() == at::kByte,
              "fastflow_cpu::int4_layout_pack: qweight must be a CPU (N, K/2) uint8 tensor");
  const int64_t n = qweight.size(0), k = qweight.size(1) * 2, groups = n > 0 && group_size > 0 ? k / group_size : 0;
  check_layout_shape(n, k, group_size, "int4_layout_pack");
  TORCH_CHECK(scale.sizes() == zero.sizes() && scale.dim() == 2 && scale.size(0) == n && scale.size(1) == groups,
              "fastflow_cpu::int4_layout_pack: scale and zero must be (N, K/G) = (", n, ", ", groups, ")");
  const at::Tensor q = qweight.contiguous();
  const int64_t blocks = n / kRows, chunks = k / kChunk;
  at::Tensor packed = at::empty({blocks, chunks, 4 * kRows}, qweight.options());
  at::Tensor table = at::empty({blocks, groups, 2, kRows}, scale.options().dtype(at::kBFloat16));

  const uint8_t* src = q.const_data_ptr<uint8_t>();
  uint8_t* dst = packed.mutable_data_ptr<uint8_t>();
  const int64_t row_bytes = k / 2;
  at::parallel_for(0, blocks, grain(kRows * k), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* rows = src + b * kRows * row_bytes;
      uint8_t* out = dst + b * chunks * 4 * kRows;
      int64_t c = 0;
      for (; c + kTile <= chunks; c += kTile) {  // 16 rows x 16 chunks: a 64-byte line of each row in,
        Words tile[kRows];                       // a 64-byte line of each chunk out
        for (int64_t r = 0; r < kRows; ++r) {
          std::memcpy(&tile[r], rows + r * row_bytes + c * 4, sizeof(Words));
          tile[r] = to_layout(tile[r]);
        }
        transpose_out(tile, out + c * kRows * 4);
      }
      for (; c < chunks; ++c)
        for (int64_t r = 0; r < kRows; ++r) store_word(out + (c * kRows + r) * 4, to_layout(load_word(rows + r * row_bytes + c * 4)));
    }
  });

  auto* sz = reinterpret_cast<uint16_t*>(table.mutable_data_ptr<at::BFloat16>());
  const bool same = scale.scalar_type() == zero.scalar_type();
  switch (same ? scale.scalar_type() : at::kDouble) {  // the storage dtypes of Int4Linear; any other through fp32
    case at::kFloat: {
      const at::Tensor s = scale.contiguous(), z = zero.contiguous();
      scale_zero_table(s.const_data_ptr<float>(), z.const_data_ptr<float>(), blocks, groups, sz);
      break;
    }
    case at::kBFloat16: {
      const at::Tensor s = scale.contiguous(), z = zero.contiguous();
      scale_zero_table(s.const_data_ptr<c10::BFloat16>(), z.const_data_ptr<c10::BFloat16>(), blocks, groups, sz);
      break;
    }
    case at::kHalf: {
      const at::Tensor s = scale.contiguous(), z = zero.contiguous();
      scale_zero_table(s.const_data_ptr<c10::Half>(), z.const_data_ptr<c10::Half>(), blocks, groups, sz);
      break;
    }
    default: {  // scale.float() / zero.float(), as the reference takes them
      const at::Tensor s = scale.to(at::kFloat).contiguous(), z = zero.to(at::kFloat).contiguous();
      scale_zero_table(s.const_data_ptr<float>(), z.const_data_ptr<float>(), blocks, groups, sz);
    }
  }
  return {packed, table};
}

// packed (N/16, K/8, 64) uint8 -> the portable codes (N, K/2) uint8 (the inverse of the codes' half of
// int4_layout_pack).
at::Tensor int4_layout_unpack(const at::Tensor& packed) {
  TORCH_CHECK(packed.device().is_cpu() && packed.dim() == 3 && packed.size(2) == 4 * kRows &&
                  packed.scalar_type() == at::kByte,
              "fastflow_cpu::int4_layout_unpack: packed must be a CPU (N/16, K/8, 64) uint8 tensor");
  const at::Tensor p = packed.contiguous();
  const int64_t blocks = p.size(0), chunks = p.size(1), row_bytes = chunks * 4;
  at::Tensor codes = at::empty({blocks * kRows, row_bytes}, p.options());
  const uint8_t* src = p.const_data_ptr<uint8_t>();
  uint8_t* dst = codes.mutable_data_ptr<uint8_t>();
  at::parallel_for(0, blocks, grain(kRows * chunks * kChunk), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* in = src + b * chunks * 4 * kRows;
      uint8_t* rows = dst + b * kRows * row_bytes;
      int64_t c = 0;
      for (; c + kTile <= chunks; c += kTile) {  // the tile of int4_layout_pack, the other way
        Words tile[kTile];
        for (int64_t t = 0; t < kTile; ++t) {
          std::memcpy(&tile[t], in + (c + t) * kRows * 4, sizeof(Words));
          tile[t] = from_layout(tile[t]);
        }
        transpose_out(tile, rows + c * 4, row_bytes);
      }
      for (; c < chunks; ++c)
        for (int64_t r = 0; r < kRows; ++r) store_word(rows + r * row_bytes + c * 4, from_layout(load_word(in + (c * kRows + r) * 4)));
    }
  });
  return codes;
}

}  // namespace
}  // namespace fastflow_cpu::int4_layout

TORCH_LIBRARY_FRAGMENT(fastflow_cpu, m) {
  m.def("int4_layout_pack(Tensor qweight, Tensor scale, Tensor zero, int group_size) -> (Tensor, Tensor)");
  m.def("int4_layout_unpack(Tensor packed) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastflow_cpu, CPU, m) {
  m.impl("int4_layout_pack", &fastflow_cpu::int4_layout::int4_layout_pack);
  m.impl("int4_layout_unpack", &fastflow_cpu::int4_layout::int4_layout_unpack);
}
