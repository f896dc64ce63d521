// fastflow_cpu::gemm's and int4_gemm's paths for bf16 activations on CPUs with AMX (cpu_gemm_amx.cpp).
#pragma once

#include <cstdint>

namespace fastflow_cpu {

// Whether the path runs here: built for a target with AMX-BF16 (Xeon since Sapphire Rapids) and the
// kernel granted this process the tile state (asked once).
bool gemm_amx_ready();

// y (M, N) = (x @ W.T) * scale + bias, rounded once to bf16. x: (M, K) bf16 bits, row-major; W: (N, K)
// int8 codes, row-major; scale, bias: N fp32 values or null. int8 codes are exact in bf16 and AMX's
// products of bf16 pairs are exact, summed in fp32: gemm_ref's definition.
void gemm_amx_int8(const uint16_t* x, int64_t M, int64_t K, const int8_t* w, int64_t N, const float* scale,
                   const float* bias, uint16_t* y);

// y (M, N) = x @ W.T + bias, rounded once to bf16, W in int4_gemv's layout (codes: N/16 blocks of K/8
// chunks of 64 bytes; table: (N/16, K/G, 2, 16) bf16 s, z' with w = (q - 8) * s + z'). Needs G % 32 == 0:
// (q - 8) is exact in bf16, each group's sums of (q - 8) * x are exact products summed in fp32, and the
// group's s and z' (times the group's sum of x) are applied in fp32 -- int4_gemm_ref's value up to the
// order of fp32 sums.
void gemm_amx_int4(const uint16_t* x, int64_t M, int64_t K, const uint8_t* codes, const uint16_t* table,
                   int64_t group_size, int64_t N, const float* bias, uint16_t* y);

}  // namespace fastflow_cpu
