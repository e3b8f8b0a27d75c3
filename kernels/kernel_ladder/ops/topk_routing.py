"""Mixture-of-experts top-k routing, forward and backward, as ``kernel_ladder::topk_routing``, and the
Switch/Mixtral auxiliary load-balancing loss.

``topk_routing(router_logits, k)`` gives each token (a row of ``router_logits``, ``(T, E)``) its
``k`` experts and their weights:

* ``scoring="softmax"`` (Mixtral, Qwen2-MoE, Qwen3-MoE): ``p = softmax(logits)`` over the experts in
  float32, the ``k`` largest ``p``, then (``renormalize=True``, Mixtral; Qwen's ``norm_topk_prob``)
  divided by their sum. ``renormalize=False`` is Qwen2-MoE without ``norm_topk_prob``.
* ``scoring="sigmoid"``: ``p = sigmoid(logits)``, the ``k`` largest, renormalized if asked.

**DeepSeek-V3's routing** (transformers' ``DeepseekV3TopkRouter``, DeepSeek's ``Gate`` in its
inference code) is the same kernel with three more inputs. ``bias`` (``e_score_correction_bias``,
``(E,)``) is added to the scores to *choose* (``choice = p + bias``) but not to *weigh*: the weights are
the unbiased ``p`` of the chosen experts. It is how DeepSeek-V3 balances its experts without an
auxiliary loss: between steps, training nudges an overloaded expert's bias down and an idle one's
up, which moves tokens without touching the gradient of the weights. ``num_groups`` and
``topk_groups`` (``n_group``, ``topk_group``) limit each token to a few groups of consecutive experts
(in expert parallelism, a few devices): each group scores the sum of its two largest choice scores,
the ``topk_groups`` best groups are kept, and the top ``k`` are chosen within them. ``scale``
(``routed_scaling_factor``) multiplies the weights after the renormalization. In the kernel the
tile's columns are laid out group by group (each group padded to a power of two), so the group
scores are a reshape and two reductions, and the group choice ``topk_groups`` more argmax rounds,
all in registers: one program per block of tokens, no host synchronization.

**Dropped groups are never chosen.** transformers 5's ``DeepseekV3TopkRouter`` and DeepSeek's own
inference code fill the dropped groups' choice scores with ``-inf`` before the final top-``k``; older
transformers (4.x's DeepseekV3) filled them with ``0.0``. This kernel chooses only within the kept
groups: the ``-inf`` semantics. The two agree whenever every kept expert's biased score is positive
(sigmoid scores are, and a zero or small bias keeps them so); they differ when a negative bias
pushes a kept expert's choice below 0, where a ``0.0`` fill would let a dropped group's expert win
(``tests/test_kernels_moe_grouped_routing.py`` builds that case). Hugging Face also adds ``1e-20``
to the renormalization's denominator; this kernel does not (DeepSeek's code does not either): they
differ only when the chosen scores are all exactly 0 (NaN here, 0 there).

One kernel, :func:`topk_routing_kernel`: a program takes ``BLOCK_T`` whole rows (all ``E`` experts
in one block of registers, ``E <= MAX_EXPERTS``), computes the scores, and picks the top ``k`` by
``k`` rounds of "argmax, then mask the winner out" in registers — no sort, no second pass over
memory. It reads the logits once and writes ``T * k`` weights and ids: the ideal traffic. The
rounds rank the experts by their logits, which order them as the scores do (softmax and sigmoid
both rise with the logit) and stay ordered where the scores are NaN; with a bias or groups they
rank the float32 choice scores, as Hugging Face does.

**Ties** pick the lowest expert index (each round's argmax is the smallest index holding the
maximum logit; between equal groups, the lowest group): the ids are the first ``k`` of a stable
descending sort of the row. ``torch.topk`` leaves the order of equal values unspecified (on the CPU
it does not pick the lowest indices), so the ids can differ from torch's where scores tie exactly;
the weights cannot.

**NaN and infinite logits** never leave a token without valid experts: the ids are always ``k``
distinct experts in ``[0, E)``, and one token's logits never change another token's routing.

* A NaN logit is read as ``-inf``: that expert scores 0 and is chosen only when ``k`` exceeds the
  experts with a larger logit. (Torch's softmax of such a row is NaN everywhere; here the other
  experts keep their probabilities.)
* A row whose largest logit is ``+inf``, or whose logits are all ``-inf`` (or NaN), has no softmax:
  torch's ``softmax`` gives NaN for every expert, and so does this kernel, so such a token's
  weights are NaN (its MoE output too, as in Hugging Face's block), and only its own. Its ids are
  the ``+inf`` experts first (lowest index first), then the rest by logit; for an all ``-inf`` row,
  experts ``0 .. k-1``. Sigmoid scores stay finite (``sigmoid(±inf)`` is 1 or 0); renormalizing
  ``k`` zero scores gives NaN, as torch's division does. With a bias or groups the choice scores
  rank (a NaN one last): a NaN sigmoid row is ranked by its bias alone, within the kept groups.

The backward (:func:`topk_routing_backward_kernel`, ``kernel_ladder::topk_routing_backward``) recomputes
the scores from the logits (one more read of ``T * E``, instead of saving a ``T * E`` float32 buffer)
and applies, per row: the scale, the renormalization's Jacobian ``ds_j = (dw_j - sum_i dw_i w_i) / S``
(``S = sum_i s_i``), the scatter of ``ds`` to the chosen experts (``g``, zero elsewhere), then the
softmax Jacobian ``dx = p * (g - sum(g * p))`` or the sigmoid's ``dx = g * p * (1 - p)``. The
expert ids are not differentiable.

:func:`moe_load_balancing_loss` is torch code on :func:`kernel_ladder.softmax` (see its docstring).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _launch, runtime
from .._launch import next_power_of_2
from .._validate import check_bool, check_choice, check_float_dtype, check_tensor, is_int, schema_types
from .softmax import softmax

__all__ = [
    "LOGIT_DTYPES",
    "MAX_EXPERTS",
    "MAX_K",
    "SCORINGS",
    "moe_load_balancing_loss",
    "topk_routing",
    "topk_routing_backward_kernel",
    "topk_routing_kernel",
]

#: The widest router one block holds (experts per token, ``E``).
MAX_EXPERTS: int = 4096
#: The most experts a token may be routed to (the ``k`` rounds are unrolled).
MAX_K: int = 32
#: Elements of logits a program aims to hold (short rows are packed, ``BLOCK_T`` rows a program).
ROUTING_TILE: int = 4096
SCORINGS = ("softmax", "sigmoid")
#: The logits' dtypes: the kernels read them in float32 (float64 logits are rounded to it once).
LOGIT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_logits_dtype(op: str, name: str, t: torch.Tensor) -> None:
    """``t`` must be one of :data:`LOGIT_DTYPES`."""
    if t.dtype not in LOGIT_DTYPES:
        raise TypeError(f"{op}: {name} must be float32, float16, bfloat16 or float64, got {t.dtype}")

_NEG_INF = tl.constexpr(float("-inf"))


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _logits(x_ptr, rows, row_ok, cols, n_experts, stride_xt, stride_xe):
    """float32 logits of a (BLOCK_T, BLOCK_E) tile, NaN read as -inf; padding columns (and rows) -inf."""
    return _expert_logits(x_ptr, rows, row_ok, cols, cols < n_experts, stride_xt, stride_xe)


@triton.jit
def _expert_logits(x_ptr, rows, row_ok, experts, valid, stride_xt, stride_xe):
    """float32 logits of a (BLOCK_T, BLOCK) tile whose column c holds expert ``experts[c]`` where ``valid[c]``
    (NaN read as -inf; padding columns and rows -inf)."""
    mask = row_ok[:, None] & valid[None, :]
    offs = rows.to(tl.int64)[:, None] * stride_xt + experts.to(tl.int64)[None, :] * stride_xe
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return tl.where(mask & (x == x), x, _NEG_INF)  # x != x: NaN


@triton.jit
def _scores(x, SIGMOID: tl.constexpr):
    """float32 scores of cleaned logits: a padding column scores 0 in a row that has a finite maximum;
    a row whose maximum is +inf or -inf has no softmax (NaN everywhere, as torch's)."""
    if SIGMOID:
        p = tl.sigmoid(x)
    else:
        m = tl.max(x, axis=1)
        e = tl.exp(x - m[:, None])
        p = e * (1.0 / tl.sum(e, axis=1))[:, None]
    return p


@triton.jit
def _top2_sum(c, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr):
    """Each group's score, (BLOCK_T, BLOCK_G): the sum of its two largest values in c (BLOCK_T, BLOCK_G *
    BLOCK_S), group g's members in columns g * BLOCK_S ..; a tie for the largest counts both."""
    c3 = tl.reshape(c, (BLOCK_T, BLOCK_G, BLOCK_S))
    s3 = tl.arange(0, BLOCK_S)[None, None, :]
    first = tl.max(c3, axis=2)
    at = tl.min(tl.where(c3 == first[:, :, None], s3, BLOCK_S), axis=2)  # one column holding the maximum
    second = tl.max(tl.where(s3 == at[:, :, None], _NEG_INF, c3), axis=2)
    total = first + second
    return tl.where(total == total, total, _NEG_INF)  # +inf + -inf (biases): NaN, ranked last


@triton.jit
def _kept_groups(group_scores, group_ok, TOPK_GROUPS: tl.constexpr, BLOCK_G: tl.constexpr):
    """(BLOCK_T, BLOCK_G) int32: 1 for the TOPK_GROUPS best groups of each row (ties: the lowest group)."""
    gidx = tl.arange(0, BLOCK_G)[None, :]
    free = group_ok
    kept = tl.zeros(group_scores.shape, tl.int32)
    for _ in tl.static_range(TOPK_GROUPS):
        best = tl.max(tl.where(free, group_scores, _NEG_INF), axis=1)
        winner = tl.min(tl.where(free & (group_scores == best[:, None]), gidx, BLOCK_G), axis=1)
        hit = gidx == winner[:, None]
        kept = tl.where(hit, 1, kept)
        free = free & (gidx != winner[:, None])
    return kept


@triton.jit
def topk_routing_kernel(
    x_ptr, w_ptr, ids_ptr, bias_ptr, n_tokens, n_experts, stride_xt, stride_xe, stride_b,
    n_groups, group_size, scale,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr = False,
    GROUPED: tl.constexpr = False, TOPK_GROUPS: tl.constexpr = 1, BLOCK_G: tl.constexpr = 1,
    BLOCK_S: tl.constexpr = 1,
):
    """weights, ids (T, K) of BLOCK_T rows: scores, then K rounds of argmax-and-mask.

    Without a bias or groups the rounds rank the logits. With them (DeepSeek-V3) they rank the choice
    scores ``score + bias``, and, GROUPED, only within the TOPK_GROUPS groups of the best top-2 sums:
    the tile's columns are then laid out group by group (column g * BLOCK_S + s holds expert
    g * group_size + s; BLOCK_E = BLOCK_G * BLOCK_S). The weights are the unbiased scores, renormalized
    if asked, times ``scale``."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < n_tokens
    cols = tl.arange(0, BLOCK_E)
    if GROUPED:
        experts = (cols // BLOCK_S) * group_size + cols % BLOCK_S
        valid = (cols // BLOCK_S < n_groups) & (cols % BLOCK_S < group_size)
    else:
        experts = cols
        valid = cols < n_experts
    x = _expert_logits(x_ptr, rows, row_ok, experts, valid, stride_xt, stride_xe)
    p = _scores(x, SIGMOID)
    if HAS_BIAS or GROUPED:
        # DeepSeek-V3 ranks the scores (plus the correction bias), not the logits; a NaN (a softmax row
        # with no softmax, opposite infinite biases) ranks last, so every round still picks a real expert.
        rank = p
        if HAS_BIAS:
            rank += tl.load(bias_ptr + experts.to(tl.int64) * stride_b, mask=valid, other=0.0).to(tl.float32)[None, :]
        rank = tl.where(valid[None, :] & (rank == rank), rank, _NEG_INF)
    else:
        # The same order as the scores (both rise with the logit), and defined where the scores are NaN.
        rank = x
    # The experts still to choose from: real columns (in kept groups), not chosen yet.
    free = valid[None, :] & (rows >= 0)[:, None]
    if GROUPED:
        group_ok = (tl.arange(0, BLOCK_G) < n_groups)[None, :] & (rows >= 0)[:, None]
        kept = _kept_groups(_top2_sum(rank, BLOCK_T, BLOCK_G, BLOCK_S), group_ok, TOPK_GROUPS, BLOCK_G)
        kept = tl.reshape(tl.broadcast_to(kept[:, :, None], (BLOCK_T, BLOCK_G, BLOCK_S)), (BLOCK_T, BLOCK_E))
        free = free & (kept != 0)  # a dropped group's experts are never chosen (see the module docstring)
    slots = tl.arange(0, BLOCK_K)
    weights = tl.zeros((BLOCK_T, BLOCK_K), tl.float32)
    ids = tl.zeros((BLOCK_T, BLOCK_K), tl.int32)
    for j in tl.static_range(K):
        best = tl.max(tl.where(free, rank, _NEG_INF), axis=1)
        # The lowest free column holding the maximum (ties: lowest expert; all -inf: the lowest free).
        winner = tl.min(tl.where(free & (rank == best[:, None]), cols[None, :], BLOCK_E), axis=1)
        chosen = cols[None, :] == winner[:, None]
        weight = tl.sum(tl.where(chosen, p, 0.0), axis=1)
        expert = tl.sum(tl.where(chosen, experts[None, :], 0), axis=1)
        weights = tl.where(slots[None, :] == j, weight[:, None], weights)
        ids = tl.where(slots[None, :] == j, expert[:, None], ids)
        free = free & (cols[None, :] != winner[:, None])
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=1)[:, None]
    weights = weights * scale  # routed_scaling_factor (1.0: exact)
    out = rows.to(tl.int64)[:, None] * K + slots[None, :]
    mask = row_ok[:, None] & (slots < K)[None, :]
    tl.store(w_ptr + out, weights, mask=mask)
    tl.store(ids_ptr + out, ids.to(ids_ptr.dtype.element_ty), mask=mask)


@triton.jit
def topk_routing_backward_kernel(
    x_ptr, ids_ptr, dw_ptr, dx_ptr, n_tokens, n_experts, stride_xt, stride_xe,
    stride_it, stride_ik, stride_dwt, stride_dwk, scale,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr,
):
    """d logits of BLOCK_T rows from d weights: the scale, renormalization, scatter, score Jacobians (the
    ids are given: a bias or group limit only chose them, and neither is differentiated)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < n_tokens
    cols = tl.arange(0, BLOCK_E)
    p = _scores(_logits(x_ptr, rows, row_ok, cols, n_experts, stride_xt, stride_xe), SIGMOID)
    p = tl.where((cols < n_experts)[None, :], p, 0.0)  # padding contributes nothing
    slots = tl.arange(0, BLOCK_K)
    kmask = row_ok[:, None] & (slots < K)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    ids = tl.load(ids_ptr + rows64 * stride_it + slots[None, :] * stride_ik, mask=kmask, other=0).to(tl.int32)
    dw = tl.load(dw_ptr + rows64 * stride_dwt + slots[None, :] * stride_dwk, mask=kmask, other=0.0).to(tl.float32)
    dw = dw * scale  # weights = scale * (renormalized) scores
    # Selected scores s_j = p[ids_j]: their sum S and sum_j dw_j s_j.
    total = tl.zeros((BLOCK_T,), tl.float32)
    dot = tl.zeros((BLOCK_T,), tl.float32)
    for j in tl.static_range(K):
        id_j = tl.sum(tl.where(slots[None, :] == j, ids, 0), axis=1)
        dw_j = tl.sum(tl.where(slots[None, :] == j, dw, 0.0), axis=1)
        s_j = tl.sum(tl.where(cols[None, :] == id_j[:, None], p, 0.0), axis=1)
        total += s_j
        dot += dw_j * s_j
    total = tl.where(row_ok, total, 1.0)
    g = tl.zeros((BLOCK_T, BLOCK_E), tl.float32)
    for j in tl.static_range(K):
        id_j = tl.sum(tl.where(slots[None, :] == j, ids, 0), axis=1)
        dw_j = tl.sum(tl.where(slots[None, :] == j, dw, 0.0), axis=1)
        if RENORMALIZE:
            ds_j = (dw_j - dot / total) / total  # w_i = s_i / S: sum_i dw_i w_i = dot / S
        else:
            ds_j = dw_j
        g += tl.where(cols[None, :] == id_j[:, None], ds_j[:, None], 0.0)
    if SIGMOID:
        dx = g * p * (1.0 - p)
    else:
        dx = p * (g - tl.sum(g * p, axis=1)[:, None])
    mask = row_ok[:, None] & (cols < n_experts)[None, :]
    tl.store(dx_ptr + rows64 * n_experts + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Launch
# ----------------------------------------------------------------------------------------------


def _config(n_tokens: int, n_experts: int, k: int, n_groups: int = 1) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_T, BLOCK_E, BLOCK_K, num_warps, BLOCK_G, BLOCK_S): whole rows, packed to about ROUTING_TILE
    elements; with groups, BLOCK_G blocks of BLOCK_S columns (each group padded to a power of two)."""
    if n_groups > 1:
        block_g, block_s = next_power_of_2(n_groups), next_power_of_2(n_experts // n_groups)
        block_e = block_g * block_s
    else:
        block_g, block_s = 1, 1
        block_e = next_power_of_2(n_experts)
    block_t = max(1, min(ROUTING_TILE // block_e, next_power_of_2(max(n_tokens, 1))))
    warps = _launch.num_warps_for(block_t * block_e, 16, max_warps=16)
    return block_t, block_e, next_power_of_2(k), warps, block_g, block_s


def _check_args(op: str, router_logits: object, k: object, renormalize: object, scoring: object,
                bias: object = None, num_groups: object = None, topk_groups: object = None,
                scale: object = 1.0) -> None:
    check_tensor(op, "router_logits", router_logits)
    check_logits_dtype(op, "router_logits", router_logits)
    if router_logits.dim() != 2:
        raise ValueError(f"{op}: router_logits must be 2-D (tokens, experts), got shape {tuple(router_logits.shape)}"
                         " (flatten the leading dims with .reshape(-1, num_experts))")
    n_experts = router_logits.shape[1]
    if not 1 <= n_experts <= MAX_EXPERTS:
        raise ValueError(f"{op}: router_logits must have 1 to {MAX_EXPERTS} experts (its last dim), got {n_experts}")
    if not is_int(k):
        raise TypeError(f"{op}: k must be an int, got {type(k).__name__}")
    if not 1 <= k <= min(n_experts, MAX_K):
        raise ValueError(f"{op}: k must be in [1, min(num_experts, {MAX_K})] = [1, {min(n_experts, MAX_K)}] "
                         f"for {n_experts} experts, got {k}")
    check_bool(op, "renormalize", renormalize)
    check_choice(op, "scoring", scoring, SCORINGS)
    if bias is not None:
        check_tensor(op, "bias", bias)
        check_logits_dtype(op, "bias", bias)
        if tuple(bias.shape) != (n_experts,):
            raise ValueError(f"{op}: bias must be (E,) = ({n_experts},), one correction per expert "
                             f"(e_score_correction_bias), got shape {tuple(bias.shape)}")
        if bias.device != router_logits.device:
            raise ValueError(f"{op}: bias must be on router_logits' device {router_logits.device}, got {bias.device}")
    if (num_groups is None) != (topk_groups is None):
        raise ValueError(f"{op}: num_groups and topk_groups go together (n_group, topk_group), got "
                         f"num_groups={num_groups!r} and topk_groups={topk_groups!r}")
    if num_groups is not None:
        for name, value in (("num_groups", num_groups), ("topk_groups", topk_groups)):
            if not is_int(value):
                raise TypeError(f"{op}: {name} must be an int, got {type(value).__name__}")
        if not 1 <= num_groups <= n_experts or n_experts % num_groups:
            raise ValueError(f"{op}: num_groups must divide the number of experts E = {n_experts} (equal groups), "
                             f"got {num_groups}")
        group_size = n_experts // num_groups
        if num_groups > 1 and group_size < 2:
            raise ValueError(f"{op}: each group needs at least 2 experts (a group scores its top-2 sum): "
                             f"E = {n_experts} in num_groups = {num_groups} groups gives {group_size}")
        if not 1 <= topk_groups <= num_groups:
            raise ValueError(f"{op}: topk_groups must be in [1, num_groups = {num_groups}], got {topk_groups}")
        if topk_groups * group_size < k:
            raise ValueError(f"{op}: topk_groups * group size must be at least k = {k}: {topk_groups} groups of "
                             f"{group_size} experts hold only {topk_groups * group_size}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{op}: scale must be a float (routed_scaling_factor), got {type(scale).__name__}")


def _check_backward_args(op: str, grad_weights, router_logits, expert_ids, renormalize, scoring) -> None:
    for name, t in (("grad_weights", grad_weights), ("router_logits", router_logits), ("expert_ids", expert_ids)):
        check_tensor(op, name, t)
    check_float_dtype(op, "grad_weights", grad_weights)
    check_logits_dtype(op, "router_logits", router_logits)
    if router_logits.dim() != 2:
        raise ValueError(f"{op}: router_logits must be 2-D, got shape {tuple(router_logits.shape)}")
    if expert_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: expert_ids must be int32 or int64, got {expert_ids.dtype}")
    if expert_ids.dim() != 2 or expert_ids.shape[0] != router_logits.shape[0] or grad_weights.shape != expert_ids.shape:
        raise ValueError(f"{op}: grad_weights and expert_ids must both be (T, k) with T = {router_logits.shape[0]}, "
                         f"got {tuple(grad_weights.shape)} and {tuple(expert_ids.shape)}")
    if not 1 <= expert_ids.shape[1] <= MAX_K:
        raise ValueError(f"{op}: k must be in [1, {MAX_K}], got {expert_ids.shape[1]}")
    check_bool(op, "renormalize", renormalize)
    check_choice(op, "scoring", scoring, SCORINGS)


# ----------------------------------------------------------------------------------------------
# Custom ops and autograd
# ----------------------------------------------------------------------------------------------

_OP = "kernel_ladder.topk_routing"


@torch.library.custom_op("kernel_ladder::topk_routing", mutates_args=())
def _topk_routing_op(router_logits: torch.Tensor, k: int, renormalize: bool, scoring: str,
                     bias: torch.Tensor | None = None, num_groups: int = 1, topk_groups: int = 1,
                     scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    _check_args(_OP, router_logits, k, renormalize, scoring, bias, num_groups, topk_groups, scale)
    runtime.require_launchable(_OP, router_logits, *(() if bias is None else (bias,)))
    n_tokens, n_experts = router_logits.shape
    weights = _launch.empty_output((n_tokens, k), router_logits, torch.float32)
    ids = _launch.empty_output((n_tokens, k), router_logits, torch.int64)
    if n_tokens:
        grouped = num_groups > 1
        block_t, block_e, block_k, warps, block_g, block_s = _config(n_tokens, n_experts, k, num_groups)
        topk_routing_kernel[(triton.cdiv(n_tokens, block_t),)](
            router_logits, weights, ids, router_logits if bias is None else bias, n_tokens, n_experts,
            *router_logits.stride(), 0 if bias is None else bias.stride(0), num_groups, n_experts // num_groups,
            float(scale), K=k, BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=block_k,
            SIGMOID=scoring == "sigmoid", RENORMALIZE=renormalize, HAS_BIAS=bias is not None, GROUPED=grouped,
            TOPK_GROUPS=topk_groups if grouped else 1, BLOCK_G=block_g, BLOCK_S=block_s, num_warps=warps,
        )
    return weights, ids


@_topk_routing_op.register_fake
def _topk_routing_fake(router_logits, k, renormalize, scoring, bias=None, num_groups=1, topk_groups=1, scale=1.0):
    _check_args(_OP, router_logits, k, renormalize, scoring, bias, num_groups, topk_groups, scale)
    n_tokens = router_logits.shape[0]
    return (router_logits.new_empty((n_tokens, k), dtype=torch.float32),
            router_logits.new_empty((n_tokens, k), dtype=torch.int64))


@torch.library.custom_op("kernel_ladder::topk_routing_backward", mutates_args=())
def _topk_routing_backward_op(grad_weights: torch.Tensor, router_logits: torch.Tensor, expert_ids: torch.Tensor,
                              renormalize: bool, scoring: str, scale: float = 1.0) -> torch.Tensor:
    op = _OP + " (backward)"
    _check_backward_args(op, grad_weights, router_logits, expert_ids, renormalize, scoring)
    runtime.require_launchable(op, router_logits, grad_weights, expert_ids)
    n_tokens, n_experts = router_logits.shape
    k = expert_ids.shape[1]
    grad = _launch.empty_output(router_logits.shape, router_logits)
    if n_tokens:
        block_t, block_e, block_k, warps, _, _ = _config(n_tokens, n_experts, k)
        topk_routing_backward_kernel[(triton.cdiv(n_tokens, block_t),)](
            router_logits, expert_ids, grad_weights, grad, n_tokens, n_experts, *router_logits.stride(),
            *expert_ids.stride(), *grad_weights.stride(), float(scale),
            K=k, BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=block_k,
            SIGMOID=scoring == "sigmoid", RENORMALIZE=renormalize, num_warps=warps,
        )
    return grad


@_topk_routing_backward_op.register_fake
def _topk_routing_backward_fake(grad_weights, router_logits, expert_ids, renormalize, scoring, scale=1.0):
    _check_backward_args(_OP + " (backward)", grad_weights, router_logits, expert_ids, renormalize, scoring)
    return router_logits.new_empty(router_logits.shape)


def _setup_context(ctx, inputs, output) -> None:
    router_logits, _, renormalize, scoring, _, _, _, scale = inputs
    _, ids = output
    ctx.save_for_backward(router_logits, ids)
    ctx.renormalize, ctx.scoring, ctx.scale = renormalize, scoring, scale
    ctx.mark_non_differentiable(ids)


def _backward(ctx, grad_weights, grad_ids):
    router_logits, ids = ctx.saved_tensors
    if grad_weights is None:
        return None, None, None, None, None, None, None, None
    grad = _topk_routing_backward_op(grad_weights, router_logits, ids, ctx.renormalize, ctx.scoring, ctx.scale)
    return grad, None, None, None, None, None, None, None


_topk_routing_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------


def topk_routing(router_logits: torch.Tensor, k: int, renormalize: bool = True, scoring: str = "softmax", *,
                 bias: torch.Tensor | None = None, num_groups: int | None = None, topk_groups: int | None = None,
                 scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top-``k`` experts and their routing weights.

    Args:
        router_logits: ``(T, E)`` float32, float16, bfloat16 or float64 (read in float32; any strides),
            ``1 <= E <= MAX_EXPERTS``.
        k: experts per token, ``1 <= k <= min(E, MAX_K)``.
        renormalize: divide the ``k`` chosen scores by their sum (Mixtral; Qwen's ``norm_topk_prob``;
            DeepSeek-V3's ``norm_topk_prob``).
        scoring: ``"softmax"`` (softmax over the experts in float32, as Mixtral's
            ``softmax(router_logits, dim=1, dtype=torch.float)``) or ``"sigmoid"`` (DeepSeek-V3's scores).
        bias: optional ``(E,)`` per-expert correction added to the scores **for the selection only**
            (DeepSeek-V3's ``e_score_correction_bias``; read in float32, any float dtype, not
            differentiated): the weights stay the unbiased scores.
        num_groups, topk_groups: group-limited routing (DeepSeek-V3's ``n_group``, ``topk_group``):
            the ``E`` experts in ``num_groups`` equal groups of consecutive ids (``E`` divisible,
            at least 2 experts a group), each scored by the sum of its two largest choice scores
            (``score + bias``); only the ``topk_groups`` best groups' experts may be chosen
            (``topk_groups * E / num_groups >= k``). Both or neither.
        scale: multiplies the final weights (DeepSeek-V3's ``routed_scaling_factor``), after the
            renormalization.

    Returns:
        ``(weights, expert_ids)``, both ``(T, k)`` and contiguous, in descending order of rank (the
        logits; with a bias or groups the choice scores): ``weights`` **float32** whatever the logits'
        dtype (Mixtral casts them to the hidden dtype only after the renormalization:
        ``weights.to(hidden.dtype)`` does the same), ``expert_ids`` **int64** like ``torch.topk``'s
        indices, always ``k`` distinct experts in ``[0, E)``. Ties pick the lowest expert index (and,
        between groups, the lowest group). A NaN logit counts as ``-inf``; a row whose largest logit
        is ``+inf`` or whose logits are all ``-inf`` gets NaN softmax weights, as torch's softmax does
        (see the module docstring). Differentiable with respect to ``router_logits`` through
        ``weights`` (the gradient in ``router_logits``' dtype).
    """
    if not schema_types(tensors=(router_logits,), optional_tensors=(bias,), ints=(k,),
                        optional_ints=(num_groups, topk_groups), reals=(scale,), flags=(renormalize,),
                        strings=(scoring,)) or (num_groups is None) != (topk_groups is None):
        _check_args(_OP, router_logits, k, renormalize, scoring, bias, num_groups, topk_groups, scale)
    if num_groups is None:
        num_groups = topk_groups = 1
    return _topk_routing_op(router_logits, k, renormalize, scoring, bias, num_groups, topk_groups, scale)


def moe_load_balancing_loss(router_logits: torch.Tensor, expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The Switch Transformer / Mixtral auxiliary loss ``num_experts * sum_e f_e * P_e``.

    Hugging Face's ``load_balancing_loss_func`` (transformers' Mixtral) for one layer and no
    attention mask: ``f_e`` = (number of (token, slot) entries routed to ``e``) / ``T`` — divided by
    the tokens, not the entries, so the ``f_e`` sum to ``k`` — and ``P_e`` = the mean over tokens of
    the softmax router probability of ``e``. Balanced routing gives ``k``.

    Torch ops on :func:`kernel_ladder.softmax` (so the gradient flows through ``kernel_ladder::softmax_backward``);
    the counts are a ``scatter_add`` (no host sync, unlike ``bincount``), not differentiable, as in
    Hugging Face. ``expert_ids`` ``(T, k)`` int32/int64 must be in ``[0, num_experts)`` (not checked:
    that would sync). Returns a float32 scalar.
    """
    op = "kernel_ladder.moe_load_balancing_loss"
    check_tensor(op, "router_logits", router_logits)
    check_tensor(op, "expert_ids", expert_ids)
    check_float_dtype(op, "router_logits", router_logits)
    if router_logits.dim() != 2:
        raise ValueError(f"{op}: router_logits must be 2-D (tokens, experts), got shape {tuple(router_logits.shape)}")
    if not is_int(num_experts):
        raise TypeError(f"{op}: num_experts must be an int, got {type(num_experts).__name__}")
    if num_experts != router_logits.shape[1]:
        raise ValueError(f"{op}: num_experts must equal router_logits.shape[1] = {router_logits.shape[1]}, "
                         f"got {num_experts}")
    if expert_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: expert_ids must be int32 or int64, got {expert_ids.dtype}")
    if expert_ids.dim() != 2 or expert_ids.shape[0] != router_logits.shape[0]:
        raise ValueError(f"{op}: expert_ids must be (T, k) with T = {router_logits.shape[0]}, "
                         f"got {tuple(expert_ids.shape)}")
    n_tokens = router_logits.shape[0]
    probs = softmax(router_logits, -1, dtype=torch.float32)
    flat = expert_ids.reshape(-1).to(torch.int64)
    counts = torch.zeros(num_experts, dtype=torch.float32, device=router_logits.device).scatter_add_(
        0, flat, torch.ones(flat.shape, dtype=torch.float32, device=router_logits.device))
    tokens_per_expert = counts / n_tokens
    prob_per_expert = probs.sum(0) / n_tokens
    return (tokens_per_expert * prob_per_expert).sum() * num_experts
