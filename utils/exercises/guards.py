"""Guarded tensors: every tensor the candidate gets lives between guard regions, outputs start poisoned.

An output (``out=True``) is a contiguous tensor filled with a recognisable NaN (:data:`_POISON_BITS`;
the most negative value for integers), so an element the kernel never wrote is told apart from one
it wrote wrongly, between guards of a canary byte (a write there is reported). An input is a copy
with the same shape and strides between guards of NaN (a read there spoils the result visibly).
On the CPU each tensor has its own storage that ends exactly where its data ends, so the tracer
also counts every access outside every tensor argument, and a missing mask lands in the guard
instead of in someone else's memory.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import numpy as np
import torch

# Poison for outputs: quiet NaNs with a payload no arithmetic produces, so "never written" is told
# apart from "wrote NaN".
_POISON_BITS: dict[torch.dtype, tuple[torch.dtype, int]] = {
    torch.float64: (torch.int64, 0x7FF8DEADDEADDEAD),
    torch.float32: (torch.int32, 0x7FC0DEAD),
    torch.float16: (torch.int16, 0x7E5A),
    torch.bfloat16: (torch.int16, 0x7FDA),
}
_CANARY_BYTE = 0xA5  # fills an output's guard regions
_MIN_GUARD_BYTES = 64 * 1024  # at least a few BLOCKs of overrun in any direction


@dataclasses.dataclass
class _Guarded:
    """A tensor given to the candidate, the guard regions on either side of it, and their snapshot."""

    label: str
    tensor: torch.Tensor
    before: torch.Tensor  # uint8 views of the guards
    after: torch.Tensor
    before_snapshot: torch.Tensor
    after_snapshot: torch.Tensor
    element_size: int

    def guard_damage(self) -> str | None:
        """A sentence saying how many guard elements changed, or None if none did."""
        parts = []
        for where, region, snapshot in (
            ("before the start", self.before, self.before_snapshot),
            ("after the end", self.after, self.after_snapshot),
        ):
            changed = (region != snapshot).view(-1, self.element_size).any(dim=1)
            count = int(changed.sum())
            if count:
                parts.append(f"{count} element{'s' if count != 1 else ''} {where} of {self.label}")
        if not parts:
            return None
        return "wrote out of bounds (guard region changed): " + " and ".join(parts)


def _storage_span(t: torch.Tensor) -> int:
    """Elements from the first to the last one a strided tensor can address (0 if empty)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def _guarded_bytes(nbytes: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """uint8 tensors (before, body, after) over one block of memory, with guards on both sides.

    On the CPU each is a separate storage over one numpy allocation, so a tensor made from
    ``body`` ends exactly at its data (the tracer sees accesses past it as out of bounds) while
    an overrun still lands in memory we own.
    """
    guard = max(_MIN_GUARD_BYTES, -(-nbytes // 64) * 64)
    if device.type == "cpu":
        block = np.empty(guard + nbytes + guard, dtype=np.uint8)
        return (
            torch.from_numpy(block[:guard]),
            torch.from_numpy(block[guard : guard + nbytes]),
            torch.from_numpy(block[guard + nbytes :]),
        )
    block = torch.empty(guard + nbytes + guard, dtype=torch.uint8, device=device)
    return block[:guard], block[guard : guard + nbytes], block[guard + nbytes :]


def _fill_poison(flat: torch.Tensor) -> None:
    """Fill a contiguous 1-D tensor with the poison for its dtype."""
    if flat.dtype in _POISON_BITS:
        int_dtype, bits = _POISON_BITS[flat.dtype]
        flat.view(int_dtype).fill_(bits)
    elif flat.dtype.is_floating_point:
        flat.fill_(float("nan"))
    elif flat.dtype == torch.bool:
        flat.fill_(False)  # overwritten with the negated reference by the caller
    else:
        flat.fill_(torch.iinfo(flat.dtype).min)


def _guarded_output(label: str, like: torch.Tensor) -> _Guarded:
    """A contiguous poisoned tensor shaped like ``like``, between canary-filled guards."""
    element_size = like.element_size()
    before, body, after = _guarded_bytes(like.numel() * element_size, like.device)
    before.fill_(_CANARY_BYTE)
    after.fill_(_CANARY_BYTE)
    flat = body.view(like.dtype)
    _fill_poison(flat)
    if like.dtype == torch.bool:
        flat.copy_(~like.reshape(-1))  # an unwritten bool is then a wrong value
    return _Guarded(label, flat.view(like.shape), before, after, before.clone(), after.clone(), element_size)


def _guarded_input(label: str, t: torch.Tensor) -> _Guarded | None:
    """A copy of ``t`` (same shape and strides) between NaN-filled guards; None if not possible."""
    if t.numel() == 0 or t.layout != torch.strided or t.is_quantized or type(t) is not torch.Tensor:
        return None
    element_size = t.element_size()
    span = _storage_span(t)
    try:
        before, body, after = _guarded_bytes(span * element_size, t.device)
        for guard in (before, after):
            if t.dtype.is_floating_point:
                guard.view(t.dtype).fill_(float("nan"))
            else:
                guard.fill_(_CANARY_BYTE)
        flat = body.view(t.dtype)
        # Copy the whole addressed span (gaps included) so expanded/overlapping views stay valid.
        flat.copy_(t.detach().as_strided((span,), (1,), t.storage_offset()))
        copy = flat.as_strided(t.shape, t.stride())
    except (RuntimeError, TypeError, ValueError):
        return None
    if t.requires_grad and t.is_leaf:
        copy.requires_grad_(True)
    return _Guarded(label, copy, before, after, before.clone(), after.clone(), element_size)


def _guard_case(case: tuple, names: list[str]) -> tuple[tuple, list[_Guarded]]:
    """The case with every tensor argument replaced by a guarded copy (same shape and strides), and every
    list, dict or set by a copy: what the candidate changes in place is its own, the case stays as drawn."""
    guarded_args = []
    guards: list[_Guarded] = []
    for i, value in enumerate(case):
        if isinstance(value, torch.Tensor):
            label = names[i] if i < len(names) else f"arg{i}"
            guarded = _guarded_input(label, value)
            if guarded is not None:
                guards.append(guarded)
                guarded_args.append(guarded.tensor)
                continue
        elif type(value) in (list, dict, set):
            try:
                value = copy.deepcopy(value)
            except Exception:  # something in it that cannot be copied: the candidate gets the case's own
                pass
        guarded_args.append(value)
    return tuple(guarded_args), guards


def _has_unwritten(value: Any) -> bool:
    """True if any float tensor in ``value`` still holds the checker's poison (never written)."""
    if isinstance(value, torch.Tensor):
        if value.dtype not in _POISON_BITS:
            return False
        int_dtype, bits = _POISON_BITS[value.dtype]
        return bool((value.detach().reshape(-1).view(int_dtype) == bits).any())
    if isinstance(value, (tuple, list)):
        return any(_has_unwritten(v) for v in value)
    return False


# --------------------------------------------------------------------------------------------
# Inputs changed in place
# --------------------------------------------------------------------------------------------

_UNSEEN = object()  # what a snapshot holds for a value it cannot compare (an object of the learner's, a model)
_PLAIN_VALUES = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)


@dataclasses.dataclass(frozen=True)
class _TensorCopy:
    """A tensor argument as it was before the call: its values, shape and strides."""

    values: torch.Tensor
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _snapshot(value: Any, depth: int = 0) -> Any:
    """A copy of an argument, to compare it with after the call: tensors, and lists, tuples, dicts and sets
    of them or of plain values; anything else (an object of the learner's, a model) is not seen."""
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.is_quantized:
            return _UNSEEN
        return _TensorCopy(value.detach().clone(), tuple(value.shape), tuple(value.stride()))
    if isinstance(value, _PLAIN_VALUES):
        return value
    if depth < 4 and type(value) in (list, tuple):
        return type(value)(_snapshot(item, depth + 1) for item in value)
    if depth < 4 and type(value) is dict:
        return {key: _snapshot(item, depth + 1) for key, item in value.items()}
    if type(value) is set:
        return set(value)
    return _UNSEEN


def _plain(value: Any) -> Any:
    """A snapshot as the learner would print the value."""
    if isinstance(value, _TensorCopy):
        return value.values
    if type(value) in (list, tuple):
        return type(value)(_plain(v) for v in value)
    if type(value) is dict:
        return {k: _plain(v) for k, v in value.items()}
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclasses.dataclass(frozen=True)
class _Changed:
    """How an argument changed: ``summary`` alone (``'12 of its 96 elements'``), ``short`` beside other
    arguments (``'12 of 96'``), and where a tensor's first changed element is (``'[0, 2]'``) with its
    values (``'0.25 → 0.5622'``)."""

    summary: str
    short: str
    at: str | None = None
    values: str | None = None


def _tensor_change(now: torch.Tensor, was: _TensorCopy) -> _Changed | None:
    """How a tensor changed, or None."""
    if tuple(now.shape) != was.shape:
        said = f"its shape {was.shape} is now {tuple(now.shape)}"
        return _Changed(said, said)
    if tuple(now.stride()) != was.stride:
        said = f"its strides {was.stride} are now {tuple(now.stride())}"
        return _Changed(said, said)
    if was.values.numel() == 0:
        return None
    current = now.detach()
    same = current == was.values
    if current.dtype.is_floating_point or current.dtype.is_complex:
        same |= current.isnan() & was.values.isnan()  # NaN stays NaN
    if bool(same.all()):
        return None
    count, total = int((~same).sum()), was.values.numel()
    first = tuple(int(i) for i in (~same).nonzero()[0])
    before, after = was.values[first].item(), current[first].item()
    shown = (lambda v: f"{v:.4g}") if isinstance(before, float) else repr
    return _Changed(
        f"{count} of its {total} elements",
        f"{count} of {total}",
        f"[{', '.join(map(str, first))}]",
        f"{shown(before)} → {shown(after)}",
    )


def _change(now: Any, was: Any) -> _Changed | None:
    """How an argument differs from its snapshot; None if it does not (or cannot be seen)."""
    if was is _UNSEEN:
        return None
    if isinstance(was, _TensorCopy):
        return _tensor_change(now, was) if isinstance(now, torch.Tensor) else None
    if isinstance(was, _PLAIN_VALUES):
        try:
            return None if bool(now == was) else _Changed("changed", "changed")
        except Exception:
            return None
    kind = type(was).__name__
    said = f"the {kind} {_short(_plain(was))} is now {_short(_plain(now) if type(now) is not set else now)}"
    whole = _Changed(said, said)
    if type(now) is not type(was) or len(now) != len(was):
        return whole
    if type(was) is set:
        return None if now == was else whole
    if type(was) is dict:
        if list(now) != list(was):
            return whole
        pairs = list(zip(now.values(), was.values()))
    else:
        pairs = list(zip(now, was))
    for item_now, item_was in pairs:
        inner = _change(item_now, item_was)
        if inner is not None:
            if not isinstance(item_was, _TensorCopy):
                return whole
            return _Changed(
                f"a tensor in the {kind}: {inner.summary}",
                f"a tensor in the {kind}: {inner.short}",
                inner.at,
                inner.values,
            )
    return None


def _changed_inputs(args: tuple, snapshots: list, names: list[str]) -> list[tuple[str, _Changed]]:
    """``(argument name, how it changed)`` for each argument the call changed in place."""
    changed = []
    for i, (arg, was) in enumerate(zip(args, snapshots)):
        how = _change(arg, was)
        if how is not None:
            changed.append((names[i] if i < len(names) else f"argument {i + 1}", how))
    return changed


def _changed_in_words(changed: list[tuple[str, _Changed]]) -> str:
    """``'x in place (12 of its 12 elements), first at [0]: 1.7 → 1.6'``, or for several arguments
    ``'q_nope, q_pe in place (q_nope: 12 of 96; q_pe: 4 of 32), first at q_nope[0, 0]: 1 → 2'``."""
    labels = [label for label, _ in changed]
    if len(changed) == 1:
        said = f"{labels[0]} in place ({changed[0][1].summary})"
    else:
        said = f"{', '.join(labels)} in place ({'; '.join(f'{label}: {how.short}' for label, how in changed)})"
    label, how = next(((label, how) for label, how in changed if how.at is not None), (None, None))
    if how is not None:
        said += f", first at {label if len(changed) > 1 else ''}{how.at}: {how.values}"
    return said
