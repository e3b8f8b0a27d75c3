// The CUDA backend of kernel_ladder_native's rms_norm_forward, rms_norm_backward, softmax_forward and
// softmax_backward (schemas: TORCH_LIBRARY in ../ops.cpp): validation, layout, the choice of kernel and vector
// width, and the launches on the current stream. The kernels are in rms_norm.cuh and softmax.cuh.
//
// Layout: the ops work on rows of the last dim. An input whose last dim is dense and whose leading dims
// collapse to one row stride (contiguous tensors, row slices, padded rows, expanded rows) is read in place
// with that stride; any other layout is copied to a contiguous tensor first. Outputs are new contiguous
// tensors.
//
// Kernel choice: rows of up to kWarpMaxColsOf<T> columns (1024; 512 for double) take the warp-per-row kernels,
// longer rows the block-per-row kernels. Vector width: 16 bytes / sizeof(T) (4 floats, 8 bf16/fp16) where every
// row start of every operand is 16-byte aligned and C is a multiple of it, else 1 (the scalar path; always for
// double).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <tuple>
#include <type_traits>
#include <utility>

#include "rms_norm.cuh"
#include "softmax.cuh"

namespace {

using kl_cuda::acc_t;

template <typename T>
constexpr int kFullVec = sizeof(T) == 8 ? 1 : 16 / (int)sizeof(T);

constexpr int64_t kMaxGrid = 2147483647;  // gridDim.x

template <typename T>
struct Tag {
  using type = T;
};

bool is_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

// f(Tag<T>{}) with T the CUDA element type of `dtype` (checked to be one of the four before).
template <typename F>
void dispatch(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat: return f(Tag<float>{});
    case at::kDouble: return f(Tag<double>{});
    case at::kHalf: return f(Tag<__half>{});
    case at::kBFloat16: return f(Tag<__nv_bfloat16>{});
    default: TORCH_CHECK_TYPE(false, "kernel_ladder: no CUDA kernel for ", dtype);
  }
}

// f(std::integral_constant<int, VEC>{}) for the runtime width vec (1 or kFullVec<T>).
template <typename T, typename F>
void with_vec(int vec, F&& f) {
  if (vec == 1)
    f(std::integral_constant<int, 1>{});
  else
    f(std::integral_constant<int, kFullVec<T>>{});
}

void check_float(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_TYPE(is_float(t.scalar_type()), op, ": ", name,
                   " must be float32, float64, float16 or bfloat16, got ", t.scalar_type());
}

void check_device(const char* op, const char* name, const at::Tensor& t, const at::Tensor& x) {
  TORCH_CHECK_VALUE(t.device() == x.device(), op, ": ", name, " must be on x's device (", x.device(), "), got ",
                    t.device());
}

void check_same_dtype(const char* op, const char* name, const at::Tensor& t, const char* other_name,
                      const at::Tensor& other) {
  TORCH_CHECK_TYPE(t.scalar_type() == other.scalar_type(), op, ": ", name, " must have ", other_name, "'s dtype (",
                   other.scalar_type(), "), got ", t.scalar_type());
}

// A tensor as rows of its last dim: the tensor read (x itself, or a contiguous copy), the number of rows,
// the row length and the distance between row starts, in elements.
struct Rows {
  at::Tensor t;
  int64_t rows, cols, stride;
};

Rows as_rows(const at::Tensor& x) {
  const int64_t cols = x.size(-1);
  int64_t rows = 1;
  for (int64_t i = 0; i + 1 < x.dim(); ++i) rows *= x.size(i);
  bool in_place = x.stride(-1) == 1 || cols <= 1;
  int64_t stride = cols, next = -1;  // next: the stride the next outer leading dim must have to collapse
  for (int64_t i = x.dim() - 2; i >= 0 && in_place; --i) {
    if (x.size(i) == 1) continue;
    if (next < 0)
      stride = x.stride(i);
    else if (x.stride(i) != next)
      in_place = false;
    next = x.stride(i) * x.size(i);
  }
  if (!in_place) return Rows{x.contiguous(), rows, cols, cols};
  return Rows{x, rows, cols, stride};
}

// The vector width for rows of `cols` elements of T starting at each (pointer, row stride) given.
template <typename T>
int vector_width(int64_t cols, std::initializer_list<std::pair<const void*, int64_t>> operands) {
  constexpr int vec = kFullVec<T>;
  if constexpr (vec == 1) {
    return 1;
  } else {
    if (cols % vec != 0) return 1;
    for (const auto& [ptr, stride] : operands)
      if (reinterpret_cast<std::uintptr_t>(ptr) % 16 != 0 || stride % vec != 0) return 1;
    return vec;
  }
}

template <typename T>
const T* data(const at::Tensor& t) {
  return reinterpret_cast<const T*>(t.const_data_ptr());
}

template <typename T>
T* mutable_data(at::Tensor& t) {
  return reinterpret_cast<T*>(t.mutable_data_ptr());
}

at::ScalarType acc_dtype(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool warp_per_row(at::ScalarType dtype, int64_t cols) {
  return cols <= (dtype == at::kDouble ? kl_cuda::kWarpMaxColsOf<double> : kl_cuda::kWarpMaxColsOf<float>);
}

// The grid of a forward or softmax-backward launch: one warp per row, or one block per row.
dim3 row_grid(const char* op, at::ScalarType dtype, int64_t rows, int64_t cols) {
  const int64_t blocks = warp_per_row(dtype, cols) ? ceil_div(rows, kl_cuda::kWarpRows) : rows;
  TORCH_CHECK_VALUE(blocks <= kMaxGrid, op, ": x has ", rows, " rows of ", cols, " elements, more than one grid (",
                    kMaxGrid, " blocks) holds");
  return dim3((unsigned)blocks);
}

dim3 row_block(at::ScalarType dtype, int64_t cols) {
  return warp_per_row(dtype, cols) ? dim3(kl_cuda::kWarp, kl_cuda::kWarpRows) : dim3(kl_cuda::kBlockThreads);
}

// ---------------------------------------------------------------------------------------------------------
// RMSNorm
// ---------------------------------------------------------------------------------------------------------

void check_rms_norm_inputs(const char* op, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK_VALUE(x.is_cuda(), op, ": x must be on a CUDA device, got ", x.device());
  check_float(op, "x", x);
  TORCH_CHECK_VALUE(x.dim() >= 1, op, ": x must have at least one dim (the normalized one), got a 0-d tensor");
  check_device(op, "weight", weight, x);
  check_same_dtype(op, "weight", weight, "x", x);
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == x.size(-1), op, ": weight must have shape (",
                    x.size(-1), ",) (x's last dim), got ", weight.sizes());
}

std::tuple<at::Tensor, at::Tensor> rms_norm_forward_cuda(const at::Tensor& x, const at::Tensor& weight, double eps) {
  constexpr const char* op = "kernel_ladder.rms_norm_forward";
  check_rms_norm_inputs(op, x, weight);
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0, op, ": eps must be a finite number >= 0, got ", eps);
  const c10::cuda::CUDAGuard guard(x.device());
  const Rows r = as_rows(x);
  const at::Tensor w = weight.contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor rstd = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(acc_dtype(x.scalar_type())));
  if (r.rows == 0) return {y, rstd};
  const dim3 grid = row_grid(op, x.scalar_type(), r.rows, r.cols), block = row_block(x.scalar_type(), r.cols);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const bool warp = warp_per_row(x.scalar_type(), r.cols);
  dispatch(x.scalar_type(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* xp = data<T>(r.t);
    const T* wp = data<T>(w);
    T* yp = mutable_data<T>(y);
    acc_t<T>* rp = mutable_data<acc_t<T>>(rstd);
    const int vec = vector_width<T>(r.cols, {{xp, r.stride}, {wp, 0}, {yp, r.cols}});
    with_vec<T>(vec, [&](auto v) {
      constexpr int VEC = decltype(v)::value;
      if (warp)
        rms_norm_forward_warp<T, VEC><<<grid, block, 0, stream>>>(xp, wp, yp, rp, r.rows, r.cols, r.stride, (float)eps);
      else
        rms_norm_forward_block<T, VEC><<<grid, block, 0, stream>>>(xp, wp, yp, rp, r.rows, r.cols, r.stride, (float)eps);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cuda(const at::Tensor& grad_y, const at::Tensor& x,
                                                          const at::Tensor& weight, const at::Tensor& rstd) {
  constexpr const char* op = "kernel_ladder.rms_norm_backward";
  check_rms_norm_inputs(op, x, weight);
  check_device(op, "grad_y", grad_y, x);
  check_same_dtype(op, "grad_y", grad_y, "x", x);
  TORCH_CHECK_VALUE(grad_y.sizes() == x.sizes(), op, ": grad_y must have x's shape ", x.sizes(), ", got ",
                    grad_y.sizes());
  check_device(op, "rstd", rstd, x);
  TORCH_CHECK_TYPE(rstd.scalar_type() == acc_dtype(x.scalar_type()), op, ": rstd must be ",
                   acc_dtype(x.scalar_type()), " for x of ", x.scalar_type(), ", got ", rstd.scalar_type());
  TORCH_CHECK_VALUE(rstd.sizes() == x.sizes().slice(0, x.dim() - 1), op, ": rstd must have shape ",
                    x.sizes().slice(0, x.dim() - 1), " (x's without its last dim), got ", rstd.sizes());
  const c10::cuda::CUDAGuard guard(x.device());
  const Rows xr = as_rows(x), gr = as_rows(grad_y);
  const at::Tensor w = weight.contiguous(), rs = rstd.contiguous();
  at::Tensor grad_x = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t rows = xr.rows, cols = xr.cols;
  if (rows == 0) return {grad_x, at::zeros({cols}, weight.options())};
  at::Tensor grad_weight = at::empty({cols}, weight.options());
  // One row of fp32 (fp64) partial sums per block; the grid depends on the row count alone (rms_norm.cuh).
  const bool warp = warp_per_row(x.scalar_type(), cols);
  const int64_t blocks = warp ? std::min<int64_t>(ceil_div(rows, kl_cuda::kWarpRows * kl_cuda::kBackwardRowsPerWarp),
                                                  kl_cuda::kBackwardMaxBlocks)
                              : std::min<int64_t>(rows, kl_cuda::kBackwardMaxBlocks);
  at::Tensor partials = at::empty({blocks, cols}, x.options().dtype(acc_dtype(x.scalar_type())));
  const dim3 block = row_block(x.scalar_type(), cols);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  dispatch(x.scalar_type(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = acc_t<T>;
    const T* gp = data<T>(gr.t);
    const T* xp = data<T>(xr.t);
    const T* wp = data<T>(w);
    const A* rp = data<A>(rs);
    T* gxp = mutable_data<T>(grad_x);
    A* pp = mutable_data<A>(partials);
    const int vec = vector_width<T>(cols, {{gp, gr.stride}, {xp, xr.stride}, {wp, 0}, {gxp, cols}, {pp, cols}});
    with_vec<T>(vec, [&](auto v) {
      constexpr int VEC = decltype(v)::value;
      if (warp)
        rms_norm_backward_warp<T, VEC><<<(unsigned)blocks, block, 0, stream>>>(gp, xp, wp, rp, gxp, pp, rows, cols,
                                                                               gr.stride, xr.stride);
      else
        rms_norm_backward_block<T, VEC><<<(unsigned)blocks, block, 0, stream>>>(gp, xp, wp, rp, gxp, pp, rows, cols,
                                                                                gr.stride, xr.stride);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    if (cols > 0) {
      const dim3 reduce_grid((unsigned)ceil_div(cols, kl_cuda::kWarp)), reduce_block(kl_cuda::kWarp, kl_cuda::kReduceRows);
      rms_norm_weight_grad_reduce<T><<<reduce_grid, reduce_block, 0, stream>>>(pp, mutable_data<T>(grad_weight), blocks,
                                                                               cols);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return {grad_x, grad_weight};
}

// ---------------------------------------------------------------------------------------------------------
// Softmax over the last dim
// ---------------------------------------------------------------------------------------------------------

at::Tensor softmax_forward_cuda(const at::Tensor& x_in) {
  constexpr const char* op = "kernel_ladder.softmax_forward";
  TORCH_CHECK_VALUE(x_in.is_cuda(), op, ": x must be on a CUDA device, got ", x_in.device());
  check_float(op, "x", x_in);
  const at::Tensor x = x_in.dim() == 0 ? x_in.reshape({1}) : x_in;  // a 0-d tensor is one row of one
  const c10::cuda::CUDAGuard guard(x.device());
  const Rows r = as_rows(x);
  at::Tensor y = at::empty(x_in.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (r.rows == 0 || r.cols == 0) return y;
  const dim3 grid = row_grid(op, x.scalar_type(), r.rows, r.cols), block = row_block(x.scalar_type(), r.cols);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const bool warp = warp_per_row(x.scalar_type(), r.cols);
  dispatch(x.scalar_type(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* xp = data<T>(r.t);
    T* yp = mutable_data<T>(y);
    with_vec<T>(vector_width<T>(r.cols, {{xp, r.stride}, {yp, r.cols}}), [&](auto v) {
      constexpr int VEC = decltype(v)::value;
      if (warp)
        softmax_forward_warp<T, VEC><<<grid, block, 0, stream>>>(xp, yp, r.rows, r.cols, r.stride);
      else
        softmax_forward_block<T, VEC><<<grid, block, 0, stream>>>(xp, yp, r.rows, r.cols, r.stride);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return y;
}

at::Tensor softmax_backward_cuda(const at::Tensor& grad_y_in, const at::Tensor& y_in) {
  constexpr const char* op = "kernel_ladder.softmax_backward";
  TORCH_CHECK_VALUE(y_in.is_cuda(), op, ": y must be on a CUDA device, got ", y_in.device());
  check_float(op, "y", y_in);
  check_device(op, "grad_y", grad_y_in, y_in);
  check_same_dtype(op, "grad_y", grad_y_in, "y", y_in);
  TORCH_CHECK_VALUE(grad_y_in.sizes() == y_in.sizes(), op, ": grad_y must have y's shape ", y_in.sizes(), ", got ",
                    grad_y_in.sizes());
  const at::Tensor y = y_in.dim() == 0 ? y_in.reshape({1}) : y_in;
  const at::Tensor grad_y = grad_y_in.dim() == 0 ? grad_y_in.reshape({1}) : grad_y_in;
  const c10::cuda::CUDAGuard guard(y.device());
  const Rows yr = as_rows(y), gr = as_rows(grad_y);
  at::Tensor grad_x = at::empty(y_in.sizes(), y.options().memory_format(at::MemoryFormat::Contiguous));
  if (yr.rows == 0 || yr.cols == 0) return grad_x;
  const dim3 grid = row_grid(op, y.scalar_type(), yr.rows, yr.cols), block = row_block(y.scalar_type(), yr.cols);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const bool warp = warp_per_row(y.scalar_type(), yr.cols);
  dispatch(y.scalar_type(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* gp = data<T>(gr.t);
    const T* yp = data<T>(yr.t);
    T* gxp = mutable_data<T>(grad_x);
    with_vec<T>(vector_width<T>(yr.cols, {{gp, gr.stride}, {yp, yr.stride}, {gxp, yr.cols}}), [&](auto v) {
      constexpr int VEC = decltype(v)::value;
      if (warp)
        softmax_backward_warp<T, VEC><<<grid, block, 0, stream>>>(gp, yp, gxp, yr.rows, yr.cols, gr.stride, yr.stride);
      else
        softmax_backward_block<T, VEC><<<grid, block, 0, stream>>>(gp, yp, gxp, yr.rows, yr.cols, gr.stride, yr.stride);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return grad_x;
}

}  // namespace

TORCH_LIBRARY_IMPL(kernel_ladder_native, CUDA, m) {
  m.impl("rms_norm_forward", &rms_norm_forward_cuda);
  m.impl("rms_norm_backward", &rms_norm_backward_cuda);
  m.impl("softmax_forward", &softmax_forward_cuda);
  m.impl("softmax_backward", &softmax_backward_cuda);
}
