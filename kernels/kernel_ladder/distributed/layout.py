"""A model of a 3-D parallel training run: memory and communication per GPU for a (tp, pp, dp) mesh.

How a large run composes the forms of parallelism, counted for a dense decoder-only transformer
(``layers`` blocks of attention + a 4x MLP, hidden size ``hidden``, ``12 · hidden²`` parameters a
block), trained with Adam in mixed precision:

* **memory per GPU** — the parameters of ``layers / pp`` blocks split ``tp`` ways, at 2 (bf16
  weight) + 2 (gradient) + 12 (fp32 master, momentum, variance) bytes a parameter (the ZeRO
  paper's count); with ZeRO-1 the 12 optimizer bytes are divided by ``dp`` as well;
* **tensor-parallel traffic** — Megatron's block makes two all-reduces of the ``(b, s, hidden)``
  activations in the forward (after attention and after the MLP) and two in the backward, each
  ring all-reduce sending ``2(tp − 1)/tp`` of the tensor per GPU;
* **pipeline** — the bubble ``(pp − 1)/(m + pp − 1)`` of ``m`` micro-batches, and the activations a
  stage boundary sends (``b · s · hidden`` bf16 values per micro-batch, each way, split across
  the ``tp`` ranks);
* **data-parallel traffic** — one all-reduce of this GPU's bf16 gradients per step
  (``2(dp − 1)/dp`` of them, overlapped with the backward by the buckets).

Every quantity is a count from the sizes; :class:`~kernel_ladder.distributed.collectives.AlphaBeta`
turns bytes into modelled seconds for given link parameters. It is a model of the arithmetic of
the layout, not a measurement of any cluster.
"""

from __future__ import annotations

from dataclasses import dataclass

from .collectives import AlphaBeta

__all__ = ["Layout", "plan_layout"]


@dataclass(frozen=True)
class Layout:
    """Per-GPU memory (bytes), traffic per step (bytes each GPU sends) and the pipeline bubble."""

    tp: int
    pp: int
    dp: int
    parameters_per_gpu: float
    weight_and_grad_bytes: float
    optimizer_bytes: float
    tp_bytes: float
    pp_bytes: float
    dp_bytes: float
    bubble: float

    @property
    def memory_bytes(self) -> float:
        return self.weight_and_grad_bytes + self.optimizer_bytes

    def comm_seconds(self, intra: AlphaBeta, inter: AlphaBeta) -> dict[str, float]:
        """Modelled seconds of each kind of traffic: tensor parallelism on the fast links inside a node
        (``intra``), pipeline and data parallelism across nodes (``inter``); bandwidth terms only."""
        return {"tp": self.tp_bytes / intra.bandwidth, "pp": self.pp_bytes / inter.bandwidth,
                "dp": self.dp_bytes / inter.bandwidth}


def plan_layout(layers: int, hidden: int, seq: int, micro_batch: int, microbatches: int, tp: int, pp: int,
                dp: int, zero1: bool = True) -> Layout:
    """The :class:`Layout` of a ``tp x pp x dp`` mesh for the transformer described in the module docstring."""
    for name, value in (("layers", layers), ("hidden", hidden), ("seq", seq), ("micro_batch", micro_batch),
                        ("microbatches", microbatches), ("tp", tp), ("pp", pp), ("dp", dp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"kernel_ladder.distributed.plan_layout: {name} must be an int >= 1, got {value!r}")
    if layers % pp:
        raise ValueError(f"kernel_ladder.distributed.plan_layout: layers ({layers}) must be divisible by pp ({pp})")
    params = 12 * hidden * hidden * (layers // pp) / tp
    activation = micro_batch * seq * hidden * 2  # one (b, s, h) bf16 tensor
    ring = (lambda p: 2 * (p - 1) / p) if tp > 1 else (lambda p: 0.0)
    tp_bytes = 4 * (layers // pp) * microbatches * activation * ring(tp)
    # A stage sends each micro-batch's activations on and its input gradient back: one (b, s, h)
    # tensor each way, split across the tp ranks (Megatron's scatter/gather at stage boundaries).
    pp_bytes = 2 * microbatches * activation / tp if pp > 1 else 0.0
    dp_bytes = 2 * (dp - 1) / dp * params * 2 if dp > 1 else 0.0
    return Layout(
        tp=tp, pp=pp, dp=dp, parameters_per_gpu=params, weight_and_grad_bytes=4 * params,
        optimizer_bytes=12 * params / (dp if zero1 else 1), tp_bytes=tp_bytes, pp_bytes=pp_bytes, dp_bytes=dp_bytes,
        bubble=(pp - 1) / (microbatches + pp - 1),
    )
