"""What the models of :mod:`kernel_ladder.models` share in taking Hugging Face weights: building one from
a ``transformers`` model, and the error that names every tensor a state dict gets wrong."""

from __future__ import annotations

import torch


def build_from_hf(cls, config_cls, hf_model: torch.nn.Module, op: str):
    """``cls(config_cls.from_hf(hf_model.config))`` with ``hf_model``'s weights copied in, on its device
    and in its dtype (``cls`` has ``load_hf_state_dict(state, source=...)``)."""
    config = getattr(hf_model, "config", None)
    if config is None:
        raise TypeError(f"{op}.from_hf: expected a transformers model with a .config, got {type(hf_model).__name__}")
    ours = cls(config_cls.from_hf(config))
    first = next(hf_model.parameters())
    ours.to(device=first.device, dtype=first.dtype)
    ours.load_hf_state_dict(hf_model.state_dict(), source=type(hf_model).__name__)
    return ours


def mismatch_error(op: str, source: str, what: str, missing=(), unexpected=(), shapes=(), most: int = 6) -> ValueError:
    """The error for a state dict that does not fit: every kind of problem, the first ``most`` of each named."""

    def few(items) -> str:
        items = list(items)
        return ", ".join(items[:most]) + (f" … ({len(items)} in all)" if len(items) > most else "")

    problems = [f"{label} {few(items)}" for label, items in
                (("missing", missing), ("unexpected", unexpected), ("wrong shapes", shapes)) if items]
    return ValueError(f"{op}: {source} does not match {what}: " + "; ".join(problems))
