"""Correct bfloat16 numerics for Triton's interpreter.

Triton's interpreter runs every program instance in numpy. numpy has no bfloat16, so the
interpreter keeps bf16 values as their raw 16-bit patterns (``uint16``) and then computes on
those integers: ``a + b`` adds bit patterns, ``tl.dot`` multiplies them, ``tl.sum`` sums them, and
an fp32 -> bf16 cast truncates instead of rounding to nearest even. The results are garbage
(a bf16 ``tl.dot`` is off by ~1e10), while the same kernel compiled for a GPU is right.

This module fixes that once, for every kernel, without touching kernel code: it wraps the
interpreter's builder so that any operation on bf16 operands decodes the bit patterns to fp32,
computes in fp32 (what a GPU's bf16 units and tensor cores do internally), and encodes the result
back to bf16 with round-to-nearest-even. Kernels keep feeding bf16 straight into ``tl.dot`` — the
fast path on tensor cores — and still give correct answers on the CPU.

It is installed only in interpreter mode, by ``kernels.runtime``. Nothing here runs on a GPU.
"""

from __future__ import annotations

import functools

import numpy as np
import triton.language as tl
from triton.runtime import interpreter as _interp

_INSTALLED = False

_FLOATS = (tl.float16, tl.float32, tl.float64)


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """Decode bf16 bit patterns (uint16) to float32 exactly."""
    bits = np.asarray(bits)
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Encode float32 values as bf16 bit patterns, rounding to nearest even (as CUDA's cvt.rn)."""
    x = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    bits = x.view(np.uint32)
    lsb = (bits >> np.uint32(16)) & np.uint32(1)
    rounded = ((bits + np.uint32(0x7FFF) + lsb) >> np.uint32(16)).astype(np.uint16)
    # NaN must stay NaN (rounding could carry a NaN's payload into the exponent's neighbour).
    nan = np.isnan(x)
    if np.any(nan):
        rounded = np.where(nan, ((bits >> np.uint32(16)).astype(np.uint16) | np.uint16(0x0040)), rounded)
    return rounded.astype(np.uint16).reshape(x.shape)


def _is_bf16(handle) -> bool:
    return getattr(handle, "dtype", None) is not None and handle.dtype.scalar == tl.bfloat16 \
        and getattr(handle.data, "dtype", None) == np.uint16


def _to_f32(handle):
    return _interp.TensorHandle(bf16_bits_to_f32(handle.data), tl.float32)


def _from_f32(handle):
    """An fp32 result back to bf16; non-float results (comparisons) pass through as int1."""
    data = handle.data
    if data.dtype == np.bool_:
        return _interp.TensorHandle(data, tl.int1)
    if data.dtype in (np.float32, np.float64, np.float16):
        return _interp.TensorHandle(f32_to_bf16_bits(data.astype(np.float32)), tl.bfloat16)
    return handle


def _wrap_compute(original):
    """Wrap a builder method whose TensorHandle arguments may be bf16."""

    @functools.wraps(original)
    def wrapped(self, *args):
        if not any(_is_bf16(a) for a in args):
            return original(self, *args)
        args = tuple(_to_f32(a) if _is_bf16(a) else a for a in args)
        return _from_f32(original(self, *args))

    return wrapped


def _wrap_ternary(original):
    @functools.wraps(original)
    def wrapped(self, lhs, rhs, other, op):
        # np.where only moves bit patterns, which is already right for bf16.
        if op is np.where or not any(_is_bf16(a) for a in (lhs, rhs, other)):
            return original(self, lhs, rhs, other, op)
        lhs, rhs, other = (_to_f32(a) if _is_bf16(a) else a for a in (lhs, rhs, other))
        return _from_f32(original(self, lhs, rhs, other, op))

    return wrapped


def _wrap_dot(original):
    @functools.wraps(original)
    def wrapped(self, a, b, d, *rest):
        if not any(_is_bf16(h) for h in (a, b, d)):
            return original(self, a, b, d, *rest)
        out_bf16 = _is_bf16(d)
        a, b, d = (_to_f32(h) if _is_bf16(h) else h for h in (a, b, d))
        result = original(self, a, b, d, *rest)
        return _from_f32(result) if out_bf16 else result

    return wrapped


def _wrap_cast(original):
    """Casts to and from bf16: decode exactly, round to nearest even on the way down."""

    @functools.wraps(original)
    def wrapped(self, src, dst_type, *rest):
        src_ty, dst_ty = src.dtype.scalar, dst_type.scalar
        if src_ty == tl.bfloat16 and dst_ty == tl.bfloat16:
            return _interp.TensorHandle(src.data, tl.bfloat16)
        if _is_bf16(src):
            return original(self, _to_f32(src), dst_type, *rest)
        if dst_ty == tl.bfloat16:
            f32 = src if src_ty == tl.float32 else original(self, src, tl.float32)
            return _interp.TensorHandle(f32_to_bf16_bits(f32.data), tl.bfloat16)
        return original(self, src, dst_type, *rest)

    return wrapped


def _wrap_fp_to_fp(original):
    @functools.wraps(original)
    def wrapped(self, src, dst_type, rounding_mode):
        src_ty, dst_ty = src.dtype.scalar, dst_type.scalar
        plain = (tl.bfloat16, *_FLOATS)
        if tl.bfloat16 in (src_ty, dst_ty) and src_ty in plain and dst_ty in plain:
            if dst_ty == tl.bfloat16 and rounding_mode == _interp._ir.ROUNDING_MODE.RTZ:
                f32 = src if src_ty == tl.float32 else self.cast_impl(src, tl.float32)
                data = (np.ascontiguousarray(f32.data, dtype=np.float32).view(np.uint32) >> np.uint32(16))
                return _interp.TensorHandle(data.astype(np.uint16), tl.bfloat16)
            return self.cast_impl(src, dst_type)
        return original(self, src, dst_type, rounding_mode)

    return wrapped


def _bf16_reduce(original, name):
    """ReduceOps.sum / min_max and ScanOps.cumsum / cumprod on bf16 inputs, computed in fp32."""

    @functools.wraps(original)
    def wrapped(self, input, *args, **kwargs):
        if not _is_bf16(input.handle):
            return original(self, input, *args, **kwargs)
        f32 = tl.core.tensor(_to_f32(input.handle), input.type.with_element_ty(tl.float32)
                             if isinstance(input.type, tl.block_type) else tl.float32)
        result = original(self, f32, *args, **kwargs)

        def back(t):
            if isinstance(t, tl.core.tensor) and t.dtype == tl.float32:
                handle = _from_f32(t.handle)
                ty = t.type.with_element_ty(tl.bfloat16) if isinstance(t.type, tl.block_type) else tl.bfloat16
                return tl.core.tensor(handle, ty)
            return t

        if isinstance(result, (list, tuple)):
            return type(result)(back(t) for t in result)
        return back(result)

    return wrapped


def reinterpret_language_library() -> None:
    """Turn triton.language's compiled-mode library functions into interpreted ones.

    ``@triton.jit`` picks compiled or interpreted when it decorates. If ``triton.language`` was
    imported before ``kernels`` switched the interpreter on, ``tl.sum``, ``tl.max``,
    ``tl.sigmoid``, ``tl.rand`` ... are compiled-mode objects and fail inside interpreted kernels.
    """
    import sys

    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    replaced: dict[int, object] = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "triton.language" or name.startswith("triton.language.")):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                if id(value) not in replaced:
                    replaced[id(value)] = InterpretedFunction(value.fn)
                setattr(module, attr, replaced[id(value)])


def explain_missing_driver() -> None:
    """Replace Triton's "0 active drivers" with an error that says why and what to do."""
    import importlib

    driver_module = importlib.import_module("triton.runtime.driver")
    original = getattr(driver_module, "_create_driver", None)
    if original is None:  # a Triton without this hook: keep its own message
        return
    original = driver_module._create_driver

    def create_driver():
        try:
            return original()
        except RuntimeError as error:
            raise RuntimeError(
                "kernels: this Triton kernel was built for compilation, but there is no GPU here "
                f"({error}). kernels runs Triton's interpreter on the CPU, which applies only to kernels "
                "defined after `import kernels` (or with TRITON_INTERPRET=1 set before Python starts). "
                "Import kernels (or utils) before defining your @triton.jit kernels, then re-run the cell."
            ) from error

    driver_module._create_driver = create_driver


def install() -> None:
    """Patch the interpreter's builder and reductions (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    builder = _interp.InterpreterBuilder
    for name in ("binary_op", "unary_op", "create_fma", "create_erf", "create_rsqrt"):
        if hasattr(builder, name):
            setattr(builder, name, _wrap_compute(getattr(builder, name)))
    builder.ternary_op = _wrap_ternary(builder.ternary_op)
    builder.create_dot = _wrap_dot(builder.create_dot)
    builder.cast_impl = _wrap_cast(builder.cast_impl)
    # The create_* cast lambdas call self.cast_impl, so they pick up the wrapper.
    builder.create_fp_to_fp = _wrap_fp_to_fp(builder.create_fp_to_fp)
    for cls, names in ((_interp.ReduceOps, ("sum", "min_max")), (_interp.ScanOps, ("cumsum", "cumprod"))):
        for name in names:
            if hasattr(cls, name):
                setattr(cls, name, _bf16_reduce(getattr(cls, name), name))
    _INSTALLED = True
