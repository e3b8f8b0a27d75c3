"""The layers whose ``forward`` ``kernels.kernelize`` puts on transformers' decorated modules.

``kernels`` checks each class before using it: an ``nn.Module`` with no constructor and no members
but ``forward`` and the flags ``can_torch_compile`` / ``has_backward``, whose ``forward`` takes as many
arguments, of the same kinds, as the forward it replaces. The forward then runs bound to the
original module, so ``self`` is transformers' module (``self.weight``, ``self.variance_epsilon``) and
``type(self).forward`` is its own forward, the way back for inputs a ``kernel_ladder`` op does not
compute the same way.
"""

from __future__ import annotations

import torch
from torch import nn

import kernel_ladder

__all__ = ["RMSNorm", "SiLU", "GELU", "GELUTanh", "SiluAndMul", "GeluTanhAndMul", "ApplyRotaryPosEmb"]


class RMSNorm(nn.Module):
    """transformers' ``RMSNorm`` layers (``LlamaRMSNorm`` and its copies): :func:`kernel_ladder.rms_norm`
    with Llama's roundings. A weight of another dtype than the input (transformers then promotes the
    product) goes back to the module's own forward."""

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.weight is None or self.weight.dtype != hidden_states.dtype:
            return type(self).forward(self, hidden_states)
        return kernel_ladder.rms_norm(hidden_states, self.weight, self.variance_epsilon, casting="llama")


class SiLU(nn.Module):
    """transformers' ``SiLUActivation``: :func:`kernel_ladder.silu`."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernel_ladder.silu(x)


class GELU(nn.Module):
    """transformers' ``GELUActivation`` (the erf form): :func:`kernel_ladder.gelu`."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernel_ladder.gelu(x)


class GELUTanh(nn.Module):
    """transformers' ``GELUTanh``, ``NewGELUActivation`` and ``FastGELUActivation`` (one tanh
    approximation, three spellings): :func:`kernel_ladder.gelu` with ``approximate="tanh"``."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernel_ladder.gelu(x, approximate="tanh")


class SiluAndMul(nn.Module):
    """``silu(x[..., :d]) * x[..., d:]`` with ``d`` half the last dim: :func:`kernel_ladder.swiglu` on the two
    halves, read in place."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return kernel_ladder.swiglu(x[..., :d], x[..., d:])


class GeluTanhAndMul(nn.Module):
    """``gelu_tanh(x[..., :d]) * x[..., d:]``: :func:`kernel_ladder.geglu` on the two halves."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return kernel_ladder.geglu(x[..., :d], x[..., d:])


class ApplyRotaryPosEmb(nn.Module):
    """transformers' ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` (``rotary_pos_emb``):
    :func:`kernel_ladder.rope`, q and k in one launch. One model family spells an interleaved rotation
    under the same name and signature (``openai_privacy_filter``): it keeps its own function."""

    can_torch_compile = True
    has_backward = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        if "openai_privacy_filter" in type(self).__module__:
            return type(self).forward(self, q, k, cos, sin, unsqueeze_dim)
        return kernel_ladder.rope(q, k, cos, sin, unsqueeze_dim)
