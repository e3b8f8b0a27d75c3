"""The LM head and its loss without the logits: ``kernel_ladder::fused_linear_cross_entropy``.

``loss = cross_entropy(x @ weight.T + bias, target)`` for ``x`` ``(..., H)``, ``weight`` ``(V, H)``
(the LM head, ``nn.Linear``'s layout) and ``target`` ``(...)``, with every option of
:func:`kernel_ladder.cross_entropy` that a language model's loss uses: ``ignore_index``, the three
reductions, label smoothing, class weights (``ce_weight``, torch's ``weight``), Gemma-2's ``softcap``
and PaLM's ``z_loss`` (with ``return_z_loss``, its term alone for logging, as Liger-Kernel returns it).

**Why.** At Llama-3's vocabulary, ``V = 128,256``, the logits of 8192 tokens are 2.1 GB in bf16 —
more than the whole rest of a 1B model's activations — and torch's ``F.cross_entropy(logits.float())``
keeps several fp32 copies of them alive until the backward. Here the rows are processed in
**chunks** of ``chunk_size`` rows, and only one chunk's logits ever exist:

1. ``logits = x[chunk] @ W^T (+ b)`` — a ``(chunk, V)`` buffer in x's dtype (``kernel_ladder.matmul``);
2. the chunk's per-row losses and, over the same buffer, the gradient of the loss with respect
   to those logits — one pass of :func:`kernel_ladder.ops.cross_entropy.cross_entropy_forward_kernel`
   (the online log-sum-exp; the gradient written over the logits it was computed from);
3. ``grad_x[chunk] = G @ W`` and ``grad_W += G^T @ x[chunk]`` (an fp32 accumulator, the matmul's
   ``accumulate`` epilogue), ``grad_b += 1^T G``.

The mean's ``1 / n_valid`` is computed once, on the device, from all the targets before the
first chunk (:func:`kernel_ladder.ops.cross_entropy.launch_targets`), so every chunk's gradient already
carries it and the chunks simply add up. The whole gradient is therefore ready when the forward
returns: the backward only scales it by the incoming ``grad_output`` (in place, skipped when it is
exactly 1, as for ``loss.backward()``). With ``reduction="none"`` a per-row ``grad_output`` can
not be applied to a summed weight gradient, so the forward computes only the losses and the
backward runs the chunks again with the rows scaled.

**Memory.** Beyond the inputs and the gradients themselves, the op holds one ``(chunk, V)``
buffer, one float per row, and the fp32 ``grad_W`` accumulator (``V x H x 4`` bytes; with a
bf16 weight, its cast is the gradient): O(chunk x V) instead of O(N x V).

**The chunk** (:func:`chunk_rows`) trades that buffer against traffic: every chunk reads and writes the
whole fp32 ``grad_W`` (``8 V H`` bytes), so ``ceil(N / chunk)`` chunks move ``8 V H ceil(N / chunk)``
bytes against the op's ``6 N V H`` FLOPs — a share of the FLOP time of about
``(8 / 6) x (FLOP/s / bytes/s) / chunk``. The default is the smallest power of two that keeps that share
under :data:`GRAD_W_TRAFFIC_SHARE` (1/8) at :data:`MACHINE_BALANCE` (an H200's sustained 790 TFLOP/s
dense bf16 over 4.3 TB/s: 184 FLOP/B), so 2048 rows; capped so that the logits buffer stays within
:data:`LOGITS_BUDGET_SHARE` (half) of the fp32 ``grad_W`` the op holds anyway (``chunk <= 2 H /
element size``); never below the memory-saving rule of Liger-Kernel, a logits buffer about as large as
``x`` (``N / ceil(V / H)`` rows, at least :data:`MIN_CHUNK_ROWS`); at most ``N``.

At Llama-3-8B's head (V = 128,256, H = 4096, N = 8192, bf16, an H200), :func:`launch_plan` counts
what each launch moves and :func:`modelled_seconds` turns it into a time (a launch-level **model**:
790 TFLOP/s, 4.3 TB/s, one 128 x 128 tile per SM per wave over 132 SMs, perfect L2 reuse): Liger's
rule alone gives 32 chunks of 256 rows, whose ``grad_W`` GEMMs move 134.6 GB of DRAM traffic, and the
op models at 67.0 ms; the default's 4 chunks of 2048 move 16.9 GB and model at 34.8 ms, against a
32.7 ms FLOP floor (``6 N V H`` at 790 TFLOP/s). ``chunk_size=`` overrides the rule.

No host synchronization: the target check is a device assertion, the counts live on the device.
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass

import torch
import triton

from .. import _launch, runtime
from .._autograd import recorded_gradient
from .._validate import (
    check_bool,
    check_float_dtype,
    check_same_device,
    check_same_dtype,
    check_tensor,
    schema_types,
)
from ..autotune import default_config
from . import cross_entropy as ce
from .matmul import _reduce_block, launch_matmul, plan_matmul

__all__ = [
    "GRAD_W_TRAFFIC_SHARE",
    "H200_MODEL",
    "LOGITS_BUDGET_SHARE",
    "MACHINE_BALANCE",
    "MIN_CHUNK_ROWS",
    "Machine",
    "PlannedLaunch",
    "chunk_rows",
    "flop_floor_seconds",
    "fused_linear_cross_entropy",
    "launch_plan",
    "modelled_seconds",
]

_OP = "kernel_ladder.fused_linear_cross_entropy"


#: The smallest default chunk: a matmul tile's rows (64-128 on a GPU). Fewer rows would leave most of
#: every tile's dot products padding and multiply the launches, for a buffer that is small anyway.
MIN_CHUNK_ROWS: int = 64


#: The share of the op's FLOP time that the default chunk lets the fp32 ``grad_W`` traffic take.
GRAD_W_TRAFFIC_SHARE: float = 1 / 8

#: FLOPs per byte of DRAM traffic at which the GPU is balanced: an H200's sustained 790 TFLOP/s dense bf16
#: over 4.3 TB/s (about 80% and 90% of the datasheet's). The fastest dense rate: the largest chunk any dtype needs.
MACHINE_BALANCE: float = 790e12 / 4.3e12

#: The ``(chunk, V)`` logits buffer's budget, as a share of the fp32 ``grad_W`` accumulator (``V x H x 4``
#: bytes) the op holds anyway: the op's own memory grows by at most half.
LOGITS_BUDGET_SHARE: float = 1 / 2


def _floor_power_of_2(n: int) -> int:
    return 1 << (max(1, int(n)).bit_length() - 1)


def chunk_rows(n_rows: int, vocab: int, hidden: int, element_size: int = 2) -> int:
    """The default chunk for ``n_rows`` rows, a ``(vocab, hidden)`` head and ``element_size``-byte logits.

    ``max(memory, min(traffic, budget))``, at most ``n_rows``, all powers of two:

    * ``traffic``: the smallest chunk with ``(8 / 6) x MACHINE_BALANCE / chunk <= GRAD_W_TRAFFIC_SHARE``:
      each chunk reads and writes the fp32 ``grad_W`` (``8 V H`` bytes) for ``6 chunk V H`` FLOPs, so
      this bounds that traffic's share of the FLOP time (2048 rows: 12%);
    * ``budget``: the largest chunk whose logits, ``chunk x V x element_size`` bytes, fit in
      ``LOGITS_BUDGET_SHARE`` of the fp32 ``grad_W``'s ``V x H x 4`` (``2 H / element_size`` rows);
    * ``memory``: Liger-Kernel's rule, ``next_power_of_2(ceil(n_rows / ceil(vocab / hidden)))`` (a logits
      buffer about the size of ``x``), at least :data:`MIN_CHUNK_ROWS` — the chunk is never smaller.

    At V = 128,256, H = 4096, N = 8192, bf16: 2048 (the memory rule alone: 256).
    """
    if n_rows <= 0:
        return 1
    memory = triton.next_power_of_2(max(1, math.ceil(n_rows / max(1, math.ceil(vocab / max(1, hidden))))))
    traffic = triton.next_power_of_2(math.ceil((8 / 6) * MACHINE_BALANCE / GRAD_W_TRAFFIC_SHARE))
    budget = _floor_power_of_2(int(LOGITS_BUDGET_SHARE * 4 * max(1, hidden)) // max(1, element_size))
    chunk = max(memory, MIN_CHUNK_ROWS, min(traffic, budget))
    return max(1, min(chunk, n_rows))


# ----------------------------------------------------------------------------------------------
# The chunk loop
# ----------------------------------------------------------------------------------------------


def _chunks(x2, target_rows, weight, bias, ce_weight, scales, loss_rows, z_rows, options, chunk, grads,
            row_scale=None):
    """Run every chunk: per-row losses into ``loss_rows`` (and z-loss terms into ``z_rows`` unless None); with
    ``grads`` = (grad_x, grad_w32, grad_b32), the gradients (``row_scale``: a per-row factor of the logits'
    gradient, for reduction="none")."""
    n_rows, _ = x2.shape
    vocab = weight.shape[0]
    ignore_index, label_smoothing, softcap, z_loss = options
    logits = _launch.empty((min(chunk, n_rows), vocab), x2.dtype, x2.device)
    ones = torch.ones((), dtype=x2.dtype, device=x2.device)  # a stride-0 row of ones: bias = 1^T G
    for start in range(0, n_rows, chunk):
        stop = min(start + chunk, n_rows)
        x_chunk = x2[start:stop]
        z = logits[: stop - start]
        launch_matmul(x_chunk, weight.t(), z, bias=bias)
        # The loss of the chunk's rows and, written over the logits, their gradient.
        ce.launch_forward(z, target_rows[start:stop], ce_weight, scales, loss_rows[start:stop],
                          None if z_rows is None else z_rows[start:stop], z if grads is not None else z[:0],
                          ignore_index, label_smoothing, softcap, z_loss)
        if grads is None:
            continue
        grad_x, grad_w32, grad_b32 = grads
        if row_scale is not None:
            torch.ops.kernel_ladder.cross_entropy_backward(z, row_scale[start:stop].to(torch.float32))
        launch_matmul(z, weight, grad_x[start:stop])
        launch_matmul(z.t(), x_chunk, grad_w32, accumulate=start > 0)
        if grad_b32 is not None:
            launch_matmul(ones.expand(1, stop - start), z, grad_b32.view(1, vocab), accumulate=start > 0)


def _targets_and_scales(target_rows, ce_weight, vocab, ignore_index, reduction, label_smoothing):
    device = target_rows.device
    check = _launch.empty((ce.CHECK_SLOTS,), torch.int64, device)
    scales = _launch.empty((ce.SCALE_SLOTS,), torch.float32, device)
    ce.launch_targets(target_rows, ce_weight, check, scales, vocab, ignore_index, reduction == "mean",
                      class_weight_sum=ce_weight is not None and label_smoothing != 0.0)
    ce.assert_targets(check, vocab, ignore_index)
    return scales


def _new_grads(x2, weight, bias):
    grad_x = _launch.empty_output(x2.shape, x2)
    grad_w32 = _launch.empty(weight.shape, torch.float32, weight.device)
    grad_b32 = _launch.empty((weight.shape[0],), torch.float32, weight.device) if bias is not None else None
    return grad_x, grad_w32, grad_b32


def _finish_grads(grads, x, weight, bias, n_rows):
    """The gradients in the parameters' dtypes and shapes (zeros when there are no rows)."""
    grad_x, grad_w32, grad_b32 = grads
    if n_rows == 0:
        grad_w32.zero_()
        if grad_b32 is not None:
            grad_b32.zero_()
    grad_w = grad_w32 if weight.dtype == torch.float32 else grad_w32.to(weight.dtype)
    grad_b = x.new_empty(0)
    if grad_b32 is not None:
        grad_b = grad_b32 if bias.dtype == torch.float32 else grad_b32.to(bias.dtype)
    return grad_x.view(x.shape), grad_w, grad_b


def _chunk(chunk_size, n_rows: int, weight: torch.Tensor) -> int:
    """The op's ``chunk_size`` (0: the default rule, resolved here on the real sizes) as rows per chunk."""
    return int(chunk_size) if chunk_size else chunk_rows(n_rows, weight.shape[0], weight.shape[1],
                                                         weight.element_size())


# ----------------------------------------------------------------------------------------------
# The launch plan (counted from the sizes) and its time model
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedLaunch:
    """One launch of the op, counted from the sizes alone: a Triton kernel, or an aten op that runs one.

    ``flops`` are the tracer's (``2 x BLOCK_M x BLOCK_N x BLOCK_K`` per ``tl.dot``: tile padding included),
    ``bytes`` what the masked-in lanes of its loads and stores move (what :mod:`utils.trace` counts; a tile
    re-read by several programs counts each time), ``dram_bytes`` each element it reads and each it writes
    once (the traffic with perfect L2 reuse: what the time model charges).
    """

    step: str  # "logits GEMM", "cross-entropy", "grad_x GEMM", "grad_W GEMM", ... (a split-K pair shares one)
    kernel: str  # the Triton kernel's name, or the aten op's ("aten._to_copy")
    programs: int  # the grid's programs; 0 for an aten op
    flops: int
    bytes: int
    dram_bytes: int
    chunk: int = -1  # the chunk it belongs to; -1 for once per call


@dataclass(frozen=True)
class Machine:
    """What :func:`modelled_seconds` assumes of a GPU (sustained rates, not a datasheet's peaks)."""

    name: str
    sms: int
    flops_per_s: float  # dense tensor-core rate for the op's dtype
    bytes_per_s: float  # DRAM bandwidth


#: An H200 (sm_90, 132 SMs) at the sustained 790 TFLOP/s dense bf16 and 4.3 TB/s the model assumes.
H200_MODEL = Machine("H200 (model: 790 TFLOP/s, 4.3 TB/s)", 132, 790e12, 4.3e12)

#: cross_entropy's row tile on a GPU (its MAX_BLOCK and TILE_ELEMENTS there): a plan for a GPU made in the
#: interpreter, whose own constants differ.
_CE_GPU_MAX_BLOCK = 4096
_CE_GPU_TILE_ELEMENTS = 4096


def _ce_tile(rows: int, vocab: int, interpreter: bool) -> tuple[int, bool]:
    """(rows per program, chunked) of the cross-entropy kernel over ``rows`` rows of ``vocab`` logits."""
    if interpreter == runtime.INTERPRETER:
        config = ce.cross_entropy_launch_config(rows, vocab)
        return config.rows_per_program, config.chunked
    block = min(triton.next_power_of_2(vocab), _CE_GPU_MAX_BLOCK)
    return max(1, min(_CE_GPU_TILE_ELEMENTS // block, triton.next_power_of_2(rows))), vocab > block


def _gemm(step, chunk, M, N, K, sizes, *, dtype, interpreter, num_sms, bias=0, accumulate=False, a_distinct=None):
    """``launch_matmul``'s launches for ``C (+)= A @ B`` (M x K @ K x N) as :class:`PlannedLaunch` es.

    ``sizes``: the element sizes of A, B and C; ``bias``: the bias's element size (0: none); ``a_distinct``:
    A's distinct bytes when it is a broadcast view. On a GPU the autotuned tiled kernel is counted at its
    default config (128 x 128 tiles): the autotuner may pick another.
    """
    a_size, b_size, c_size = sizes
    plan = plan_matmul(M, N, K, dtype, num_sms=num_sms, interpreter=interpreter)
    config = plan.config or default_config(M, N, K, dtype, "tiled", interpreter=False)
    tiles_m, tiles_n = triton.cdiv(M, config.BLOCK_M), triton.cdiv(N, config.BLOCK_N)
    tiles = tiles_m * tiles_n
    flops = tiles * triton.cdiv(K, config.BLOCK_K) * 2 * config.BLOCK_M * config.BLOCK_N * config.BLOCK_K
    # Rows/cols past M/N wrap around (unmasked loads of whole tiles); K is masked.
    operand_bytes = tiles_m * config.BLOCK_M * K * tiles_n * a_size + tiles_n * config.BLOCK_N * K * tiles_m * b_size
    operand_dram = (M * K * a_size if a_distinct is None else a_distinct) + K * N * b_size
    out = M * N * c_size * (2 if accumulate else 1)  # C read first when accumulating
    if plan.method == "tiled":
        return [PlannedLaunch(step, "matmul_kernel", tiles, flops, operand_bytes + tiles_m * N * bias + out,
                              operand_dram + N * bias + out, chunk)]
    k_per_split = triton.cdiv(triton.cdiv(K, plan.split_k), config.BLOCK_K) * config.BLOCK_K
    split = triton.cdiv(K, k_per_split)
    partials = split * M * N * 4
    reduce_m, reduce_n = _reduce_block(M, N)
    reduce_tiles_m = triton.cdiv(M, reduce_m)
    return [
        PlannedLaunch(step, "matmul_split_k_kernel", tiles * split, flops, operand_bytes + partials,
                      operand_dram + partials, chunk),
        PlannedLaunch(step, "matmul_split_k_reduce_kernel", reduce_tiles_m * triton.cdiv(N, reduce_n), 0,
                      partials + reduce_tiles_m * N * bias + out, partials + N * bias + out, chunk),
    ]


def launch_plan(
    n_rows: int,
    vocab: int,
    hidden: int,
    dtype: torch.dtype = torch.bfloat16,
    *,
    chunk_size: int | None = None,
    bias: bool = False,
    reduction: str = "mean",
    compute_grad: bool = True,
    target_dtype: torch.dtype = torch.int64,
    interpreter: bool | None = None,
    num_sms: int | None = None,
) -> list[PlannedLaunch]:
    """Every launch of one ``fused_linear_cross_entropy`` call, in order, from the sizes alone (no tensors).

    For ``x`` ``(n_rows, hidden)`` and a ``(vocab, hidden)`` weight of ``dtype``, every target a class
    (none ignored), no class weights, smoothing, softcap or z-loss; ``reduction`` "mean" or "sum", with the
    gradients (``compute_grad``: x or the weight requires grad) or without. ``chunk_size`` None is
    :func:`chunk_rows`. ``interpreter`` / ``num_sms`` (None: this process's) say which machine's configs to
    count with: ``interpreter=False, num_sms=132`` is an H200 (the tiled GEMMs at their default 128 x 128
    tiles, where a GPU autotunes). In the interpreter the plan's ``bytes`` and ``flops`` are what
    :mod:`utils.trace` counts, launch by launch (tested), so at a GPU's sizes they are counts too.
    Launches that repeat per chunk carry its index; the aten ops are the targets' check, the ones of the
    bias gradient and the casts of the fp32 gradients to ``dtype``.
    """
    if n_rows < 1 or vocab < 1 or hidden < 1:
        raise ValueError(f"{_OP}: launch_plan needs n_rows, vocab and hidden >= 1, got {n_rows}, {vocab}, {hidden}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"{_OP}: launch_plan plans reduction 'mean' or 'sum', got {reduction!r}")
    interpreter = runtime.INTERPRETER if interpreter is None else bool(interpreter)
    size = torch.empty((), dtype=dtype).element_size()
    t_size = torch.empty((), dtype=target_dtype).element_size()
    chunk = int(chunk_size) if chunk_size else chunk_rows(n_rows, vocab, hidden, size)
    gemm = functools.partial(_gemm, dtype=dtype, interpreter=interpreter, num_sms=num_sms)
    plan = [
        # one program reads every target; writes the check (3 int64) and the scales (3 float32)
        PlannedLaunch("targets", "cross_entropy_targets_kernel", 1, 0, n_rows * t_size + 36, n_rows * t_size + 36),
        PlannedLaunch("target check", "aten._assert_async.msg", 0, 0, 8, 8),
        PlannedLaunch("ones (grad_b's row)", "aten.ones.default", 0, 0, size, size),
    ]
    for index, start in enumerate(range(0, n_rows, chunk)):
        rows = min(chunk, n_rows - start)
        plan += gemm("logits GEMM", index, rows, vocab, hidden, (size, size, size), bias=size if bias else 0)
        per_program, chunked = _ce_tile(rows, vocab, interpreter)
        programs = triton.cdiv(rows, per_program)
        passes = 2 if chunked and compute_grad else 1  # a long row: statistics first, then the gradient
        logits = rows * vocab * size
        read = rows * t_size + rows * size + programs * 12  # targets, each row's target logit, the 3 scales
        written = rows * 4 + (logits if compute_grad else 0)  # the row losses, the gradient over the logits
        plan.append(PlannedLaunch("cross-entropy", "cross_entropy_forward_kernel", programs, 0,
                                  read + passes * logits + written, rows * t_size + 12 + logits + written, index))
        if not compute_grad:
            continue
        plan += gemm("grad_x GEMM", index, rows, hidden, vocab, (size, size, size))
        plan += gemm("grad_W GEMM", index, vocab, hidden, rows, (size, size, 4), accumulate=start > 0)
        if bias:
            plan += gemm("grad_b GEMM", index, 1, vocab, rows, (size, size, 4), accumulate=start > 0,
                         a_distinct=size)
    mean = 8 if reduction == "mean" else 0  # the two scales, read to make the loss NaN when they are
    plan.append(PlannedLaunch("loss sum", "cross_entropy_reduce_kernel", 1, 0, n_rows * 4 + mean + 4,
                              n_rows * 4 + mean + 4))
    if compute_grad and dtype != torch.float32:
        cast = vocab * hidden * (4 + size)  # the fp32 accumulator read, the gradient written in x's dtype
        plan.append(PlannedLaunch("grad_W cast", "aten._to_copy.default", 0, 0, cast, cast))
        if bias:
            cast = vocab * (4 + size)
            plan.append(PlannedLaunch("grad_b cast", "aten._to_copy.default", 0, 0, cast, cast))
    return plan


def modelled_seconds(launch: PlannedLaunch, machine: Machine = H200_MODEL, overlap: bool = True) -> float:
    """A **model** of one launch's time: its FLOPs in whole waves, against its DRAM bytes at the bandwidth.

    Compute: ``ceil(programs / sms)`` waves, one program per SM at a time, each as long as one program's
    FLOPs at ``flops_per_s / sms`` (wave quantization: a last wave of 4 programs costs a whole wave).
    Memory: ``dram_bytes / bytes_per_s``. The launch takes the larger (``overlap``; the roofline), or the sum
    (``overlap=False``: no overlap at all, an upper bound). Launch latency is not modelled.
    """
    compute = 0.0
    if launch.flops and launch.programs:
        waves = triton.cdiv(launch.programs, machine.sms)
        compute = waves * (launch.flops / launch.programs) / (machine.flops_per_s / machine.sms)
    memory = launch.dram_bytes / machine.bytes_per_s
    return max(compute, memory) if overlap else compute + memory


def flop_floor_seconds(n_rows: int, vocab: int, hidden: int, machine: Machine = H200_MODEL) -> float:
    """The op's useful FLOPs with its gradients, ``6 N V H`` (three GEMMs), at the machine's FLOP rate."""
    return 6 * n_rows * vocab * hidden / machine.flops_per_s


# ----------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------


def _is_int(value: object) -> bool:
    # torch.compile passes a Python int it has made dynamic (a chunk computed from a shape) as a SymInt.
    return isinstance(value, (numbers.Integral, torch.SymInt)) and not isinstance(value, bool)


def _check_args(x, weight, target, bias, ce_weight, ignore_index, reduction, label_smoothing, softcap, z_loss,
                return_z_loss, chunk_size):
    """Every argument, as the public function takes them (the ops pass ``_public_chunk(chunk_size)``)."""
    check_tensor(_OP, "x", x)
    check_tensor(_OP, "weight", weight)
    check_tensor(_OP, "target", target)
    check_float_dtype(_OP, "x", x)
    check_float_dtype(_OP, "weight", weight)
    check_same_dtype(_OP, "x", x, "weight", weight)
    check_same_device(_OP, "x", x, "weight", weight)
    check_same_device(_OP, "x", x, "target", target)
    if x.dim() < 1:
        raise ValueError(f"{_OP}: x must be (..., hidden), got a 0-d tensor")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"{_OP}: weight must be the LM head's (vocab, hidden) = (V, {x.shape[-1]}) for x of shape "
            f"{tuple(x.shape)}, got {tuple(weight.shape)}"
        )
    if weight.shape[0] == 0:
        raise ValueError(f"{_OP}: weight must have at least one row (one class), got shape {tuple(weight.shape)}")
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{_OP}: target must be int64 (or int32) class indices, got {target.dtype}")
    if tuple(target.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"{_OP}: target must have x's leading shape {tuple(x.shape[:-1])} (one class per row), "
                         f"got {tuple(target.shape)}")
    if bias is not None:
        check_tensor(_OP, "bias", bias)
        check_same_dtype(_OP, "x", x, "bias", bias)
        check_same_device(_OP, "x", x, "bias", bias)
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"{_OP}: bias must be (vocab,) = ({weight.shape[0]},), got {tuple(bias.shape)}")
    if ce_weight is not None:
        check_tensor(_OP, "ce_weight", ce_weight)
        check_float_dtype(_OP, "ce_weight", ce_weight)
        check_same_device(_OP, "x", x, "ce_weight", ce_weight)
        if tuple(ce_weight.shape) != (weight.shape[0],):
            raise ValueError(f"{_OP}: ce_weight must hold one weight per class, shape (vocab,) = "
                             f"({weight.shape[0]},), got {tuple(ce_weight.shape)}")
    ce.check_loss_options(_OP, ignore_index, reduction, label_smoothing, softcap, z_loss)
    check_bool(_OP, "return_z_loss", return_z_loss)
    if chunk_size is not None and (not _is_int(chunk_size) or chunk_size < 1):
        raise ValueError(f"{_OP}: chunk_size must be None (the default rule) or an int >= 1, got {chunk_size!r}")


def _public_chunk(chunk_size):
    """The op's ``chunk_size`` as the public function's: its 0 (the default rule) is None."""
    return None if type(chunk_size) is int and chunk_size == 0 else chunk_size


def _rows_view(x: torch.Tensor) -> torch.Tensor:
    """x as (rows, hidden) without a copy: rows are chunked in this order."""
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        raise ValueError(
            f"{_OP}: x's leading dims {tuple(x.shape[:-1])} with strides {x.stride()[:-1]} cannot be walked as one "
            "run of rows without a copy; pass x.contiguous() (the op never copies silently)"
        ) from None


# ----------------------------------------------------------------------------------------------
# The custom ops
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("kernel_ladder::fused_linear_cross_entropy", mutates_args=())
def _flce_op(
    x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
    ce_weight: torch.Tensor | None, ignore_index: int, reduction: str, label_smoothing: float,
    softcap: float | None, z_loss: float, return_z_loss: bool, chunk_size: int, compute_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, z-loss term, grad_x, grad_weight, grad_bias, anchor)``; the z term empty unless ``return_z_loss``,
    the gradients empty unless ``compute_grad``; ``chunk_size`` 0 for :func:`chunk_rows`."""
    _check_args(x, weight, target, bias, ce_weight, ignore_index, reduction, label_smoothing, softcap, z_loss,
                return_z_loss, _public_chunk(chunk_size))
    runtime.require_launchable(_OP, x, weight, target, *([ce_weight] if ce_weight is not None else []))
    x2 = _rows_view(x)
    n_rows, vocab = x2.shape[0], weight.shape[0]
    target_rows = target.reshape(n_rows)
    scales = _targets_and_scales(target_rows, ce_weight, vocab, ignore_index, reduction, label_smoothing)
    loss_rows = _launch.empty((n_rows,), torch.float32, x.device)
    z_rows = _launch.empty((n_rows,), torch.float32, x.device) if return_z_loss else None
    grads = _new_grads(x2, weight, bias) if compute_grad else None
    options = (ignore_index, label_smoothing, softcap, z_loss)
    _chunks(x2, target_rows, weight, bias, ce_weight, scales, loss_rows, z_rows, options,
            _chunk(chunk_size, n_rows, weight), grads)
    if reduction == "none":
        loss = loss_rows.view(target.shape)
        z = z_rows.view(target.shape) if return_z_loss else _launch.empty((0,), torch.float32, x.device)
    else:
        loss = _launch.empty((), torch.float32, x.device)
        z = _launch.empty(() if return_z_loss else (0,), torch.float32, x.device)
        ce.cross_entropy_reduce_kernel[(1,)](loss_rows, z_rows if return_z_loss else loss_rows, scales, loss, z,
                                             n_rows, RETURN_Z=return_z_loss, MEAN=reduction == "mean",
                                             BLOCK=ce.SCAN_BLOCK)
    if grads is not None:
        grad_x, grad_w, grad_b = _finish_grads(grads, x, weight, bias, n_rows)
    else:  # three distinct empty tensors: a custom op's outputs may not alias
        grad_x, grad_w, grad_b = x.new_empty(0), x.new_empty(0), x.new_empty(0)
    return loss, z, grad_x, grad_w, grad_b, _launch.empty((0,), torch.float32, x.device)


@_flce_op.register_fake
def _flce_fake(x, weight, target, bias, ce_weight, ignore_index, reduction, label_smoothing, softcap, z_loss,
               return_z_loss, chunk_size, compute_grad):
    _check_args(x, weight, target, bias, ce_weight, ignore_index, reduction, label_smoothing, softcap, z_loss,
                return_z_loss, _public_chunk(chunk_size))
    loss_shape = tuple(target.shape) if reduction == "none" else ()
    loss = x.new_empty(loss_shape, dtype=torch.float32)
    z = x.new_empty(loss_shape if return_z_loss else (0,), dtype=torch.float32)
    anchor = x.new_empty((0,), dtype=torch.float32)
    if not compute_grad:
        return loss, z, x.new_empty(0), x.new_empty(0), x.new_empty(0), anchor
    grad_b = bias.new_empty(bias.shape) if bias is not None else x.new_empty(0)
    return loss, z, x.new_empty(x.shape), weight.new_empty(weight.shape), grad_b, anchor


@torch.library.custom_op("kernel_ladder::fused_linear_cross_entropy_backward", mutates_args=())
def _flce_backward_op(
    grad_loss: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
    ce_weight: torch.Tensor | None, ignore_index: int, label_smoothing: float, softcap: float | None, z_loss: float,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """reduction="none": the chunks again, each row's gradient scaled by its ``grad_loss``."""
    runtime.require_launchable(f"{_OP} (backward)", grad_loss, x, weight)
    x2 = _rows_view(x)
    n_rows, vocab = x2.shape[0], weight.shape[0]
    target_rows = target.reshape(n_rows)
    scales = _targets_and_scales(target_rows, ce_weight, vocab, ignore_index, "none", label_smoothing)
    loss_rows = _launch.empty((n_rows,), torch.float32, x.device)  # recomputed, unused
    grads = _new_grads(x2, weight, bias)
    _chunks(x2, target_rows, weight, bias, ce_weight, scales, loss_rows, None,
            (ignore_index, label_smoothing, softcap, z_loss), _chunk(chunk_size, n_rows, weight), grads,
            row_scale=grad_loss.reshape(n_rows))
    return _finish_grads(grads, x, weight, bias, n_rows)


@_flce_backward_op.register_fake
def _flce_backward_fake(grad_loss, x, weight, target, bias, ce_weight, ignore_index, label_smoothing, softcap, z_loss,
                        chunk_size):
    grad_b = bias.new_empty(bias.shape) if bias is not None else x.new_empty(0)
    return x.new_empty(x.shape), weight.new_empty(weight.shape), grad_b


#: The op's inputs: x, weight, target, bias, then these (none of them differentiable).
_OPTIONS = ("ce_weight", "ignore_index", "reduction", "label_smoothing", "softcap", "z_loss", "return_z_loss",
            "chunk_size", "compute_grad")


def _setup_context(ctx, inputs, output) -> None:
    x, weight, target, bias = inputs[:4]
    options = dict(zip(_OPTIONS, inputs[4:]))
    _, z, grad_x, grad_w, grad_b, anchor = output
    ctx.options = tuple(options[k] for k in ("ignore_index", "label_smoothing", "softcap", "z_loss", "chunk_size"))
    ctx.reduction, ctx.compute_grad, ctx.has_bias = options["reduction"], options["compute_grad"], bias is not None
    ctx.backward_ran = False
    ctx.save_for_backward(x, weight, target, bias, options["ce_weight"], grad_x, grad_w, grad_b, anchor)
    # z is for logging (its gradient is already in the loss's, as in Liger-Kernel); not the anchor: it links
    # recorded gradients here
    ctx.mark_non_differentiable(z, grad_x, grad_w, grad_b)
    ctx.set_materialize_grads(False)


def _scaled(grad: torch.Tensor, grad_loss: torch.Tensor) -> torch.Tensor:
    """``grad * grad_loss`` (a 0-d factor): in place, skipped when the factor is 1, unless traced."""
    if grad.numel() == 0:
        return grad
    if ce.tracing(grad, grad_loss):  # a traced graph must not mutate a saved tensor
        return grad * grad_loss.to(grad.dtype)
    with torch.no_grad():
        torch.ops.kernel_ladder.cross_entropy_backward(grad.view(1, -1), grad_loss)
    return grad


def _backward(ctx, grad_loss, *_unused):
    none = (None,) * len(_OPTIONS)
    if ctx.reduction != "none" and ctx.backward_ran:  # before saved_tensors: they were scaled in place
        raise RuntimeError(f"{_OP}: backward through the same loss twice (retain_graph=True) is not supported: "
                           "the gradients computed in the forward are scaled in place. Compute the loss again")
    x, weight, target, bias, ce_weight, grad_x, grad_w, grad_b, anchor = ctx.saved_tensors
    if grad_loss is None:
        return None, None, None, None, *none
    if ctx.reduction == "none":
        ignore_index, label_smoothing, softcap, z_loss, chunk_size = ctx.options
        grad_x, grad_w, grad_b = _flce_backward_op(grad_loss, x, weight, target, bias, ce_weight, ignore_index,
                                                   label_smoothing, softcap, z_loss, chunk_size)
    else:
        if not ctx.compute_grad:
            raise RuntimeError(f"{_OP}: the forward ran without a gradient; call "
                               "kernel_ladder.fused_linear_cross_entropy (it decides from requires_grad and grad mode)")
        ctx.backward_ran = True
        grad_x, grad_w, grad_b = (_scaled(g, grad_loss.reshape(())) for g in (grad_x, grad_w, grad_b))
    if torch.is_grad_enabled():  # create_graph=True: usable, but a gradient of it raises the op's error
        name = f"{_OP} (backward)"
        grad_x, grad_w = (recorded_gradient(name, g, anchor, grad_loss) for g in (grad_x, grad_w))
        if ctx.has_bias:
            grad_b = recorded_gradient(name, grad_b, anchor, grad_loss)
    return grad_x, grad_w, None, (grad_b if ctx.has_bias else None), *none


_flce_op.register_autograd(_backward, setup_context=_setup_context)


def fused_linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    z_loss: float = 0.0,
    chunk_size: int | None = None,
    ce_weight: torch.Tensor | None = None,
    return_z_loss: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``cross_entropy(x @ weight.T + bias, target)`` without ever materializing the ``(N, V)`` logits.

    Args:
        x: float32, float16 or bfloat16 hidden states ``(..., H)`` whose leading dims can be walked
            as one run of rows (a contiguous or row-sliced tensor; else pass ``x.contiguous()``).
        weight: the LM head, ``(V, H)``, x's dtype and device.
        target: int64/int32 class indices of x's leading shape, each in ``[0, V)`` or ``ignore_index``.
        bias: ``(V,)`` or None.
        ignore_index, reduction, label_smoothing, softcap, z_loss: as :func:`kernel_ladder.cross_entropy`
            (``softcap``: Gemma-2's ``softcap * tanh(z / softcap)`` of the logits; ``z_loss``: PaLM's
            ``z_loss * mean(logsumexp**2)``).
        chunk_size: rows per chunk; None for :func:`chunk_rows` (enough rows that the fp32 weight gradient's
            traffic stays under 1/8 of the FLOP time, within a memory budget), computed inside the op from the
            real sizes (so a dynamic shape under ``torch.compile`` never
            turns it into a symbolic expression).
        ce_weight: per-class weights ``(V,)``, torch's ``cross_entropy(weight=...)`` (any float dtype, not
            differentiable): row ``i``'s loss is scaled by ``ce_weight[target_i]`` (the smoothing term by each
            class's weight), and ``"mean"`` divides by the sum of the non-ignored rows' target weights. The
            z-loss is not weighted (its ``"mean"`` divides by the number of non-ignored rows).
        return_z_loss: also return the z-loss term alone, ``z_loss * logsumexp**2`` reduced like the loss
            (``"mean"``: summed over the non-ignored rows and divided by their count) — Liger-Kernel's
            definition (``LigerFusedLinearCrossEntropyLoss(return_z_loss=True)``, whose ``lse_square_scale``
            is this ``z_loss``). For logging: not differentiable (its gradient is already in the loss's).

    Returns:
        The loss (0-d, or x's leading shape for ``"none"``) in float32, whatever x's dtype: the
        logits never exist in a dtype of their own, and a loss rounded to bf16 keeps under three
        significant digits (what Hugging Face's models get by upcasting the logits first). With
        ``return_z_loss``, ``(loss, z_loss_term)``, both float32.
        Differentiable in x, weight and bias: for "mean" and "sum" the gradients are computed in the
        forward (one backward per loss); for "none" the backward recomputes the chunks.
    """
    if not schema_types(tensors=(x, weight, target), optional_tensors=(bias, ce_weight),
                        reals=(label_smoothing, z_loss), optional_reals=(softcap,), ints=(ignore_index,),
                        optional_ints=(chunk_size,),
                        flags=(return_z_loss,), strings=(reduction,)) or (chunk_size is not None and chunk_size < 1):
        _check_args(x, weight, target, bias, ce_weight, ignore_index, reduction, label_smoothing, softcap, z_loss,
                    return_z_loss, chunk_size)  # else the op checks values (its 0 is the default chunk)
    if ce_weight is not None and ce_weight.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{_OP}: ce_weight is not differentiable (as torch's cross_entropy weight); pass "
                         "ce_weight.detach()")
    needs = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                         or (bias is not None and bias.requires_grad))
    compute_grad = needs and reduction != "none"
    loss, z, *_ = _flce_op(x, weight, target, bias, ce_weight, int(ignore_index), reduction, float(label_smoothing),
                           None if softcap is None else float(softcap), float(z_loss), bool(return_z_loss),
                           0 if chunk_size is None else chunk_size, compute_grad)
    return (loss, z) if return_z_loss else loss
