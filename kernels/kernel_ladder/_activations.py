"""Activations written once, each with its derivative, as ``@triton.jit`` functions on float32 tiles.

Every kernel that applies an activation — ``kernel_ladder.gelu`` and ``kernel_ladder.silu``, the SwiGLU gate,
the matmul epilogue behind ``kernel_ladder.linear``, and their backward kernels — calls these, so a
formula and its derivative live in one place and cannot drift apart.

=============  ==============================================  ===============================================
name           f(x)                                            f'(x)
=============  ==============================================  ===============================================
``relu``       max(x, 0)                                       1 where x > 0, else 0
``gelu``       x Φ(x) = x/2 (1 + erf(x / √2))                  Φ(x) + x φ(x),  φ(x) = exp(-x²/2) / √(2π)
``gelu_tanh``  x/2 (1 + tanh(z)) = x σ(2z),                    σ(2z) + 2 x σ(2z) (1 - σ(2z)) dz/dx,
               z = √(2/π) (x + 0.044715 x³)                    dz/dx = √(2/π) (1 + 3 · 0.044715 x²)
``silu``       x σ(x)                                          σ(x) (1 + x (1 - σ(x)))
=============  ==============================================  ===============================================

``1/2 (1 + tanh(z)) == σ(2z)``: the sigmoid form needs no ``tanh`` (which is libdevice-only on older
Triton and missing from the interpreter) and is exact at both tails. The derivatives recompute
σ and erf from ``x`` rather than saving them: in a memory-bound kernel FLOPs are free, bytes are not.

:func:`apply` and :func:`derivative` select one of them by a ``tl.constexpr`` name (``"none"`` is the
identity), which is how the matmul epilogue and the linear backward are specialized.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "ACTIVATIONS",
    "apply",
    "derivative",
    "gelu",
    "gelu_grad",
    "gelu_tanh",
    "gelu_tanh_grad",
    "relu",
    "relu_grad",
    "silu",
    "silu_grad",
]

#: Every activation this module defines, by the name kernels pass as a constexpr.
ACTIVATIONS: tuple[str, ...] = ("relu", "gelu", "gelu_tanh", "silu")

_SQRT_HALF = tl.constexpr(0.7071067811865476)  # 1 / sqrt(2)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)  # 1 / sqrt(2 pi)
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi)
_TANH_CUBIC = tl.constexpr(0.044715)


@triton.jit
def relu(x):
    return tl.maximum(x, 0.0)


@triton.jit
def relu_grad(x):
    # Also right when given relu's output instead of its input: y > 0 exactly where x > 0.
    return tl.where(x > 0.0, 1.0, 0.0)


@triton.jit
def gelu(x):
    return 0.5 * x * (1.0 + tl.erf(x * _SQRT_HALF))


@triton.jit
def gelu_grad(x):
    cdf = 0.5 * (1.0 + tl.erf(x * _SQRT_HALF))
    pdf = tl.exp(-0.5 * x * x) * _INV_SQRT_2PI
    return cdf + x * pdf


@triton.jit
def gelu_tanh(x):
    z = _SQRT_2_OVER_PI * (x + _TANH_CUBIC * x * x * x)
    return x * tl.sigmoid(2.0 * z)


@triton.jit
def gelu_tanh_grad(x):
    z = _SQRT_2_OVER_PI * (x + _TANH_CUBIC * x * x * x)
    dz_dx = _SQRT_2_OVER_PI * (1.0 + 3.0 * _TANH_CUBIC * x * x)
    s = tl.sigmoid(2.0 * z)
    return s + 2.0 * x * s * (1.0 - s) * dz_dx


@triton.jit
def silu(x):
    return x * tl.sigmoid(x)


@triton.jit
def silu_grad(x):
    s = tl.sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


@triton.jit
def apply(x, ACTIVATION: tl.constexpr):
    """``ACTIVATION(x)`` for a float32 tile; ``"none"`` returns ``x``."""
    if ACTIVATION == "relu":
        y = relu(x)
    elif ACTIVATION == "gelu":
        y = gelu(x)
    elif ACTIVATION == "gelu_tanh":
        y = gelu_tanh(x)
    elif ACTIVATION == "silu":
        y = silu(x)
    else:
        y = x
    return y


@triton.jit
def derivative(x, ACTIVATION: tl.constexpr):
    """``ACTIVATION'(x)`` for a float32 tile; ``"none"`` gives ones."""
    if ACTIVATION == "relu":
        d = relu_grad(x)
    elif ACTIVATION == "gelu":
        d = gelu_grad(x)
    elif ACTIVATION == "gelu_tanh":
        d = gelu_tanh_grad(x)
    elif ACTIVATION == "silu":
        d = silu_grad(x)
    else:
        d = x * 0.0 + 1.0
    return d
