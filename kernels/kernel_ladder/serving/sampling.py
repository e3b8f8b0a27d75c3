"""Choosing the next token from a model's logits: greedy, temperature, nucleus (``top_p``).

Sampling's own arithmetic runs in plain torch on the ``(S, V)`` logits of the sampled tokens
only; the draws use a seeded CPU generator, so a seed reproduces a generation on any device.
"""

from __future__ import annotations

import torch

__all__ = ["distribution", "sample"]


def distribution(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The probabilities sampling draws from: the softmax of ``logits / temperature`` kept to
    the smallest set of top tokens whose mass reaches ``top_p``, renormalized (a one-hot of the
    argmax at ``temperature == 0``)."""
    if temperature == 0.0:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # sampling's own arithmetic, on (S, V) only
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the tokens ranked above each
        sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)  # the top one always stays
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``logits``: the argmax at ``temperature == 0``, else a draw from
    :func:`distribution`."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    probs = distribution(logits, temperature, top_p)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)
