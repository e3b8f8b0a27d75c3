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

float8 e4m3fn (``torch.float8_e4m3fn``) gets the same treatment (see ``install_fp8``): exact decoding,
fp32 compute, and round-to-nearest-even encoding with saturation to +-448.

It is installed only in interpreter mode, by ``kernel_ladder.runtime``. Nothing here runs on a GPU.
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
    imported before ``kernel_ladder`` switched the interpreter on, ``tl.sum``, ``tl.max``,
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
                "kernel_ladder: this Triton kernel was built for compilation, but there is no GPU here "
                f"({error}). kernels runs Triton's interpreter on the CPU, which applies only to kernels "
                "defined after `import kernel_ladder` (or with TRITON_INTERPRET=1 set before Python starts). "
                "Import kernel_ladder (or utils) before defining your @triton.jit kernels, then re-run the cell."
            ) from error

    driver_module._create_driver = create_driver


def skip_dead_overflow_checks() -> None:
    """Stop the interpreter computing integer-overflow checks whose result it throws away.

    With ``sanitize_overflow`` on (the default), every 32-bit integer ``+``, ``-`` and ``*`` in a
    kernel is also done in int64 and compared against the int32 range, and the verdict is handed to
    ``device_assert`` — which does nothing unless the kernel runs with ``debug=True``, never the case
    in the interpreter. A compiled kernel has the same dead code removed by the compiler; the
    interpreter executes it with numpy, about five extra array operations per integer operation (a
    third or more of an index-heavy kernel's interpreted time). Tying the check to ``debug``, as
    ``device_assert`` already is, changes no result.
    """
    import dataclasses

    # The interpreter keeps one module-level builder, made at import; its options are what the
    # semantic layer reads.
    builder = getattr(_interp, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is not None and getattr(options, "sanitize_overflow", False) and not options.debug:
        builder.options = dataclasses.replace(options, sanitize_overflow=False)


def patch_language_once_per_launch() -> None:
    """Stop the interpreter re-patching ``triton.language`` at every device-function call.

    A launch points ``tl``'s builtins at the interpreter (``_patch_lang``: ``inspect.getmembers``
    over ``tl``, ``tl.tensor`` and ``tl.math``) and undoes it when the launch ends. Every call of a
    ``@triton.jit`` helper inside the kernel (``_rotate_heads`` per token, an activation per tile)
    runs the same scan again, finds everything already patched, and leaves it so — a few hundred
    microseconds a call, a fifth of a decoder forward's interpreted time. Here the scan is skipped
    when the launch in progress has already patched the language modules the helper sees; outside
    a launch, or for a module the launch did not patch, Triton's own patching runs as before.
    """
    import inspect

    if getattr(_interp._patch_lang, "_kernels_once_per_launch", False):
        return
    original_patch, original_call = _interp._patch_lang, _interp.GridExecutor.__call__
    launches: list[set[int]] = []  # per launch in progress: the language modules it has patched

    def languages(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and (v is tl or v is tl.core)}

    def _patch_lang(fn):
        seen = languages(fn)
        if launches and seen and seen <= launches[-1]:
            return _interp._LangPatchScope()  # already patched for this launch: nothing to do or undo
        scope = original_patch(fn)
        if launches:
            launches[-1].update(seen)
        return scope

    @functools.wraps(original_call)
    def __call__(self, *args, **kwargs):
        launches.append(set())
        try:
            return original_call(self, *args, **kwargs)
        finally:
            launches.pop()

    _patch_lang._kernels_once_per_launch = True
    _patch_lang.triton_original = original_patch  # for a test's negative control
    _interp._patch_lang = _patch_lang
    _interp.GridExecutor.__call__ = __call__


def install() -> None:
    """Patch the interpreter's builder and reductions (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    skip_dead_overflow_checks()
    patch_language_once_per_launch()
    install_fp8()  # innermost: the bf16 repairs below wrap the fp8 ones
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


# ----------------------------------------------------------------------------------------------
# float8 e4m3fn (torch.float8_e4m3fn, Triton's fp8e4nv)
# ----------------------------------------------------------------------------------------------
#
# The interpreter keeps fp8 values as their raw bytes (uint8) and gets most of what it does with
# them wrong: arithmetic and comparisons act on the codes; its fp32 -> fp8 conversion flushes
# every subnormal to zero, rounds half up by magnitude, does not saturate (values past 448 come
# out as NaN or as 256) and turns inf into 256 and NaN into 384; and it decodes the NaN codes
# 0x7F / 0xFF as +-480 (in casts and in ``tl.dot``). The repairs below mirror the bf16 ones:
# decode exactly (a 256-entry table), compute in fp32, and encode back with round-to-nearest-even
# and saturation to +-448 — what a GPU's ``cvt.rn.satfinite.e4m3x2.f32`` does, and what torch's
# ``.to(torch.float8_e4m3fn)`` does (NaN stays NaN). They sit underneath the bf16 repairs, so a
# bf16 <-> fp8 cast goes through fp32 exactly once.

#: Largest finite e4m3fn value: 1.75 * 2**8.
FP8_E4M3_MAX = 448.0


def _fp8_e4m3_table() -> np.ndarray:
    codes = np.arange(256, dtype=np.int64)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent = (codes >> 3) & 0xF
    mantissa = (codes & 0x7).astype(np.float64)
    normal = (1.0 + mantissa / 8.0) * np.exp2(exponent.astype(np.float64) - 7.0)
    subnormal = mantissa * 2.0**-9
    values = sign * np.where(exponent == 0, subnormal, normal)
    values[(codes & 0x7F) == 0x7F] = np.nan  # e4m3fn has no infinities; S.1111.111 is NaN
    return values.astype(np.float32)


_FP8_E4M3_VALUES = _fp8_e4m3_table()
#: The 127 non-negative finite values in code order (0x00 ... 0x7E), which is ascending.
_FP8_E4M3_POSITIVE = _FP8_E4M3_VALUES[:0x7F].astype(np.float64)


def fp8e4m3_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """Decode float8 e4m3fn codes (uint8) to float32 exactly (0x7F / 0xFF are NaN)."""
    return _FP8_E4M3_VALUES[np.asarray(bits).astype(np.uint8)]


def f32_to_fp8e4m3_bits(x: np.ndarray, round_to_zero: bool = False) -> np.ndarray:
    """Encode values (float16/32/64) as float8 e4m3fn codes, rounding once to nearest even.

    Finite values beyond +-448 and infinities saturate to +-448 (``satfinite``); NaN becomes
    0x7F. With ``round_to_zero`` the rounding truncates instead (``fp_downcast_rounding="rtz"``).
    """
    x = np.asarray(x)
    values = x.astype(np.float64)  # exact for every float16/float32 input
    magnitude = np.abs(values)
    with np.errstate(invalid="ignore", over="ignore"):
        _, exponent = np.frexp(magnitude)  # magnitude = f * 2**exponent, f in [0.5, 1)
        # The spacing of e4m3 values around `magnitude`: 3 mantissa bits below the leading one,
        # and the fixed subnormal spacing 2**-9 below the smallest normal 2**-6.
        quantum = np.exp2(np.maximum(exponent - 1, -6) - 3.0)
        steps = magnitude / quantum
        rounded = (np.trunc(steps) if round_to_zero else np.rint(steps)) * quantum  # rint: ties to even
        rounded = np.minimum(rounded, FP8_E4M3_MAX)  # saturate, also +-inf
    rounded = np.where(np.isnan(values), 0.0, rounded)
    codes = np.searchsorted(_FP8_E4M3_POSITIVE, rounded).astype(np.uint8)  # exact: rounded is a value
    codes |= np.signbit(values).astype(np.uint8) << np.uint8(7)
    codes = np.where(np.isnan(values), np.uint8(0x7F), codes)
    return codes.astype(np.uint8).reshape(x.shape)


def _is_fp8e4m3(handle) -> bool:
    return getattr(handle, "dtype", None) is not None and handle.dtype.scalar == tl.float8e4nv \
        and getattr(handle.data, "dtype", None) == np.uint8


def _is_other_fp8(handle) -> bool:
    dtype = getattr(handle, "dtype", None)
    return dtype is not None and dtype.scalar.is_fp8() and dtype.scalar != tl.float8e4nv


def _fp8_to_f32(handle):
    return _interp.TensorHandle(fp8e4m3_bits_to_f32(handle.data), tl.float32)


def _fp8_from_f32(handle):
    """An fp32 result back to fp8 e4m3; non-float results (comparisons) pass through as int1."""
    data = handle.data
    if data.dtype == np.bool_:
        return _interp.TensorHandle(data, tl.int1)
    if data.dtype in (np.float32, np.float64, np.float16):
        return _interp.TensorHandle(f32_to_fp8e4m3_bits(data), tl.float8e4nv)
    return handle


def _exact_float64(builder, handle) -> np.ndarray:
    """The values of a float handle (bf16 bit patterns decoded, fp8 e4m3 decoded) as float64."""
    scalar = handle.dtype.scalar
    if scalar == tl.bfloat16 and handle.data.dtype == np.uint16:
        return bf16_bits_to_f32(handle.data).astype(np.float64)
    if _is_fp8e4m3(handle):
        return fp8e4m3_bits_to_f32(handle.data).astype(np.float64)
    if scalar.is_floating() and handle.data.dtype in (np.float16, np.float32, np.float64):
        return handle.data.astype(np.float64)
    return builder.cast_impl(handle, tl.float32).data.astype(np.float64)


def _fp8_wrap_compute(original):
    @functools.wraps(original)
    def wrapped(self, *args):
        if not any(_is_fp8e4m3(a) for a in args):
            return original(self, *args)
        args = tuple(_fp8_to_f32(a) if _is_fp8e4m3(a) else a for a in args)
        return _fp8_from_f32(original(self, *args))

    return wrapped


def _fp8_wrap_ternary(original):
    @functools.wraps(original)
    def wrapped(self, lhs, rhs, other, op):
        # np.where only moves codes, which is already right for fp8.
        if op is np.where or not any(_is_fp8e4m3(a) for a in (lhs, rhs, other)):
            return original(self, lhs, rhs, other, op)
        lhs, rhs, other = (_fp8_to_f32(a) if _is_fp8e4m3(a) else a for a in (lhs, rhs, other))
        return _fp8_from_f32(original(self, lhs, rhs, other, op))

    return wrapped


def _fp8_wrap_dot(original):
    """fp8 operands decoded exactly to fp32 (the interpreter's own path turns NaN into 480)."""

    @functools.wraps(original)
    def wrapped(self, a, b, d, *rest):
        if not any(_is_fp8e4m3(h) for h in (a, b)):
            return original(self, a, b, d, *rest)

        def decode(h):
            if _is_fp8e4m3(h):
                return _fp8_to_f32(h)
            if _is_other_fp8(h):  # e.g. e5m2 x e4m3: the interpreter's own decoding for the other
                f16 = _interp._convert_float(h.data, h.dtype.scalar, tl.float16, None).view(np.float16)
                return _interp.TensorHandle(f16.astype(np.float32), tl.float32)
            return h

        return original(self, decode(a), decode(b), d, *rest)

    return wrapped


def _fp8_wrap_cast(original):
    """Casts from fp8 decode exactly; casts to fp8 round once to nearest even and saturate."""

    @functools.wraps(original)
    def wrapped(self, src, dst_type, *rest):
        src_ty, dst_ty = src.dtype.scalar, dst_type.scalar
        if src_ty == tl.float8e4nv and dst_ty == tl.float8e4nv:
            return _interp.TensorHandle(src.data, tl.float8e4nv)
        if _is_fp8e4m3(src):
            f32 = _fp8_to_f32(src)
            return f32 if dst_ty == tl.float32 else self.cast_impl(f32, dst_type)
        if dst_ty == tl.float8e4nv and not _is_other_fp8(src):
            return _interp.TensorHandle(f32_to_fp8e4m3_bits(_exact_float64(self, src)), tl.float8e4nv)
        return original(self, src, dst_type, *rest)

    return wrapped


def _fp8_wrap_fp_to_fp(original):
    @functools.wraps(original)
    def wrapped(self, src, dst_type, rounding_mode):
        src_ty, dst_ty = src.dtype.scalar, dst_type.scalar
        if _is_fp8e4m3(src) and not dst_ty.is_fp8():
            f32 = _fp8_to_f32(src)
            return f32 if dst_ty == tl.float32 else self.cast_impl(f32, dst_type)
        if dst_ty == tl.float8e4nv and not src_ty.is_fp8():
            rtz = rounding_mode == _interp._ir.ROUNDING_MODE.RTZ
            bits = f32_to_fp8e4m3_bits(_exact_float64(self, src), round_to_zero=rtz)
            return _interp.TensorHandle(bits, tl.float8e4nv)
        return original(self, src, dst_type, rounding_mode)

    return wrapped


def _fp8_reduce(original):
    """ReduceOps.sum / min_max and ScanOps.cumsum / cumprod on fp8 e4m3 inputs, computed in fp32."""

    @functools.wraps(original)
    def wrapped(self, input, *args, **kwargs):
        if not _is_fp8e4m3(input.handle):
            return original(self, input, *args, **kwargs)
        f32 = tl.core.tensor(_fp8_to_f32(input.handle), input.type.with_element_ty(tl.float32)
                             if isinstance(input.type, tl.block_type) else tl.float32)
        result = original(self, f32, *args, **kwargs)

        def back(t):
            if isinstance(t, tl.core.tensor) and t.dtype == tl.float32:
                ty = t.type.with_element_ty(tl.float8e4nv) if isinstance(t.type, tl.block_type) else tl.float8e4nv
                return tl.core.tensor(_fp8_from_f32(t.handle), ty)
            return t

        if isinstance(result, (list, tuple)):
            return type(result)(back(t) for t in result)
        return back(result)

    return wrapped


#: The interpreter's own methods, before the fp8 repairs (for tests' negative controls).
FP8_ORIGINALS: dict[str, object] = {}
_FP8_INSTALLED = False


def install_fp8() -> None:
    """Patch the interpreter's fp8 e4m3 numerics (idempotent). ``install`` calls it first, so the
    bf16 repairs wrap these: every ``__wrapped__`` chain ends at the interpreter's own method."""
    global _FP8_INSTALLED
    if _FP8_INSTALLED:
        return
    builder = _interp.InterpreterBuilder
    wrappers = {
        "ternary_op": _fp8_wrap_ternary, "create_dot": _fp8_wrap_dot, "cast_impl": _fp8_wrap_cast,
        "create_fp_to_fp": _fp8_wrap_fp_to_fp,
    }
    for name in ("binary_op", "unary_op", "create_fma", "create_erf", "create_rsqrt"):
        wrappers[name] = _fp8_wrap_compute
    for name, wrap in wrappers.items():
        if hasattr(builder, name):
            FP8_ORIGINALS[name] = getattr(builder, name)
            setattr(builder, name, wrap(getattr(builder, name)))
    for cls, names in ((_interp.ReduceOps, ("sum", "min_max")), (_interp.ScanOps, ("cumsum", "cumprod"))):
        for name in names:
            if hasattr(cls, name):
                FP8_ORIGINALS[f"{cls.__name__}.{name}"] = getattr(cls, name)
                setattr(cls, name, _fp8_reduce(getattr(cls, name)))
    _FP8_INSTALLED = True
