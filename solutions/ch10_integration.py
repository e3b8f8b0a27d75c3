"""Solutions to chapter 10, integration and profiling: a fake kernel, a fixed fake, an autograd
formula, a launch path without its host sync.

One solution per exercise of ``chapters/10_integration/10_integration.ipynb``, written for reading,
and what the chapter gives: three small Triton-backed operators registered in their own namespace
(``ch10::``, so that nothing here can clash with the library's ``kernel_ladder::`` ops), each exercise's
cases, the reference it is checked against and the diagnosis, which the notebook's checks and
``tests/test_solutions_ch10.py`` both import.

The ops' fakes and autograd formulas are *swappable*: each registration calls whatever
:func:`installed` has put in place, the solution by default. A check installs the learner's
function for the duration of the check and puts the solution back, so a wrong answer never
breaks a later cell.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import platform
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import triton
import triton.language as tl

import kernel_ladder  # noqa: F401  (fixes interpreter/compiled mode before any @triton.jit below)
from utils import flamegraph

__all__ = [
    "machine",
    "quantize_rows_kernel",
    "quantize_rows",
    "quantize_rows_fake",
    "scale_rows_kernel",
    "scale_rows",
    "scale_rows_fake",
    "scale_rows_fake_given",
    "scale_rows_setup_context",
    "scale_rows_backward",
    "installed",
    "FakeReport",
    "FAKE_ALLOWED_OPS",
    "fake_cases",
    "fake_cases_batched",
    "OTHER_DEVICE",
    "fake_report",
    "real_report",
    "diagnose_fake",
    "gradient_cases",
    "gradients_with",
    "gradients_reference",
    "diagnose_gradients",
    "explain_gradients",
    "embedding_rows_kernel",
    "embedding_rows",
    "embedding_rows_nosync",
    "embedding_cases",
    "embedding_reference",
    "embedding_checked",
    "diagnose_embedding",
    "Refusal",
    "METADATA_CHECKS",
    "HostSyncError",
    "without_syncs",
]


def machine() -> str:
    """The CPU this process runs on (its model name and cores) and whether a GPU is in use: what the
    chapter's timings came from."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = torch.cuda.get_device_name() if kernel_ladder.runtime.DEVICE.type == "cuda" else "no GPU"
    return f"{cpu}, {os.cpu_count()} cores, {gpu}"


# ----------------------------------------------------------------------------------------------
# Swappable registrations: a check installs the learner's function, then restores the solution
# ----------------------------------------------------------------------------------------------

_INSTALLED: dict[str, Callable[..., Any]] = {}


@contextlib.contextmanager
def installed(**functions: Callable[..., Any]) -> Iterator[None]:
    """Use ``functions`` as the ops' fakes / autograd pieces inside the block, then restore.

    Keys: ``quantize_rows_fake``, ``scale_rows_fake``, ``scale_rows_setup_context``,
    ``scale_rows_backward``.
    """
    unknown = set(functions) - set(_INSTALLED)
    if unknown:
        raise ValueError(f"solutions.ch10_integration.installed: unknown registration(s) {sorted(unknown)}; "
                         f"expected some of {sorted(_INSTALLED)}")
    saved = {name: _INSTALLED[name] for name in functions}
    _INSTALLED.update(functions)
    try:
        yield
    finally:
        _INSTALLED.update(saved)


# ----------------------------------------------------------------------------------------------
# Op 1 (exercise 1, write the fake): per-row int8 quantization, ch10::quantize_rows
# ----------------------------------------------------------------------------------------------


@triton.jit
def quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, n_cols, stride_xr, stride_xc, BLOCK_N: tl.constexpr):
    """One program per row: ``scale = max|x| / 127``, ``q = round(x / scale)`` in int8."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_xr + cols * stride_xc, mask=mask, other=0.0).to(tl.float32)
    scale = tl.max(tl.abs(x), axis=0) / 127.0
    inverse = tl.where(scale > 0, 1.0 / scale, 0.0)  # an all-zero row quantizes to zeros
    scaled = x * inverse
    q = tl.where(scaled >= 0, scaled + 0.5, scaled - 0.5).to(tl.int8)  # round half away from zero
    tl.store(q_ptr + row * n_cols + cols, q, mask=mask)
    tl.store(scale_ptr + row, scale)


@torch.library.custom_op("ch10::quantize_rows", mutates_args=())
def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` of shape ``(..., N)`` → ``q`` int8 of the same shape (contiguous) and ``scale`` float32
    of shape ``x.shape[:-1]``, one per row, with ``x ≈ q * scale[..., None]``."""
    if x.dim() < 1 or not x.dtype.is_floating_point:
        raise ValueError(f"ch10.quantize_rows: x must be a floating-point tensor of rank >= 1, got "
                         f"{x.dtype} of shape {tuple(x.shape)}")
    rows = x.reshape(-1, x.shape[-1])  # a view for every layout this chapter passes (2-D, strided)
    q = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    scale = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if rows.shape[0] and rows.shape[1]:
        quantize_rows_kernel[(rows.shape[0],)](rows, q, scale, rows.shape[1], rows.stride(0), rows.stride(1),
                                               BLOCK_N=triton.next_power_of_2(rows.shape[1]))
    elif rows.shape[0]:
        scale.zero_()
    return q, scale


def quantize_rows_fake(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 1's solution: what ``ch10::quantize_rows`` returns, without running it.

    Teaches that a fake states every output's shape, dtype, device and strides exactly as the real
    op makes them — here two outputs, of different dtypes, one of them a shape (``x.shape[:-1]``)
    that is none of the inputs' — and allocates nothing real (``new_empty`` on a fake tensor
    makes a fake tensor). It must not read ``x``'s values: under ``torch.compile`` it has none.
    """
    q = x.new_empty(x.shape, dtype=torch.int8)
    scale = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return q, scale


@quantize_rows.register_fake
def _quantize_rows_fake_installed(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    result = _INSTALLED["quantize_rows_fake"](x)
    # torch's own complaint about a wrong count ("not an instance of 'sequence'") says little.
    if not (isinstance(result, (tuple, list)) and len(result) == 2
            and all(isinstance(r, torch.Tensor) for r in result)):
        got = type(result).__name__
        if isinstance(result, (tuple, list)):
            got += f" of {len(result)}"
        raise TypeError(f"ch10.quantize_rows: the fake must return 2 tensors (q, scale), got {got}")
    return tuple(result)


# ----------------------------------------------------------------------------------------------
# Op 2 (exercises 2 and 3, fix the fake, write the backward): ch10::scale_rows
# ----------------------------------------------------------------------------------------------


@triton.jit
def scale_rows_kernel(x_ptr, s_ptr, out_ptr, n_cols, stride_xr, stride_xc,
                      FP64: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per row: ``out[r, :] = x[r, :] * s[r]``; out is contiguous, x any strides."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_xr + cols * stride_xc, mask=mask)
    s = tl.load(s_ptr + row)
    if FP64:  # float64 inputs stay float64 (gradcheck needs it)
        y = x.to(tl.float64) * s.to(tl.float64)
    else:
        y = x.to(tl.float32) * s.to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@torch.library.custom_op("ch10::scale_rows", mutates_args=())
def scale_rows(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``out = x * s[:, None]`` for ``x`` of shape ``(M, N)`` (any strides) and ``s`` of shape ``(M,)``;
    ``out`` is contiguous, in ``x``'s dtype."""
    if x.dim() != 2 or s.shape != (x.shape[0],):
        raise ValueError(f"ch10.scale_rows: expected x of shape (M, N) and s of shape (M,), got "
                         f"{tuple(x.shape)} and {tuple(s.shape)}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel():
        scale_rows_kernel[(x.shape[0],)](x, s, out, x.shape[1], x.stride(0), x.stride(1),
                                         FP64=x.dtype == torch.float64 or s.dtype == torch.float64,
                                         BLOCK_N=triton.next_power_of_2(x.shape[1]))
    return out


def scale_rows_fake_given(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The fake exercise 2 starts from. It looks right, and is right for contiguous ``x``."""
    return torch.empty_like(x)


def scale_rows_fake(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Exercise 2's solution: the fake of ``ch10::scale_rows``, fixed.

    Teaches that strides are part of what a fake promises. ``torch.empty_like`` keeps the layout
    of its argument (a transposed ``x`` gives a transposed result), while the kernel always writes
    a contiguous ``out``; compiled code that trusts the fake's strides would index the real output
    wrongly. ``opcheck`` runs the op on a transposed input and compares the two.
    """
    return x.new_empty(x.shape)


@scale_rows.register_fake
def _scale_rows_fake_installed(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return _INSTALLED["scale_rows_fake"](x, s)


def scale_rows_setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    """Exercise 3's solution, part 1: save what the backward needs — both inputs.

    ``grad_x`` needs ``s``, ``grad_s`` needs ``x``; the output is not needed. ``setup_context``
    receives the op's inputs and output and runs once per forward under autograd.
    """
    x, s = inputs
    ctx.save_for_backward(x, s)


def scale_rows_backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 3's solution, part 2: one gradient per input of the forward, in order.

    Teaches the formula and its shapes. ``out[r, c] = x[r, c] s[r]``, so ``grad_x = grad_out * s[:, None]``
    — the same op again, which keeps the backward on the Triton kernel and differentiable — and
    ``grad_s[r] = Σ_c grad_out[r, c] x[r, c]``, a reduction over the row (``(M,)``, like ``s``),
    accumulated in at least float32 and returned in ``s``'s dtype.
    """
    x, s = ctx.saved_tensors
    grad_x = scale_rows(grad_out, s) if ctx.needs_input_grad[0] else None
    grad_s = None
    if ctx.needs_input_grad[1]:
        accumulate = torch.promote_types(torch.float32, x.dtype)
        grad_s = (grad_out.to(accumulate) * x.to(accumulate)).sum(dim=1).to(s.dtype)
    return grad_x, grad_s


def _setup_installed(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    _INSTALLED["scale_rows_setup_context"](ctx, inputs, output)


def _backward_installed(ctx: Any, grad_out: torch.Tensor):
    return _INSTALLED["scale_rows_backward"](ctx, grad_out)


scale_rows.register_autograd(_backward_installed, setup_context=_setup_installed)

_INSTALLED.update(
    quantize_rows_fake=quantize_rows_fake,
    scale_rows_fake=scale_rows_fake,
    scale_rows_setup_context=scale_rows_setup_context,
    scale_rows_backward=scale_rows_backward,
)


# ----------------------------------------------------------------------------------------------
# Checking a fake: its outputs' metadata against the real op's, and opcheck
# ----------------------------------------------------------------------------------------------

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "float64": torch.float64}

#: The device of the checks' extra fake-tensor case: one that is not this machine's (a fake tensor
#: needs no memory on its device, so a CPU-only machine can trace a "cuda" input, and a GPU one a
#: "cpu" input). A fake that allocates with ``torch.empty(shape)`` and no ``device=`` makes a CPU
#: tensor whatever ``x``'s device; only an input on another device shows it.
OTHER_DEVICE = "cuda" if kernel_ladder.runtime.DEVICE.type == "cpu" else "cpu"


@dataclasses.dataclass(frozen=True)
class FakeReport:
    """What an op's outputs look like — ``(shape, dtype, strides, device)`` each — what opcheck said,
    and the aten ops the fake ran that read tensor values (none for a fake that only allocates)."""

    outputs: tuple[tuple[tuple[int, ...], str, tuple[int, ...], str], ...]
    opcheck: str | None = None
    reads: tuple[str, ...] = ()


#: The aten ops a fake may run: they allocate or change metadata, and read no tensor's values.
FAKE_ALLOWED_OPS = frozenset({
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "zeros", "zeros_like", "new_zeros",
    "ones", "ones_like", "new_ones", "full", "full_like", "new_full", "view", "_unsafe_view", "reshape",
    "_reshape_alias", "as_strided", "expand", "t", "transpose", "permute", "unsqueeze", "squeeze", "detach",
    "alias", "lift_fresh", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "size", "stride", "dim",
})


def _values_read(fake: Callable[..., Any], reads: list[str]) -> Callable[..., Any]:
    """``fake``, appending to ``reads`` the name of every aten op it runs outside :data:`FAKE_ALLOWED_OPS`."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ not in FAKE_ALLOWED_OPS:
                reads.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    def recorded(*args: Any) -> Any:
        with Recorder():
            return fake(*args)

    return recorded


def _inputs(op: str, shape: list[int], dtype: str, layout: str) -> tuple[torch.Tensor, ...]:
    """The op's inputs for a case, on this machine's device: ``x`` of ``shape`` (stored transposed
    if ``layout`` says so)."""
    gen = torch.Generator().manual_seed(sum(shape) * 31 + len(layout))
    if layout == "transposed":
        x = torch.randn(*reversed(shape), generator=gen).to(_DTYPES[dtype]).transpose(-1, -2)
    else:
        x = torch.randn(*shape, generator=gen).to(_DTYPES[dtype])
    device = kernel_ladder.runtime.DEVICE
    x = x.to(device)
    if op == "scale_rows":
        return x, torch.rand(shape[0], generator=gen).to(device) + 0.5
    return (x,)


def _describe(outputs: Any, device: str | None = None) -> tuple:
    """Each output's ``(shape, dtype, strides, device type)``; ``device`` overrides the last."""
    outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    return tuple((tuple(o.shape), str(o.dtype).removeprefix("torch."), tuple(o.stride()), device or o.device.type)
                 for o in outputs)


def _ops(op: str):
    return {"quantize_rows": torch.ops.ch10.quantize_rows.default, "scale_rows": torch.ops.ch10.scale_rows.default}[op]


def real_report(op: str) -> Callable[[list[int], str, str, str], FakeReport]:
    """The reference for a fake check: the real op's outputs on the case's inputs (no opcheck).

    The real op runs on this machine's device; both ops allocate their outputs on ``x``'s device
    (``device=x.device``), so for the case on :data:`OTHER_DEVICE` the outputs' device is that one.
    """

    def report(shape: list[int], dtype: str, layout: str, device: str) -> FakeReport:
        outputs = _ops(op)(*_inputs(op, shape, dtype, layout))
        here = kernel_ladder.runtime.DEVICE.type
        if any(o.device.type != here for o in outputs):
            raise AssertionError(f"ch10.{op}: the real op's outputs left x's device {here}")
        return FakeReport(_describe(outputs, device))

    return report


def _opcheck_problem(op: str, args: tuple) -> str | None:
    # The fake and schema tests are what a wrong fake fails; the autograd ones are exercise 3's.
    result = torch.library.opcheck(_ops(op), args, test_utils=("test_schema", "test_faketensor",
                                                               "test_aot_dispatch_dynamic"),
                                   raise_exception=False)
    failed = {name: outcome for name, outcome in result.items() if outcome != "SUCCESS"}
    if not failed:
        return None
    name, error = next(iter(failed.items()))
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    detail = next((line for line in lines if "stride" in line or "dtype" in line or "shape" in line
                   or "size" in line or "device" in line), lines[0] if lines else type(error).__name__)
    return f"opcheck {name} failed: {detail[:300]}"


def _fake_of(mode: Any, tensor: torch.Tensor, device: str) -> torch.Tensor:
    """``tensor`` as a fake tensor of ``mode`` on ``device`` (same shape, strides and dtype)."""
    if device == tensor.device.type:
        return mode.from_tensor(tensor)
    with mode:
        return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)


def fake_report(op: str, fake: Callable[..., Any]) -> Callable[[list[int], str, str, str], FakeReport]:
    """The candidate for a fake check: ``fake`` installed, the op's outputs under fake tensors on the
    case's device, and opcheck (on this machine's device only: it runs the real op too)."""
    from torch._subclasses import FakeTensorMode
    from torch.utils._python_dispatch import _disable_current_modes

    def report(shape: list[int], dtype: str, layout: str, device: str) -> FakeReport:
        args = _inputs(op, shape, dtype, layout)
        # Outside any dispatch mode the caller runs (a check traces its candidate): fake tensors
        # and opcheck's compile must see the op as a model would.
        reads: list[str] = []
        with _disable_current_modes():
            mode = FakeTensorMode()
            fake_args = tuple(_fake_of(mode, a, device) for a in args)
            with installed(**{f"{op}_fake": _values_read(fake, reads)}), mode:
                outputs = _ops(op)(*fake_args)
            with installed(**{f"{op}_fake": fake}):
                problem = _opcheck_problem(op, args) if device == kernel_ladder.runtime.DEVICE.type else None
        return FakeReport(_describe(outputs), problem, tuple(dict.fromkeys(reads)))

    return report


def fake_cases(gen: torch.Generator) -> list[tuple]:
    """Shapes as lists (printed in full in a verdict), a dtype name, a layout and a device: tiny, odd,
    one strided, and the last a fake tensor on :data:`OTHER_DEVICE` (where a fake that allocates
    without ``device=`` puts its output on the wrong device)."""
    here = kernel_ladder.runtime.DEVICE.type
    rows = int(torch.randint(2, 6, (1,), generator=gen))
    cols = int(torch.randint(3, 20, (1,), generator=gen))
    return [([rows, cols], "float32", "contiguous", here), ([rows + 1, cols], "float16", "contiguous", here),
            ([rows, cols + 2], "float32", "transposed", here), ([rows, cols], "float32", "contiguous", OTHER_DEVICE)]


def fake_cases_batched(gen: torch.Generator) -> list[tuple]:
    """Exercise 1's cases: :func:`fake_cases` with a 3-D input (the scale's shape is ``x.shape[:-1]``)
    before the last."""
    cases = fake_cases(gen)
    return [*cases[:-1], ([2, 3, 5], "float32", "contiguous", kernel_ladder.runtime.DEVICE.type), cases[-1]]


def _shape_cause(got: tuple[int, ...], expected: tuple[int, ...]) -> str:
    """Why a fake's shape differs from the kernel's, where the difference says it."""
    if got == (*expected, 1):
        return ": a trailing dimension of 1 kept — one value per row is x.shape[:-1], without keepdim"
    if len(expected) > 1 and got == expected[:1]:
        return (": only the first dimension kept — with a 3-D x every dimension but the last counts rows: "
                "x.shape[:-1]")
    if len(got) == len(expected) > 1 and got == tuple(reversed(expected)):
        return ": the dimensions are reversed (transposed)"
    if len(got) == len(expected):
        off = [g - e for g, e in zip(got, expected) if g != e]
        if len(off) == 1 and abs(off[0]) == 1:
            return ": one dimension off by one"
    return ""


def diagnose_fake(got: FakeReport, expected: FakeReport) -> str | None:
    """None if the fake's outputs match the real op's and opcheck passed, else what differs and why."""
    if not isinstance(got, FakeReport):
        return f"the fake's result could not be read: {got!r}"
    if len(got.outputs) != len(expected.outputs):
        return (f"the fake returns {len(got.outputs)} output(s), the op returns {len(expected.outputs)}: "
                "return one tensor per output, in order")
    for i, ((g_shape, g_dtype, g_stride, g_device), (e_shape, e_dtype, e_stride, e_device)) in enumerate(
            zip(got.outputs, expected.outputs)):
        which = f"output {i}" if len(got.outputs) > 1 else "the output"
        if g_device != e_device:
            return (f"{which}: the fake says device {g_device}, the kernel returns {e_device} (x's device): "
                    "torch.empty(shape) without device= allocates on the CPU whatever x's device — "
                    "allocate with x.new_empty(...) or pass device=x.device")
        if g_shape != e_shape:
            cause = _shape_cause(g_shape, e_shape)
            return f"{which}: the fake says shape {g_shape}, the kernel returns {e_shape}{cause}"
        if g_dtype != e_dtype:
            return f"{which}: the fake says dtype {g_dtype}, the kernel returns {e_dtype}"
        if g_stride != e_stride:
            return (f"{which}: the fake says strides {g_stride}, the kernel returns {e_stride} "
                    "(contiguous: the fake must promise the layout the kernel writes)")
    if got.reads:
        return (f"the fake ran {', '.join(got.reads)}: a fake must not read x's values — under torch.compile "
                "it has none (only shapes, dtypes, strides); allocate the outputs with x.new_empty(...) "
                "and compute their shapes from x.shape")
    return got.opcheck


# ----------------------------------------------------------------------------------------------
# Checking an autograd formula: gradients through the op against float64 autograd, and gradcheck
# ----------------------------------------------------------------------------------------------


def gradient_cases(gen: torch.Generator) -> list[tuple]:
    """``(rows, cols, seed, zero_rows)``: the inputs are drawn from the seed in float64 by both sides;
    in the last case ``s`` is zero in ``zero_rows`` rows (a scale of zero is a valid input: a backward
    that recovers ``x`` as ``output / s`` breaks there)."""
    cases = []
    for rows, cols, zero_rows in ((1, 1, 0), (3, 7, 0), (5, 16, 2)):
        cases.append((rows, cols, int(torch.randint(0, 2**30, (1,), generator=gen)), zero_rows))
    return cases


def _gradient_inputs(rows: int, cols: int, seed: int, zero_rows: int = 0
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    s = torch.rand(rows, generator=gen, dtype=torch.float64) + 0.5
    s[torch.randperm(rows, generator=gen)[:zero_rows]] = 0.0
    grad = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    device = kernel_ladder.runtime.DEVICE
    return x.to(device), s.to(device), grad.to(device)


def gradients_reference(rows: int, cols: int, seed: int, zero_rows: int = 0
                        ) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``(grad_x, grad_s, True)`` from torch's own autograd of ``x * s[:, None]`` in float64."""
    x, s, grad = _gradient_inputs(rows, cols, seed, zero_rows)
    x.requires_grad_(True)
    s.requires_grad_(True)
    (x * s[:, None]).backward(grad)
    return x.grad.detach(), s.grad.detach(), True


def _checked_setup(setup_context: Callable[..., Any], saved: list[int]) -> Callable[..., Any]:
    """``setup_context``, counting the tensors it saved (read back from ``ctx.to_save``)."""

    def setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        setup_context(ctx, inputs, output)
        held = sorted(name for name, value in vars(ctx).items() if name != "to_save" and (
            isinstance(value, torch.Tensor)
            or isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value)))
        if held:
            raise ValueError(f"setup_context stored tensors as ctx attributes ({', '.join('ctx.' + n for n in held)}): "
                             "save tensors with ctx.save_for_backward(...) and read them back from "
                             "ctx.saved_tensors — autograd then checks that they were not modified in place and "
                             "frees them after the backward; attributes on ctx are for non-tensors")
        saved.append(len(getattr(ctx, "to_save", None) or ()))

    return setup


def _checked_backward(backward: Callable[..., Any], saved: list[int]) -> Callable[..., Any]:
    """``backward``, its result held to the forward's inputs before autograd reads it: one gradient
    per input, each of its input's shape (a wrong one named, with the likely cause)."""

    def checked(ctx: Any, grad_out: torch.Tensor):
        x, s = ctx.saved_tensors if len(ctx.saved_tensors) == 2 else (None, None)
        rows, cols = grad_out.shape
        try:
            result = backward(ctx, grad_out)
        except ValueError as error:
            if saved and saved[-1] < 2 and "unpack" in str(error):
                raise ValueError(f"setup_context saved {saved[-1]} tensor{'' if saved[-1] == 1 else 's'}, the "
                                 "backward reads 2: save both x and s (ctx.save_for_backward(x, s))") from error
            raise
        except RuntimeError as error:
            if f"size of tensor a ({cols}) must match the size of tensor b ({rows})" in str(error):
                raise ValueError(f"{str(error).splitlines()[0]}: s of shape ({rows},) broadcasts along the columns "
                                 f"of grad_out ({rows}, {cols}) — its last dimension; one scale per row is "
                                 "s[:, None], of shape (M, 1)") from error
            raise
        if not isinstance(result, (tuple, list)) or len(result) != 2:
            count = len(result) if isinstance(result, (tuple, list)) else 1
            raise ValueError(f"backward returned {count} value{'' if count == 1 else 's'}: return (grad_x, grad_s), "
                             "one gradient per input of the forward, in order (None for an input without one)")
        grad_x, grad_s = result
        if (isinstance(grad_x, torch.Tensor) and isinstance(grad_s, torch.Tensor)
                and tuple(grad_x.shape) == (rows,) and tuple(grad_s.shape) == (rows, cols)):
            raise ValueError(f"the gradients are in the wrong order: the first has s's shape ({rows},), the second "
                             f"x's ({rows}, {cols}) — return (grad_x, grad_s), one per input of the forward, in the "
                             "forward's order")
        for index, (name, gradient) in enumerate((("x", grad_x), ("s", grad_s))):
            if gradient is None and ctx.needs_input_grad[index]:
                raise ValueError(f"backward returned None for {name}'s gradient, though {name} requires one: "
                                 "None is only for an input that needs no gradient (ctx.needs_input_grad says which)")
        if isinstance(grad_s, torch.Tensor) and tuple(grad_s.shape) != (rows,):
            where = ""
            if tuple(grad_s.shape) == (rows, cols):
                where = ": sum grad_out * x over each row (dim=1)"
            elif tuple(grad_s.shape) == (cols,):
                where = ": summed over the rows (dim=0) instead of along each row (dim=1)"
            raise ValueError(f"grad_s has shape {tuple(grad_s.shape)}, s has shape ({rows},){where} — a gradient "
                             "has its input's shape")
        if isinstance(grad_x, torch.Tensor) and tuple(grad_x.shape) != (rows, cols):
            turned = " (transposed)" if tuple(grad_x.shape) == (cols, rows) else ""
            raise ValueError(f"grad_x has shape {tuple(grad_x.shape)}{turned}, x has shape ({rows}, {cols}) — a "
                             "gradient has its input's shape")
        return grad_x, grad_s

    return checked


def gradients_with(setup_context: Callable[..., Any], backward: Callable[..., Any]
                   ) -> Callable[[int, int, int], tuple[torch.Tensor, torch.Tensor, bool]]:
    """The candidate for the autograd check: ``(grad_x, grad_s, gradcheck passed)`` through
    ``ch10::scale_rows`` with the learner's ``setup_context`` and ``backward`` installed (the
    backward's result held to the inputs' count and shapes, a wrong one named)."""

    def gradients(rows: int, cols: int, seed: int, zero_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor, bool]:
        x, s, grad = _gradient_inputs(rows, cols, seed, zero_rows)
        x.requires_grad_(True)
        s.requires_grad_(True)
        saved: list[int] = []
        with installed(scale_rows_setup_context=_checked_setup(setup_context, saved),
                       scale_rows_backward=_checked_backward(backward, saved)):
            grad_x, grad_s = torch.autograd.grad(scale_rows(x, s), (x, s), grad)
            passed = torch.autograd.gradcheck(scale_rows, (x, s), raise_exception=False)
        return grad_x.detach(), grad_s.detach(), bool(passed)

    return gradients


def diagnose_gradients(got: Any, expected: tuple) -> str | None:
    """None if both gradients match float64 autograd and gradcheck passed, else which does not."""
    if not isinstance(got, tuple) or len(got) != 3:
        return f"expected (grad_x, grad_s, gradcheck), got {type(got).__name__}"
    for name, g, e in (("grad_x", got[0], expected[0]), ("grad_s", got[1], expected[1])):
        if not isinstance(g, torch.Tensor):
            return f"{name}: backward returned {type(g).__name__}, not a tensor"
        if g.shape != e.shape:
            return f"{name}: shape {tuple(g.shape)}, expected {tuple(e.shape)} (one gradient per input, its shape)"
        if not torch.allclose(g, e, rtol=1e-7, atol=1e-9):
            worst = float((g - e).abs().max())
            return f"{name}: wrong values (largest error {worst:.3g}) against float64 autograd"
    if not got[2]:
        return "torch.autograd.gradcheck in float64 failed (the formula disagrees with finite differences)"
    return None


def explain_gradients(case: tuple, got: Any, expected: tuple) -> str | None:
    """The common wrong formulas, each recomputed in float64 from the case's inputs, against ``got``."""
    rows, cols, seed, zero_rows = case
    x, s, grad = _gradient_inputs(rows, cols, seed, zero_rows)
    grad_x, grad_s = got[0].double(), got[1].double()
    right_x, right_s = expected[0].double(), expected[1].double()
    for name, gradient in (("grad_x", grad_x), ("grad_s", grad_s)):
        zero = (s == 0).reshape(-1, *[1] * (gradient.dim() - 1)).expand_as(gradient) if gradient.dim() else None
        nan = gradient.isnan()
        if zero is not None and zero.any() and nan.any() and bool(zero[nan].all()):
            return (f"{name} is NaN in the rows where s = 0 (x recovered as output / s?): save the inputs x and s, "
                    "not the output — dividing by s fails where s is zero, a valid scale")

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.shape == b.shape and torch.allclose(a, b, rtol=1e-7, atol=1e-9)

    x_candidates = [
        (grad * x, "x and s swapped: grad_x = grad_out · s[:, None] (out's derivative in x is s), "
                   "grad_s = Σ_c grad_out · x"),
        (grad, "grad_x is grad_out unscaled: out = x · s[:, None], so grad_x = grad_out · s[:, None]"),
        (-grad * s[:, None], "grad_x has the wrong sign: grad_out · s[:, None]"),
    ]
    s_candidates = [
        ((grad * s[:, None]).sum(1), "x and s swapped: grad_s = Σ_c grad_out · x (out's derivative in s is x), "
                                     "grad_x = grad_out · s[:, None]"),
        ((grad * x).mean(1), f"grad_s is the mean over each row, not the sum (÷ {cols}): "
                             "grad_s[r] = Σ_c grad_out[r, c] · x[r, c]"),
        (-(grad * x).sum(1), "grad_s has the wrong sign: Σ_c grad_out · x"),
        (x.sum(1), "grad_s sums x alone: each term is weighted by grad_out — Σ_c grad_out · x"),
    ]
    causes = []
    if not same(grad_x, right_x):
        causes += [cause for value, cause in x_candidates if same(grad_x, value) and not same(value, right_x)]
    if not same(grad_s, right_s):
        causes += [cause for value, cause in s_candidates if same(grad_s, value) and not same(value, right_s)]
    causes = list(dict.fromkeys(causes))
    return "; and ".join(causes) if causes else None


# ----------------------------------------------------------------------------------------------
# Op 3 (exercise 4, find the sync): an embedding lookup whose launch path calls .item()
# ----------------------------------------------------------------------------------------------


@triton.jit
def embedding_rows_kernel(table_ptr, ids_ptr, out_ptr, bad_ptr, num_rows, dim, stride_t,
                          BLOCK_D: tl.constexpr):
    """One program per id: copy row ``table[id]`` to ``out``; an id out of range writes zeros and
    adds one to ``bad[0]`` (the error is counted on the device, read whenever the host syncs anyway)."""
    pid = tl.program_id(0).to(tl.int64)
    index = tl.load(ids_ptr + pid).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < dim
    lane_index = index + tl.zeros([BLOCK_D], tl.int64)  # the id on every lane, so the masks are blocks
    lane_valid = (lane_index >= 0) & (lane_index < num_rows)
    safe = tl.where(lane_valid, lane_index, 0)
    row = tl.load(table_ptr + safe * stride_t + cols, mask=mask & lane_valid, other=0.0)
    tl.store(out_ptr + pid * dim + cols, row, mask=mask)
    tl.atomic_add(bad_ptr, ((index < 0) | (index >= num_rows)).to(tl.int32))


def _launch_embedding(table: torch.Tensor, ids: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    out = torch.empty(ids.shape[0], table.shape[1], dtype=table.dtype, device=table.device)
    if ids.numel():
        embedding_rows_kernel[(ids.shape[0],)](table, ids, out, bad, table.shape[0], table.shape[1],
                                               table.stride(0), BLOCK_D=triton.next_power_of_2(table.shape[1]))
    return out


def _ids_in_range(ids: torch.Tensor, num_rows: int) -> bool:
    # The hidden sync: two reductions read back to the host before the launch can be queued.
    return ids.numel() == 0 or (ids.min().item() >= 0 and ids.max().item() < num_rows)


def _validate(table: torch.Tensor, ids: torch.Tensor) -> None:
    if table.dim() != 2 or ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ch10.embedding_rows: expected table (V, D) and int ids (T,), got {tuple(table.shape)} "
                         f"and {ids.dtype} {tuple(ids.shape)}")
    if table.stride(1) != 1:
        raise ValueError("ch10.embedding_rows: table's rows must be contiguous (stride 1 along D)")
    if not _ids_in_range(ids, table.shape[0]):
        raise ValueError(f"ch10.embedding_rows: ids must lie in [0, {table.shape[0]})")


def _prepare(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    _validate(table, ids)
    return torch.zeros(1, dtype=torch.int32, device=table.device)


def embedding_rows(table: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(table[ids], bad)``, given to exercise 4: correct, but its launch path syncs the host."""
    bad = _prepare(table, ids)
    return _launch_embedding(table, ids, bad), bad


def embedding_rows_nosync(table: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 4's solution: the same lookup with no host sync.

    Teaches that a data-dependent check (``ids.max().item()``) makes the host wait for the device
    before it can queue the next kernel, so launches stop running ahead. Checks of *metadata*
    (rank, dtype, strides) cost nothing and stay; the range check moves onto the device: the kernel
    counts bad ids in ``bad`` (and writes zeros for them), and the caller reads that count at a
    sync it already has — logging the loss, say — or asserts on it after the step.
    """
    if table.dim() != 2 or ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ch10.embedding_rows: expected table (V, D) and int ids (T,), got {tuple(table.shape)} "
                         f"and {ids.dtype} {tuple(ids.shape)}")
    if table.stride(1) != 1:
        raise ValueError("ch10.embedding_rows: table's rows must be contiguous (stride 1 along D)")
    bad = torch.zeros(1, dtype=torch.int32, device=table.device)
    return _launch_embedding(table, ids, bad), bad


#: The metadata checks exercise 4 keeps, each with the input the check's cases give it to refuse.
METADATA_CHECKS = {
    "rank": "ids of rank 2 (a (2, 3) tensor)",
    "dtype": "ids of dtype float32",
    "strides": "a table whose rows are strided (stride 2 along D)",
}


def embedding_cases(gen: torch.Generator) -> list[tuple]:
    """``(table, ids, refused_by)``. Three valid lookups (``refused_by=None``): tiny, an odd width,
    a repeated id, and the third with ids out of range (negative and past the vocabulary), whose
    rows must be zero and which ``bad`` must count. Then one input per metadata check
    (:data:`METADATA_CHECKS`) that the check named by ``refused_by`` must refuse with a ValueError."""
    cases = []
    device = kernel_ladder.runtime.DEVICE
    for vocab, dim, tokens in ((7, 5, 4), (16, 12, 9), (6, 3, 8)):
        table = torch.randn(vocab, dim, generator=gen)
        ids = torch.randint(0, vocab, (tokens,), generator=gen)
        ids[-1] = ids[0]
        if vocab == 6:
            ids[1], ids[4], ids[5] = -1, vocab, vocab + 100
        cases.append((table.to(device), ids.to(device), None))
    table = torch.randn(9, 8, generator=gen).to(device)
    ids = torch.randint(0, 9, (6,), generator=gen).to(device)
    cases.append((table, ids.reshape(2, 3), "rank"))
    cases.append((table, ids.to(torch.float32), "dtype"))
    cases.append((table[:, ::2], ids, "strides"))
    return cases


@dataclasses.dataclass(frozen=True)
class Refusal:
    """What a launch path did with an input that the metadata check ``check`` must refuse: the
    exception it raised (its type's name and message), or ``raised=None`` if it returned."""

    check: str
    raised: str | None
    message: str = ""


def embedding_reference(table: torch.Tensor, ids: torch.Tensor, refused_by: str | None = None) -> Any:
    """``(rows, bad)``: ``table[ids]`` with a zero row for each id outside ``[0, V)``, and how many
    there were (one int32); for an input a metadata check must refuse, that check's refusal."""
    if refused_by is not None:
        return Refusal(refused_by, "ValueError")
    ids = ids.long()
    valid = (ids >= 0) & (ids < table.shape[0])
    rows = table[ids.clamp(0, table.shape[0] - 1)] * valid[:, None].to(table.dtype)
    return rows, valid.logical_not().sum().to(torch.int32).reshape(1)


def embedding_checked(function: Callable[..., Any]) -> Callable[..., Any]:
    """The candidate for exercise 4: ``function`` under :func:`without_syncs` on a valid case; on an
    input a metadata check must refuse, what it did with it (a :class:`Refusal`)."""
    guarded = without_syncs(function)

    def run(table: torch.Tensor, ids: torch.Tensor, refused_by: str | None = None) -> Any:
        if refused_by is None:
            return guarded(table, ids)
        try:
            guarded(table, ids)
        except HostSyncError:
            raise
        except Exception as error:  # which exception, and from where, is the diagnosis
            return Refusal(refused_by, type(error).__name__, str(error).splitlines()[0] if str(error) else "")
        return Refusal(refused_by, None)

    run.__name__ = getattr(function, "__name__", "run")  # no __wrapped__: the verdict names run's three arguments
    return run


def diagnose_embedding(got: Any, expected: Any) -> str | None:
    """None if ``got`` is the lookup (or the refusal) expected, else what is wrong, and why."""
    if isinstance(expected, Refusal):
        what = METADATA_CHECKS[expected.check]
        if not isinstance(got, Refusal):
            return f"the {expected.check} check must refuse {what}, got {type(got).__name__}"
        if got.raised == "ValueError":
            return None
        keep = ("keep the launch path's metadata checks — rank, dtype, strides: they read no tensor values, "
                "so they cost no sync — and raise a ValueError naming the argument")
        if got.raised == "TypeError":
            return (f"the {expected.check} check raised TypeError, the spec asks for a ValueError for {what} "
                    f"({got.message[:120]}): raise ValueError, as the launch path you were given does")
        if got.raised is None:
            return f"the {expected.check} check is gone: it accepted {what}; {keep}"
        return (f"the {expected.check} check is gone: {what} reached the launch and raised {got.raised} "
                f"({got.message[:120]}); {keep}")
    if isinstance(got, Refusal):
        return f"a valid input was refused: {got.raised}: {got.message[:200]}"
    if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)):
        return f"return (rows, bad), two tensors; got {type(got).__name__}"
    (rows, bad), (want_rows, want_bad) = got, expected
    if tuple(rows.shape) != tuple(want_rows.shape) or rows.dtype != want_rows.dtype:
        return (f"rows: shape {tuple(rows.shape)} {rows.dtype}, expected {tuple(want_rows.shape)} {want_rows.dtype} "
                "(one row of the table per id)")
    if tuple(bad.shape) != (1,) or bad.dtype != torch.int32:
        return f"bad must be a one-element int32 tensor, got shape {tuple(bad.shape)} {bad.dtype}"
    rows, want_rows, bad, want_bad = rows.cpu(), want_rows.cpu(), bad.cpu(), want_bad.cpu()
    wrong = [i for i in range(rows.shape[0]) if not torch.allclose(rows[i], want_rows[i], rtol=1e-6, atol=0.0)]
    out_of_range = [i for i in range(rows.shape[0]) if not bool(want_rows[i].any())]
    if wrong and set(wrong) <= set(out_of_range):
        return (f"rows {wrong}: their ids lie outside [0, V) and their rows must be zero, got a table row (ids "
                "clamped or wrapped?): given.embedding_rows_kernel zeroes them when it is launched on the ids as "
                "they came")
    if wrong:
        return f"rows {wrong} are not table[ids] (first: got {rows[wrong[0]].tolist()}, expected " \
               f"{want_rows[wrong[0]].tolist()})"
    if int(bad[0]) != int(want_bad[0]):
        cause = (": hand the kernel the bad tensor you return — it adds one for each id outside [0, V)"
                 if int(bad[0]) == 0 or int(want_bad[0]) == 0 else "")
        return f"bad is {bad.tolist()}, expected {want_bad.tolist()} (ids out of range counted){cause}"
    return None


class HostSyncError(RuntimeError):
    """A function that must not sync the host read a tensor's value back (``.item()`` and friends)."""


def without_syncs(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function``, raising :class:`HostSyncError` naming the caller if it calls ``aten._local_scalar_dense``.

    That op is what ``.item()``, ``int(t)``, ``float(t)``, ``bool(t)`` and a tensor in an ``if``
    become: on a GPU, each waits for every kernel queued before it.
    """

    def guarded(*args: Any) -> Any:
        with flamegraph.dispatch_stacks() as syncs:
            result = function(*args)
        if syncs.total:
            stack = next(iter(syncs.stacks))
            caller = stack[-2] if len(stack) >= 2 else "?"
            raise HostSyncError(f"{syncs.total} host sync(s) (aten._local_scalar_dense, e.g. .item()); "
                                f"the innermost caller: {caller}")
        return result

    guarded.__name__ = getattr(function, "__name__", "guarded")
    guarded.__wrapped__ = function
    return guarded


# ----------------------------------------------------------------------------------------------
# Op 4 (exercise 5, the instruction level): a loop's integer overhead, read from its sm_90 SASS
# ----------------------------------------------------------------------------------------------

#: The tile both kernels add per iteration, and the launch the check compiles: 32 x 64 fp32 over
#: 4 warps is 16 elements — 16 FP32 adds — per thread per tile.
BIAS_GRAD_BLOCK_R = 32
BIAS_GRAD_BLOCK_D = 64
BIAS_GRAD_WARPS = 4
ADDS_PER_TILE = BIAS_GRAD_BLOCK_R * BIAS_GRAD_BLOCK_D // (32 * BIAS_GRAD_WARPS)


@triton.jit
def bias_grad_flat_kernel(x_ptr, out_ptr, B, T, D, stride_b, stride_t, stride_d,
                          BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """``out[d] = Σ_{b,t} x[b, t, d]``: the bias gradient of a ``(B, T, D)`` output gradient, any strides.

    One program per ``BLOCK_D`` columns; its loop walks the ``B·T`` rows as one flat range,
    ``BLOCK_R`` rows at a time, and adds each tile into a ``BLOCK_R × BLOCK_D`` fp32 accumulator.
    Given to exercise 5: right, and its steady loop is mostly integer instructions.
    """
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for start in range(0, B * T, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        b = rows // T
        t = rows % T
        offsets = (b.to(tl.int64)[:, None] * stride_b + t.to(tl.int64)[:, None] * stride_t
                   + cols.to(tl.int64)[None, :] * stride_d)
        mask = (rows[:, None] < B * T) & (cols[None, :] < D)
        acc += tl.load(x_ptr + offsets, mask=mask, other=0.0)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0), mask=cols < D)


@triton.jit
def bias_grad_kernel(x_ptr, out_ptr, B, T, D, stride_b, stride_t, stride_d,
                     BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Exercise 5's solution: the same sums, with the integer work taken out of the steady loop.

    Teaches reading a loop's SASS for what it costs besides its work. The given loop recovers
    ``(b, t)`` from a flat row index with a runtime ``//`` and ``%`` per row (I2F, MUFU.RCP,
    IMAD.HI...), rebuilds every address from the strides in 64 bits (IMAD.WIDE) and compares every
    row against the end (ISETP) — for a mask only the last tile needs. Here the loops follow the
    data instead: one over ``b``, one over the tiles of ``t``; the tile's offsets are computed once,
    the pointers advance by one tile's stride per iteration, whole tiles load with the column mask
    alone (loop-invariant: a predicate set once), and the one partial tile of each ``b`` is added
    after the loop, masked. The steady loop keeps the same work — one tile loaded, 16 FP32 adds per
    thread — with a few integer instructions left: the pointer increments and the loop's counter.

    Nothing that scales a stride is computed in 32 bits: a tile's offsets and the step reach as far
    as the tensor does (a column ``(D - 1) · stride_d`` elements from the first, rows ``BLOCK_R · stride_t``
    apart), so they are products in 64 bits, once, before the loops; the pointers (64-bit) advance by
    ``stride_b`` and by the step.
    """
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < D
    rows = tl.arange(0, BLOCK_R)
    tile = rows.to(tl.int64)[:, None] * stride_t + cols.to(tl.int64)[None, :] * stride_d  # computed once
    step = BLOCK_R * stride_t.to(tl.int64)  # one tile down
    whole = T - T % BLOCK_R  # the rows of each b that fill whole tiles
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    batch_ptr = x_ptr
    for _ in range(0, B):
        ptrs = batch_ptr + tile
        for _ in range(0, whole, BLOCK_R):
            acc += tl.load(ptrs, mask=col_mask[None, :], other=0.0)
            ptrs += step
        if whole < T:  # the partial last tile: the only one that needs a row mask
            acc += tl.load(ptrs, mask=(rows[:, None] < T - whole) & col_mask[None, :], other=0.0)
        batch_ptr += stride_b
    tl.store(out_ptr + cols, tl.sum(acc, axis=0), mask=col_mask)


def bias_grad(x: torch.Tensor, kernel: Any = bias_grad_kernel) -> torch.Tensor:
    """``x.sum(dim=(0, 1))`` in float32 for ``x`` of shape ``(B, T, D)``, any strides, by ``kernel``
    (one program per 64 columns, 32-row tiles: the launch the check compiles)."""
    if x.dim() != 3 or x.dtype != torch.float32:
        raise ValueError(f"ch10.bias_grad: expected x float32 of shape (B, T, D), got {x.dtype} {tuple(x.shape)}")
    batch, length, width = x.shape
    out = torch.full((width,), float("nan"), dtype=torch.float32, device=x.device)  # unwritten shows as NaN
    if width and batch * length:
        kernel[(triton.cdiv(width, BIAS_GRAD_BLOCK_D),)](x, out, batch, length, width, *x.stride(),
                                                         BLOCK_R=BIAS_GRAD_BLOCK_R, BLOCK_D=BIAS_GRAD_BLOCK_D,
                                                         num_warps=BIAS_GRAD_WARPS)
    elif width:
        out.zero_()
    return out


_BIAS_GRAD_TYPES = {"x_ptr": "*fp32", "out_ptr": "*fp32", "B": "i32", "T": "i32", "D": "i32", "stride_b": "i32",
                    "stride_t": "i32", "stride_d": "i32"}


def _bias_grad_spec() -> Any:
    """The compile the check counts first: what Triton's launcher builds for a contiguous
    ``(8, 1000, 4096)`` float32 gradient — ``stride_d = 1`` a constant, ``D`` and the two outer
    strides multiples of 16; ``T = 1000`` and ``B = 8`` are not."""
    from utils.exercises.sass_loop import CompileSpec

    return CompileSpec(label="x (8, 1000, 4096) fp32", types=_BIAS_GRAD_TYPES,
                       constexprs={"BLOCK_R": BIAS_GRAD_BLOCK_R, "BLOCK_D": BIAS_GRAD_BLOCK_D},
                       ones=("stride_d",), divisible=("D", "stride_t", "stride_b"), num_warps=BIAS_GRAD_WARPS)


def _bias_grad_strided_spec() -> Any:
    """The second compile: a column-strided view, ``x[:, :, ::2]`` of an ``(8, 1000, 8192)`` gradient —
    ``stride_d = 2`` a runtime value, so a kernel cannot keep a lean path for ``stride_d == 1`` alone."""
    from utils.exercises.sass_loop import CompileSpec

    return CompileSpec(label="x[:, :, ::2] of (8, 1000, 8192) fp32 (stride_d = 2, known at run time only)",
                       types=_BIAS_GRAD_TYPES, constexprs={"BLOCK_R": BIAS_GRAD_BLOCK_R, "BLOCK_D": BIAS_GRAD_BLOCK_D},
                       divisible=("D", "stride_t", "stride_b"), num_warps=BIAS_GRAD_WARPS)


@dataclasses.dataclass(frozen=True)
class LoopBound:
    """What exercise 5's loops may spend, per ``BLOCK_R × BLOCK_D`` tile they load, beside the work.

    The work of a tile is its loads and ``adds`` FP32 adds per thread; everything else a loop issues
    — integer and control instructions, int/float conversions (I2F, F2I, FRND), MUFU, and FP32
    instructions beyond the adds — is overhead. Each path through one pass of a loop is counted apart
    (an if/else, a branch no call takes), its tiles the distinct addresses it loads (the same address
    twice is one tile; of loads under complementary predicates, one side; a load of a line whose ``tl.load``
    never loaded an element in the interpreted cases — masked off every time — none). An innermost loop's leanest
    path — its steady pass — may spend ``inner`` per tile; its other paths, and every path of a loop
    around one (over ``b``: one pass of it with each loop inside run once — the check cannot know how
    often they run), ``nest`` per tile loaded on that path. ``vector``: the tile's loads must be 128-bit
    (``LDG.E.128``).
    """

    inner: int
    nest: int
    adds: int
    tile_bytes: int  # one tile, per thread
    vector: bool
    layout: str  # what the compile's loads are, for the verdict

    @property
    def overhead(self) -> int:  # the innermost loop's bound, as the prose states it
        return self.inner


_TILE_BYTES = BIAS_GRAD_BLOCK_R * BIAS_GRAD_BLOCK_D * 4 // (32 * BIAS_GRAD_WARPS)

#: The bounds, per compile. Contiguous: a lean loop spends about 20-30 per tile — one 64-bit address
#: advance per 128-bit load (4 loads, 2 instructions each), zeroing the registers a masked load may
#: leave unwritten (8 CS2R), the counter, compare and branch; 40 (2.5 per element) allows that with
#: room, and the given loop spends about 160. Column-strided: sixteen 32-bit loads per thread, each with
#: its own 64-bit address: a lean loop spends about 35-100 (one 64-bit address advance, two instructions,
#: and with a row mask on every tile a predicate or two, per element); 112 (7 per element) allows that, the
#: given loop spends about 560. The loop's
#: other paths (a flat loop's partial tile and wrapped counters) and a loop around one get three times
#: the innermost bound per tile on their path: room to set up a row pointer per load in 64 bits and add
#: the partial tile once per ``b`` (the solution's outer pass, its inner loop run once and no partial
#: tile, spends about 90 on its one tile), not to rebuild an index per row.
BIAS_GRAD_BOUND = LoopBound(inner=40, nest=120, adds=ADDS_PER_TILE, tile_bytes=_TILE_BYTES, vector=True,
                            layout="four 128-bit loads per thread")
BIAS_GRAD_STRIDED_BOUND = LoopBound(inner=112, nest=336, adds=ADDS_PER_TILE, tile_bytes=_TILE_BYTES, vector=False,
                                    layout="sixteen 32-bit loads per thread")


def bias_grad_cases(gen: torch.Generator) -> list[tuple]:
    """``(x,)`` for eight awkward shapes — square ``T = D`` (a transposed read stays in bounds and shows),
    a partial last tile, ``T`` under one tile, a transposed and column-strided view twice (``T = 19``
    and ``T = 41``), ``T = 1``, ``T = 300`` (past four tiles: an unroll of the tiles by a fixed count
    shows) and ``B = 17`` (an unroll of the ``b`` loop shows) — then ``(spec,)`` twice: the sm_90
    compiles whose loops are counted, contiguous and column-strided. Narrow ``D``: one program each."""
    device = kernel_ladder.runtime.DEVICE
    cases = []
    for shape in ((1, 64, 64), (2, 37, 70), (3, 5, 33)):
        cases.append((torch.randn(*shape, generator=gen).to(device),))
    for batch, length, width in ((4, 19, 100), (3, 41, 70)):  # (B, T, D) views of a (T, B, 2D) tensor
        x = torch.randn(length, batch, 2 * width, generator=gen).to(device).transpose(0, 1)[:, :, ::2]
        cases.append((x,))
    cases.append((torch.randn(5, 1, 20, generator=gen).to(device),))
    cases.append((torch.randn(2, 300, 24, generator=gen).to(device),))
    cases.append((torch.randn(17, 3, 20, generator=gen).to(device),))
    cases.append((_bias_grad_spec(),))
    cases.append((_bias_grad_strided_spec(),))
    return cases


def bias_grad_reference(x: Any) -> Any:
    """The column sums in float64 — or, for a compile case, the bound its loops must keep."""
    if isinstance(x, torch.Tensor):
        return x.double().sum(dim=(0, 1))
    return BIAS_GRAD_STRIDED_BOUND if "stride_d" not in x.ones else BIAS_GRAD_BOUND


def bias_grad_checked(kernel: Any) -> Any:
    """The candidate for exercise 5: ``kernel`` launched on a tensor case; on a compile case, its sm_90
    loops (:func:`utils.exercises.sass_loop.loop_reports`: both compiles in one child process), with the
    lines whose ``tl.load`` loaded an element in the tensor cases run before it
    (:func:`utils.exercises.sass_loop.recorded_loads`): only their loads count as tiles."""
    from utils.exercises.sass_loop import CompileSpec, loop_reports, recorded_loads

    loaded: collections.Counter = collections.Counter()  # elements loaded per line, over the tensor cases run
    ran = False

    def run(x: Any) -> Any:
        nonlocal ran
        if isinstance(x, CompileSpec):
            specs = (_bias_grad_spec(), _bias_grad_strided_spec())
            reports = loop_reports(kernel, specs)
            report = next(report for spec, report in zip(specs, reports, strict=True) if spec == x)
            lines = frozenset(line for line, elements in loaded.items() if elements) if ran else None
            return dataclasses.replace(report, loaded_lines=lines)
        try:
            with recorded_loads(kernel) as counts:
                result = bias_grad(x, kernel)
            loaded.update(counts)
            ran = True
            return result
        except Exception as error:  # an error only the interpreter makes: say so, then let the check report it
            _explain_interpreter_error(error)
            raise

    run.__name__ = getattr(kernel, "__name__", "run")
    return run


def _explain_interpreter_error(error: BaseException) -> None:
    """Add a note (shown after the error in the verdict) to the two errors Triton's interpreter raises for
    code that compiles: a scalar condition in a mask, and ``.to()`` on a ``range`` loop's variable."""
    root = error
    while type(root).__name__ == "InterpreterError" and root.__cause__ is not None:
        root = root.__cause__
    text = str(root)
    frames = [f for f in traceback.extract_tb(root.__traceback__) if "site-packages" not in f.filename
              and "/triton/" not in f.filename.replace("\\", "/") and "/utils/" not in f.filename.replace("\\", "/")]
    quoted = f" (`{frames[-1].line.strip()[:70]}`)" if frames and frames[-1].line else ""
    note = None
    if isinstance(root, ValueError) and "could not be broadcast" in text:
        note = (f"cause{quoted}: a scalar condition in a mask (`mask & (T > 0)`)? Compiled, Triton broadcasts "
                "a scalar into a mask; the interpreter cannot — put the condition in an `if`, or broadcast it "
                "yourself (`(rows[:, None] < T) & ...`)")
    elif isinstance(root, AttributeError) and "'int' object has no attribute" in text:
        note = (f"cause{quoted}: the interpreter runs a range() loop with a Python int as its variable (compiled, "
                "it is a tensor): `b.to(tl.int64)` fails here — widen the stride instead "
                "(`b * stride_b.to(tl.int64)`), or advance a pointer by `stride_b` each pass")
    if note is not None and hasattr(root, "add_note") and note not in getattr(root, "__notes__", ()):
        root.add_note(note)


# What each kind of overhead compiles to: how a verdict names it from the opcodes left in the loop.
_CONVERSION_BASES = ("I2F", "F2I", "I2FP", "F2IP", "FRND")
_DIVISION = ("I2F", "F2I", "MUFU.RCP", "IMAD.HI", "IABS", "FRND")


def _loop_causes(opcodes: dict[str, int], loads: int) -> list[str]:
    causes = []
    names = " ".join(opcodes)
    if any(marker in names for marker in _DIVISION):
        causes.append("a runtime division or modulo, in integers or in floats (`//`, `%` by a value only known at "
                      "run time compile to I2F/MUFU.RCP/IMAD.HI sequences per row; a float reciprocal to "
                      "FMUL/FRND/F2I)")
    # Sign extensions, 32x32->64 multiplies and high halves of 64-bit adds. A pointer advanced by a step is
    # one 64-bit add per load (IADD3 + IADD3.X, or one IMAD.WIDE): up to two high halves per load are that.
    wide = sum(n for opcode, n in opcodes.items()
               if opcode.startswith(("SHF.R.S32.HI", "IMAD.WIDE.U32", "LEA.HI.X", "IMAD.X", "IADD3.X")))
    if wide > 2 * loads + 2:
        causes.append(f"64-bit address arithmetic rebuilt each iteration ({wide} SHF.R.S32.HI/IMAD.WIDE.U32/"
                      f"LEA.HI.X/IMAD.X/IADD3.X for {loads} loads): compute the tile's offsets once and advance "
                      "a pointer")
    compares = sum(n for opcode, n in opcodes.items() if opcode.startswith(("ISETP", "PLOP3", "SEL", "FSETP", "FSEL")))
    if compares > 4:
        causes.append(f"a mask or a comparison evaluated every iteration ({compares} ISETP/PLOP3/SEL/FSETP/FSEL): "
                      "only the last, partial tile needs the row mask")
    return causes


def diagnose_bias_grad(got: Any, expected: Any) -> str | None:
    """None if ``got`` is right: the column sums (values), or loops within the bound (compile case)."""
    from utils.exercises.sass_loop import LoopReport

    if isinstance(expected, LoopBound):
        if not isinstance(got, LoopReport):
            return f"expected the loop report, got {type(got).__name__}"
        return diagnose_loop(got, expected)
    if not isinstance(got, torch.Tensor):
        return f"expected a tensor of column sums, got {type(got).__name__}"
    if tuple(got.shape) != tuple(expected.shape):
        return f"shape {tuple(got.shape)}, expected {tuple(expected.shape)} (one sum per column d)"
    got, expected = got.double().cpu(), expected.cpu()
    unwritten = torch.nonzero(got.isnan()).flatten().tolist()
    if unwritten:
        return f"columns {_spans(unwritten)} never written (still NaN): the store's mask, or the grid"
    tolerance = 1e-5 * expected.abs().clamp_min(1.0) + 1e-5
    wrong = torch.nonzero((got - expected).abs() > tolerance).flatten().tolist()
    if wrong:
        first = wrong[0]
        return (f"columns {_spans(wrong)} wrong (column {first}: got {float(got[first]):.6g}, expected "
                f"{float(expected[first]):.6g})")
    return None


def explain_bias_grad(case: tuple, got: Any, expected: Any) -> str | None:
    """The common wrong answers, recomputed in float64: the partial tile of each ``b`` dropped, or added twice."""
    (x,) = case
    if not isinstance(x, torch.Tensor) or not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return None
    x64 = x.double().cpu()
    whole = x64.shape[1] - x64.shape[1] % BIAS_GRAD_BLOCK_R
    got, reference = got.double().cpu(), expected.double().cpu()

    def same(value: torch.Tensor) -> bool:
        return bool(torch.allclose(got, value, rtol=1e-5, atol=1e-5)) and not torch.allclose(value, reference)

    if same(x64[:, :whole].sum(dim=(0, 1))):
        return (f"the last, partial tile of each b is missing (its T % BLOCK_R = {x64.shape[1] - whole} rows): "
                "add it after the loop over whole tiles, with the row mask")
    if same(reference + x64[:, whole:].sum(dim=(0, 1))):
        return "the partial tile of each b is added twice: once in the loop, once after it"
    batch, length = x64.shape[0], x64.shape[1]
    for first in range(1, batch):
        if same(x64[:first].sum(dim=(0, 1))):
            return (f"only the first {first} of the B = {batch} b's are added: a loop over b unrolled a fixed number "
                    f"of times (`tl.static_range({first})`)? B is known at run time only: loop with `range(0, B)`")
    for rows in range(BIAS_GRAD_BLOCK_R, length, BIAS_GRAD_BLOCK_R):
        if same(x64[:, :rows].sum(dim=(0, 1))):
            return (f"only the first {rows} rows of each b are added ({rows // BIAS_GRAD_BLOCK_R} tiles of the T = "
                    f"{length} rows): the tiles of t unrolled a fixed number of times (`tl.static_range`)? T is known "
                    "at run time only: loop over the tiles with `range`")
    if x64.shape[1] == x64.shape[2] and same(x64.transpose(1, 2).sum(dim=(0, 1))):
        return ("these are the sums over d, not over t: the strides of t and d are swapped (rows of a tile step by "
                "stride_t, its columns by stride_d, and the pointer advances by BLOCK_R * stride_t)")
    return None


def _spans(indices: list[int]) -> str:
    """``[0, 1, 2, 5]`` → ``"0–2, 5"`` (at most four spans)."""
    spans: list[list[int]] = []
    for i in indices:
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    text = ", ".join(f"{a}–{b}" if a != b else f"{a}" for a, b in spans[:4])
    return text + (", ..." if len(spans) > 4 else "")


def _overhead(ops: Any, tiles: float, bound: LoopBound) -> dict[str, int]:
    """The overhead of a path through a loop (its instructions ``ops``), by opcode: everything but its loads and
    the tiles' FP32 adds (see :class:`LoopBound`)."""
    from utils.exercises.sass_loop import CONVERSIONS

    counted: dict[str, int] = {}
    adds = 0
    for op in getattr(ops, "ops", ops):
        if op.category in ("integer", "control", "mufu") or op.base in CONVERSIONS:
            counted[op.opcode] = counted.get(op.opcode, 0) + 1
        elif op.category == "fp32":
            adds += 1
    extra = adds - round(bound.adds * tiles)
    if extra > 0:
        counted["FP32 beyond the tile's adds"] = extra
    return dict(sorted(counted.items(), key=lambda item: -item[1]))


def _by_line(view: Any, report: Any, opcodes: dict[str, int]) -> str:
    """The overhead of a loop (or of a path through it: ``view`` may be its instructions) by line of the kernel,
    numbered as tracebacks number it (:meth:`LoopReport.where`), with where each line is in the source."""
    import ast

    from utils.exercises.sass_loop import CONVERSIONS

    in_loop: set[int] = set()
    try:
        for node in ast.walk(ast.parse("\n".join(report.source))):
            if isinstance(node, ast.For | ast.While):
                in_loop.update(range(node.body[0].lineno, (node.end_lineno or node.lineno) + 1))
    except SyntaxError:
        pass
    per_line: dict[int, dict[str, int]] = {}
    for op in getattr(view, "ops", view):
        if op.line and op.line <= len(report.source) and (op.category in ("integer", "control", "mufu")
                                                          or op.base in CONVERSIONS):
            per_line.setdefault(op.line, {})
            per_line[op.line][op.opcode] = per_line[op.line].get(op.opcode, 0) + 1
    heavy = sorted(per_line.items(), key=lambda item: -sum(item[1].values()))[:3]
    unattributed = sum(opcodes.values()) - sum(sum(ops.values()) for ops in per_line.values())
    parts = []
    for number, ops in heavy:
        listed = ", ".join(f"{op} ×{n}" for op, n in sorted(ops.items(), key=lambda item: -item[1])[:3])
        where = "" if number in in_loop else (" (a line outside every loop of your source: the line table puts "
                                              "these loop instructions on it)")
        parts.append(f"{report.where(number)}: {sum(ops.values())} ({listed}){where}")
    if parts and unattributed > 0:
        parts.append(f"{unattributed} from no line of yours (Triton's own code, e.g. the zeros a masked load's "
                     "`other` fills, or FP32 beyond the adds)")
    return "; ".join(parts)


def diagnose_loop(report: Any, bound: LoopBound) -> str | None:
    """None if every loop that loads ``x`` keeps the bound (:class:`LoopBound`); else what is wrong, and
    which lines of the kernel the overhead comes from."""
    if report.error is not None:
        return (f"the kernel does not compile alone for sm_90 ({report.error}): it must stand alone — "
                "triton and tl only, no helper or global from the notebook — with the given arguments")
    if not report.loop_found:
        return ("no loop in the kernel's SASS: the rows must still be walked by a loop (B and T are known "
                "at run time only)")
    from utils.exercises.sass_loop import path_load_bytes

    loading = report.loading_loops()
    if not loading:
        atomics = sorted({op.opcode for view in report.all_loops() for op in view.ops
                          if op.base.startswith("ATOM") or op.base.startswith("RED")})
        if atomics:
            return (f"a loop reads x with an atomic ({', '.join(atomics)}: `tl.atomic_add` or another `tl.atomic_*`), "
                    "not a load: an atomic is a read-modify-write of the gradient in memory, serialized per "
                    "address — read x with `tl.load` and add into the accumulator in registers")
        return ("no loop of the kernel's SASS loads x: the loop must walk the rows and load them, one tile "
                "(or more) per pass")
    problems = []
    if report.narrow_products:
        lines = ", ".join(report.where(n) for n in report.narrow_products)
        problems.append(f"{lines}: a loop's index times a stride in 32 bits, an offset that grows with the tensor "
                        "and wraps past 2^31 elements (an fp32 gradient of 8 GiB) — compute it in 64 bits "
                        "(`b * stride_b.to(tl.int64)`) or advance a pointer by the stride instead")
    if report.stride_products:
        lines = ", ".join(report.where(n) for n in report.stride_products)
        problems.append(f"{lines}: a stride times an offset in 32 bits (`cols * stride_d`, `BLOCK_R * stride_t`): "
                        "it reaches as far as the tensor does — a column (D - 1) · stride_d elements from the "
                        "first, rows BLOCK_R · stride_t apart — and wraps past 2^31 elements; multiply in 64 bits "
                        "(`cols.to(tl.int64)[None, :] * stride_d`, `BLOCK_R * stride_t.to(tl.int64)`), once, "
                        "before the loops")
    failures = []
    for view in loading:
        counts = view.counts
        if counts.get("async_copy", 0):
            problems.append("a loop copies x into shared memory with cp.async (LDGSTS), reads it back (LDS) and "
                            "waits for it (DEPBAR/BAR): software pipelining (`tl.range(..., num_stages=n)`). "
                            "This exercise does not use it: a streaming sum keeps its loads in flight without it, "
                            "and its stage bookkeeping is more integer work per tile — use `range` (or `tl.range` "
                            "without num_stages)")
            continue
        if counts.get("shared", 0) or counts.get("sync", 0):
            problems.append("a loop has shared-memory/synchronization instructions (STS/LDS/BAR): a reduction "
                            "inside the loop (tl.sum)? Keep adding the tile into a BLOCK_R × BLOCK_D accumulator "
                            "in registers and reduce once, after the loop")
            continue
        if bound.vector:
            narrow = {op.opcode: 0 for op in view.loads if op.load_bytes < 16}
            for op in view.loads:
                if op.opcode in narrow:
                    narrow[op.opcode] += 1
            if narrow:
                listed = ", ".join(f"{op} ×{n}" for op, n in narrow.items())
                problems.append(f"a loop loads x with narrower than 128-bit loads ({listed}; {bound.layout} are "
                                "expected): the compiler can no longer prove a row's columns contiguous and "
                                "16-byte aligned — build each address as a tile of offsets `rows[:, None] * "
                                "stride_t + cols[None, :] * stride_d` plus a pointer, not per-row offsets "
                                "computed in the loop")
                continue
        # Each path through one pass is held apart (an if/else, a branch no call takes): its tiles are the
        # distinct addresses it loads (of lines that loaded an element in the interpreted cases: a load masked
        # off in every case loads nothing), its overhead what it issues besides their loads and adds.
        # An innermost loop's leanest path is its steady pass, held to the innermost bound; its other paths
        # (a partial tile, counters wrapped once per b) and every path of an outer loop, to the outer bound.
        paths = view.paths() or [view.ops]
        short, measured = None, []
        for path in paths:
            tiles = path_load_bytes(path, report.loads_elements) / bound.tile_bytes
            adds = sum(op.category == "fp32" and op.base not in _CONVERSION_BASES for op in path)
            if view.innermost and tiles and adds < bound.adds * tiles - 0.5 * bound.adds:
                short = (tiles, adds)
            overhead = _overhead(path, tiles, bound)
            measured.append((sum(overhead.values()) / max(tiles, 1), tiles, path, overhead))
        if short is not None:
            problems.append(f"a loop loads {short[0]:g} tile(s) on a path through one pass but issues only "
                            f"{short[1]} FP32 adds on it: adding a tile is {bound.adds} per thread — add every tile "
                            "it loads into the accumulator")
            continue
        measured.sort(key=lambda entry: entry[0])
        for rank, entry in enumerate(measured):
            limit = bound.inner if view.innermost and rank == 0 else bound.nest
            if entry[0] > limit:
                failures.append((entry[0] / limit, limit, view, len(paths), rank, entry))
    if failures:
        _, limit, view, count, rank, (per_tile, tiles, path, overhead) = max(failures, key=lambda f: f[0])
        which = ("the innermost loop" if view.innermost else
                 "an outer loop (one pass of it, each loop inside it run once)")
        if count > 1:
            which += (f", on its leanest path through one pass (of {count} paths; the others may spend up to "
                      f"{bound.nest}),") if rank == 0 and view.innermost else (
                      f", on its costliest path through one pass (of {count} paths),")
        listed = ", ".join(f"{op} ×{n}" for op, n in list(overhead.items())[:6])
        text = (f"{which} spends {per_tile:.3g} instructions of overhead per tile it loads (at most {limit}; "
                f"{tiles:g} tile(s) on that path — distinct addresses, {bound.layout} — beside {bound.adds} FP32 "
                f"adds per tile): {listed}")
        idle = report.idle_load_lines(view.ops)
        if idle:
            text += " — " + "; ".join(f"{report.where(n)} never loads an element in any case: it is not a tile"
                                      for n in idle)
        where = _by_line(path, report, overhead)
        if where:
            text += f" — by line of your kernel: {where}"
        causes = _loop_causes(overhead, sum(1 for op in path if report.loads_elements(op)))
        if causes:
            text += " — that is " + "; and ".join(causes)
        problems.append(text)
    return "; ".join(dict.fromkeys(problems)) if problems else None
