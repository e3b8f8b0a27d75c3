"""The runtime: mode selection, launch errors, and correct bf16 numerics in the interpreter.

The bf16 tests run Triton kernels that feed bf16 values straight into arithmetic, ``tl.dot``,
reductions and casts — exactly what production kernels do — and compare with torch. Without
``kernel_ladder._interpreter_numerics`` every one of them fails in the interpreter (negative control
at the bottom shows the unpatched interpreter is wrong).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import kernel_ladder
from kernel_ladder import _interpreter_numerics as numerics
from kernel_ladder import runtime

interpreter_only = pytest.mark.skipif(not runtime.INTERPRETER, reason="interpreter numerics only")


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, OUT_BF16: tl.constexpr):
    rm = tl.arange(0, M)
    rn = tl.arange(0, N)
    rk = tl.arange(0, K)
    a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
    b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
    acc = tl.dot(a, b)  # bf16 x bf16 -> fp32 accumulator, no upcast of the inputs
    if OUT_BF16:
        tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16))
    else:
        tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc)


@triton.jit
def _arith_kernel(x_ptr, y_ptr, out_ptr, n, OP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=1.0)
    y = tl.load(y_ptr + offs, mask=mask, other=1.0)
    if OP == "add":
        r = x + y
    elif OP == "mul":
        r = x * y
    elif OP == "sub":
        r = x - y
    elif OP == "div":
        r = x / y
    elif OP == "neg":
        r = -x
    elif OP == "max":
        r = tl.maximum(x, y)
    elif OP == "where":
        r = tl.where(x < y, x, y)
    elif OP == "exp":
        r = tl.exp(x.to(tl.float32)).to(tl.bfloat16)  # tl.exp takes fp32/fp64 only, as on a GPU
    elif OP == "fma":
        r = x * y + x
    else:
        r = x * 2.0 + 1.0  # bf16 tensor with Python float constants
    tl.store(out_ptr + offs, r, mask=mask)


@triton.jit
def _reduce_kernel(x_ptr, sum_ptr, max_ptr, min_ptr, cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < cols
    x = tl.load(x_ptr + row * cols + offs, mask=mask, other=0.0)
    tl.store(sum_ptr + row, tl.sum(x, axis=0))
    x_neg_inf = tl.where(mask, x, float("-inf"))
    tl.store(max_ptr + row, tl.max(x_neg_inf, axis=0))
    x_pos_inf = tl.where(mask, x, float("inf"))
    tl.store(min_ptr + row, tl.min(x_pos_inf, axis=0))


@triton.jit
def _cast_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask).to(out_ptr.dtype.element_ty), mask=mask)


def test_mode_is_interpreter_without_cuda():
    assert runtime.INTERPRETER == (not torch.cuda.is_available() or os.environ.get("KERNEL_LADDER_INTERPRET") == "1")
    assert runtime.mode() in ("interpreter", "compiled")
    assert "triton" in runtime.describe() and "torch" in runtime.describe()


def test_import_alone_needs_nothing_set():
    """`import kernel_ladder` in a fresh interpreter with no TRITON_* variables works and picks a mode."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON_", "KERNEL_LADDER_"))}
    code = "import kernel_ladder, os; print(kernel_ladder.runtime.mode(), os.environ.get('TRITON_INTERPRET'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    expected = "compiled" if torch.cuda.is_available() else "interpreter 1"
    assert out.stdout.strip().startswith(expected)


@interpreter_only
def test_compiled_launch_without_gpu_says_what_to_do(monkeypatch):
    monkeypatch.setattr(runtime, "INTERPRETER", False)
    assert "no CUDA device is visible" in runtime.describe()  # describe() itself must not crash
    with pytest.raises(RuntimeError,
                       match=r"kernel_ladder\.add: cannot launch a compiled Triton kernel.*KERNEL_LADDER"):
        runtime.require_launchable("kernel_ladder.add", torch.zeros(1))


def test_bf16_codec_round_to_nearest_even_matches_torch():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(100_000, generator=gen) * torch.logspace(-30, 30, 100_000)
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 3.3895e38, 1e-41, 1.0 + 2**-8])
    x = torch.cat([x, special])
    ours = numerics.f32_to_bf16_bits(x.numpy())
    theirs = x.bfloat16().view(torch.int16).numpy().view(np.uint16)
    finite = ~np.isnan(x.numpy())
    assert np.array_equal(ours[finite], theirs[finite])
    assert np.isnan(numerics.bf16_bits_to_f32(ours[~finite])).all()
    back = numerics.bf16_bits_to_f32(theirs)
    assert np.array_equal(back[finite], x.bfloat16().float().numpy()[finite])


@interpreter_only
@pytest.mark.parametrize("out_bf16", [False, True])
def test_bf16_dot_is_correct(out_bf16):
    gen = torch.Generator().manual_seed(1)
    M, N, K = 16, 32, 64
    a = torch.randn(M, K, generator=gen).bfloat16()
    b = torch.randn(K, N, generator=gen).bfloat16()
    c = torch.full((M, N), float("nan"), dtype=torch.bfloat16 if out_bf16 else torch.float32)
    _dot_kernel[(1,)](a, b, c, M, N, K, out_bf16)
    expected = a.double() @ b.double()
    if out_bf16:
        torch.testing.assert_close(c, expected.bfloat16(), rtol=1e-2, atol=1e-2)
    else:
        torch.testing.assert_close(c.double(), expected, rtol=1e-5, atol=1e-5)


@interpreter_only
@pytest.mark.parametrize("op", ["add", "mul", "sub", "div", "neg", "max", "where", "exp", "fma", "const"])
def test_bf16_elementwise_matches_torch(op):
    gen = torch.Generator().manual_seed(2)
    n = 1000
    x = torch.randn(n, generator=gen).bfloat16()
    y = (torch.rand(n, generator=gen) + 0.5).bfloat16()
    out = torch.full((n,), float("nan"), dtype=torch.bfloat16)
    _arith_kernel[(1,)](x, y, out, n, op, 1024)
    xf, yf = x.float(), y.float()
    expected = {
        "add": xf + yf, "mul": xf * yf, "sub": xf - yf, "div": xf / yf, "neg": -xf,
        "max": torch.maximum(xf, yf), "where": torch.where(xf < yf, xf, yf), "exp": torch.exp(xf),
        "fma": xf * yf + xf, "const": xf * 2.0 + 1.0,
    }[op]
    # A GPU computes each bf16 op in fp32 and rounds once; so do we: results agree to one rounding.
    torch.testing.assert_close(out.float(), expected.bfloat16().float(), rtol=8e-3, atol=1e-5)


@interpreter_only
def test_bf16_reductions_are_correct():
    gen = torch.Generator().manual_seed(3)
    rows, cols = 4, 300
    x = torch.randn(rows, cols, generator=gen).bfloat16()
    s = torch.empty(rows, dtype=torch.bfloat16)
    mx = torch.empty(rows, dtype=torch.bfloat16)
    mn = torch.empty(rows, dtype=torch.bfloat16)
    _reduce_kernel[(rows,)](x, s, mx, mn, cols, 512)
    torch.testing.assert_close(s.float(), x.double().sum(1).float(), rtol=1e-2, atol=5e-2)
    assert torch.equal(mx, x.max(1).values)
    assert torch.equal(mn, x.min(1).values)


@interpreter_only
@pytest.mark.parametrize(
    "src,dst",
    [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16),
     (torch.bfloat16, torch.float16), (torch.bfloat16, torch.int32), (torch.int32, torch.bfloat16)],
)
def test_bf16_casts_round_like_torch(src, dst):
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(777, generator=gen) * 100)
    x = x.round().to(src) if src == torch.int32 else x.to(src)
    out = torch.empty(777, dtype=dst)
    _cast_kernel[(1,)](x, out, 777, 1024)
    expected = x.to(torch.float32).trunc().to(dst) if dst == torch.int32 else x.to(dst)
    assert torch.equal(out, expected)


@interpreter_only
def test_negative_control_unpatched_interpreter_is_wrong(monkeypatch):
    """Undo the fix for one call: the interpreter's own bf16 dot is far off, so the tests above can fail."""
    from triton.runtime import interpreter as interp

    unwrapped = interp.InterpreterBuilder.create_dot.__wrapped__
    monkeypatch.setattr(interp.InterpreterBuilder, "create_dot", unwrapped)
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(16, 16, generator=gen).bfloat16()
    b = torch.randn(16, 16, generator=gen).bfloat16()
    c = torch.empty(16, 16)
    _dot_kernel[(1,)](a, b, c, 16, 16, 16, False)
    assert (c - a.float() @ b.float()).abs().max() > 1.0


def test_package_stands_alone():
    """kernel_ladder must not import the course's packages."""
    import pathlib
    import re

    root = pathlib.Path(kernel_ladder.__file__).parent
    for path in root.rglob("*.py"):
        text = path.read_text()
        assert not re.search(r"^\s*(from|import)\s+(utils|solutions|chapters|bench)\b", text, re.M), path


_EARLY_IMPORT = """
import torch, triton, triton.language as tl

@triton.jit
def defined_too_early(x_ptr):
    tl.store(x_ptr, 1.0)

import kernel_ladder

@triton.jit
def uses_library(x_ptr, o_ptr, B: tl.constexpr):
    r = tl.arange(0, B)
    x = tl.load(x_ptr + r)
    tl.store(o_ptr, tl.sum(x, axis=0))
    tl.store(o_ptr + 1, tl.max(tl.sigmoid(x), axis=0))

x = torch.randn(16)
o = torch.zeros(2)
uses_library[(1,)](x, o, 16)
assert abs(o[0] - x.sum()) < 1e-4 and abs(o[1] - torch.sigmoid(x).max()) < 1e-6, o
try:
    defined_too_early[(1,)](o)
except RuntimeError as error:
    print("ERROR:", error)
"""


@interpreter_only
def test_triton_imported_before_kernels(tmp_path):
    """tl.sum & co. still work when triton.language was imported first; a kernel defined before
    `import kernel_ladder` gets an error that says what to do instead of Triton's '0 active drivers'."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON_", "KERNEL_LADDER_"))}
    script = tmp_path / "early_import.py"  # Triton reads kernel source from a file
    script.write_text(_EARLY_IMPORT)
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ERROR: kernel_ladder: this Triton kernel was built for compilation" in out.stdout
    assert "Import kernel_ladder (or utils) before defining" in out.stdout


@pytest.mark.interpreter
def test_interpreter_does_not_warn_about_inf_and_nan_a_gpu_computes_silently():
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        kernel_ladder.silu(torch.full((4,), -100.0))  # exp(100) overflows to inf: sigmoid is 0, as on a GPU
        kernel_ladder.softmax(torch.full((2, 3), float("-inf")))  # -inf - -inf: nan, as torch gives
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)]


@pytest.mark.interpreter
def test_the_interpreter_skips_overflow_checks_whose_verdict_it_discards():
    """The checks feed device_assert, a no-op without debug: the runtime turns them off with debug off
    (a negative control: the stock options would compute them), and integer arithmetic still wraps
    as compiled int32 arithmetic does."""
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    options = interpreter.interpreter_builder.options
    assert not options.debug and not options.sanitize_overflow
    assert interpreter.InterpreterOptions().sanitize_overflow  # what Triton would have done

    @triton.jit
    def wrap_kernel(x_ptr, out_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(out_ptr + offs, tl.load(x_ptr + offs) * 3 + 7)

    x = torch.tensor([2**30, -(2**30), 5, 0], dtype=torch.int32)
    out = torch.empty_like(x)
    wrap_kernel[(1,)](x, out, N=4)
    assert out.tolist() == [(v * 3 + 7 + 2**31) % 2**32 - 2**31 for v in x.tolist()]


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _helper_kernel(x_ptr, out_ptr, N: tl.constexpr, CALLS: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    for _ in tl.static_range(CALLS):
        x = _twice(x)
    tl.store(out_ptr + offs, x)


@pytest.mark.interpreter
def test_a_launch_patches_the_language_once_not_at_every_helper_call(monkeypatch):
    """Triton's interpreter re-scans triton.language at every @triton.jit helper call; the runtime
    keeps the launch's one scan, and the helper still computes."""
    from triton.runtime import interpreter

    scans = []
    original = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *a: (scans.append(a[0]), original(*a))[1])
    x = torch.arange(4, dtype=torch.float32)

    def scans_per_launch() -> dict[int, int]:
        counts = {}
        for calls in (1, 6):
            out = torch.empty_like(x)
            scans.clear()
            _helper_kernel[(2,)](x, out, N=4, CALLS=calls)
            assert torch.equal(out, x * 2**calls)
            counts[calls] = len(scans)
        return counts

    counts = scans_per_launch()
    assert counts[1] == counts[6] > 0, counts
    # The negative control: Triton's own patching scans again at every helper call of every program.
    monkeypatch.setattr(interpreter, "_patch_lang", interpreter._patch_lang.triton_original)
    stock = scans_per_launch()
    assert stock[6] - stock[1] >= 2 * 5, stock
