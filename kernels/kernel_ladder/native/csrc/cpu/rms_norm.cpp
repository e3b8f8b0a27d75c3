// RMSNorm on the CPU: the top of the CPU ladder (rows in parallel, each row's loops vectorized).
//
//   rstd = 1 / sqrt(mean(x^2) + eps)      y = x * rstd * w
//   backward, with g = dy * w:  dx = rstd * (g - x * rstd^2 * mean(g * x))      dw = sum over rows of dy * x * rstd
//
// Accumulation is in float32 (float64 for float64). A float32 sum of squares overflows once |x| passes
// about 1.8e19; such a row is summed again scaled by its largest |x| (only then: the common row pays one
// isinf test), so rows of 1e30 normalize correctly.
//
// dw is deterministic: rows are cut into blocks of a fixed size (not one per thread), each block's
// dy * x * rstd summed into its own float32 row of a partial buffer, and the partial rows added in block
// order. The result is bitwise the same for any number of threads and any schedule.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../native.h"
#include "rows.h"

namespace kernel_ladder_native::cpu {

namespace {

constexpr int64_t kBlockRows = 32;  // rows per dw partial: fixed, so dw does not depend on the threads

template <typename T>
void rms_norm_forward_rows(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& y,
                           at::Tensor& rstd) {
  using A = acc_t<T>;
  const int64_t cols = x.size(-1), rows = rstd.numel();
  const int64_t x_col_stride = cols > 1 ? x.stride(-1) : 1, w_stride = cols > 1 ? weight.stride(0) : 1;
  const RowIndexer x_rows(x);
  const T* x_data = x.const_data_ptr<T>();
  const T* w_data = weight.const_data_ptr<T>();
  T* y_data = y.mutable_data_ptr<T>();
  A* rstd_data = rstd.mutable_data_ptr<A>();
  const A eps_a = static_cast<A>(eps);
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    std::vector<A> w_buf(cols), x_buf(cols), y_buf(std::is_same_v<T, A> ? 0 : cols);
    const A* w = load_row(w_data, cols, w_stride, w_buf.data());
    for (int64_t row = begin; row < end; ++row) {
      const A* xr = load_row(x_data + x_rows.offset(row), cols, x_col_stride, x_buf.data());
      A sum_sq = 0;
#pragma omp simd reduction(+ : sum_sq)
      for (int64_t j = 0; j < cols; ++j) sum_sq += xr[j] * xr[j];
      A r = A(1) / std::sqrt(sum_sq / static_cast<A>(cols) + eps_a);
      if (std::isinf(sum_sq)) {
        // Overflow, or an inf in the row. Scale by the largest |x|: if it is finite, the squares of
        // x / max fit, and rstd = 1 / (max * sqrt(mean((x / max)^2) + eps / max^2)).
        A big = 0;
#pragma omp simd reduction(max : big)
        for (int64_t j = 0; j < cols; ++j) big = std::abs(xr[j]) > big ? std::abs(xr[j]) : big;
        if (std::isfinite(big)) {
          const A inv_big = A(1) / big;
          A scaled = 0;
#pragma omp simd reduction(+ : scaled)
          for (int64_t j = 0; j < cols; ++j) scaled += (xr[j] * inv_big) * (xr[j] * inv_big);
          r = A(1) / std::sqrt(scaled / static_cast<A>(cols) + eps_a / big / big) / big;
        }
      }
      rstd_data[row] = r;
      T* yr = y_data + row * cols;
      if constexpr (std::is_same_v<T, A>) {
#pragma omp simd
        for (int64_t j = 0; j < cols; ++j) yr[j] = xr[j] * r * w[j];
      } else {
        A* out = y_buf.data();
#pragma omp simd
        for (int64_t j = 0; j < cols; ++j) out[j] = xr[j] * r * w[j];
        narrow_contiguous(out, yr, cols);
      }
    }
  });
}

template <typename T>
void rms_norm_backward_rows(const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& rstd, at::Tensor& grad_x, at::Tensor& grad_weight) {
  using A = acc_t<T>;
  const int64_t cols = x.size(-1), rows = rstd.numel();
  const int64_t x_col_stride = cols > 1 ? x.stride(-1) : 1, dy_col_stride = cols > 1 ? grad_y.stride(-1) : 1;
  const int64_t w_stride = cols > 1 ? weight.stride(0) : 1;
  const RowIndexer x_rows(x), dy_rows(grad_y);
  const T* x_data = x.const_data_ptr<T>();
  const T* dy_data = grad_y.const_data_ptr<T>();
  const T* w_data = weight.const_data_ptr<T>();
  const at::Tensor rstd_c = rstd.contiguous();  // one value per row (the forward's, contiguous already)
  const A* rstd_data = rstd_c.const_data_ptr<A>();
  T* dx_data = grad_x.mutable_data_ptr<T>();
  const int64_t blocks = (rows + kBlockRows - 1) / kBlockRows;
  at::Tensor partial = at::empty({blocks, cols}, x.options().dtype(rstd.scalar_type()));
  A* partial_data = partial.mutable_data_ptr<A>();
  const A inv_cols = A(1) / static_cast<A>(cols);
  at::parallel_for(0, blocks, std::max<int64_t>(1, grain_rows(cols) / kBlockRows), [&](int64_t b0, int64_t b1) {
    std::vector<A> w_buf(cols), x_buf(cols), dy_buf(cols), dx_buf(std::is_same_v<T, A> ? 0 : cols);
    const A* w = load_row(w_data, cols, w_stride, w_buf.data());
    for (int64_t b = b0; b < b1; ++b) {
      A* dw = partial_data + b * cols;
#pragma omp simd
      for (int64_t j = 0; j < cols; ++j) dw[j] = 0;
      for (int64_t row = b * kBlockRows; row < std::min(rows, (b + 1) * kBlockRows); ++row) {
        const A* xr = load_row(x_data + x_rows.offset(row), cols, x_col_stride, x_buf.data());
        const A* dyr = load_row(dy_data + dy_rows.offset(row), cols, dy_col_stride, dy_buf.data());
        const A r = rstd_data[row];
        A dot = 0;  // sum(g * x), g = dy * w
#pragma omp simd reduction(+ : dot)
        for (int64_t j = 0; j < cols; ++j) dot += dyr[j] * w[j] * xr[j];
        const A c = dot * r * r * inv_cols;
        A* out = std::is_same_v<T, A> ? reinterpret_cast<A*>(dx_data + row * cols) : dx_buf.data();
#pragma omp simd
        for (int64_t j = 0; j < cols; ++j) {
          out[j] = r * (dyr[j] * w[j] - xr[j] * c);
          dw[j] += dyr[j] * xr[j] * r;
        }
        if constexpr (!std::is_same_v<T, A>) narrow_contiguous(out, dx_data + row * cols, cols);
      }
    }
  });
  // dw: the partial rows added in block order, the columns in parallel.
  T* dw_data = grad_weight.mutable_data_ptr<T>();
  at::parallel_for(0, cols, std::max<int64_t>(256, 16384 / std::max<int64_t>(blocks, 1)), [&](int64_t c0, int64_t c1) {
    const int64_t n = c1 - c0;
    std::vector<A> sum(n, A(0));
    for (int64_t b = 0; b < blocks; ++b) {
      const A* p = partial_data + b * cols + c0;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) sum[j] += p[j];
    }
    narrow_contiguous(sum.data(), dw_data + c0, n);
  });
}

std::tuple<at::Tensor, at::Tensor> rms_norm_forward_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rms_norm_forward(kRmsNorm, x, weight, eps);
  auto [y, rstd] = empty_rms_norm_outputs(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm_forward_cpu", [&] {
    rms_norm_forward_rows<scalar_t>(x, weight, eps, y, rstd);
  });
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cpu(const at::Tensor& grad_y, const at::Tensor& x,
                                                         const at::Tensor& weight, const at::Tensor& rstd) {
  check_rms_norm_backward(kRmsNormBackward, grad_y, x, weight, rstd);
  at::Tensor grad_x = at::empty(x.sizes(), x.options());
  at::Tensor grad_weight = at::empty(weight.sizes(), weight.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm_backward_cpu", [&] {
    rms_norm_backward_rows<scalar_t>(grad_y, x, weight, rstd, grad_x, grad_weight);
  });
  return {grad_x, grad_weight};
}

}  // namespace

TORCH_LIBRARY_IMPL(kernel_ladder_native, CPU, m) {
  m.impl("rms_norm_forward", &rms_norm_forward_cpu);
  m.impl("rms_norm_backward", &rms_norm_backward_cpu);
}

}  // namespace kernel_ladder_native::cpu
