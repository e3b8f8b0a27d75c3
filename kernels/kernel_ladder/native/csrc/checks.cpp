// The argument checks shared by every backend (see native.h).
#include "native.h"

#include <cmath>
#include <sstream>

namespace kernel_ladder_native {

std::string dtype_name(at::ScalarType dtype) {
  return "torch." + std::string(c10::getDtypeNames(dtype).first);
}

namespace {

bool supported_dtype(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16;
}

std::string shape_of(const at::Tensor& t) {
  std::ostringstream out;
  out << "(";
  auto sizes = t.sym_sizes();
  for (size_t i = 0; i < sizes.size(); ++i) {
    out << sizes[i] << (sizes.size() == 1 ? "," : (i + 1 < sizes.size() ? ", " : ""));
  }
  out << ")";
  return out.str();
}

void check_input(const char* op, const char* name, const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.defined(), op, ": ", name, " must be a tensor, got None");
  TORCH_CHECK_VALUE(x.dim() >= 1, op, ": ", name,
                    " must have at least one dim (the normalized one), got a 0-d tensor");
  TORCH_CHECK_TYPE(supported_dtype(x.scalar_type()), op, ": ", name,
                   " must be torch.float32, torch.float64, torch.float16 or torch.bfloat16, got ",
                   dtype_name(x.scalar_type()));
}

void check_like(const char* op, const char* name, const at::Tensor& t, const char* ref_name, const at::Tensor& ref) {
  TORCH_CHECK_VALUE(t.defined(), op, ": ", name, " must be a tensor, got None");
  TORCH_CHECK_VALUE(t.sym_sizes() == ref.sym_sizes(), op, ": ", name, " must have ", ref_name, "'s shape ",
                    shape_of(ref), ", got ", shape_of(t));
  TORCH_CHECK_TYPE(t.scalar_type() == ref.scalar_type(), op, ": ", name, " must have ", ref_name, "'s dtype ",
                   dtype_name(ref.scalar_type()), ", got ", dtype_name(t.scalar_type()));
  TORCH_CHECK_VALUE(t.device() == ref.device(), op, ": ", name, " must be on ", ref_name, "'s device ",
                    ref.device(), ", got ", t.device());
}

void check_weight(const char* op, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK_VALUE(weight.defined(), op, ": weight must be a tensor of shape (C,), got None");
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.sym_size(0) == x.sym_size(-1), op,
                    ": weight must have shape (", x.sym_size(-1), ",) (x's last dim), got ", shape_of(weight));
  TORCH_CHECK_TYPE(weight.scalar_type() == x.scalar_type(), op, ": weight must have x's dtype ",
                   dtype_name(x.scalar_type()), ", got ", dtype_name(weight.scalar_type()));
  TORCH_CHECK_VALUE(weight.device() == x.device(), op, ": weight must be on x's device ", x.device(), ", got ",
                    weight.device());
}

}  // namespace

void check_rms_norm_forward(const char* op, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_input(op, "x", x);
  check_weight(op, x, weight);
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0.0, op, ": eps must be a finite number >= 0, got ", eps);
}

void check_rms_norm_backward(const char* op, const at::Tensor& grad_y, const at::Tensor& x,
                             const at::Tensor& weight, const at::Tensor& rstd) {
  check_input(op, "x", x);
  check_like(op, "grad_y", grad_y, "x", x);
  check_weight(op, x, weight);
  TORCH_CHECK_VALUE(rstd.defined(), op, ": rstd must be a tensor, got None");
  auto rows = x.sym_sizes().slice(0, x.dim() - 1);
  TORCH_CHECK_VALUE(rstd.sym_sizes() == rows, op, ": rstd must have shape x.shape[:-1], got ", shape_of(rstd));
  const auto acc = accumulate_dtype(x.scalar_type());
  TORCH_CHECK_TYPE(rstd.scalar_type() == acc, op, ": rstd must be ", dtype_name(acc), " for x of ",
                   dtype_name(x.scalar_type()), ", got ", dtype_name(rstd.scalar_type()));
  TORCH_CHECK_VALUE(rstd.device() == x.device(), op, ": rstd must be on x's device ", x.device(), ", got ",
                    rstd.device());
}

void check_softmax_forward(const char* op, const at::Tensor& x) { check_input(op, "x", x); }

void check_softmax_backward(const char* op, const at::Tensor& grad_y, const at::Tensor& y) {
  check_input(op, "y", y);
  check_like(op, "grad_y", grad_y, "y", y);
}

std::tuple<at::Tensor, at::Tensor> empty_rms_norm_outputs(const at::Tensor& x) {
  auto y = at::empty_symint(x.sym_sizes(), x.options());
  auto rstd = at::empty_symint(x.sym_sizes().slice(0, x.dim() - 1),
                               x.options().dtype(accumulate_dtype(x.scalar_type())));
  return {y, rstd};
}

}  // namespace kernel_ladder_native
