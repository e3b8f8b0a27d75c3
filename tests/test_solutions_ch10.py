"""Chapter 10's solutions pass the checker on fresh inputs; wrong variants of each do not.

Each exercise is checked as the notebook checks it (the same givens from
``solutions.ch10_integration``: cases, candidate wrappers, references, diagnoses), once with the
solution (SOLVED) and once per negative control — a plausible wrong answer the checker must reject,
with the diagnosis it must give.
"""

from __future__ import annotations

import pytest
import torch

from solutions import ch10_integration as given
from utils.exercises import check

pytestmark = pytest.mark.interpreter


def rejected(verdict, diagnosis: str) -> bool:
    """NOT SOLVED, saying ``diagnosis`` (the verdict's lines are wrapped: compared with single spaces)."""
    return not verdict.solved and diagnosis in " ".join(verdict.message.split())


# ----------------------------------------------------------------------------------------------
# Exercise 1: write the fake of ch10::quantize_rows
# ----------------------------------------------------------------------------------------------


def check_quantize_fake(fake):
    return check("ch10.quantize_rows_fake", given.fake_report("quantize_rows", fake),
                 given.real_report("quantize_rows"), given.fake_cases_batched, compare=given.diagnose_fake)


def test_quantize_rows_fake_solved():
    assert check_quantize_fake(given.quantize_rows_fake).solved


def _scale_keepdim(x):
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


def _q_in_x_dtype(x):
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


def _scale_of_first_dim(x):
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty(x.shape[:1], dtype=torch.float32)


def _reads_values(x):
    rows = int((x.abs() > 0).sum().item())  # data-dependent: no values under fake tensors
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty(rows, dtype=torch.float32)


def _only_q(x):
    return (x.new_empty(x.shape, dtype=torch.int8),)


def _stub(x):
    raise NotImplementedError


def _no_device(x):  # torch.empty without device=: a CPU tensor whatever x's device
    return torch.empty(x.shape, dtype=torch.int8), torch.empty(x.shape[:-1], dtype=torch.float32)


def _reads_x_for_the_scale(x):  # right metadata, but a fake has no values to read
    return x.new_empty(x.shape, dtype=torch.int8), x.float().abs().amax(-1) / 127


@pytest.mark.parametrize("fake, diagnosis", [
    (_reads_x_for_the_scale, "aten.abs, aten.amax, aten.div: a fake must not read"),
    (_reads_x_for_the_scale, "the fake ran aten."),
    (_no_device, "output 0: the fake says device cpu, the kernel returns cuda (x's device)"),
    (_scale_keepdim, "a trailing dimension of 1 kept"),
    (_q_in_x_dtype, "output 0: the fake says dtype float"),
    (_scale_of_first_dim, "the fake says shape (2,), the kernel returns (2, 3): only the first dimension kept"),
    (_reads_values, "raised"),
    (_only_q, "the fake must return 2 tensors (q, scale), got tuple of 1"),
    (_stub, "not implemented yet"),
])
def test_quantize_rows_fake_wrong_variants_rejected(fake, diagnosis):
    verdict = check_quantize_fake(fake)
    assert rejected(verdict, diagnosis), verdict.message


# ----------------------------------------------------------------------------------------------
# Exercise 2: fix the fake of ch10::scale_rows
# ----------------------------------------------------------------------------------------------


def check_scale_fake(fake):
    return check("ch10.scale_rows_fake", given.fake_report("scale_rows", fake), given.real_report("scale_rows"),
                 given.fake_cases, compare=given.diagnose_fake)


def test_scale_rows_fake_solved():
    assert check_scale_fake(given.scale_rows_fake).solved


def test_the_given_fake_is_wrong_only_in_its_strides_for_a_transposed_input():
    verdict = check_scale_fake(given.scale_rows_fake_given)
    assert rejected(verdict, "layout='transposed'") and rejected(verdict, "the fake says strides"), verdict.message


def test_opcheck_itself_rejects_the_given_fake():
    x = torch.randn(6, 4).t()  # (4, 6), transposed
    with given.installed(scale_rows_fake=given.scale_rows_fake_given):
        result = torch.library.opcheck(torch.ops.ch10.scale_rows.default, (x, torch.rand(4)),
                                       raise_exception=False)
    assert result["test_faketensor"] != "SUCCESS" or result["test_aot_dispatch_dynamic"] != "SUCCESS", result
    fixed = torch.library.opcheck(torch.ops.ch10.scale_rows.default, (x, torch.rand(4)), raise_exception=False)
    assert all(outcome == "SUCCESS" for outcome in fixed.values()), fixed


def _always_float32(x, s):
    return x.new_empty(x.shape, dtype=torch.float32)


def _one_row_short(x, s):
    return x.new_empty((x.shape[0] - 1, x.shape[1]))


def _contiguous_but_no_device(x, s):
    return torch.empty(x.shape, dtype=x.dtype)


@pytest.mark.parametrize("fake, diagnosis", [
    (_contiguous_but_no_device, "the output: the fake says device cpu, the kernel returns cuda (x's device)"),
    (_always_float32, "the fake says dtype float32, the kernel returns float16"),
    (_one_row_short, "the output: the fake says shape"),
    (_one_row_short, "one dimension off by one"),
])
def test_scale_rows_fake_wrong_variants_rejected(fake, diagnosis):
    verdict = check_scale_fake(fake)
    assert rejected(verdict, diagnosis), verdict.message


# ----------------------------------------------------------------------------------------------
# Exercise 3: the autograd formula of ch10::scale_rows
# ----------------------------------------------------------------------------------------------


def check_autograd(setup_context, backward):
    return check("ch10.scale_rows_autograd", given.gradients_with(setup_context, backward),
                 given.gradients_reference, given.gradient_cases, compare=given.diagnose_gradients,
                 diagnose=given.explain_gradients)


def test_scale_rows_autograd_solved():
    assert check_autograd(given.scale_rows_setup_context, given.scale_rows_backward).solved


def _save_only_x(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _no_row_sum(ctx, grad_out):
    x, s = ctx.saved_tensors
    return grad_out * s[:, None], grad_out * x  # grad_s must be summed over the row


def _summed_over_rows(ctx, grad_out):
    x, s = ctx.saved_tensors
    return grad_out * s[:, None], (grad_out * x).sum(dim=0)


def _mean_not_sum(ctx, grad_out):
    x, s = ctx.saved_tensors
    return grad_out * s[:, None], (grad_out * x).mean(dim=1)


def _swapped(ctx, grad_out):
    x, s = ctx.saved_tensors
    return grad_out * x, (grad_out * s[:, None]).sum(dim=1)


def _wrong_sign(ctx, grad_out):
    x, s = ctx.saved_tensors
    return grad_out * s[:, None], -(grad_out * x).sum(dim=1)


def _grad_x_unscaled(ctx, grad_out):
    x, s = ctx.saved_tensors
    return grad_out.clone(), (grad_out * x).sum(dim=1)


def _grad_s_without_grad_out(ctx, grad_out):
    x, s = ctx.saved_tensors
    return grad_out * s[:, None], x.sum(dim=1)


def _one_gradient(ctx, grad_out):
    x, s = ctx.saved_tensors
    return grad_out * s[:, None]


def _save_output(ctx, inputs, output):
    ctx.save_for_backward(output, inputs[1])


def _x_from_output(ctx, grad_out):
    out, s = ctx.saved_tensors
    return grad_out * s[:, None], (grad_out * out / s[:, None]).sum(1)  # x = out / s: NaN where s == 0


def _tensors_as_attributes(ctx, inputs, output):
    ctx.x, ctx.s = inputs


def _reads_attributes(ctx, grad_out):
    return grad_out * ctx.s[:, None], (grad_out * ctx.x).sum(1)


def _order_swapped(ctx, grad_out):
    x, s = ctx.saved_tensors
    return (grad_out * x).sum(1), grad_out * s[:, None]


def _grad_s_none(ctx, grad_out):
    x, s = ctx.saved_tensors
    return grad_out * s[:, None], None


def _s_on_the_wrong_axis(ctx, grad_out):
    x, s = ctx.saved_tensors
    return grad_out * s, (grad_out * x).sum(1)


@pytest.mark.parametrize("setup_context, backward, diagnosis", [
    (_save_output, _x_from_output, "cause: grad_s is NaN in the rows where s = 0"),
    (_save_output, _x_from_output, "save the inputs x and s, not the output"),
    (_tensors_as_attributes, _reads_attributes, "setup_context stored tensors as ctx attributes (ctx.s, ctx.x)"),
    (_tensors_as_attributes, _reads_attributes, "ctx.save_for_backward"),
    (given.scale_rows_setup_context, _order_swapped, "the gradients are in the wrong order"),
    (given.scale_rows_setup_context, _grad_s_none, "backward returned None for s's gradient"),
    (given.scale_rows_setup_context, _s_on_the_wrong_axis, "s[:, None]"),
    (given.scale_rows_setup_context, _s_on_the_wrong_axis, "broadcasts along the columns"),
    (_save_only_x, given.scale_rows_backward, "setup_context saved 1 tensor, the backward reads 2: save both x and s"),
    (given.scale_rows_setup_context, _no_row_sum,
     "grad_s has shape (1, 1), s has shape (1,): sum grad_out * x over each row (dim=1)"),
    (given.scale_rows_setup_context, _summed_over_rows,
     "grad_s has shape (7,), s has shape (3,): summed over the rows (dim=0) instead of along each row (dim=1)"),
    (given.scale_rows_setup_context, _mean_not_sum, "cause: grad_s is the mean over each row, not the sum"),
    (given.scale_rows_setup_context, _swapped, "cause: x and s swapped"),
    (given.scale_rows_setup_context, _wrong_sign, "cause: grad_s has the wrong sign"),
    (given.scale_rows_setup_context, _grad_x_unscaled, "cause: grad_x is grad_out unscaled"),
    (given.scale_rows_setup_context, _grad_s_without_grad_out, "cause: grad_s sums x alone"),
    (given.scale_rows_setup_context, _one_gradient, "backward returned 1 value: return (grad_x, grad_s)"),
])
def test_scale_rows_autograd_wrong_variants_rejected(setup_context, backward, diagnosis):
    verdict = check_autograd(setup_context, backward)
    assert rejected(verdict, diagnosis), verdict.message


def test_a_failed_check_leaves_the_solutions_installed():
    check_autograd(given.scale_rows_setup_context, _wrong_sign)
    check_scale_fake(given.scale_rows_fake_given)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    s = torch.rand(3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(given.scale_rows, (x, s))
    assert given.scale_rows(x.detach().t().contiguous().t(), s.detach()).is_contiguous()


def test_installed_names_an_unknown_registration():
    with pytest.raises(ValueError, match="unknown registration"), given.installed(scale_rows_forward=len):
        pass


def test_double_backward_stays_unsupported_for_the_library_ops_with_a_clear_error():
    import kernel_ladder

    x = torch.randn(4, 8, requires_grad=True)
    (grad,) = torch.autograd.grad(kernel_ladder.gelu(x).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        grad.sum().backward()


# ----------------------------------------------------------------------------------------------
# Exercise 4: the launch path without its host sync
# ----------------------------------------------------------------------------------------------


def check_nosync(function):
    return check("ch10.embedding_rows_nosync", given.embedding_checked(function), given.embedding_reference,
                 given.embedding_cases, compare=given.diagnose_embedding)


def test_embedding_rows_nosync_solved():
    assert check_nosync(given.embedding_rows_nosync).solved


def test_the_given_launch_path_syncs_and_the_check_names_the_function():
    verdict = check_nosync(given.embedding_rows)
    assert rejected(verdict, "HostSyncError") and rejected(verdict, "_ids_in_range ("), verdict.message


def _sync_in_an_if(table, ids):
    if (ids < 0).any():  # bool(tensor): a sync too
        raise ValueError("negative id")
    return given.embedding_rows_nosync(table, ids)


def _drops_the_flag(table, ids):
    out, _ = given.embedding_rows_nosync(table, ids)
    return out, torch.ones(1, dtype=torch.int32)


def _torch_gather_with_sync(table, ids):
    return table[ids[: int(ids.numel())]], torch.zeros(1, dtype=torch.int32, device=table.device) + int(ids.max() < 0)


def _gathers_without_counting(table, ids):
    # No sync, right rows for valid ids, but out-of-range ids neither zeroed nor counted.
    rows = table[ids.clamp(0, table.shape[0] - 1)]
    return rows, torch.zeros(1, dtype=torch.int32, device=table.device)


def _without(*kept: str):
    """``embedding_rows_nosync`` with only the metadata checks named in ``kept``."""

    def function(table, ids):
        if "rank" in kept and (table.dim() != 2 or ids.dim() != 1):
            raise ValueError("ch10.embedding_rows: expected table (V, D) and ids (T,)")
        if "dtype" in kept and ids.dtype not in (torch.int32, torch.int64):
            raise ValueError("ch10.embedding_rows: ids must be int32 or int64")
        if "strides" in kept and table.stride(1) != 1:
            raise ValueError("ch10.embedding_rows: table's rows must be contiguous")
        bad = torch.zeros(1, dtype=torch.int32, device=table.device)
        return given._launch_embedding(table, ids, bad), bad

    return function


@pytest.mark.parametrize("function, diagnosis", [
    (_without("rank", "dtype", "strides"), None),
    (_without(), "the rank check is gone"),
    (_without("rank", "strides"), "the dtype check is gone: it accepted ids of dtype float32"),
    (_without("rank", "dtype"), "the strides check is gone"),
])
def test_embedding_rows_metadata_checks_are_required(function, diagnosis):
    verdict = check_nosync(function)
    if diagnosis is None:
        assert verdict.solved, verdict.message
    else:
        assert rejected(verdict, diagnosis), verdict.message


def _type_error_for_float_ids(table, ids):
    if ids.dtype not in (torch.int32, torch.int64):
        raise TypeError("ids must be int32 or int64")
    return given.embedding_rows_nosync(table, ids)


@pytest.mark.parametrize("function, diagnosis", [
    (_type_error_for_float_ids, "the dtype check raised TypeError, the spec asks for a ValueError"),
    (_sync_in_an_if, "_sync_in_an_if ("),
    (_drops_the_flag, "bad is [1], expected [0]"),
    (_torch_gather_with_sync, "HostSyncError"),
    (_gathers_without_counting, "case 3 of 6"),
])
def test_embedding_rows_wrong_variants_rejected(function, diagnosis):
    verdict = check_nosync(function)
    assert rejected(verdict, diagnosis), verdict.message


def test_the_sync_free_version_still_reports_bad_ids_on_the_device():
    table = torch.randn(5, 3)
    out, bad = given.embedding_rows_nosync(table, torch.tensor([0, 7, -1, 4]))
    assert int(bad) == 2 and torch.equal(out[1], torch.zeros(3)) and torch.equal(out[3], table[4])
    with pytest.raises(ValueError, match=r"ch10.embedding_rows: ids must lie in \[0, 5\)"):
        given.embedding_rows(table, torch.tensor([0, 7]))
