// Shared by the sources of the fastflow_cpu library: the benchmark switch, and what the two decode
// GEMVs (cpu_gemv.cpp's gemv, cpu_gemv_q16.cpp's gemv_q16) share -- operand checks, fp32 staging,
// the split of weight rows across threads, the scale and bias epilogue.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace fastflow_cpu {
// True while benchmarks/decode_overhead.py has the kernels return zeros without computing: the
// time of a decode step outside the weight GEMVs and attention is then measured with the same
// compiled code, whichever wrapper (Python or C++) calls the ops. Off unless set_null_kernels(True).
bool null_kernels();

// How far ahead of the current load the GEMVs prefetch, in weight elements (int4: half as many
// bytes): near into L1, far into L2. Defaults from cpu_gemv.cpp's measurements; set per machine by
// the op set_prefetch (autotune.tune_prefetch, a timed search run on the GEMVs' first use: cpu_gemv.ready).
int64_t near_prefetch();
int64_t far_prefetch();

// gemv's path for bf16 x and bf16 weights on AVX512-BF16 CPUs (cpu_gemv_bf16.cpp): fills y (M, total)
// and returns true, or returns false (other dtypes, or no such instructions in this build).
bool gemv_bf16_dot(const at::Tensor& x, at::TensorList weights, const std::vector<int64_t>& first_row, float* y);

// Below this many weight elements one thread does the whole GEMV: waking the others costs more.
constexpr int64_t kMinParallelElements = 1 << 15;
constexpr int64_t kMaxRows = 8;  // cpu_gemv.py's MAX_ROWS

// A contiguous fp32/bf16/fp16 tensor as fp32 values.
inline std::vector<float> as_floats(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  const int64_t n = c.numel();
  std::vector<float> out(n);
  switch (c.scalar_type()) {
    case at::kFloat: std::copy_n(c.const_data_ptr<float>(), n, out.begin()); break;
    case at::kBFloat16: std::copy_n(c.const_data_ptr<c10::BFloat16>(), n, out.begin()); break;
    case at::kHalf: std::copy_n(c.const_data_ptr<c10::Half>(), n, out.begin()); break;
    default: TORCH_CHECK(false, "fastflow_cpu: unsupported dtype ", c.scalar_type());
  }
  return out;
}

// fp32 values into a contiguous fp32/bf16/fp16 tensor (one rounding).
inline void store_floats(const std::vector<float>& v, at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: std::copy(v.begin(), v.end(), t.mutable_data_ptr<float>()); break;
    case at::kBFloat16: std::copy(v.begin(), v.end(), t.mutable_data_ptr<c10::BFloat16>()); break;
    case at::kHalf: std::copy(v.begin(), v.end(), t.mutable_data_ptr<c10::Half>()); break;
    default: TORCH_CHECK(false, "fastflow_cpu: unsupported dtype ", t.scalar_type());
  }
}

inline void check_vector(const at::Tensor& t, int64_t N, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 1 && t.size(0) == N && t.is_contiguous(),
              op, ": each ", name, " must be a contiguous CPU vector of its weight's ", N, " rows");
  TORCH_CHECK(t.is_floating_point(), op, ": ", name, " must be floating point");
}

// Checks a GEMV's operands (1 to kMaxRows rows of x; (N_i, K) weights of one dtype among `allowed`, named
// `allowed_names` in the error;
// no, or one (N_i,) scale and bias per weight). Returns the weights' first rows in the concatenated
// output, with the total last.
inline std::vector<int64_t> gemv_first_rows(const char* op, const at::Tensor& x, at::TensorList weights,
                                            at::TensorList scales, at::TensorList biases,
                                            std::initializer_list<at::ScalarType> allowed, const char* allowed_names) {
  TORCH_CHECK(!weights.empty(), op, ": no weights");
  TORCH_CHECK(scales.empty() || scales.size() == weights.size(), op, ": one scale per weight, or none");
  TORCH_CHECK(biases.empty() || biases.size() == weights.size(), op, ": one bias per weight, or none");
  TORCH_CHECK(x.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              op, ": x must be float32, bfloat16 or float16");
  const int64_t K = x.size(-1);
  TORCH_CHECK(x.dim() >= 1 && K > 0 && x.numel() % K == 0 && x.numel() / K >= 1 && x.numel() / K <= kMaxRows,
              op, ": x must hold 1 to ", kMaxRows, " rows, got shape ", x.sizes());
  const auto wtype = weights[0].scalar_type();
  TORCH_CHECK(std::find(allowed.begin(), allowed.end(), wtype) != allowed.end(), op,
              ": weights must be ", allowed_names, ", got ", wtype);
  std::vector<int64_t> first_row{0};
  for (size_t i = 0; i < weights.size(); ++i) {
    const at::Tensor& w = weights[i];
    TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.is_contiguous() && w.size(1) == K && w.scalar_type() == wtype,
                op, ": weights must be contiguous CPU (N, ", K, ") matrices of one dtype");
    if (!scales.empty()) check_vector(scales[i], w.size(0), op, "scale");
    if (!biases.empty()) check_vector(biases[i], w.size(0), op, "bias");
    first_row.push_back(first_row.back() + w.size(0));
  }
  return first_row;
}

// The rows of all weights as one range [0, total): thread t handles one contiguous run of it, across
// matrix boundaries, so siblings (q/k/v, gate/up) share one parallel region and one prefetch stream.
// run(i, local, count, r): weight i's rows [local, local + count), rows [r, r + count) of the
// concatenated output -- the thread's part of one weight's rows.
template <typename RunFn>
void for_each_run(const std::vector<int64_t>& first_row, int64_t K, int threads_available, RunFn&& run) {
  const int64_t total = first_row.back();
  const int64_t grain = std::max<int64_t>(1, kMinParallelElements / std::max<int64_t>(K, 1));
  const int threads = static_cast<int>(std::min<int64_t>(threads_available, (total + grain - 1) / grain));
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t begin = total * t / nt, end = total * (t + 1) / nt;
    size_t i = std::upper_bound(first_row.begin(), first_row.end(), begin) - first_row.begin() - 1;
    for (int64_t r = begin; r < end; ++i) {
      const int64_t stop = std::min(end, first_row[i + 1]);
      if (stop > r) run(i, r - first_row[i], stop - r, r);
      r = std::max(r, stop);
    }
  }
}

// The same split a row at a time: row(i, local, r) for weight i's row `local`, row r of the output.
template <typename RowFn>
void for_each_row(const std::vector<int64_t>& first_row, int64_t K, int threads_available, RowFn&& row) {
  for_each_run(first_row, K, threads_available, [&](size_t i, int64_t local, int64_t count, int64_t r) {
    for (int64_t j = 0; j < count; ++j) row(i, local + j, r + j);
  });
}

// y (M, total) *= each weight's scale, += its bias, in fp32 (the order the references use).
inline void apply_scales_biases(std::vector<float>& y, int64_t M, const std::vector<int64_t>& first_row,
                                at::TensorList scales, at::TensorList biases) {
  const int64_t total = first_row.back();
  for (size_t i = 0; i + 1 < first_row.size(); ++i) {
    const int64_t begin = first_row[i], N = first_row[i + 1] - begin;
    if (!scales.empty()) {
      const std::vector<float> s = as_floats(scales[i]);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) y[m * total + begin + n] *= s[n];
    }
    if (!biases.empty()) {
      const std::vector<float> b = as_floats(biases[i]);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) y[m * total + begin + n] += b[n];
    }
  }
}
}  // namespace fastflow_cpu
