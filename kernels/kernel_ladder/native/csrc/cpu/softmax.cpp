// Softmax over the last dim on the CPU: rows in parallel, each row's three loops vectorized
// (max; exp and sum; scale), exp computed by exp_simd so that its loop vectorizes too.
//
//   y = exp(x - max(x)) / sum(exp(x - max(x)))        backward: dx = y * (dy - sum(dy * y))
//
// As torch.softmax: a row that is all -inf gives NaN (exp(-inf - -inf)); a row with some -inf gives
// exact zeros there; a NaN anywhere in a row makes the whole row NaN; +inf in a row gives NaN.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../native.h"
#include "rows.h"

namespace kernel_ladder_native::cpu {

namespace {

template <typename T>
void softmax_forward_rows(const at::Tensor& x, at::Tensor& y) {
  using A = acc_t<T>;
  const int64_t cols = x.size(-1), rows = cols ? x.numel() / cols : 0;
  const int64_t x_col_stride = cols > 1 ? x.stride(-1) : 1;
  const RowIndexer x_rows(x);
  const T* x_data = x.const_data_ptr<T>();
  T* y_data = y.mutable_data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    std::vector<A> x_buf(cols), e_buf(std::is_same_v<T, A> ? 0 : cols);
    for (int64_t row = begin; row < end; ++row) {
      const A* xr = load_row(x_data + x_rows.offset(row), cols, x_col_stride, x_buf.data());
      A m = -std::numeric_limits<A>::infinity();
#pragma omp simd reduction(max : m)
      for (int64_t j = 0; j < cols; ++j) m = xr[j] > m ? xr[j] : m;
      A* e = std::is_same_v<T, A> ? reinterpret_cast<A*>(y_data + row * cols) : e_buf.data();
      A sum = 0;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < cols; ++j) {
        const A v = exp_simd(xr[j] - m);
        e[j] = v;
        sum += v;
      }
      const A inv = A(1) / sum;
#pragma omp simd
      for (int64_t j = 0; j < cols; ++j) e[j] *= inv;
      if constexpr (!std::is_same_v<T, A>) narrow_contiguous(e, y_data + row * cols, cols);
    }
  });
}

template <typename T>
void softmax_backward_rows(const at::Tensor& grad_y, const at::Tensor& y, at::Tensor& grad_x) {
  using A = acc_t<T>;
  const int64_t cols = y.size(-1), rows = cols ? y.numel() / cols : 0;
  const int64_t y_col_stride = cols > 1 ? y.stride(-1) : 1, dy_col_stride = cols > 1 ? grad_y.stride(-1) : 1;
  const RowIndexer y_rows(y), dy_rows(grad_y);
  const T* y_data = y.const_data_ptr<T>();
  const T* dy_data = grad_y.const_data_ptr<T>();
  T* dx_data = grad_x.mutable_data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    std::vector<A> y_buf(cols), dy_buf(cols), dx_buf(std::is_same_v<T, A> ? 0 : cols);
    for (int64_t row = begin; row < end; ++row) {
      const A* yr = load_row(y_data + y_rows.offset(row), cols, y_col_stride, y_buf.data());
      const A* dyr = load_row(dy_data + dy_rows.offset(row), cols, dy_col_stride, dy_buf.data());
      A dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int64_t j = 0; j < cols; ++j) dot += dyr[j] * yr[j];
      A* out = std::is_same_v<T, A> ? reinterpret_cast<A*>(dx_data + row * cols) : dx_buf.data();
#pragma omp simd
      for (int64_t j = 0; j < cols; ++j) out[j] = yr[j] * (dyr[j] - dot);
      if constexpr (!std::is_same_v<T, A>) narrow_contiguous(out, dx_data + row * cols, cols);
    }
  });
}

at::Tensor softmax_forward_cpu(const at::Tensor& x) {
  check_softmax_forward(kSoftmax, x);
  at::Tensor y = at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "softmax_forward_cpu", [&] {
    softmax_forward_rows<scalar_t>(x, y);
  });
  return y;
}

at::Tensor softmax_backward_cpu(const at::Tensor& grad_y, const at::Tensor& y) {
  check_softmax_backward(kSoftmaxBackward, grad_y, y);
  at::Tensor grad_x = at::empty(y.sizes(), y.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y.scalar_type(), "softmax_backward_cpu", [&] {
    softmax_backward_rows<scalar_t>(grad_y, y, grad_x);
  });
  return grad_x;
}

}  // namespace

TORCH_LIBRARY_IMPL(kernel_ladder_native, CPU, m) {
  m.impl("softmax_forward", &softmax_forward_cpu);
  m.impl("softmax_backward", &softmax_backward_cpu);
}

}  // namespace kernel_ladder_native::cpu
