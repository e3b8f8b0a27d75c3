"""Chapter 10's solutions pass the checker on fresh inputs; wrong variants of each do not.

Each exercise is checked as the notebook checks it (the same givens from
``solutions.ch10_integration``: cases, candidate wrappers, references, diagnoses), once with the
solution (SOLVED) and once per negative control — a plausible wrong answer the checker must reject,
with the diagnosis it must give.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import triton
import triton.language as tl

from solutions import ch10_integration as given
from utils.exercises import check
from utils.exercises.sass_loop import loop_report

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


# ----------------------------------------------------------------------------------------------
# Exercise 5: remove the integer overhead of a loop, read from its sm_90 SASS
# ----------------------------------------------------------------------------------------------

needs_sm90 = pytest.mark.skipif(not importlib.util.find_spec("triton.backends.nvidia"),
                                reason="Triton's NVIDIA backend (ptxas, nvdisasm) is needed to compile for sm_90")


def check_bias_grad(kernel, values_only=False):
    def values(gen):
        return [case for case in given.bias_grad_cases(gen) if isinstance(case[0], torch.Tensor)]

    cases = values if values_only else given.bias_grad_cases
    return check("ch10.bias_grad_kernel", given.bias_grad_checked(kernel), given.bias_grad_reference, cases,
                 compare=given.diagnose_bias_grad, diagnose=given.explain_bias_grad)


def sm90_loop(kernel):
    return loop_report(kernel, given._bias_grad_spec())


@triton.jit
def hoisted_but_masked_kernel(x_ptr, out_ptr, B, T, D, stride_b, stride_t, stride_d,
                              BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # No division, pointers advanced; but the row mask is evaluated on every tile.
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    rows = tl.arange(0, BLOCK_R)
    tile = rows.to(tl.int64)[:, None] * stride_t + cols.to(tl.int64)[None, :] * stride_d
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    batch_ptr = x_ptr
    for _ in range(0, B):
        ptrs = batch_ptr + tile
        for start in range(0, T, BLOCK_R):
            acc += tl.load(ptrs, mask=((start + rows)[:, None] < T) & (cols[None, :] < D), other=0.0)
            ptrs += BLOCK_R * stride_t.to(tl.int64)
        batch_ptr += stride_b
    tl.store(out_ptr + cols, tl.sum(acc, axis=0), mask=cols < D)


@triton.jit
def addresses_rebuilt_kernel(x_ptr, out_ptr, B, T, D, stride_b, stride_t, stride_d,
                             BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # No division (a loop per b), but every address rebuilt from the strides in 64 bits, every tile masked.
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    rows = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for b in range(0, B):
        for start in range(0, T, BLOCK_R):
            t = start + rows
            offsets = (tl.full((), 0, tl.int64) + b) * stride_b + t.to(tl.int64)[:, None] * stride_t \
                + cols.to(tl.int64)[None, :] * stride_d
            acc += tl.load(x_ptr + offsets, mask=(t[:, None] < T) & (cols[None, :] < D), other=0.0)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0), mask=cols < D)


@triton.jit
def no_row_mask_kernel(x_ptr, out_ptr, B, T, D, stride_b, stride_t, stride_d,
                       BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # The lean loop, with the partial tile loaded whole: rows past T read the next b (or past the end).
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    rows = tl.arange(0, BLOCK_R)
    tile = rows.to(tl.int64)[:, None] * stride_t + cols.to(tl.int64)[None, :] * stride_d
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    batch_ptr = x_ptr
    for _ in range(0, B):
        ptrs = batch_ptr + tile
        for _ in range(0, T, BLOCK_R):
            acc += tl.load(ptrs, mask=cols[None, :] < D, other=0.0)
            ptrs += BLOCK_R * stride_t.to(tl.int64)
        batch_ptr += stride_b
    tl.store(out_ptr + cols, tl.sum(acc, axis=0), mask=cols < D)


@triton.jit
def tail_dropped_kernel(x_ptr, out_ptr, B, T, D, stride_b, stride_t, stride_d,
                        BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # Whole tiles only: the T % BLOCK_R last rows of each b are never added.
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    rows = tl.arange(0, BLOCK_R)
    tile = rows.to(tl.int64)[:, None] * stride_t + cols.to(tl.int64)[None, :] * stride_d
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    batch_ptr = x_ptr
    for _ in range(0, B):
        ptrs = batch_ptr + tile
        for _ in range(0, T - T % BLOCK_R, BLOCK_R):
            acc += tl.load(ptrs, mask=cols[None, :] < D, other=0.0)
            ptrs += BLOCK_R * stride_t.to(tl.int64)
        batch_ptr += stride_b
    tl.store(out_ptr + cols, tl.sum(acc, axis=0), mask=cols < D)


@triton.jit
def sum_in_the_loop_kernel(x_ptr, out_ptr, B, T, D, stride_b, stride_t, stride_d,
                           BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # Right, few integer instructions, but each tile is reduced across warps inside the loop.
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    rows = tl.arange(0, BLOCK_R)
    tile = rows.to(tl.int64)[:, None] * stride_t + cols.to(tl.int64)[None, :] * stride_d
    acc = tl.zeros([BLOCK_D], tl.float32)
    whole = T - T % BLOCK_R
    batch_ptr = x_ptr
    for _ in range(0, B):
        ptrs = batch_ptr + tile
        for _ in range(0, whole, BLOCK_R):
            acc += tl.sum(tl.load(ptrs, mask=cols[None, :] < D, other=0.0), axis=0)
            ptrs += BLOCK_R * stride_t.to(tl.int64)
        acc += tl.sum(tl.load(ptrs, mask=(rows[:, None] < T - whole) & (cols[None, :] < D), other=0.0), axis=0)
        batch_ptr += stride_b
    tl.store(out_ptr + cols, acc, mask=cols < D)


@triton.jit
def _tile_sum(ptrs, mask):
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def uses_a_helper_kernel(x_ptr, out_ptr, B, T, D, stride_b, stride_t, stride_d,
                         BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # Right in the interpreter; compiled alone, _tile_sum is not there.
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    rows = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for b in range(0, B):
        for start in range(0, T, BLOCK_R):
            ptrs = x_ptr + b * stride_b + (start + rows)[:, None] * stride_t + cols[None, :] * stride_d
            acc += _tile_sum(ptrs, ((start + rows)[:, None] < T) & (cols[None, :] < D))
    tl.store(out_ptr + cols, tl.sum(acc, axis=0), mask=cols < D)


@triton.jit
def one_tile_kernel(x_ptr, out_ptr, B, T, D, stride_b, stride_t, stride_d,
                    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # No loop at all: the first tile of the first b only.
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    rows = tl.arange(0, BLOCK_R)
    tile = tl.load(x_ptr + rows[:, None] * stride_t + cols[None, :] * stride_d,
                   mask=(rows[:, None] < T) & (cols[None, :] < D), other=0.0)
    tl.store(out_ptr + cols, tl.sum(tile, axis=0), mask=cols < D)


# The gaming attempts a learner found, each right in the interpreter and passing the first version
# of the check: they must fail its loop rules now.


@triton.jit
def never_run_lean_loop_kernel(x_ptr, out_ptr, B, T, D, stride_b, stride_t, stride_d,
                               BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # A lean loop that loads three tiles per pass but never runs (D is never that large), beside the
    # given flat loop, which does the work with its // and % per row.
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    lean = x_ptr + tl.arange(0, BLOCK_R)[:, None] * stride_t + cols[None, :] * stride_d
    for _ in range(0, (D > 2000000000) * T, BLOCK_R):
        acc += tl.load(lean) + tl.load(lean + stride_b) + tl.load(lean + 2 * stride_b)
        lean += BLOCK_R * stride_t.to(tl.int64)
    for start in range(0, B * T, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        offsets = ((rows // T).to(tl.int64)[:, None] * stride_b + (rows % T).to(tl.int64)[:, None] * stride_t
                   + cols.to(tl.int64)[None, :] * stride_d)
        acc += tl.load(x_ptr + offsets, mask=(rows[:, None] < B * T) & (cols[None, :] < D), other=0.0)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0), mask=cols < D)


@triton.jit
def division_in_the_outer_loop_kernel(x_ptr, out_ptr, B, T, D, stride_b, stride_t, stride_d,
                                      BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # The division moved to an outer loop whose inner loop runs once per pass (a trip count only known
    # at run time): the innermost loop looks lean, the outer one does all the integer work per tile.
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    once = 1 + (D < 0)
    for start in range(0, B * T, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        offsets = ((rows // T).to(tl.int64)[:, None] * stride_b + (rows % T).to(tl.int64)[:, None] * stride_t
                   + cols.to(tl.int64)[None, :] * stride_d)
        ptrs = x_ptr + offsets
        for _ in range(0, once):
            acc += tl.load(ptrs, mask=(rows[:, None] < B * T) & (cols[None, :] < D), other=0.0)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0), mask=cols < D)


@triton.jit
def padded_with_adds_kernel(x_ptr, out_ptr, B, T, D, stride_b, stride_t, stride_d,
                            BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # The given loop, padded with FP32 adds whose result is thrown away: more "tiles" by an FADD count.
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    pad = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for start in range(0, B * T, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        offsets = ((rows // T).to(tl.int64)[:, None] * stride_b + (rows % T).to(tl.int64)[:, None] * stride_t
                   + cols.to(tl.int64)[None, :] * stride_d)
        acc += tl.load(x_ptr + offsets, mask=(rows[:, None] < B * T) & (cols[None, :] < D), other=0.0)
        for k in tl.static_range(8):
            pad = pad + (k + 1.0)
    tl.store(out_ptr + cols, tl.sum(acc + pad * 0.0, axis=0), mask=cols < D)


@triton.jit
def float_reciprocal_kernel(x_ptr, out_ptr, B, T, D, stride_b, stride_t, stride_d,
                            BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # b = floor(row * (1/T)) in fp32: no integer division, but 1/T is rounded, and row * (1/T) lands just
    # below an integer for some rows (T = 41: row 41 gives 0.99999994): those rows are read from the wrong b.
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < D
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    inverse = 1.0 / T.to(tl.float32)
    col_ptrs = x_ptr + cols[None, :] * stride_d
    for start in range(0, B * T, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        b = tl.floor(rows.to(tl.float32) * inverse)
        offsets = (b * stride_b + (rows.to(tl.float32) - b * T) * stride_t).to(tl.int32)
        acc += tl.load(col_ptrs + offsets[:, None], mask=(rows[:, None] < B * T) & col_mask[None, :], other=0.0)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0), mask=col_mask)


@triton.jit
def float_division_corrected_kernel(x_ptr, out_ptr, B, T, D, stride_b, stride_t, stride_d,
                                    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # The fp32 division with a correction step: right (below 2^24 rows), the integer work now in FP32
    # (FMUL, FRND, FSETP, FSEL, F2I), and per-row offsets that lose the 128-bit loads.
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < D
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    length = T.to(tl.float32)
    inverse = 1.0 / length
    col_ptrs = x_ptr + cols[None, :] * stride_d
    row = tl.arange(0, BLOCK_R).to(tl.float32)
    for start in range(0, B * T, BLOCK_R):
        b = tl.floor(row * inverse)
        t = row - b * length
        b = tl.where(t >= length, b + 1.0, tl.where(t < 0.0, b - 1.0, b))
        t = tl.where(t >= length, t - length, tl.where(t < 0.0, t + length, t))
        offsets = (b * stride_b.to(tl.float32) + t * stride_t.to(tl.float32)).to(tl.int32)
        acc += tl.load(col_ptrs + offsets[:, None], mask=(start + tl.arange(0, BLOCK_R) < B * T)[:, None]
                       & col_mask[None, :], other=0.0)
        row += BLOCK_R
    tl.store(out_ptr + cols, tl.sum(acc, axis=0), mask=col_mask)


@triton.jit
def lean_only_for_unit_stride_kernel(x_ptr, out_ptr, B, T, D, stride_b, stride_t, stride_d,
                                     BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # A lean path under `if stride_d == 1` (all a contiguous compile keeps), the given loop otherwise.
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    if stride_d == 1:
        rows = tl.arange(0, BLOCK_R)
        batch_ptr = x_ptr
        for _ in range(0, B):
            ptrs = batch_ptr + rows.to(tl.int64)[:, None] * stride_t + cols[None, :]
            for start in range(0, T, BLOCK_R):
                acc += tl.load(ptrs, mask=(rows[:, None] < T - start) & (cols[None, :] < D), other=0.0)
                ptrs += BLOCK_R * stride_t.to(tl.int64)
            batch_ptr += stride_b
    else:
        for start in range(0, B * T, BLOCK_R):
            rows = start + tl.arange(0, BLOCK_R)
            offsets = ((rows // T).to(tl.int64)[:, None] * stride_b + (rows % T).to(tl.int64)[:, None] * stride_t
                       + cols.to(tl.int64)[None, :] * stride_d)
            acc += tl.load(x_ptr + offsets, mask=(rows[:, None] < B * T) & (cols[None, :] < D), other=0.0)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0), mask=cols < D)


@triton.jit
def batch_offset_in_32_bits_kernel(x_ptr, out_ptr, B, T, D, stride_b, stride_t, stride_d,
                                   BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # Lean, right at these sizes; but b * stride_b is an i32 product that wraps once x passes 2^31 elements.
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    rows = tl.arange(0, BLOCK_R)
    col_mask = cols < D
    tile = rows.to(tl.int64)[:, None] * stride_t + cols.to(tl.int64)[None, :] * stride_d
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    whole = T - T % BLOCK_R
    for b in range(0, B):
        ptrs = x_ptr + (b * stride_b + tile)
        for _ in range(0, whole, BLOCK_R):
            acc += tl.load(ptrs, mask=col_mask[None, :], other=0.0)
            ptrs += BLOCK_R * stride_t.to(tl.int64)
        acc += tl.load(ptrs, mask=(rows[:, None] < T - whole) & col_mask[None, :], other=0.0)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0), mask=col_mask)


@triton.jit
def swapped_strides_kernel(x_ptr, out_ptr, B, T, D, stride_b, stride_t, stride_d,
                           BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # The lean loop with stride_t and stride_d exchanged: it sums x over d, not over t.
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    rows = tl.arange(0, BLOCK_R)
    col_mask = cols < D
    tile = rows.to(tl.int64)[:, None] * stride_d + cols.to(tl.int64)[None, :] * stride_t
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    whole = T - T % BLOCK_R
    batch_ptr = x_ptr
    for _ in range(0, B):
        ptrs = batch_ptr + tile
        for _ in range(0, whole, BLOCK_R):
            acc += tl.load(ptrs, mask=col_mask[None, :], other=0.0)
            ptrs += BLOCK_R * stride_d.to(tl.int64)
        acc += tl.load(ptrs, mask=(rows[:, None] < T - whole) & col_mask[None, :], other=0.0)
        batch_ptr += stride_b
    tl.store(out_ptr + cols, tl.sum(acc, axis=0), mask=col_mask)


@triton.jit
def pointer_advanced_in_64_bits_kernel(x_ptr, out_ptr, B, T, D, stride_b, stride_t, stride_d,
                                       BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # Clean, and safe past 2^31 elements everywhere: int64 offsets and an int64 step (two instructions per
    # 64-bit pointer advance, where an i32 step takes one).
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    rows = tl.arange(0, BLOCK_R)
    col_mask = cols < D
    tile = rows.to(tl.int64)[:, None] * stride_t + cols.to(tl.int64)[None, :] * stride_d
    step = stride_t.to(tl.int64) * BLOCK_R
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    whole = T - T % BLOCK_R
    for b in range(0, B):
        ptrs = x_ptr + stride_b.to(tl.int64) * b + tile
        for _ in range(0, whole, BLOCK_R):
            acc += tl.load(ptrs, mask=col_mask[None, :], other=0.0)
            ptrs += step
        acc += tl.load(ptrs, mask=(rows[:, None] < T - whole) & col_mask[None, :], other=0.0)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0), mask=col_mask)


@triton.jit
def pipelined_kernel(x_ptr, out_ptr, B, T, D, stride_b, stride_t, stride_d,
                     BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # The lean loop, software-pipelined: tiles staged through shared memory with cp.async.
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    rows = tl.arange(0, BLOCK_R)
    col_mask = cols < D
    tile = rows.to(tl.int64)[:, None] * stride_t + cols.to(tl.int64)[None, :] * stride_d
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    whole = T - T % BLOCK_R
    batch_ptr = x_ptr
    for _ in range(0, B):
        ptrs = batch_ptr + tile
        for _ in tl.range(0, whole, BLOCK_R, num_stages=3):
            acc += tl.load(ptrs, mask=col_mask[None, :], other=0.0)
            ptrs += BLOCK_R * stride_t.to(tl.int64)
        acc += tl.load(ptrs, mask=(rows[:, None] < T - whole) & col_mask[None, :], other=0.0)
        batch_ptr += stride_b
    tl.store(out_ptr + cols, tl.sum(acc, axis=0), mask=col_mask)


@triton.jit
def bias_grad_stub(x_ptr, out_ptr, B, T, D, stride_b, stride_t, stride_d,
                   BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    pass


@needs_sm90
def test_bias_grad_solved():
    verdict = check_bias_grad(given.bias_grad_kernel)
    assert verdict.solved, verdict.message


@needs_sm90
def test_pointers_advanced_with_the_mask_kept_on_every_tile_is_also_solved():
    # The bound asks for the division and the rebuilt addresses gone; the mask on every tile may stay.
    verdict = check_bias_grad(hoisted_but_masked_kernel)
    assert verdict.solved, verdict.message


@needs_sm90
def test_the_given_kernel_is_right_but_its_loop_is_named_line_by_line():
    assert check_bias_grad(given.bias_grad_flat_kernel, values_only=True).solved
    verdict = check_bias_grad(given.bias_grad_flat_kernel)
    assert rejected(verdict, "case 9 of 10: x=sm_90 compile of x (8, 1000, 4096) fp32"), verdict.message
    for said in ("instructions of overhead per tile it loads (at most 40;", "of bias_grad_flat_kernel `b = rows // T`",
                 "a runtime division or modulo",
                 "64-bit address arithmetic rebuilt each iteration",
                 "a mask or a comparison evaluated every iteration"):
        assert rejected(verdict, said), (said, verdict.message)


@needs_sm90
def test_the_loop_counts_of_the_given_kernel_and_the_solution():
    before, after = sm90_loop(given.bias_grad_flat_kernel), sm90_loop(given.bias_grad_kernel)
    assert before.error is None and after.error is None, (before.error, after.error)
    bound = given.BIAS_GRAD_BOUND
    # The same work per tile (four 128-bit loads, sixteen adds per thread; the compiler may put several
    # tiles in one pass of the solution's loop)...
    tiles = after.steady.load_bytes // bound.tile_bytes
    assert before.steady.load_bytes == bound.tile_bytes and tiles >= 1
    assert after.counts["fp32"] == bound.adds * tiles and after.counts["global"] == 4 * tiles
    assert all(op.opcode == "LDG.E.128" for op in before.steady.loads + after.steady.loads)
    # ...and the overhead: the given loop spends several times the bound, the solution well under it.
    assert before.integer_control > 3 * bound.inner, before.counts
    assert after.integer_control / tiles <= bound.inner - 5, after.overhead_opcodes()
    assert any(op.startswith("MUFU.RCP") for op in before.opcodes.get("mufu", {}))  # the division's reciprocal
    assert "mufu" not in after.counts
    assert before.spilled_bytes == 0 == after.spilled_bytes
    assert given.diagnose_loop(after, bound) is None
    strided = loop_report(given.bias_grad_kernel, given._bias_grad_strided_spec())
    assert given.diagnose_loop(strided, given.BIAS_GRAD_STRIDED_BOUND) is None


@needs_sm90
@pytest.mark.parametrize("kernel, diagnosis", [
    (addresses_rebuilt_kernel, "64-bit address arithmetic rebuilt each iteration"),
    (sum_in_the_loop_kernel, "shared-memory/synchronization instructions"),
    (uses_a_helper_kernel, "does not compile alone for sm_90"),
], ids=lambda value: getattr(value, "__name__", ""))
def test_right_values_with_a_loop_that_breaks_the_spec_are_not_solved(kernel, diagnosis):
    assert check_bias_grad(kernel, values_only=True).solved  # the values alone would pass
    verdict = check_bias_grad(kernel)
    assert rejected(verdict, "case 9 of 10") and rejected(verdict, diagnosis), verdict.message


@needs_sm90
@pytest.mark.parametrize("kernel, said", [
    # a lean loop that never runs beside the real one: every loop that loads is held, not the leanest
    (never_run_lean_loop_kernel, "the innermost loop spends"),
    # the division one loop out, around a one-pass inner loop: a loop around one is held too
    (division_in_the_outer_loop_kernel, "an outer loop (one pass of it, each loop inside it run once)"),
    # FP32 adds thrown away: the tiles per pass come from the bytes loaded, extra FP32 is overhead
    (padded_with_adds_kernel, "FP32 beyond the tile's adds"),
    # the division done in floats (right below 2^24 rows): per-row offsets, no 128-bit loads
    (float_division_corrected_kernel, "narrower than 128-bit loads"),
    # the given loop kept for stride_d != 1: the column-strided compile keeps it
    (lean_only_for_unit_stride_kernel, "case 10 of 10: x=sm_90 compile of x[:, :, ::2]"),
    # b * stride_b in 32 bits: wraps past 2^31 elements
    (batch_offset_in_32_bits_kernel, "of batch_offset_in_32_bits_kernel `ptrs = x_ptr + (b * stride_b + tile)`: "
                                     "a loop's index times a stride in 32 bits"),
], ids=lambda value: getattr(value, "__name__", ""))
def test_right_values_that_game_the_loop_count_are_not_solved(kernel, said):
    assert check_bias_grad(kernel, values_only=True).solved  # right values
    verdict = check_bias_grad(kernel)
    assert rejected(verdict, said), verdict.message


def test_a_float_reciprocal_for_the_division_is_caught_by_a_strided_t_of_41():
    verdict = check_bias_grad(float_reciprocal_kernel, values_only=True)
    assert rejected(verdict, "x: (3, 41, 70) float32 strides (140, 420, 2)"), verdict.message


def test_swapped_strides_are_named():
    verdict = check_bias_grad(swapped_strides_kernel, values_only=True)
    assert rejected(verdict, "case 1 of 8") and rejected(verdict, "the strides of t and d are swapped"), verdict.message
    assert "is a mask missing" not in verdict.message


@needs_sm90
def test_a_clean_pointer_advance_in_64_bits_is_solved_with_room():
    verdict = check_bias_grad(pointer_advanced_in_64_bits_kernel)
    assert verdict.solved, verdict.message
    report = sm90_loop(pointer_advanced_in_64_bits_kernel)
    tiles = report.steady.load_bytes / given.BIAS_GRAD_BOUND.tile_bytes
    assert report.integer_control / tiles <= given.BIAS_GRAD_BOUND.inner - 5, report.overhead_opcodes()


@needs_sm90
def test_software_pipelining_is_named_and_not_taken_for_a_reduction():
    verdict = check_bias_grad(pipelined_kernel)
    assert rejected(verdict, "software pipelining (`tl.range(..., num_stages=n)`)"), verdict.message
    assert "tl.sum" not in verdict.message


@needs_sm90
def test_lines_of_the_loop_are_the_kernels_own_and_a_line_outside_every_loop_is_said_to_be():
    # The line table also names Triton's own files (tl.zeros, tl.sum): their lines are none of the kernel's.
    report = sm90_loop(pointer_advanced_in_64_bits_kernel)
    source_lines = len(report.source)
    assert report.lines and all(1 <= line.number <= source_lines for line in report.lines), report.lines
    assert all(op.line is None or op.line <= source_lines for op in report.ops)
    # Where the line table puts a loop instruction on a line after the loop (the store), the verdict says so.
    view = report.steady
    where = given._by_line(view, report, given._overhead(view, 1, given.BIAS_GRAD_BOUND))
    for line in report.lines:
        if line.text.startswith("tl.store") and line.overhead:
            assert f"{report.where(line.number)}" in where and "a line outside every loop of your source" in where


@needs_sm90
@pytest.mark.parametrize("kernel, loop_diagnosis, diagnosis", [
    (no_row_mask_kernel, None, "case 2 of 10"),
    (tail_dropped_kernel, None, "the last, partial tile of each b is missing"),
    (one_tile_kernel, "no loop in the kernel's SASS", "wrong"),
], ids=lambda value: getattr(value, "__name__", ""))
def test_a_lean_loop_with_wrong_values_is_not_solved(kernel, loop_diagnosis, diagnosis):
    # Its loop alone would pass (or, without a loop, is named): the values catch it.
    assert given.diagnose_loop(sm90_loop(kernel), given.BIAS_GRAD_BOUND) == loop_diagnosis or (
        loop_diagnosis and loop_diagnosis in given.diagnose_loop(sm90_loop(kernel), given.BIAS_GRAD_BOUND))
    verdict = check_bias_grad(kernel)
    assert rejected(verdict, diagnosis), verdict.message


def test_no_row_mask_reads_past_the_rows():
    verdict = check_bias_grad(no_row_mask_kernel, values_only=True)
    assert not verdict.solved and "wrong" in verdict.message, verdict.message


def test_the_stub_is_never_written():
    verdict = check_bias_grad(bias_grad_stub)
    assert rejected(verdict, "never written (still NaN)"), verdict.message


# A second learner's attempts, each passing (or wrongly failing) the check before it counted per path and
# per distinct address, ran B > 5 and T > 128 in the interpreter, and held products with a stride to 64 bits.


@triton.jit
def four_tiles_unrolled_kernel(x_ptr, out_ptr, B, T, D, stride_b, stride_t, stride_d,
                               BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # The tiles of t unrolled four times with tl.static_range: right for T <= 4 * BLOCK_R only.
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    rows = tl.arange(0, BLOCK_R)
    tile = rows.to(tl.int64)[:, None] * stride_t + cols.to(tl.int64)[None, :] * stride_d
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    batch_ptr = x_ptr + tile
    for _ in range(0, B):
        for i in tl.static_range(4):
            acc += tl.load(batch_ptr + i * BLOCK_R * stride_t.to(tl.int64),
                           mask=(rows[:, None] + i * BLOCK_R < T) & (cols[None, :] < D), other=0.0)
        batch_ptr += stride_b.to(tl.int64)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0), mask=cols < D)


@triton.jit
def five_batches_unrolled_kernel(x_ptr, out_ptr, B, T, D, stride_b, stride_t, stride_d,
                                 BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # The loop over b unrolled five times with tl.static_range: right for B <= 5 only.
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    rows = tl.arange(0, BLOCK_R)
    tile = rows.to(tl.int64)[:, None] * stride_t + cols.to(tl.int64)[None, :] * stride_d
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    whole = T - T % BLOCK_R
    batch_ptr = x_ptr
    for b in tl.static_range(5):
        if b < B:
            ptrs = batch_ptr + tile
            for _ in range(0, whole, BLOCK_R):
                acc += tl.load(ptrs, mask=cols[None, :] < D, other=0.0)
                ptrs += BLOCK_R * stride_t.to(tl.int64)
            acc += tl.load(ptrs, mask=(rows[:, None] < T - whole) & (cols[None, :] < D), other=0.0)
        batch_ptr += stride_b.to(tl.int64)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0), mask=cols < D)


@triton.jit
def same_address_reloaded_kernel(x_ptr, out_ptr, B, T, D, stride_b, stride_t, stride_d,
                                 BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # The given loop, plus eight loads of the same tile under masks that are never true: nine "tiles" a pass.
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for start in range(0, B * T, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        offsets = ((rows // T).to(tl.int64)[:, None] * stride_b + (rows % T).to(tl.int64)[:, None] * stride_t
                   + cols.to(tl.int64)[None, :] * stride_d)
        mask = (rows[:, None] < B * T) & (cols[None, :] < D)
        acc += tl.load(x_ptr + offsets, mask=mask, other=0.0)
        for k in tl.static_range(1, 9):
            acc += tl.load(x_ptr + offsets, mask=mask & (rows[:, None] >= (k + 1) * B * T), other=0.0)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0), mask=cols < D)


@triton.jit
def never_taken_branch_kernel(x_ptr, out_ptr, B, T, D, stride_b, stride_t, stride_d,
                              BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # The given loop, plus a branch no real call takes, holding eight more tiles.
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for start in range(0, B * T, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        offsets = ((rows // T).to(tl.int64)[:, None] * stride_b + (rows % T).to(tl.int64)[:, None] * stride_t
                   + cols.to(tl.int64)[None, :] * stride_d)
        mask = (rows[:, None] < B * T) & (cols[None, :] < D)
        acc += tl.load(x_ptr + offsets, mask=mask, other=0.0)
        if start == B * D + 1:
            for k in tl.static_range(8):
                acc += tl.load(x_ptr + offsets + 4 * k, mask=mask, other=0.0)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0), mask=cols < D)


@triton.jit
def phantom_loads_kernel(x_ptr, out_ptr, B, T, D, stride_b, stride_t, stride_d,
                         BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # The given loop, plus eight loads of other addresses under a mask no call makes true: read statically,
    # nine distinct tiles a pass; run, the eight never load an element.
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for start in range(0, B * T, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        offsets = ((rows // T).to(tl.int64)[:, None] * stride_b + (rows % T).to(tl.int64)[:, None] * stride_t
                   + cols.to(tl.int64)[None, :] * stride_d)
        mask = (rows[:, None] < B * T) & (cols[None, :] < D)
        acc += tl.load(x_ptr + offsets, mask=mask, other=0.0)
        for j in tl.static_range(1, 9):
            acc += tl.load(x_ptr + offsets + 4 * j, mask=mask & (rows[:, None] >= 2 * B * T), other=0.0)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0), mask=cols < D)


@triton.jit
def flat_counters_kernel(x_ptr, out_ptr, B, T, D, stride_b, stride_t, stride_d,
                         BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # Right and lean: one flat loop over the (b, tile) pairs, the tile counter wrapped by hand, a whole tile
    # loaded with the column mask alone and the last one of each b with the row mask — an if/else per pass.
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    rows = tl.arange(0, BLOCK_R)
    col_mask = cols[None, :] < D
    tile = rows.to(tl.int64)[:, None] * stride_t + cols.to(tl.int64)[None, :] * stride_d
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    step = BLOCK_R * stride_t.to(tl.int64)
    batch_ptr = x_ptr
    ptr = x_ptr
    start = 0
    for _ in range(0, B * tl.cdiv(T, BLOCK_R)):
        left = T - start
        if left >= BLOCK_R:
            acc += tl.load(ptr + tile, mask=col_mask, other=0.0)
        else:
            acc += tl.load(ptr + tile, mask=(rows[:, None] < left) & col_mask, other=0.0)
        start += BLOCK_R
        ptr += step
        if start >= T:
            start = 0
            batch_ptr += stride_b.to(tl.int64)
            ptr = batch_ptr
    tl.store(out_ptr + cols, tl.sum(acc, axis=0), mask=cols < D)


@triton.jit
def offsets_in_32_bits_kernel(x_ptr, out_ptr, B, T, D, stride_b, stride_t, stride_d,
                              BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # Lean, but the tile's offsets and the step are i32 products of a stride: cols * stride_d passes 2^31 once
    # a column lies 2^31 elements from the first (a D-major layout), BLOCK_R * stride_t once rows are far apart.
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    rows = tl.arange(0, BLOCK_R)
    col_mask = cols[None, :] < D
    tile = rows[:, None] * stride_t + cols[None, :] * stride_d
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    whole = T - T % BLOCK_R
    batch_ptr = x_ptr
    for _ in range(0, B):
        ptrs = batch_ptr + tile
        for _ in range(0, whole, BLOCK_R):
            acc += tl.load(ptrs, mask=col_mask, other=0.0)
            ptrs += BLOCK_R * stride_t
        acc += tl.load(ptrs, mask=(rows[:, None] < T - whole) & col_mask, other=0.0)
        batch_ptr += stride_b
    tl.store(out_ptr + cols, tl.sum(acc, axis=0), mask=cols < D)


@triton.jit
def read_by_atomics_kernel(x_ptr, out_ptr, B, T, D, stride_b, stride_t, stride_d,
                           BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # x read by adding zero to it atomically: a read-modify-write of the gradient, not a load.
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    rows = tl.arange(0, BLOCK_R)
    tile = rows.to(tl.int64)[:, None] * stride_t + cols.to(tl.int64)[None, :] * stride_d
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for b in range(0, B):
        for start in range(0, T, BLOCK_R):
            mask = (rows[:, None] < T - start) & (cols[None, :] < D)
            ptrs = x_ptr + b * stride_b.to(tl.int64) + start * stride_t.to(tl.int64) + tile
            acc += tl.where(mask, tl.atomic_add(ptrs, tl.zeros([BLOCK_R, BLOCK_D], tl.float32), mask=mask,
                                                sem="relaxed"), 0.0)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0), mask=cols < D)


@triton.jit
def scalar_condition_in_a_mask_kernel(x_ptr, out_ptr, B, T, D, stride_b, stride_t, stride_d,
                                      BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # Valid Triton (compiled, the scalar broadcasts), but the interpreter cannot broadcast it.
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    rows = tl.arange(0, BLOCK_R)
    col_mask = cols[None, :] < D
    tile = rows.to(tl.int64)[:, None] * stride_t + cols.to(tl.int64)[None, :] * stride_d
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    batch_ptr = x_ptr
    for _ in range(0, B):
        ptrs = batch_ptr + tile
        for start in range(0, T, BLOCK_R):
            acc += tl.load(ptrs, mask=(rows[:, None] < T - start) & col_mask & (T > 0), other=0.0)
            ptrs += BLOCK_R * stride_t.to(tl.int64)
        batch_ptr += stride_b.to(tl.int64)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0), mask=cols < D)


@triton.jit
def loop_variable_cast_kernel(x_ptr, out_ptr, B, T, D, stride_b, stride_t, stride_d,
                              BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # Right when compiled; in the interpreter a range() loop's variable is a Python int, with no .to().
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    rows = tl.arange(0, BLOCK_R)
    tile = rows.to(tl.int64)[:, None] * stride_t + cols.to(tl.int64)[None, :] * stride_d
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for b in range(0, B):
        ptrs = x_ptr + b.to(tl.int64) * stride_b + tile
        for start in range(0, T, BLOCK_R):
            acc += tl.load(ptrs, mask=(rows[:, None] < T - start) & (cols[None, :] < D), other=0.0)
            ptrs += BLOCK_R * stride_t.to(tl.int64)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0), mask=cols < D)


@pytest.mark.parametrize("kernel, said", [
    (four_tiles_unrolled_kernel, "only the first 128 rows of each b are added"),
    (five_batches_unrolled_kernel, "only the first 5 of the B = 17 b's are added"),
], ids=lambda value: getattr(value, "__name__", ""))
def test_a_fixed_unroll_fails_on_values_with_t_past_four_tiles_and_b_past_eight(kernel, said):
    verdict = check_bias_grad(kernel, values_only=True)
    assert rejected(verdict, "wrong") and rejected(verdict, said), verdict.message


@needs_sm90
@pytest.mark.parametrize("kernel, said", [
    # the same address loaded nine times is one tile; the eight extra adds are FP32 beyond the tile's
    (same_address_reloaded_kernel, "FP32 beyond the tile's adds"),
    # a branch no call takes is a path of its own, and its loads never load an element: the path a pass
    # really takes loads one tile, and it is the leanest
    (never_taken_branch_kernel, "on its leanest path through one pass"),
    (never_taken_branch_kernel, "never loads an element in any case: it is not a tile"),
], ids=lambda value: getattr(value, "__name__", ""))
def test_loads_a_pass_does_not_really_make_do_not_count_as_tiles(kernel, said):
    assert check_bias_grad(kernel, values_only=True).solved  # right values
    verdict = check_bias_grad(kernel)
    assert rejected(verdict, "case 9 of 10") and rejected(verdict, said), verdict.message


@needs_sm90
def test_loads_that_never_load_an_element_in_any_case_are_not_tiles():
    assert check_bias_grad(phantom_loads_kernel, values_only=True).solved  # right values
    verdict = check_bias_grad(phantom_loads_kernel)
    line = phantom_loads_kernel.fn.__code__.co_firstlineno + 14  # the @triton.jit line + 14: the masked-off loads
    assert rejected(verdict, "case 9 of 10") and rejected(verdict, "a runtime division or modulo"), verdict.message
    assert rejected(verdict, f"line {line} of phantom_loads_kernel `acc += tl.load(x_ptr + offsets + 4 * j,"), \
        verdict.message
    assert rejected(verdict, "never loads an element in any case: it is not a tile"), verdict.message


@needs_sm90
def test_a_flat_loop_with_an_if_else_per_tile_is_solved():
    verdict = check_bias_grad(flat_counters_kernel)
    assert verdict.solved, verdict.message


@needs_sm90
def test_offsets_that_scale_a_stride_in_32_bits_are_named_by_line():
    assert check_bias_grad(offsets_in_32_bits_kernel, values_only=True).solved
    verdict = check_bias_grad(offsets_in_32_bits_kernel)
    first = offsets_in_32_bits_kernel.fn.__code__.co_firstlineno  # the @triton.jit line; the def is the next
    for line, text in ((first + 8, "tile = rows[:, None] * stride_t + cols[None, :] * stride_d"),
                       (first + 16, "ptrs += BLOCK_R * stride_t")):
        assert rejected(verdict, f"line {line} of offsets_in_32_bits_kernel `{text}`"), (line, verdict.message)
    assert rejected(verdict, "a stride times an offset in 32 bits"), verdict.message


@needs_sm90
def test_the_solution_multiplies_strides_in_64_bits():
    for spec in (given._bias_grad_spec(), given._bias_grad_strided_spec()):
        report = loop_report(given.bias_grad_kernel, spec)
        assert report.error is None and not report.narrow_products and not report.stride_products, report


@needs_sm90
def test_x_read_by_atomics_is_named():
    verdict = check_bias_grad(read_by_atomics_kernel)
    assert rejected(verdict, "atomic"), verdict.message
    assert "no loop of the kernel's SASS loads x" not in verdict.message


@pytest.mark.parametrize("kernel, said", [
    (scalar_condition_in_a_mask_kernel, "a scalar condition in a mask"),
    (loop_variable_cast_kernel, "the interpreter runs a range() loop with a Python int"),
], ids=lambda value: getattr(value, "__name__", ""))
def test_interpreter_only_errors_are_explained(kernel, said):
    verdict = check_bias_grad(kernel, values_only=True)
    assert rejected(verdict, said), verdict.message


@needs_sm90
def test_sass_lines_are_numbered_as_tracebacks_number_them():
    # The same numbering as an interpreter error's "(line N of fn)": the line in the file (or cell).
    verdict = check_bias_grad(given.bias_grad_flat_kernel)
    line = given.bias_grad_flat_kernel.fn.__code__.co_firstlineno + 13  # the @triton.jit line + 13
    assert rejected(verdict, f"line {line} of bias_grad_flat_kernel `b = rows // T`"), verdict.message
