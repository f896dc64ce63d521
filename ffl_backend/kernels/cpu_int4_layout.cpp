// fastflow_cpu::int4_layout_pack / int4_layout_unpack / int4_layout_table: an int4 weight's portable
// codes to and from the layout of int4_gemv / int4_gemm / int4_widen, and its scale/zero table (kernels/int4_layout.py says what the layout is; its
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

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace fastflow_cpu::int4_layout {
namespace {

constexpr int64_t kRows = 16, kChunk = 8;  // int4_layout.INT4_ROWS, INT4_CHUNK

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

// One step of a 16 x 16 transpose of words: rows i and i + S (i & S == 0) swap their off-diagonal
// S x S sub-blocks (words j | S of row i <-> words j of row i + S). Four steps (S = 8, 4, 2, 1)
// transpose the tile; each is two-source shuffles with fixed lanes (AVX-512: one instruction each).
#define FFL_LO(S, j) (((j) & (S)) ? 16 + (j) - (S) : (j))
#define FFL_HI(S, j) (((j) & (S)) ? 16 + (j) : (j) + (S))
#define FFL_LANES(F, S)                                                                                     \
  F(S, 0), F(S, 1), F(S, 2), F(S, 3), F(S, 4), F(S, 5), F(S, 6), F(S, 7), F(S, 8), F(S, 9), F(S, 10), F(S, 11), \
      F(S, 12), F(S, 13), F(S, 14), F(S, 15)
#define FFL_TRANSPOSE_STEP(S)                                                         \
  for (int i = 0; i < 16; ++i)                                                        \
    if (!(i & (S))) {                                                                 \
      const Words a = t[i], b = t[i + (S)];                                           \
      t[i] = __builtin_shufflevector(a, b, FFL_LANES(FFL_LO, S));                     \
      t[i + (S)] = __builtin_shufflevector(a, b, FFL_LANES(FFL_HI, S));               \
    }

// tile[i][j] -> line j (64 bytes at out + j * stride) word i.
inline void transpose_out(const Words* tile, uint8_t* out, int64_t stride = 4 * kTile) {
  Words t[kTile];
  for (int64_t i = 0; i < kTile; ++i) t[i] = tile[i];
  FFL_TRANSPOSE_STEP(8)
  FFL_TRANSPOSE_STEP(4)
  FFL_TRANSPOSE_STEP(2)
  FFL_TRANSPOSE_STEP(1)
  for (int64_t j = 0; j < kTile; ++j) std::memcpy(out + j * stride, &t[j], sizeof(Words));
}
#undef FFL_TRANSPOSE_STEP
#undef FFL_LANES
#undef FFL_HI
#undef FFL_LO

inline uint32_t load_word(const uint8_t* p) {  // any alignment: a weight mapped from a file sits anywhere
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store_word(uint8_t* p, uint32_t v) { std::memcpy(p, &v, sizeof v); }

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }
inline float widen(c10::Half v) { return static_cast<float>(v); }

// fn(begin, end) over row blocks [0, blocks), `per_block` bytes of output each, in one parallel region
// of as many threads as torch uses -- each thread taking the next chunk of blocks when done with its
// last (cpu_quantize.cpp's scheme: a thread slowed by another process on its core takes fewer chunks
// instead of holding the call up) -- or on this thread alone where the call writes less than
// kBytesPerThread a thread: starting a parallel region costs ~20 us on a quiet machine, but ~4 ms
// beside another busy process on 2 cores (measured: a 3 MB table took 1 ms on one thread, 4 ms on
// two), and a load makes one call per layer group.
constexpr int64_t kChunkBytes = 32 << 10, kBytesPerThread = 4 << 20;

template <typename Fn>
void parallel_blocks(int64_t blocks, int64_t per_block, const Fn& fn) {
  if (blocks <= 0) return;
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / std::max<int64_t>(1, per_block));
  const int64_t chunks = (blocks + chunk - 1) / chunk;
  const int threads = static_cast<int>(
      std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(1, blocks * per_block / kBytesPerThread)));
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(threads) if (threads > 1)
  for (int64_t c = next++; c < chunks; c = next++) fn(c * chunk, std::min(blocks, (c + 1) * chunk));
}

// One block of 16 rows: codes (16 rows of row_bytes at `rows`) -> 64-byte chunks at `out`.
void pack_block(const uint8_t* rows, int64_t row_bytes, uint8_t* out) {
  const int64_t chunks = row_bytes / 4;
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

typedef float Floats __attribute__((vector_size(64)));       // 16 rows' values of one group
typedef uint16_t Halves __attribute__((vector_size(32)));

// fp32 -> bf16 bits, to nearest even, 16 at a time: c10::BFloat16's rounding (and torch's vectorised
// .to(bfloat16) but for the bits of a NaN, which stays a NaN).
inline Halves bf16_bits(Floats f) {
  const Words u = (Words)f;
  const Words rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return __builtin_convertvector(f != f ? Words{} + 0x7FC0u : rounded, Halves);
}

// One block's scale/zero table: 16 rows of `groups` scales and zero points -> (groups, 2, 16) bf16:
// for each group, its 16 rows' s and z' side by side, computed 16 at a time.
template <typename T>
void table_block(const T* scale, const T* zero, int64_t groups, uint16_t* out) {
  constexpr int64_t kBatch = 32;  // groups at a time: the rows' values go through a small transposed buffer
  Floats s[kBatch], z[kBatch];
  for (int64_t g0 = 0; g0 < groups; g0 += kBatch) {
    const int64_t count = std::min(kBatch, groups - g0);
    for (int64_t r = 0; r < kRows; ++r)
      for (int64_t g = 0; g < count; ++g) {
        s[g][r] = widen(scale[r * groups + g0 + g]);
        z[g][r] = widen(zero[r * groups + g0 + g]);
      }
    // z' = (8 - zero) * s: two fp32 roundings, as torch's `(8.0 - zero.float()) * s` (no fused
    // multiply-add can form: the product is not added to anything)
    for (int64_t g = 0; g < count; ++g) {
      const Halves hs = bf16_bits(s[g]), hz = bf16_bits((8.f - z[g]) * s[g]);
      std::memcpy(out + (g0 + g) * 2 * kRows, &hs, sizeof hs);
      std::memcpy(out + (g0 + g) * 2 * kRows + kRows, &hz, sizeof hz);
    }
  }
}

void check_layout_shape(int64_t n, int64_t k, int64_t group_size, const char* op) {
  TORCH_CHECK(n > 0 && n % kRows == 0, "fastflow_cpu::", op, ": out_features ", n, " is not a positive multiple of 16");
  TORCH_CHECK(group_size > 0 && group_size % kChunk == 0 && k % group_size == 0, "fastflow_cpu::", op,
              ": group_size ", group_size, " must be a multiple of 8 dividing in_features ", k);
}

// A member weight, ready to pack: its codes (undefined: the table only), and its scale and zero point
// in one of the table's dtypes.
struct Member {
  at::Tensor codes, scale, zero;
  int64_t first_block;  // where its rows start in the fused layout, in blocks of 16
};

// packed: the fused codes' layout, or nullptr for the table only.
template <typename T>
void pack_members(const std::vector<Member>& members, int64_t blocks, int64_t k, int64_t groups, uint8_t* packed,
                  uint16_t* table) {
  const int64_t row_bytes = k / 2;
  std::vector<const Member*> owner(blocks);  // the member each fused block belongs to
  for (const Member& m : members)
    for (int64_t b = 0; b < m.scale.size(0) / kRows; ++b) owner[m.first_block + b] = &m;
  const int64_t per_block = (packed != nullptr ? kRows * row_bytes : 0) + groups * 2 * kRows * 2;
  parallel_blocks(blocks, per_block, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const Member& m = *owner[b];
      const int64_t local = b - m.first_block;
      if (packed != nullptr)
        pack_block(m.codes.const_data_ptr<uint8_t>() + local * kRows * row_bytes, row_bytes,
                   packed + b * row_bytes * kRows);
      table_block(m.scale.const_data_ptr<T>() + local * kRows * groups, m.zero.const_data_ptr<T>() + local * kRows * groups,
                  groups, table + b * groups * 2 * kRows);
    }
  });
}

// The members (codes or not) ready to pack, the table's dtype, and the fused row blocks.
struct Job {
  std::vector<Member> members;
  at::ScalarType dtype;
  int64_t blocks = 0;
};

Job prepare(at::TensorList qweights, at::TensorList scales, at::TensorList zeros, int64_t k, int64_t group_size,
            const char* op) {
  const size_t count = scales.size();
  TORCH_CHECK(group_size > 0 && group_size % kChunk == 0, "fastflow_cpu::", op, ": group_size ", group_size,
              " must be a multiple of 8 dividing in_features ", k);
  TORCH_CHECK(count > 0 && zeros.size() == count && (qweights.empty() || qweights.size() == count), "fastflow_cpu::",
              op, ": as many qweights, scales and zeros, at least one");
  const int64_t groups = k / group_size;
  // The table's arithmetic in the members' dtype when they share one of Int4Linear's, else in fp32
  // (scale.float() / zero.float(), as the reference takes them: exact for every float dtype but float64).
  Job job;
  job.dtype = scales[0].scalar_type();
  for (size_t i = 0; i < count; ++i)
    if (scales[i].scalar_type() != job.dtype || zeros[i].scalar_type() != job.dtype) job.dtype = at::kFloat;
  if (job.dtype != at::kBFloat16 && job.dtype != at::kHalf) job.dtype = at::kFloat;
  for (size_t i = 0; i < count; ++i) {
    const int64_t n = scales[i].dim() == 2 ? scales[i].size(0) : -1;
    check_layout_shape(n, k, group_size, op);
    TORCH_CHECK(scales[i].device().is_cpu() && scales[i].size(1) == groups && zeros[i].sizes() == scales[i].sizes(),
                "fastflow_cpu::", op, ": scale and zero must be CPU (N, K/G) = (", n, ", ", groups, ") tensors");
    at::Tensor codes;
    if (!qweights.empty()) {
      TORCH_CHECK(qweights[i].size(0) == n, "fastflow_cpu::", op, ": qweight ", i, " has ", qweights[i].size(0),
                  " rows, its scale ", n);
      codes = qweights[i].contiguous();
    }
    job.members.push_back({codes, scales[i].to(job.dtype).contiguous(), zeros[i].to(job.dtype).contiguous(), job.blocks});
    job.blocks += n / kRows;
  }
  return job;
}

void run(const Job& job, int64_t k, int64_t groups, uint8_t* packed, at::Tensor& table) {
  auto* t = reinterpret_cast<uint16_t*>(table.mutable_data_ptr<at::BFloat16>());
  switch (job.dtype) {
    case at::kBFloat16: pack_members<c10::BFloat16>(job.members, job.blocks, k, groups, packed, t); break;
    case at::kHalf: pack_members<c10::Half>(job.members, job.blocks, k, groups, packed, t); break;
    default: pack_members<float>(job.members, job.blocks, k, groups, packed, t);
  }
}

// qweights: members' (N_i, K/2) uint8 portable codes; scales, zeros: their (N_i, K/G) -> the layout of
// their row concatenation: (packed (sum N_i/16, K/8, 64) uint8, scale_zeros (sum N_i/16, K/G, 2, 16)
// bf16) = int4_layout.int4_layout_from_portable_ref of the concatenated weights, in one pass (sibling
// projections fused, or one weight alone).
std::tuple<at::Tensor, at::Tensor> int4_layout_pack(at::TensorList qweights, at::TensorList scales, at::TensorList zeros,
                                                    int64_t group_size) {
  TORCH_CHECK(!qweights.empty() && qweights.size() == scales.size(), "fastflow_cpu::int4_layout_pack: as many qweights, "
              "scales and zeros, at least one");
  const int64_t k = qweights[0].dim() == 2 ? qweights[0].size(1) * 2 : -1;
  for (const at::Tensor& q : qweights)
    TORCH_CHECK(q.device().is_cpu() && q.dim() == 2 && q.scalar_type() == at::kByte && q.size(1) * 2 == k,
                "fastflow_cpu::int4_layout_pack: qweights must be CPU (N, K/2) uint8 tensors of one K");
  const Job job = prepare(qweights, scales, zeros, k, group_size, "int4_layout_pack");
  const int64_t groups = k / group_size;
  at::Tensor packed = at::empty({job.blocks, k / kChunk, 4 * kRows}, qweights[0].options());
  at::Tensor table = at::empty({job.blocks, groups, 2, kRows}, qweights[0].options().dtype(at::kBFloat16));
  run(job, k, groups, packed.mutable_data_ptr<uint8_t>(), table);
  return {packed, table};
}

// The scale/zero half of int4_layout_pack alone: for codes already in the layout (a checkpoint that
// saved them so). scales, zeros: (N_i, K/G) -> (sum N_i/16, K/G, 2, 16) bf16.
at::Tensor int4_layout_table(at::TensorList scales, at::TensorList zeros, int64_t group_size) {
  TORCH_CHECK(!scales.empty() && scales[0].dim() == 2, "fastflow_cpu::int4_layout_table: (N, K/G) scales, at least one");
  TORCH_CHECK(group_size > 0 && group_size % kChunk == 0, "fastflow_cpu::int4_layout_table: group_size ", group_size,
              " must be a multiple of 8 dividing in_features");
  const int64_t k = scales[0].size(1) * group_size;
  const Job job = prepare({}, scales, zeros, k, group_size, "int4_layout_table");
  at::Tensor table = at::empty({job.blocks, k / group_size, 2, kRows}, scales[0].options().dtype(at::kBFloat16));
  run(job, k, k / group_size, nullptr, table);
  return table;
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
  parallel_blocks(blocks, kRows * row_bytes, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* in = src + b * chunks * 4 * kRows;
      uint8_t* rows = dst + b * kRows * row_bytes;
      int64_t c = 0;
      for (; c + kTile <= chunks; c += kTile) {  // pack_block's tile, the other way
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
  m.def("int4_layout_pack(Tensor[] qweights, Tensor[] scales, Tensor[] zeros, int group_size) -> (Tensor, Tensor)");
  m.def("int4_layout_table(Tensor[] scales, Tensor[] zeros, int group_size) -> Tensor");
  m.def("int4_layout_unpack(Tensor packed) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastflow_cpu, CPU, m) {
  m.impl("int4_layout_pack", &fastflow_cpu::int4_layout::int4_layout_pack);
  m.impl("int4_layout_table", &fastflow_cpu::int4_layout::int4_layout_table);
  m.impl("int4_layout_unpack", &fastflow_cpu::int4_layout::int4_layout_unpack);
}
