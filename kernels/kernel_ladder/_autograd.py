"""Second-order gradients: every backward op says clearly that it has none.

Each op's backward is its own custom op (``kernel_ladder::<op>_backward``). Without an autograd formula
of its own, asking for a gradient of a gradient (``create_graph=True`` and a second backward)
gets torch's generic advice to register one; this module registers a formula that raises an
error saying what is and is not supported, so that ``create_graph=True`` itself still works
(a first-order backward that is merely recorded) and only a real double backward fails.
"""

from __future__ import annotations

import torch

__all__ = ["COVERED", "NoDoubleBackward", "forbid_double_backward", "gradient_reusable", "recorded_gradient"]

#: The backward ops given a raising formula (filled on import of ``kernel_ladder``).
COVERED: list[str] = []


def _raise_for(public_name: str):
    def backward(ctx, *grads):
        raise RuntimeError(
            f"{public_name}: double backward (a gradient of a gradient) is not supported; the backward "
            "kernels are first order. For second-order terms use the torch reference op, e.g. the one in "
            "torch.nn.functional."
        )

    return backward


class NoDoubleBackward(torch.autograd.Function):
    """A gradient handed out under ``create_graph=True`` by an op whose backward mutates a buffer (and so
    cannot have the raising formula above): the identity, whose own backward raises the op's error.

    Its other inputs link it into the graph: an output of the forward (a 0-element anchor, so that
    a backward through the gradient reaches this node whatever it differentiates) and the incoming
    gradient (which may itself require a gradient).
    """

    @staticmethod
    def forward(ctx, public_name, grad, *links):
        ctx.public_name = public_name
        return grad

    @staticmethod
    def backward(ctx, *grads):
        _raise_for(ctx.public_name)(ctx, *grads)


def recorded_gradient(public_name: str, grad: torch.Tensor, *links: torch.Tensor) -> torch.Tensor:
    """``grad``, as the result of a first-order backward recorded under ``create_graph=True``: usable,
    but differentiating it raises ``public_name``'s double-backward error (see :class:`NoDoubleBackward`)."""
    return NoDoubleBackward.apply(public_name, grad, *links)


def _no_context(ctx, inputs, output) -> None:
    pass


def forbid_double_backward() -> list[str]:
    """Give every mutation-free ``kernel_ladder::*_backward`` op a formula that raises; returns their names."""
    done = []
    for name in dir(torch.ops.kernel_ladder):
        if not name.endswith("_backward"):
            continue
        packet = getattr(torch.ops.kernel_ladder, name)
        schema = packet.default._schema
        if any(arg.alias_info is not None and arg.alias_info.is_write for arg in schema.arguments):
            continue  # an op that writes its input in place (cross-entropy's scaling) cannot take one
        public = f"kernel_ladder.{name.removesuffix('_backward')} (backward)"
        torch.library.register_autograd(f"kernel_ladder::{name}", _raise_for(public), setup_context=_no_context)
        done.append(name)
    COVERED[:] = done
    return done


def gradient_reusable(grad: torch.Tensor) -> bool:
    """Whether an op that asked for an in-place backward may write its input gradient into ``grad``.

    The ops' ``in_place_backward=True`` (``rms_norm``, ``add_rms_norm``, ``swiglu``) write the
    gradient they return into the buffer of the gradient they receive, saving one allocation of
    its size. That is only sound when nothing else reads ``grad`` afterwards, which the op cannot
    check: the caller promises it by opting in. What the op does check, falling back to a fresh
    buffer otherwise: ``grad`` is contiguous (so no stride-0 view such as the ``ones.expand(...)``
    that ``y.sum().backward()`` hands down, whose elements share memory), it does not require grad
    and grad mode is off (under ``create_graph=True`` the out-of-place op runs, recorded with its
    double-backward error, instead of a mutation autograd cannot see).
    """
    return grad.is_contiguous() and not grad.requires_grad and not torch.is_grad_enabled()
