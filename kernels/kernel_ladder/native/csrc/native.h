// kernel_ladder.native: what every backend of the operators shares (CPU, Meta, CUDA).
//
// The argument checks live here, written on symbolic sizes (sym_sizes) so the Meta kernels run them
// under torch.compile(dynamic=True) too, and raise through TORCH_CHECK_VALUE / TORCH_CHECK_TYPE, which
// Python sees as ValueError / TypeError. Every message starts with the op's name as Python users call
// it ("kernel_ladder.native.rms_norm: ") and names the argument, what was expected and what came.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <tuple>

namespace kernel_ladder_native {

// Op names in messages: the user-facing ops and the backend ops they dispatch to.
constexpr const char* kRmsNorm = "kernel_ladder.native.rms_norm";
constexpr const char* kRmsNormBackward = "kernel_ladder.native.rms_norm (backward)";
constexpr const char* kSoftmax = "kernel_ladder.native.softmax";
constexpr const char* kSoftmaxBackward = "kernel_ladder.native.softmax (backward)";

// "torch.float32" for a dtype, as Python prints it.
std::string dtype_name(at::ScalarType dtype);

// The dtype the statistics are kept in: float64 for float64 inputs, float32 for the others.
inline at::ScalarType accumulate_dtype(at::ScalarType dtype) {
  return dtype == at::kDouble ? at::kDouble : at::kFloat;
}

// x (..., C) of a supported float dtype, weight (C,) of x's dtype and device, eps finite and >= 0.
void check_rms_norm_forward(const char* op, const at::Tensor& x, const at::Tensor& weight, double eps);
// grad_y like x; x and weight as in the forward; rstd of shape x.shape[:-1] in x's accumulate dtype.
void check_rms_norm_backward(const char* op, const at::Tensor& grad_y, const at::Tensor& x,
                             const at::Tensor& weight, const at::Tensor& rstd);
// x (..., C) of a supported float dtype.
void check_softmax_forward(const char* op, const at::Tensor& x);
// grad_y and y of one shape, dtype and device.
void check_softmax_backward(const char* op, const at::Tensor& grad_y, const at::Tensor& y);

// Empty outputs of the right shapes (symbolic sizes: usable by the Meta kernels).
std::tuple<at::Tensor, at::Tensor> empty_rms_norm_outputs(const at::Tensor& x);

}  // namespace kernel_ladder_native
