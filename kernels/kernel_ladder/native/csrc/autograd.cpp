// The Autograd kernels of the user-facing ops: torch::autograd::Function subclasses.
//
// forward runs with autograd off and calls the backend forward op below the autograd keys
// (AutoDispatchBelowADInplaceOrView), so the dispatcher goes straight to the CPU, CUDA or Meta
// kernel; it saves what the backward needs (x, weight and the per-row rstd for RMSNorm, the output
// y for softmax). backward calls the backend backward op. Both calls go through the dispatcher, so
// torch.compile's tracer sees the backend ops as nodes of the forward and backward graphs.
#include <torch/autograd.h>
#include <torch/library.h>

#include "native.h"

namespace kernel_ladder_native {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

const auto& rms_norm_forward_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("kernel_ladder_native::rms_norm_forward", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, double)>();
  return op;
}

const auto& rms_norm_backward_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("kernel_ladder_native::rms_norm_backward", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                 const at::Tensor&, const at::Tensor&)>();
  return op;
}

const auto& softmax_forward_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("kernel_ladder_native::softmax_forward", "")
                       .typed<at::Tensor(const at::Tensor&)>();
  return op;
}

const auto& softmax_backward_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("kernel_ladder_native::softmax_backward", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  return op;
}

struct RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, double eps) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [y, rstd] = rms_norm_forward_op().call(x, weight, eps);
    ctx->save_for_backward({x, weight, rstd});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto [grad_x, grad_weight] = rms_norm_backward_op().call(grads[0], saved[0], saved[1], saved[2]);
    return {grad_x, grad_weight, at::Tensor()};
  }
};

struct SoftmaxFunction : public torch::autograd::Function<SoftmaxFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto y = softmax_forward_op().call(x);
    ctx->save_for_backward({y});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    return {softmax_backward_op().call(grads[0], saved[0])};
  }
};

at::Tensor rms_norm_autograd(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rms_norm_forward(kRmsNorm, x, weight, eps);
  return RmsNormFunction::apply(x, weight, eps);
}

at::Tensor softmax_autograd(const at::Tensor& x) {
  check_softmax_forward(kSoftmax, x);
  return SoftmaxFunction::apply(x);
}

}  // namespace

TORCH_LIBRARY_IMPL(kernel_ladder_native, Autograd, m) {
  m.impl("rms_norm", &rms_norm_autograd);
  m.impl("softmax", &softmax_autograd);
}

}  // namespace kernel_ladder_native
