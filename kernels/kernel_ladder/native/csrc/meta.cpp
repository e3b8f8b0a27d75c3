// Meta kernels of the backend ops: the same checks as the real kernels, then empty outputs of the
// right shapes and dtypes, on symbolic sizes. FakeTensor (torch.compile, torch.library.opcheck)
// runs these instead of the computation.
#include <torch/library.h>

#include "native.h"

namespace kernel_ladder_native {

namespace {

std::tuple<at::Tensor, at::Tensor> rms_norm_forward_meta(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rms_norm_forward(kRmsNorm, x, weight, eps);
  return empty_rms_norm_outputs(x);
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_meta(const at::Tensor& grad_y, const at::Tensor& x,
                                                          const at::Tensor& weight, const at::Tensor& rstd) {
  check_rms_norm_backward(kRmsNormBackward, grad_y, x, weight, rstd);
  return {at::empty_symint(x.sym_sizes(), x.options()), at::empty_symint(weight.sym_sizes(), weight.options())};
}

at::Tensor softmax_forward_meta(const at::Tensor& x) {
  check_softmax_forward(kSoftmax, x);
  return at::empty_symint(x.sym_sizes(), x.options());
}

at::Tensor softmax_backward_meta(const at::Tensor& grad_y, const at::Tensor& y) {
  check_softmax_backward(kSoftmaxBackward, grad_y, y);
  return at::empty_symint(y.sym_sizes(), y.options());
}

}  // namespace

TORCH_LIBRARY_IMPL(kernel_ladder_native, Meta, m) {
  m.impl("rms_norm_forward", &rms_norm_forward_meta);
  m.impl("rms_norm_backward", &rms_norm_backward_meta);
  m.impl("softmax_forward", &softmax_forward_meta);
  m.impl("softmax_backward", &softmax_backward_meta);
}

}  // namespace kernel_ladder_native
