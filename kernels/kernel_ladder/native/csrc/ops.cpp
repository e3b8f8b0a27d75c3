// The operators' schemas (TORCH_LIBRARY), and the kernels that are the same for every backend.
//
// Four backend ops do the work, one kernel per backend key (CPU: cpu/*.cpp, Meta: meta.cpp,
// CUDA: cuda/ops_cuda.cu):
//   rms_norm_forward, rms_norm_backward, softmax_forward, softmax_backward.
// Two user-facing ops, rms_norm and softmax, have:
//   - an Autograd kernel (autograd.cpp): a torch::autograd::Function whose forward calls the backend
//     forward below the autograd keys and whose backward calls the backend backward;
//   - a CompositeExplicitAutograd kernel (here): the forward alone, for calls that reach the op below
//     the autograd keys (inference_mode) and for every backend at once (CPU, CUDA, Meta).
// The backend ops themselves are not differentiable: their Autograd kernel is torch's
// "not implemented" fallback, so differentiating through one (a double backward) fails with an error
// naming the op when the gradient is asked for, and never silently gives zero.
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include "native.h"

namespace kernel_ladder_native {

namespace {

at::Tensor rms_norm_composite(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rms_norm_forward(kRmsNorm, x, weight, eps);
  static auto forward = c10::Dispatcher::singleton()
                            .findSchemaOrThrow("kernel_ladder_native::rms_norm_forward", "")
                            .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, double)>();
  return std::get<0>(forward.call(x, weight, eps));
}

at::Tensor softmax_composite(const at::Tensor& x) {
  check_softmax_forward(kSoftmax, x);
  static auto forward = c10::Dispatcher::singleton()
                            .findSchemaOrThrow("kernel_ladder_native::softmax_forward", "")
                            .typed<at::Tensor(const at::Tensor&)>();
  return forward.call(x);
}

}  // namespace

TORCH_LIBRARY(kernel_ladder_native, m) {
  m.def("rms_norm_forward(Tensor x, Tensor weight, float eps) -> (Tensor y, Tensor rstd)");
  m.def("rms_norm_backward(Tensor grad_y, Tensor x, Tensor weight, Tensor rstd) -> (Tensor grad_x, Tensor grad_weight)");
  m.def("softmax_forward(Tensor x) -> Tensor");
  m.def("softmax_backward(Tensor grad_y, Tensor y) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("softmax(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(kernel_ladder_native, CompositeExplicitAutograd, m) {
  m.impl("rms_norm", &rms_norm_composite);
  m.impl("softmax", &softmax_composite);
}

TORCH_LIBRARY_IMPL(kernel_ladder_native, Autograd, m) {
  for (const char* op : {"rms_norm_forward", "rms_norm_backward", "softmax_forward", "softmax_backward"}) {
    m.impl(op, torch::autograd::autogradNotImplementedFallback());
  }
}

}  // namespace kernel_ladder_native
