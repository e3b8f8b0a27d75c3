// The CUDA backend of kernel_ladder_native's rms_norm_forward, rms_norm_backward, softmax_forward and
// softmax_backward (schemas: TORCH_LIBRARY in ../ops.cpp): layout, the choice of kernel and vector width, and the
// launches on the current stream. The kernels are in rms_norm.cuh and softmax.cuh.
//
// Checks: the argument checks are the ones every backend shares (check_* in ../native.h, compiled from
// ../checks.cpp into the same library), called with the same op names as the CPU and Meta kernels, so a bad
// argument gets the same error on any device. Only what is CUDA's own is checked here: that the tensors are
// on a CUDA device, and that a launch's rows fit in one grid.
//
// Layout: the ops work on rows of the last dim, and no input is ever copied. Each input is read with its own
// strides: its last-dim (column) stride, and the row stride of the leading dims, which collapse to one row
// stride for contiguous tensors, row slices, padded rows, expanded rows and transposed matrices. Where the
// leading dims do not collapse for every input (a slice or permutation of a batch of matrices: rare), the
// innermost run of them that does is one launch's rows, and the dims outside it are walked here, one launch
// per index (RowPlan, row_plan.h). A column stride other than 1 in any input (or an rstd whose rows are not
// dense) takes the kernels' column-stride path (STRIDED: scalar loads); the stride-1 paths are unchanged by
// it. Outputs are new contiguous tensors.
//
// Kernel choice: rows of up to kWarpMaxColsOf<T, STRIDED> columns (1024; 512 for double; half that on the
// column-stride path) take the warp-per-row kernels, longer rows the block-per-row kernels. Vector width:
// 16 bytes / sizeof(T) (4 floats, 8 bf16/fp16) where every row start of every operand of the launch is 16-byte
// aligned and C is a multiple of it, else 1 (the scalar path; always for double and the column-stride path).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "../native.h"
#include "rms_norm.cuh"
#include "row_plan.h"
#include "softmax.cuh"

namespace {

using kl_cuda::acc_t;
using kl_cuda::RowPlan;
using namespace kernel_ladder_native;  // the shared checks and op names (native.h)

template <typename T>
constexpr int kFullVec = sizeof(T) == 8 ? 1 : 16 / (int)sizeof(T);

constexpr int64_t kMaxGrid = 2147483647;  // gridDim.x

template <typename T>
struct Tag {
  using type = T;
};

// f(Tag<T>{}) with T the CUDA element type of `dtype` (one of the four: the shared checks ran before).
template <typename F>
void dispatch(const char* op, at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat: return f(Tag<float>{});
    case at::kDouble: return f(Tag<double>{});
    case at::kHalf: return f(Tag<__half>{});
    case at::kBFloat16: return f(Tag<__nv_bfloat16>{});
    default: TORCH_CHECK_TYPE(false, op, ": no CUDA kernel for ", dtype_name(dtype));
  }
}

// f(VEC, STRIDED) as integral constants: the column-stride path (1, true) where `strided`, else the stride-1
// path of the runtime width vec (1 or kFullVec<T>).
template <typename T, typename F>
void with_layout(bool strided, int vec, F&& f) {
  if (strided)
    f(std::integral_constant<int, 1>{}, std::true_type{});
  else if (vec == 1)
    f(std::integral_constant<int, 1>{}, std::false_type{});
  else
    f(std::integral_constant<int, kFullVec<T>>{}, std::false_type{});
}

// The checks of the CUDA backend's own: every tensor is on a CUDA device (the shared checks have put them on
// one device already).
void check_cuda(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.is_cuda(), op, ": ", name, " must be on a CUDA device, got ", t.device());
}

// The distance between neighbouring elements of a row (any value where a row has at most one element).
int64_t col_stride(const at::Tensor& t) { return t.size(-1) > 1 ? t.stride(-1) : 1; }

std::vector<int64_t> leading_sizes(const at::Tensor& t) { return t.sizes().slice(0, t.dim() - 1).vec(); }
std::vector<int64_t> leading_strides(const at::Tensor& t) { return t.strides().slice(0, t.dim() - 1).vec(); }

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

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool warp_per_row(at::ScalarType dtype, int64_t cols, bool strided) {
  const int64_t most = dtype == at::kDouble ? kl_cuda::kWarpMaxColsOf<double> : kl_cuda::kWarpMaxColsOf<float>;
  return cols <= (strided ? most / 2 : most);
}

// The grid of a forward or softmax-backward launch of `rows` rows: one warp per row, or one block per row.
dim3 row_grid(const char* op, at::ScalarType dtype, int64_t rows, int64_t cols, bool strided) {
  const int64_t blocks = warp_per_row(dtype, cols, strided) ? ceil_div(rows, kl_cuda::kWarpRows) : rows;
  TORCH_CHECK_VALUE(blocks <= kMaxGrid, op, ": x has ", rows, " rows of ", cols, " elements, more than one grid (",
                    kMaxGrid, " blocks) holds");
  return dim3((unsigned)blocks);
}

dim3 row_block(at::ScalarType dtype, int64_t cols, bool strided) {
  return warp_per_row(dtype, cols, strided) ? dim3(kl_cuda::kWarp, kl_cuda::kWarpRows) : dim3(kl_cuda::kBlockThreads);
}

// ---------------------------------------------------------------------------------------------------------
// RMSNorm
// ---------------------------------------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> rms_norm_forward_cuda(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rms_norm_forward(kRmsNorm, x, weight, eps);
  const char* op = kRmsNorm;
  check_cuda(op, "x", x);
  const c10::cuda::CUDAGuard guard(x.device());
  auto [y, rstd] = empty_rms_norm_outputs(x);
  const int64_t cols = x.size(-1);
  if (rstd.numel() == 0) return {y, rstd};
  const RowPlan plan(leading_sizes(x), {leading_strides(x)});
  const int64_t x_cs = col_stride(x), w_cs = cols > 1 ? weight.stride(0) : 1;
  const bool strided = x_cs != 1 || w_cs != 1;
  const dim3 grid = row_grid(op, x.scalar_type(), plan.rows, cols, strided);
  const dim3 block = row_block(x.scalar_type(), cols, strided);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const bool warp = warp_per_row(x.scalar_type(), cols, strided);
  dispatch(op, x.scalar_type(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* wp = data<T>(weight);
    for (int64_t l = 0; l < plan.launches; ++l) {
      const T* xp = data<T>(x) + plan.offset(0, l);
      T* yp = mutable_data<T>(y) + l * plan.rows * cols;
      acc_t<T>* rp = mutable_data<acc_t<T>>(rstd) + l * plan.rows;
      const int vec = vector_width<T>(cols, {{xp, plan.row_stride[0]}, {wp, 0}, {yp, cols}});
      with_layout<T>(strided, vec, [&](auto v, auto s) {
        constexpr int VEC = decltype(v)::value;
        constexpr bool STRIDED = decltype(s)::value;
        if (warp)
          rms_norm_forward_warp<T, VEC, STRIDED><<<grid, block, 0, stream>>>(xp, wp, yp, rp, plan.rows, cols,
                                                                             plan.row_stride[0], (float)eps, x_cs,
                                                                             w_cs);
        else
          rms_norm_forward_block<T, VEC, STRIDED><<<grid, block, 0, stream>>>(xp, wp, yp, rp, plan.rows, cols,
                                                                              plan.row_stride[0], (float)eps, x_cs,
                                                                              w_cs);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    }
  });
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cuda(const at::Tensor& grad_y, const at::Tensor& x,
                                                          const at::Tensor& weight, const at::Tensor& rstd) {
  check_rms_norm_backward(kRmsNormBackward, grad_y, x, weight, rstd);
  const char* op = kRmsNormBackward;
  check_cuda(op, "x", x);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor grad_x = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t cols = x.size(-1);
  if (rstd.numel() == 0) return {grad_x, at::zeros({cols}, weight.options())};
  at::Tensor grad_weight = at::empty({cols}, weight.options());
  // inputs 0, 1, 2 of the plan: grad_y, x, rstd (whose dims are the leading dims)
  const RowPlan plan(leading_sizes(x), {leading_strides(grad_y), leading_strides(x), rstd.strides().vec()});
  const int64_t g_cs = col_stride(grad_y), x_cs = col_stride(x), w_cs = cols > 1 ? weight.stride(0) : 1;
  const int64_t r_stride = plan.rows > 1 ? plan.row_stride[2] : 1;
  const bool strided = g_cs != 1 || x_cs != 1 || w_cs != 1 || r_stride != 1;
  // One row of fp32 (fp64) partial sums per block of each launch: the grid depends on the row count alone
  // (rms_norm.cuh), and the reduce adds every launch's rows in one fixed order. With several launches (leading
  // dims that do not collapse) there are launches * blocks rows of partials: at most as many elements as x.
  const bool warp = warp_per_row(x.scalar_type(), cols, strided);
  const int64_t rows = plan.rows;
  const int64_t blocks = warp ? std::min<int64_t>(ceil_div(rows, kl_cuda::kWarpRows * kl_cuda::kBackwardRowsPerWarp),
                                                  kl_cuda::kBackwardMaxBlocks)
                              : std::min<int64_t>(rows, kl_cuda::kBackwardMaxBlocks);
  at::Tensor partials = at::empty({plan.launches * blocks, cols}, x.options().dtype(accumulate_dtype(x.scalar_type())));
  const dim3 block = row_block(x.scalar_type(), cols, strided);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  dispatch(op, x.scalar_type(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = acc_t<T>;
    const T* wp = data<T>(weight);
    for (int64_t l = 0; l < plan.launches; ++l) {
      const T* gp = data<T>(grad_y) + plan.offset(0, l);
      const T* xp = data<T>(x) + plan.offset(1, l);
      const A* rp = data<A>(rstd) + plan.offset(2, l);
      T* gxp = mutable_data<T>(grad_x) + l * rows * cols;
      A* pp = mutable_data<A>(partials) + l * blocks * cols;
      const int vec = vector_width<T>(
          cols, {{gp, plan.row_stride[0]}, {xp, plan.row_stride[1]}, {wp, 0}, {gxp, cols}, {pp, cols}});
      with_layout<T>(strided, vec, [&](auto v, auto s) {
        constexpr int VEC = decltype(v)::value;
        constexpr bool STRIDED = decltype(s)::value;
        if (warp)
          rms_norm_backward_warp<T, VEC, STRIDED><<<(unsigned)blocks, block, 0, stream>>>(
              gp, xp, wp, rp, gxp, pp, rows, cols, plan.row_stride[0], plan.row_stride[1], g_cs, x_cs, w_cs, r_stride);
        else
          rms_norm_backward_block<T, VEC, STRIDED><<<(unsigned)blocks, block, 0, stream>>>(
              gp, xp, wp, rp, gxp, pp, rows, cols, plan.row_stride[0], plan.row_stride[1], g_cs, x_cs, w_cs, r_stride);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    }
    if (cols > 0) {
      const dim3 reduce_grid((unsigned)ceil_div(cols, kl_cuda::kWarp));
      const dim3 reduce_block(kl_cuda::kWarp, kl_cuda::kReduceRows);
      rms_norm_weight_grad_reduce<T><<<reduce_grid, reduce_block, 0, stream>>>(
          mutable_data<A>(partials), mutable_data<T>(grad_weight), plan.launches * blocks, cols);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return {grad_x, grad_weight};
}

// ---------------------------------------------------------------------------------------------------------
// Softmax over the last dim
// ---------------------------------------------------------------------------------------------------------

at::Tensor softmax_forward_cuda(const at::Tensor& x) {
  check_softmax_forward(kSoftmax, x);
  const char* op = kSoftmax;
  check_cuda(op, "x", x);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t cols = x.size(-1);
  if (y.numel() == 0) return y;
  const RowPlan plan(leading_sizes(x), {leading_strides(x)});
  const int64_t x_cs = col_stride(x);
  const bool strided = x_cs != 1;
  const dim3 grid = row_grid(op, x.scalar_type(), plan.rows, cols, strided);
  const dim3 block = row_block(x.scalar_type(), cols, strided);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const bool warp = warp_per_row(x.scalar_type(), cols, strided);
  dispatch(op, x.scalar_type(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    for (int64_t l = 0; l < plan.launches; ++l) {
      const T* xp = data<T>(x) + plan.offset(0, l);
      T* yp = mutable_data<T>(y) + l * plan.rows * cols;
      const int vec = vector_width<T>(cols, {{xp, plan.row_stride[0]}, {yp, cols}});
      with_layout<T>(strided, vec, [&](auto v, auto s) {
        constexpr int VEC = decltype(v)::value;
        constexpr bool STRIDED = decltype(s)::value;
        if (warp)
          softmax_forward_warp<T, VEC, STRIDED><<<grid, block, 0, stream>>>(xp, yp, plan.rows, cols,
                                                                            plan.row_stride[0], x_cs);
        else
          softmax_forward_block<T, VEC, STRIDED><<<grid, block, 0, stream>>>(xp, yp, plan.rows, cols,
                                                                             plan.row_stride[0], x_cs);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    }
  });
  return y;
}

at::Tensor softmax_backward_cuda(const at::Tensor& grad_y, const at::Tensor& y) {
  check_softmax_backward(kSoftmaxBackward, grad_y, y);
  const char* op = kSoftmaxBackward;
  check_cuda(op, "y", y);
  const c10::cuda::CUDAGuard guard(y.device());
  at::Tensor grad_x = at::empty(y.sizes(), y.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t cols = y.size(-1);
  if (grad_x.numel() == 0) return grad_x;
  // inputs 0, 1 of the plan: grad_y, y
  const RowPlan plan(leading_sizes(y), {leading_strides(grad_y), leading_strides(y)});
  const int64_t g_cs = col_stride(grad_y), y_cs = col_stride(y);
  const bool strided = g_cs != 1 || y_cs != 1;
  const dim3 grid = row_grid(op, y.scalar_type(), plan.rows, cols, strided);
  const dim3 block = row_block(y.scalar_type(), cols, strided);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const bool warp = warp_per_row(y.scalar_type(), cols, strided);
  dispatch(op, y.scalar_type(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    for (int64_t l = 0; l < plan.launches; ++l) {
      const T* gp = data<T>(grad_y) + plan.offset(0, l);
      const T* yp = data<T>(y) + plan.offset(1, l);
      T* gxp = mutable_data<T>(grad_x) + l * plan.rows * cols;
      const int vec = vector_width<T>(cols, {{gp, plan.row_stride[0]}, {yp, plan.row_stride[1]}, {gxp, cols}});
      with_layout<T>(strided, vec, [&](auto v, auto s) {
        constexpr int VEC = decltype(v)::value;
        constexpr bool STRIDED = decltype(s)::value;
        if (warp)
          softmax_backward_warp<T, VEC, STRIDED><<<grid, block, 0, stream>>>(
              gp, yp, gxp, plan.rows, cols, plan.row_stride[0], plan.row_stride[1], g_cs, y_cs);
        else
          softmax_backward_block<T, VEC, STRIDED><<<grid, block, 0, stream>>>(
              gp, yp, gxp, plan.rows, cols, plan.row_stride[0], plan.row_stride[1], g_cs, y_cs);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    }
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
