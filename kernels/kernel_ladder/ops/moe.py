"""A sparse mixture-of-experts block, forward and backward, as ``kernel_ladder.moe``: Mixtral's and Qwen-MoE's,
DeepSeek-V3's (group-limited sigmoid routing with a correction bias, a scaling factor, shared experts) and
GPT-OSS's (biased experts with a clamped SwiGLU, its interleaved transposed weights).

``moe(x, router_logits, w_gate_up, w_down, top_k)`` computes, for every token ``t``,

    out[t] = Σ_j p_tj · down_e(act(gate_e x_t) ⊙ up_e x_t),   e = the j-th expert chosen for t,

with Hugging Face's ``MixtralExperts`` layout: ``w_gate_up`` ``(E, 2F, H)`` (the gate's ``F`` rows
first, then up's) and ``w_down`` ``(E, H, F)``, used as they are (the grouped GEMMs read them
transposed through their strides, no copy). Five ops, each a Triton op with its backward:

1. :func:`kernel_ladder.topk_routing` — softmax (or sigmoid) over the experts in fp32, the top ``k``
   (with DeepSeek-V3's bias, groups and scale when given);
2. :func:`kernel_ladder.moe_permute` — the ``T·k`` (token, slot) entries sorted by expert (a counting
   sort) and each expert's cumulative end row;
3. ``kernel_ladder::moe_gate_up`` — **one** grouped GEMM for every expert's gate and up projections,
   reading the token rows through the permutation (the sorted copy of ``x`` is never written) and
   applying the gate in its epilogue: each program computes a gate tile and the matching up tile
   from the same ``x`` tiles, adds their biases, and stores only ``h = act(gate) * up`` ``(T·k, F)``;
4. :func:`kernel_ladder.grouped_matmul` — the down projection (and its bias), ``(T·k, H)``;
5. :func:`kernel_ladder.moe_combine` — each token's ``k`` rows weighted by the router and summed (the
   weights applied in the gather back, no atomics).

**GPT-OSS** (``GptOssExperts``): ``gate_up_layout="gpt_oss"`` takes ``gate_up_proj`` ``(E, H, 2F)`` with
gate and up **interleaved** (gate column ``n`` is ``2n``, its up column ``2n + 1``) and ``down_proj``
``(E, F, H)``; the kernels read the gate columns with a stride of 2 and the up columns one element
further (no de-interleaving copy). ``activation="swiglu_oai"`` is its gate, ``(clamp(up, -limit, limit)
+ 1) * g * sigmoid(alpha * g)`` with ``g = gate.clamp(max=limit)``; ``gate_up_bias`` ``(E, 2F)`` (in the
layout's column order) and ``down_bias`` ``(E, H)`` are added in the two GEMMs' epilogues. The down
bias is part of each expert's output, so the router weight scales it too, as in Hugging Face.

**Shared experts** (DeepSeek-V3, Qwen2-MoE without its shared gate): ``shared=(w_gate, w_up, w_down)``
adds :func:`kernel_ladder.gated_mlp` of every token to the routed sum.

Of the unfused chain (``solutions.ch09_moe.moe_unfused``: gather, GEMM, SwiGLU, GEMM, combine) the
gathered rows ``(T·k, H)`` and the pre-activations ``(T·k, 2F)`` no longer go through memory; what
is left besides the weights is the block's least traffic (the course's byte model for it is
``utils.traffic.moe_ideal_bytes``). No step synchronizes with the host: the group sizes stay on the
device, and the launch count does not depend on ``E``.

**Backward.** ``h`` is saved (the down GEMM's weight gradient needs it); the pre-activations are
not: ``kernel_ladder::moe_gate_up_backward`` recomputes the gate and up tiles in the same grouped kernel,
reads ``dh`` in the epilogue and writes ``[d gate | d up]`` ``(T·k, 2F)`` in the weight's column layout
(the trade ``kernel_ladder.gated_mlp`` makes: ``4·T·k·F·H`` more FLOPs for ``2·T·k·F`` fewer elements
held). The clamped gate passes no gradient where the clamp held the value (``gate > limit``,
``|up| > limit``), as torch's ``clamp``. Then ``d rows = [d gate | d up] @ w_gate_up[e]`` (a grouped
GEMM), ``dx`` = each token's ``k`` rows summed (the combine without weights) and ``d w_gate_up[e] =
[d gate | d up]^T x_e`` (the grouped weight-gradient kernel, gathering ``x``'s rows through the
permutation as the forward did; the biases' gradients, each expert's column sums, in the same kernel).
"""

from __future__ import annotations

import torch

from .. import _launch, runtime
from .._validate import check_choice, check_float_dtype, check_tensor, is_int
from .gated_mlp import gated_mlp
from .grouped_matmul import grouped_matmul, launch_grouped_dw, launch_grouped_matmul
from .moe_permute import _moe_combine_op, moe_combine, moe_permute
from .topk_routing import check_logits_dtype, topk_routing

__all__ = ["ACTIVATIONS", "GATE_UP_LAYOUTS", "experts_forward", "moe"]

_OP = "kernel_ladder.moe"
#: The experts' gates: SwiGLU, and GPT-OSS's clamped SwiGLU.
ACTIVATIONS = ("silu", "swiglu_oai")
#: ``"mixtral"``: w_gate_up (E, 2F, H) gate rows then up rows, w_down (E, H, F); ``"gpt_oss"``: w_gate_up
#: (E, H, 2F) gate and up columns interleaved, w_down (E, F, H).
GATE_UP_LAYOUTS = ("mixtral", "gpt_oss")
#: GptOssConfig's defaults for ``swiglu_alpha`` and ``swiglu_limit``.
OAI_ALPHA, OAI_LIMIT = 1.702, 7.0


def _check_experts(op, x, w_gate_up, w_down, activation, alpha, limit, gate_up_bias, down_bias,
                   layout) -> tuple[float, float]:
    """The experts' arguments; returns the gate's (alpha, limit)."""
    for name, t in (("x", x), ("w_gate_up", w_gate_up), ("w_down", w_down)):
        check_tensor(op, name, t)
        check_float_dtype(op, name, t)
    check_choice(op, "gate_up_layout", layout, GATE_UP_LAYOUTS)
    check_choice(op, "activation", activation, ACTIVATIONS)
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be 2-D (tokens, hidden), got shape {tuple(x.shape)} "
                         "(flatten the batch and sequence dims first: x.reshape(-1, hidden))")
    hidden = x.shape[1]
    gpt_oss = layout == "gpt_oss"
    want_gu, want_d = ("(E, H, 2F)", "(E, F, H)") if gpt_oss else ("(E, 2F, H)", "(E, H, F)")
    if w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError(f"{op}: w_gate_up must be {want_gu} and w_down {want_d} (gate_up_layout={layout!r}), "
                         f"got shapes {tuple(w_gate_up.shape)} and {tuple(w_down.shape)}")
    h = w_gate_up.shape[1] if gpt_oss else w_gate_up.shape[2]
    two_f = w_gate_up.shape[2] if gpt_oss else w_gate_up.shape[1]
    if h != hidden:
        raise ValueError(f"{op}: w_gate_up's {'middle' if gpt_oss else 'last'} dim must be x's hidden size "
                         f"{hidden} (w_gate_up is {want_gu} for gate_up_layout={layout!r}), got {h}")
    if two_f % 2:
        raise ValueError(f"{op}: w_gate_up's {'last' if gpt_oss else 'middle'} dim must be 2F (gate and up), "
                         f"got {two_f}")
    experts, ffn = w_gate_up.shape[0], two_f // 2
    down_shape = (experts, ffn, hidden) if gpt_oss else (experts, hidden, ffn)
    if tuple(w_down.shape) != down_shape:
        raise ValueError(f"{op}: w_down must be {want_d} = {down_shape}, got {tuple(w_down.shape)}")
    for name, t in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if t.dtype != x.dtype:
            raise TypeError(f"{op}: {name} must have x's dtype {x.dtype}, got {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"{op}: {name} must be on x's device {x.device}, got {t.device}")
    for name, t, shape in (("gate_up_bias", gate_up_bias, (experts, 2 * ffn)),
                           ("down_bias", down_bias, (experts, hidden))):
        if t is None:
            continue
        check_tensor(op, name, t)
        check_float_dtype(op, name, t)
        if tuple(t.shape) != shape:
            raise ValueError(f"{op}: {name} must be {shape}, got shape {tuple(t.shape)}")
        if t.device != x.device:
            raise ValueError(f"{op}: {name} must be on x's device {x.device}, got {t.device}")
    if activation == "silu":
        if alpha is not None or limit is not None:
            raise ValueError(f"{op}: alpha and limit belong to activation='swiglu_oai', got alpha={alpha!r}, "
                             f"limit={limit!r} with activation='silu'")
        return OAI_ALPHA, OAI_LIMIT  # unused by the SwiGLU
    for name, value in (("alpha", alpha), ("limit", limit)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise TypeError(f"{op}: {name} must be a float or None, got {type(value).__name__}")
    alpha = OAI_ALPHA if alpha is None else float(alpha)
    limit = OAI_LIMIT if limit is None else float(limit)
    if not limit >= 0:
        raise ValueError(f"{op}: limit must be >= 0 (the clamp's bound), got {limit}")
    return alpha, limit


def _check_shared(op, x, shared) -> None:
    if not isinstance(shared, (tuple, list)) or len(shared) != 3 or not all(isinstance(t, torch.Tensor)
                                                                           for t in shared):
        raise TypeError(f"{op}: shared must be a tuple of 3 tensors (w_gate (Fs, H), w_up (Fs, H), w_down (H, Fs)), "
                        f"got {type(shared).__name__}")


# ----------------------------------------------------------------------------------------------
# kernel_ladder::moe_gate_up: gather + gate/up grouped GEMM + gate, one launch; its backward
# ----------------------------------------------------------------------------------------------


def _check_gate_up(op, x, w_gate_up, offsets, permutation, top_k) -> None:
    """The internal op's contract (kernel_ladder.moe has checked the user's arguments)."""
    check_tensor(op, "x", x)
    check_tensor(op, "w_gate_up", w_gate_up)
    if permutation.dtype != torch.int32 or offsets.dtype != torch.int32:
        raise TypeError(f"{op}: permutation and offsets must be int32 (kernel_ladder.moe_permute's outputs)")
    if permutation.shape != (x.shape[0] * top_k,) or offsets.shape != (w_gate_up.shape[0],):
        raise ValueError(f"{op}: permutation must be (T·k,) and offsets (E,), got {tuple(permutation.shape)} "
                         f"and {tuple(offsets.shape)}")


def _weight_kn(w_gate_up: torch.Tensor, layout: str) -> torch.Tensor:
    """w_gate_up as (E, H, 2F), a view: the grouped kernel's (E, K, N) in the layout's column order."""
    return w_gate_up if layout == "gpt_oss" else w_gate_up.transpose(1, 2)


@torch.library.custom_op("kernel_ladder::moe_gate_up", mutates_args=())
def _moe_gate_up_op(x: torch.Tensor, w_gate_up: torch.Tensor, offsets: torch.Tensor, permutation: torch.Tensor,
                    top_k: int, bias: torch.Tensor | None = None, activation: str = "silu", alpha: float = OAI_ALPHA,
                    limit: float = OAI_LIMIT, layout: str = "mixtral") -> torch.Tensor:
    op = "kernel_ladder.moe (gate/up)"
    _check_gate_up(op, x, w_gate_up, offsets, permutation, top_k)
    runtime.require_launchable(op, x, w_gate_up, offsets, permutation)
    w = _weight_kn(w_gate_up, layout)
    hidden = _launch.empty_output((permutation.shape[0], w.shape[2] // 2), x)
    launch_grouped_matmul(x, w, offsets, hidden, gather=permutation, gather_k=top_k,
                          epilogue="swiglu" if activation == "silu" else "swiglu_oai", bias=bias,
                          interleaved=layout == "gpt_oss", alpha=alpha, limit=limit)
    return hidden


@_moe_gate_up_op.register_fake
def _moe_gate_up_fake(x, w_gate_up, offsets, permutation, top_k, bias=None, activation="silu", alpha=OAI_ALPHA,
                      limit=OAI_LIMIT, layout="mixtral"):
    _check_gate_up("kernel_ladder.moe (gate/up)", x, w_gate_up, offsets, permutation, top_k)
    return _launch.empty_output((permutation.shape[0], _weight_kn(w_gate_up, layout).shape[2] // 2), x)


@torch.library.custom_op("kernel_ladder::moe_gate_up_backward", mutates_args=())
def _moe_gate_up_backward_op(
    grad_hidden: torch.Tensor, x: torch.Tensor, w_gate_up: torch.Tensor, offsets: torch.Tensor,
    permutation: torch.Tensor, top_k: int, need_x: bool, need_w: bool, bias: torch.Tensor | None = None,
    need_bias: bool = False, activation: str = "silu", alpha: float = OAI_ALPHA, limit: float = OAI_LIMIT,
    layout: str = "mixtral",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    op = "kernel_ladder.moe (gate/up backward)"
    runtime.require_launchable(op, grad_hidden, x)
    grad_hidden = grad_hidden.to(x.dtype)
    entries = permutation.shape[0]
    w = _weight_kn(w_gate_up, layout)
    interleaved = layout == "gpt_oss"
    # [d gate | d up] in w's column order, the gate/up tiles recomputed from x (gathered) and w in the same kernel.
    grad_gate_up = _launch.empty_output((entries, w.shape[2]), x)
    launch_grouped_matmul(x, w, offsets, grad_gate_up, gather=permutation, gather_k=top_k,
                          epilogue="swiglu_backward" if activation == "silu" else "swiglu_oai_backward",
                          dh=grad_hidden, bias=bias, interleaved=interleaved, alpha=alpha, limit=limit)
    grad_x = x.new_empty(0)
    grad_w = x.new_empty(0)
    grad_b = x.new_empty(0)
    if need_x:
        grad_rows = _launch.empty_output((entries, x.shape[1]), x)
        launch_grouped_matmul(grad_gate_up, w.transpose(1, 2), offsets, grad_rows)  # (T·k, 2F) @ (2F, H) per expert
        grad_x = _moe_combine_op(grad_rows, permutation, top_k, None)  # each token's k rows summed
    if need_w or need_bias:
        grad_w = _launch.empty_in_layout(w_gate_up)
        if need_bias:
            grad_b = _launch.empty(bias.shape, bias.dtype, x.device)
        # d w[e] (H, 2F) = x_e^T [d gate | d up]_e, x's rows gathered through the permutation; the bias's: column sums.
        launch_grouped_dw(x, grad_gate_up, offsets, _weight_kn(grad_w, layout), gather=permutation, gather_k=top_k,
                          db=grad_b if need_bias else None)
        if not need_w:
            grad_w = x.new_empty(0)
    return grad_x, grad_w, grad_b


@_moe_gate_up_backward_op.register_fake
def _moe_gate_up_backward_fake(grad_hidden, x, w_gate_up, offsets, permutation, top_k, need_x, need_w, bias=None,
                               need_bias=False, activation="silu", alpha=OAI_ALPHA, limit=OAI_LIMIT,
                               layout="mixtral"):
    grad_x = _launch.empty_output(x.shape, x) if need_x else x.new_empty(0)
    grad_w = _launch.empty_in_layout(w_gate_up) if need_w else x.new_empty(0)
    grad_b = bias.new_empty(bias.shape) if need_bias else x.new_empty(0)
    return grad_x, grad_w, grad_b


def _gate_up_setup(ctx, inputs, output) -> None:
    x, w_gate_up, offsets, permutation, top_k, bias, activation, alpha, limit, layout = inputs
    ctx.options = (top_k, activation, alpha, limit, layout)
    ctx.save_for_backward(x, w_gate_up, offsets, permutation, bias)


def _gate_up_backward(ctx, grad_hidden):
    x, w_gate_up, offsets, permutation, bias = ctx.saved_tensors
    top_k, activation, alpha, limit, layout = ctx.options
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_b = bias is not None and ctx.needs_input_grad[5]
    grad_x, grad_w, grad_b = _moe_gate_up_backward_op(grad_hidden, x, w_gate_up, offsets, permutation, top_k,
                                                      need_x, need_w, bias, need_b, activation, alpha, limit, layout)
    return (grad_x if need_x else None, grad_w if need_w else None, None, None, None, grad_b if need_b else None,
            None, None, None, None)


_moe_gate_up_op.register_autograd(_gate_up_backward, setup_context=_gate_up_setup)


# ----------------------------------------------------------------------------------------------
# kernel_ladder.moe
# ----------------------------------------------------------------------------------------------


def moe(x: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
        top_k: int, renormalize: bool = True, *, scoring: str = "softmax", bias: torch.Tensor | None = None,
        num_groups: int | None = None, topk_groups: int | None = None, scale: float = 1.0,
        activation: str = "silu", alpha: float | None = None, limit: float | None = None,
        gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
        gate_up_layout: str = "mixtral",
        shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """A sparse MoE block: route, sort by expert, two grouped GEMMs, combine (plus shared experts).

    Args:
        x: ``(T, H)`` token states (fp32, fp16 or bf16).
        router_logits: ``(T, E)`` the router's logits: float32, float16, bfloat16 or float64 (routed in
            fp32).
        w_gate_up: ``(E, 2F, H)``, each expert's gate rows then up rows (``MixtralExperts.gate_up_proj``);
            with ``gate_up_layout="gpt_oss"``, ``(E, H, 2F)`` with gate and up columns interleaved
            (``GptOssExperts.gate_up_proj``).
        w_down: ``(E, H, F)`` (``MixtralExperts.down_proj``); ``(E, F, H)`` for ``"gpt_oss"``.
        top_k: experts per token.
        renormalize: divide each token's ``top_k`` weights by their sum (Mixtral; Qwen's and DeepSeek's
            ``norm_topk_prob``); False keeps the scores (Qwen2-MoE without ``norm_topk_prob``).
        scoring, bias, num_groups, topk_groups, scale: the routing, as :func:`kernel_ladder.topk_routing`
            (DeepSeek-V3: ``"sigmoid"``, ``e_score_correction_bias``, ``n_group``, ``topk_group``,
            ``routed_scaling_factor``).
        activation: ``"silu"`` (SwiGLU) or ``"swiglu_oai"`` (GPT-OSS's clamped SwiGLU, with ``alpha``
            and ``limit``, by default GptOssConfig's 1.702 and 7.0; not taken with ``"silu"``).
        gate_up_bias: optional ``(E, 2F)`` in ``w_gate_up``'s column order; down_bias: optional ``(E, H)``.
        gate_up_layout: ``"mixtral"`` or ``"gpt_oss"`` (see the module docstring); the weights are
            read in place through their strides whichever it is.
        shared: optional ``(w_gate (Fs, H), w_up (Fs, H), w_down (H, Fs))``: shared experts every token
            goes through, :func:`kernel_ladder.gated_mlp` added to the routed sum.

    Returns:
        ``(T, H)`` in ``x``'s dtype. A token whose router row is NaN or infinite is routed as
        :func:`kernel_ladder.topk_routing` says (NaN logits count as ``-inf``; a row with no softmax,
        largest logit ``+inf`` or all ``-inf``, gets NaN weights and a NaN output row); it never
        changes another token's output, and no kernel reads or writes outside its tensors.
        Differentiable in ``x``, ``router_logits``, the weights and biases, and the shared experts.
    """
    alpha, limit = _check_experts(_OP, x, w_gate_up, w_down, activation, alpha, limit, gate_up_bias, down_bias,
                                  gate_up_layout)
    check_tensor(_OP, "router_logits", router_logits)
    check_logits_dtype(_OP, "router_logits", router_logits)  # routed in float32: float64 logits too
    experts = w_gate_up.shape[0]
    if router_logits.dim() != 2 or tuple(router_logits.shape) != (x.shape[0], experts):
        raise ValueError(f"{_OP}: router_logits must be (tokens, E) = {(x.shape[0], experts)}, got "
                         f"{tuple(router_logits.shape)}")
    if router_logits.device != x.device:
        raise ValueError(f"{_OP}: router_logits must be on x's device {x.device}, got {router_logits.device}")
    if not is_int(top_k) or not 1 <= top_k <= experts:
        raise ValueError(f"{_OP}: top_k must be an int in [1, E = {experts}], got {top_k!r}")
    if not isinstance(renormalize, bool):
        raise TypeError(f"{_OP}: renormalize must be a bool, got {type(renormalize).__name__}")
    if shared is not None:
        _check_shared(_OP, x, shared)
    weights, expert_ids = topk_routing(router_logits, top_k, renormalize=renormalize, scoring=scoring, bias=bias,
                                       num_groups=num_groups, topk_groups=topk_groups, scale=scale)
    out = _experts(x, expert_ids, weights, w_gate_up, w_down, activation, alpha, limit, gate_up_bias, down_bias,
                   gate_up_layout)
    if shared is not None:
        out = out + gated_mlp(x, *shared)
    return out


def experts_forward(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor,
                    w_down: torch.Tensor, *, activation: str = "silu", alpha: float | None = None,
                    limit: float | None = None, gate_up_bias: torch.Tensor | None = None,
                    down_bias: torch.Tensor | None = None, gate_up_layout: str = "mixtral") -> torch.Tensor:
    """The experts half of :func:`moe`, for routing done elsewhere (``kernel_ladder.patch``'s
    ``ExpertsInterface`` entry): ``expert_ids`` and ``weights`` ``(T, k)``; sort by expert, the
    gate-up and the down grouped GEMMs (biases, activation and layout as :func:`moe`), the weighted combine."""
    op = "kernel_ladder.ops.moe.experts_forward"
    alpha, limit = _check_experts(op, x, w_gate_up, w_down, activation, alpha, limit, gate_up_bias, down_bias,
                                  gate_up_layout)
    return _experts(x, expert_ids, weights, w_gate_up, w_down, activation, alpha, limit, gate_up_bias, down_bias,
                    gate_up_layout)


def _experts(x, expert_ids, weights, w_gate_up, w_down, activation, alpha, limit, gate_up_bias, down_bias,
             layout) -> torch.Tensor:
    top_k = expert_ids.shape[1]
    permutation, offsets = moe_permute(expert_ids, w_gate_up.shape[0])
    # (T·k, F), the gate applied
    hidden = _moe_gate_up_op(x, w_gate_up, offsets, permutation, top_k, gate_up_bias, activation, alpha, limit,
                             layout)
    w_down_kn = w_down if layout == "gpt_oss" else w_down.transpose(1, 2)  # (E, F, H), a view
    down = grouped_matmul(hidden, w_down_kn, offsets, bias=down_bias)  # (T·k, H)
    return moe_combine(down, permutation, weights)
