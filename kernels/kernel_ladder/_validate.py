"""Input checks shared by the ops, with errors a user can act on.

Every message starts with the op's public name (``kernel_ladder.gelu``), names the argument, and says
what was expected and what came, e.g.
``kernel_ladder.gelu: x must be float32, float16 or bfloat16, got torch.int64``. Type problems raise
``TypeError``; values out of range, shape and device mismatches raise ``ValueError``.

Checks run before any Triton launch, so bad input never reaches Triton's compiler.

Checks of tensor *values* (not shapes) go through :func:`check_values`, the one place that applies
the runtime's policy (:mod:`kernel_ladder.runtime`: on the host for CPU tensors, or when asked; else a
device-side assertion on CUDA; nothing while traced or captured), so no op synchronizes by default.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence

import torch

from . import _autocast, _launch, runtime

__all__ = [
    "FLOAT_DTYPES",
    "check_tensor",
    "check_float_dtype",
    "check_same_dtype",
    "check_same_device",
    "check_same_shape",
    "check_broadcastable",
    "check_probability",
    "check_choice",
    "check_seed",
    "check_bool",
    "check_shape",
    "is_int",
    "check_attention_options",
    "check_paged_caches",
    "check_values",
    "share_elements",
]

#: The floating dtypes the elementwise kernels accept (they compute in float32 internally).
FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)

_FLOAT_NAMES = "float32, float16 or bfloat16"


def _type_name(value: object) -> str:
    return type(value).__name__


def check_tensor(op: str, name: str, value: object) -> torch.Tensor:
    """``value`` must be a ``torch.Tensor``."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {_type_name(value)}")
    return value


def check_float_dtype(op: str, name: str, tensor: torch.Tensor) -> None:
    """``tensor`` must be float32, float16 or bfloat16."""
    if tensor.dtype not in FLOAT_DTYPES:
        hint = (
            "cast it with .float(), .half() or .bfloat16() first"
            if tensor.is_floating_point() or tensor.is_complex()
            else "integer and bool tensors have no floating-point values to compute on: convert with .float()"
        )
        raise TypeError(f"{op}: {name} must be {_FLOAT_NAMES}, got {tensor.dtype} ({hint})")


def check_same_dtype(op: str, name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    """``a`` and ``b`` must share a dtype (the ops do not promote types), unless autocast is about to
    cast both to one (``kernel_ladder._autocast.unifies``: ``op``'s policy casts the arguments ``name_a`` and
    ``name_b`` on their device), as torch's ``F.linear(x_bf16, w_fp32)`` is accepted under autocast."""
    if a.dtype != b.dtype and not _autocast.unifies(op, (name_a, a), (name_b, b)):
        raise TypeError(
            f"{op}: {name_a} and {name_b} must have the same dtype, got {a.dtype} and {b.dtype} "
            f"(cast one of them with .to())"
        )


def check_same_device(op: str, name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    """``a`` and ``b`` must live on the same device."""
    if a.device != b.device:
        raise ValueError(
            f"{op}: {name_a} and {name_b} must be on the same device, got {a.device} and {b.device}"
        )


def check_same_shape(op: str, name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    """``a`` and ``b`` must have exactly the same shape (no broadcasting)."""
    if a.shape != b.shape:
        raise ValueError(
            f"{op}: {name_a} and {name_b} must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}"
        )


def check_broadcastable(op: str, name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> torch.Size:
    """``a`` and ``b`` must broadcast together (torch's rules); returns the broadcast shape."""
    try:
        return _broadcast_shapes(a.shape, b.shape)
    except RuntimeError:
        raise ValueError(
            f"{op}: {name_a} and {name_b} must have broadcastable shapes, "
            f"got {tuple(a.shape)} and {tuple(b.shape)}"
        ) from None


@_launch.shape_cache
def _broadcast_shapes(a: torch.Size, b: torch.Size) -> torch.Size:
    # Cached: torch.broadcast_shapes is Python with symbolic-shape guards, most of a small add's host time.
    return torch.broadcast_shapes(a, b)


def check_probability(op: str, name: str, value: object) -> float:
    """``value`` must be a real number in [0, 1]; returns it as a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{op}: {name} must be a float in [0, 1], got {_type_name(value)}")
    value = float(value)
    if not 0.0 <= value <= 1.0:  # also rejects NaN
        raise ValueError(f"{op}: {name} must be in [0, 1], got {value}")
    return value


def check_choice(op: str, name: str, value: object, choices: Sequence[str]) -> str:
    """``value`` must be one of the strings ``choices``."""
    names = [repr(c) for c in choices]
    expected = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
    if not isinstance(value, str):
        raise TypeError(f"{op}: {name} must be {expected}, got {_type_name(value)}")
    if value not in choices:
        raise ValueError(f"{op}: {name} must be {expected}, got {value!r}")
    return value


#: Seeds are passed to the kernel as a 64-bit integer (Philox's key).
SEED_MAX = 2**63 - 1


def check_seed(op: str, name: str, value: object) -> int:
    """``value`` must be an int in [0, 2**63 - 1]; returns it as an int."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{op}: {name} must be an int or None, got {_type_name(value)}")
    value = int(value)
    if not 0 <= value <= SEED_MAX:
        raise ValueError(f"{op}: {name} must be in [0, 2**63 - 1], got {value}")
    return value


def check_bool(op: str, name: str, value: object) -> bool:
    """``value`` must be a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{op}: {name} must be a bool, got {_type_name(value)}")
    return value


def check_shape(op: str, name: str, value: object) -> tuple[int, ...]:
    """``value`` must be a sequence of non-negative ints (or a torch.Size); returns a tuple."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = (value,)
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise TypeError(f"{op}: {name} must be a sequence of ints, got {_type_name(value)}")
    dims = []
    for size in value:
        if isinstance(size, bool) or not isinstance(size, numbers.Integral):
            raise TypeError(f"{op}: {name} must be a sequence of ints, got an element of type {_type_name(size)}")
        if size < 0:
            raise ValueError(f"{op}: {name} must have non-negative sizes, got {tuple(value)}")
        dims.append(int(size))
    return tuple(dims)


def schema_types(tensors: tuple = (), optional_tensors: tuple = (), reals: tuple = (), optional_reals: tuple = (),
                 ints: tuple = (), optional_ints: tuple = (), flags: tuple = (), strings: tuple = ()) -> bool:
    """Whether every value has a type an op's schema takes as it is (a public wrapper's fast path).

    A public function checks its arguments in full only when this is False: the custom op behind
    it checks the values in its body (or its fake, under ``torch.compile``), so checking them in
    the wrapper too would validate every call twice. What the wrapper must catch first is what the
    schema itself would refuse with torch's own message, which names neither the op nor the
    argument: a list where a tensor goes, a string for a float. ``reals`` are Python floats or
    ints (not bools); ``ints`` Python ints or ``torch.SymInt`` (not bools: the schema's ``int`` takes a
    symbolic int under ``torch.compile``); ``flags`` bools.
    """
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            return False
    for t in optional_tensors:
        if t is not None and not isinstance(t, torch.Tensor):
            return False
    for v in reals:
        if type(v) is not float and type(v) is not int:
            return False
    for v in optional_reals:
        if v is not None and type(v) is not float and type(v) is not int:
            return False
    for v in ints:
        if type(v) is not int and type(v) is not torch.SymInt:
            return False
    for v in optional_ints:
        if v is not None and type(v) is not int and type(v) is not torch.SymInt:
            return False
    for v in flags:
        if type(v) is not bool:
            return False
    for v in strings:
        if type(v) is not str:
            return False
    return True


def is_int(value: object) -> bool:
    """An integer, and not a bool: a Python int, or a ``torch.SymInt`` — what an int argument becomes
    under ``torch.compile`` once it is dynamic (a size, ``max_seqlen``, a count worked out from shapes)."""
    return isinstance(value, (numbers.Integral, torch.SymInt)) and not isinstance(value, bool)


def check_attention_options(op: str, softmax_scale: object, window: object, softcap: object) -> None:
    """The options every attention op shares: ``softmax_scale`` (None for 1/sqrt(D)), a sliding
    ``window`` (keys per query, its own included) and Gemma-2's ``softcap``."""
    import math

    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
            raise TypeError(f"{op}: softmax_scale must be a float or None (for 1/sqrt(D)), "
                            f"got {type(softmax_scale).__name__}")
        if not (math.isfinite(softmax_scale) and softmax_scale > 0):
            raise ValueError(f"{op}: softmax_scale must be a positive finite number, got {softmax_scale}")
    if window is not None:
        if not is_int(window):
            raise TypeError(f"{op}: window must be an int (the number of most recent keys each query sees) or None, "
                            f"got {type(window).__name__}")
        if window < 1:
            raise ValueError(f"{op}: window must be >= 1 (each query sees its own key and the window - 1 "
                             f"before it), got {window}")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
            raise TypeError(f"{op}: softcap must be a float or None, got {type(softcap).__name__}")
        if not (math.isfinite(softcap) and softcap > 0):
            raise ValueError(f"{op}: softcap must be a positive finite number (Gemma-2 uses 50.0), got {softcap}")


def check_paged_caches(op: str, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """A paged K/V cache pair: 4-D ``(num_blocks, block_size, Hkv, D)``, the same shape and dtype."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4:
            raise ValueError(f"{op}: {name} must be 4-D (num_blocks, block_size, Hkv, D), got shape {tuple(t.shape)}"
                             " (for one layer of a (layers, ...) cache, pass cache[layer])")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"{op}: k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} "
                         f"and {tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"{op}: k_cache and v_cache must have the same dtype, got {k_cache.dtype} and {v_cache.dtype}")


def share_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors share any byte of memory: exact for any sizes, strides (0 included) and offsets.

    Not by their byte ranges: ``kv[:, 0]`` and ``kv[:, 1]`` of one ``(blocks, 2, ...)`` tensor each span the
    other's bytes and share none. Decided from the strides alone, without enumerating an element (see
    :func:`_strided_intersect`), so a cache of billions of elements costs microseconds; cached by shape.
    Tensors on different devices share nothing. (Meta tensors all start at address 0: views of one
    meta tensor are answered exactly; two separate meta tensors as if one storage held both.)
    """
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    return _strided_intersect(a.data_ptr(), tuple(a.shape), tuple(a.stride()), a.element_size(),
                              b.data_ptr(), tuple(b.shape), tuple(b.stride()), b.element_size())


@_launch.shape_cache
def _strided_intersect(start_a: int, sizes_a: tuple[int, ...], strides_a: tuple[int, ...], item_a: int,
                       start_b: int, sizes_b: tuple[int, ...], strides_b: tuple[int, ...], item_b: int) -> bool:
    """Whether ``{start_a + item_a * sum(i_k * strides_a[k]) + r}`` (``0 <= i_k < sizes_a[k]``,
    ``0 <= r < item_a``: every byte of every element) meets the same set of ``b``.

    A shared byte is a solution of ``sum(i_k g_k) = T`` over both views' dims, each index in its range:
    with ``b``'s indices counted from their top (``j' = m - 1 - j``) every coefficient is positive, and
    ``T = start_b - start_a + (b's largest offset) + item_b - 1``. Equal coefficients merge (a range of
    ``u1 + u2``), which is what makes the interleaved halves of a cache cheap: they share every stride.
    :func:`_representable` then decides it exactly."""
    if 0 in sizes_a or 0 in sizes_b:
        return False
    gens: dict[int, int] = {}
    target = start_b - start_a + item_b - 1
    for sizes, strides, item, sign in ((sizes_a, strides_a, item_a, 1), (sizes_b, strides_b, item_b, -1)):
        for size, stride in zip(sizes, strides):
            step = abs(stride) * item
            if size <= 1 or step == 0:
                continue
            if stride < 0:  # index from the other end: the same set, a positive step
                target += sign * (size - 1) * step
            if sign < 0:
                target += (size - 1) * step
            gens[step] = gens.get(step, 0) + size - 1
        if item > 1:
            gens[1] = gens.get(1, 0) + item - 1
    return _representable(target, sorted(gens.items(), reverse=True))


def _representable(target: int, gens: list[tuple[int, int]]) -> bool:
    """Whether ``target = sum(c_t g_t)`` with ``0 <= c_t <= u_t`` for ``gens = [(g_t, u_t)]``, ``g_t`` > 0 descending.

    A depth-first search from the largest coefficient: ``c_t`` ranges only over values that leave a rest
    the smaller coefficients can reach (at most their maximum, and a multiple of their gcd), so when each
    coefficient exceeds what the smaller ones add up to (a tensor's own dims) at most one or two values
    are tried per level; the last two coefficients are solved in closed form (extended Euclid)."""
    n = len(gens)
    rest_max, rest_gcd = [0] * (n + 1), [0] * (n + 1)
    for t in range(n - 1, -1, -1):
        rest_max[t] = rest_max[t + 1] + gens[t][0] * gens[t][1]
        rest_gcd[t] = math.gcd(rest_gcd[t + 1], gens[t][0])

    def search(t: int, rest: int) -> bool:
        if rest < 0 or rest > rest_max[t] or (rest % rest_gcd[t] if rest_gcd[t] else rest):
            return False
        if n - t <= 2:
            return _two_terms(rest, gens[t:])
        g, u = gens[t]
        g_rest = rest_gcd[t + 1]
        h = math.gcd(g, g_rest)
        period = g_rest // h  # c_t is fixed modulo this by the gcd of the rest
        first = (rest // h) * pow(g // h, -1, period) % period if period > 1 else 0
        lo = max(0, -((rest_max[t + 1] - rest) // g))  # ceil((rest - rest_max[t + 1]) / g)
        hi = min(u, rest // g)
        start = lo + (first - lo) % period
        return any(search(t + 1, rest - c * g) for c in range(start, hi + 1, period))

    return search(0, target)


def _two_terms(rest: int, gens: list[tuple[int, int]]) -> bool:
    """``rest = x g0 + y g1`` with ``0 <= x <= u0``, ``0 <= y <= u1`` (or fewer terms), in closed form."""
    if not gens:
        return rest == 0
    if len(gens) == 1:
        (g, u), = gens
        return rest % g == 0 and rest // g <= u
    (a, ua), (b, ub) = gens
    g, x0, y0 = _extended_gcd(a, b)
    if rest % g:
        return False
    a, b, rest = a // g, b // g, rest // g
    x, y = x0 * rest, y0 * rest  # one solution; all are (x + k b, y - k a)
    k_lo = max(-(x // b), -((ub - y) // a))  # x + k b >= 0, y - k a <= ub
    k_hi = min((ua - x) // b, y // a)  # x + k b <= ua, y - k a >= 0
    return k_lo <= k_hi


def _extended_gcd(a: int, b: int) -> tuple[int, int, int]:
    """``(g, x, y)`` with ``a x + b y = g = gcd(a, b)``."""
    x0, x1, y0, y1 = 1, 0, 0, 1
    while b:
        q, a, b = a // b, b, a % b
        x0, x1 = x1, x0 - q * x1
        y0, y1 = y1, y0 - q * y1
    return a, x0, y0


def check_values(tensors: Sequence[torch.Tensor], ok: Callable[[], torch.Tensor], message: str,
                 error: Callable[[], str] | None = None, *, host_ok: Callable[[], bool] | None = None,
                 device_assert: bool = True) -> None:
    """A data-dependent check of ``tensors``' values, by the runtime's policy; raises ``ValueError``.

    Args:
        tensors: the tensors whose values are checked (their device decides the policy).
        ok: builds a one-element tensor on their device, true (nonzero) when the values are valid —
            computed with tensor ops, never read here unless the host check runs. Called only when a
            check of some kind runs, so a skipped check costs no launch.
        message: the rule, starting with the op's name (``kernel_ladder.grouped_matmul: offsets must ...``).
        error: the full text of the ``ValueError`` (naming the bad values, read on the host), built
            only on failure; ``None`` for ``message`` itself.
        host_ok: for CPU tensors, the same condition computed on their memory directly (numpy),
            instead of ``ok``'s tensor ops: no aten op runs, so a ``utils.trace`` of the op counts
            only its own work, as a GPU would run it by default.
        device_assert: whether CUDA tensors are asserted on the device when the host check is off
            (``False``: nothing runs on CUDA unless asked; for checks whose kernels mask bad values
            anyway, or whose assertion would cost a decode step more launches than it is worth).

    When :func:`kernel_ladder.runtime.values_checked` says so, the check runs on the host: on the CPU through
    ``host_ok`` or ``torch._assert_async`` (which reads the flag at once), on CUDA with one
    synchronization. Else, on CUDA, ``ok`` is asserted on the device (``torch._assert_async``:
    asynchronous, no synchronization), its message saying how to get the host check. Else (tracing,
    or the CPU with checks off) nothing.
    """
    tensors = tuple(tensors)
    if runtime.values_checked(*tensors):
        on_cpu = all(t.device.type == "cpu" for t in tensors)
        if on_cpu and host_ok is not None:
            if host_ok():
                return
        else:
            flag = ok()
            if flag.device.type == "cpu":
                try:
                    torch._assert_async(flag, message)
                    return
                except RuntimeError:
                    pass
            elif bool(flag):  # the one synchronization the user asked for
                return
        raise ValueError(error() if error is not None else message) from None
    if device_assert and runtime.device_assertions(*tensors):
        torch._assert_async(ok(), f"{message} ({runtime.CHECK_VALUES_HINT})")
