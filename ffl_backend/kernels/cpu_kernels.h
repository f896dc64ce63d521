// Shared by the sources of the fastflow_cpu library (cpu_gemv.cpp, cpu_attention.cpp).
#pragma once

namespace fastflow_cpu {
// True while benchmarks/decode_overhead.py has the kernels return zeros without computing: the
// time of a decode step outside the weight GEMVs and attention is then measured with the same
// compiled code, whichever wrapper (Python or C++) calls the ops. Off unless set_null_kernels(True).
bool null_kernels();
}  // namespace fastflow_cpu
