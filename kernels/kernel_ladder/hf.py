"""``kernel_ladder`` through Hugging Face's own extension points: no patching.

Two libraries, two kinds of extension point:

* **transformers' interfaces.** :func:`register` puts a ``"kernel_ladder"`` entry in
  ``AttentionInterface`` (:func:`attention`, running :func:`kernel_ladder.flash_attention`), the
  matching mask function in ``AttentionMaskInterface`` and the experts in ``ExpertsInterface``
  (:func:`experts`, grouped GEMMs on the stacked weights of ``MixtralExperts``, ``Qwen3MoeExperts``,
  ``DeepseekV3Experts`` and ``GptOssExperts``). After it, any model that
  dispatches through those interfaces runs on ``kernel_ladder`` when asked for by name::

      kernel_ladder.hf.register()
      model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="kernel_ladder")
      model.set_experts_implementation("kernel_ladder")  # a MoE model

* **kernels' layer mapping.** transformers decorates some layers with
  ``use_kernel_forward_from_hub("<name>")`` (``RMSNorm``, the activations ``SiLU``, ``GeLU``,
  ``GeluTanh``, ``NewGELU``, ``FastGELU``, and the rotary function ``rotary_pos_emb``);
  ``kernels.kernelize`` swaps such a layer's ``forward`` for one from a layer repository.
  :func:`kernel_mapping` maps those names to the layers of :mod:`kernel_ladder.hf_layers`, a local
  layer repository shipped inside this package (loaded by ``kernels.LocalLayerRepository``, nothing
  downloaded), and :func:`kernelize` applies it::

      kernel_ladder.hf.kernelize(model)
      # or, by hand:
      with kernels.use_kernel_mapping(kernel_ladder.hf.kernel_mapping()):
          kernels.kernelize(model, mode=kernels.Mode.INFERENCE, device="cpu")

Everything here imports ``transformers`` / ``kernels`` inside its functions: ``import kernel_ladder``
never does.

Padded batches are unpadded into packed sequences (as flash-attention's integration in transformers
does) and run through :func:`kernel_ladder.flash_attention_varlen`, and so are packed rows (``position_ids``
that restart, or flash-attention's ``cu_seq_lens_*``). Limits of :func:`attention`, refused with a
``ValueError`` rather than computed wrongly: a 4-D mask other than a causal, windowed or all-visible one,
attention dropout, a sliding window on a non-causal layer, and a sliding window over padding between
tokens. It reads a given mask's values (and, without one, ``position_ids``) on the host: a few
synchronizations per forward, the plan they give reused by every layer that gets the same tensor.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

import kernel_ladder

__all__ = ["NAME", "LAYERS", "attention", "experts", "register", "layer_repository_path", "kernel_mapping", "kernelize"]

#: The name :func:`register` uses by default: ``attn_implementation="kernel_ladder"``.
NAME = "kernel_ladder"

#: transformers' ``use_kernel_forward_from_hub`` names -> the layer of :mod:`kernel_ladder.hf_layers` that
#: replaces its forward. ``SiluAndMul`` and ``GeluTanhAndMul`` are kernels' own example names (no
#: transformers layer carries them): a model of yours decorated with them gets ``swiglu`` / ``geglu``.
LAYERS = {
    "RMSNorm": "RMSNorm",
    "SiLU": "SiLU",
    "GeLU": "GELU",
    "GeluTanh": "GELUTanh",
    "NewGELU": "GELUTanh",
    "FastGELU": "GELUTanh",
    "rotary_pos_emb": "ApplyRotaryPosEmb",
    "SiluAndMul": "SiluAndMul",
    "GeluTanhAndMul": "GeluTanhAndMul",
}

_ATTENTION = "kernel_ladder.hf.attention"


# ----------------------------------------------------------------------------------------------
# transformers' interfaces
# ----------------------------------------------------------------------------------------------


def _pattern(tq: int, tk: int, causal: bool, window: int | None, device) -> torch.Tensor:
    """(Tq, Tk) booleans, True where :func:`kernel_ladder.flash_attention` lets query i see key j."""
    i = torch.arange(tq, device=device)[:, None]
    j = torch.arange(tk, device=device)[None, :]
    visible = torch.ones(tq, tk, dtype=torch.bool, device=device)
    if causal:
        visible &= j <= i + tk - tq  # bottom-right aligned, as flash_attention's causal is
    if window is not None:
        visible &= j > i + tk - tq - window
    return visible


def _read_mask(mask: torch.Tensor, tq: int, tk: int, causal: bool, window: int | None) -> tuple[bool, int | None]:
    """The ``(causal, window)`` that computes what a 4-D ``mask`` asks for; raises for anything else."""
    if mask.dim() != 4:
        raise ValueError(f"{_ATTENTION}: attention_mask must be None, (B, Tk) or (B, 1 or H, Tq, Tk), "
                         f"got shape {tuple(mask.shape)}")
    if mask.shape[-2:] != (tq, tk):
        raise ValueError(f"{_ATTENTION}: a 4-D attention_mask must end in (Tq, Tk) = {(tq, tk)}, got shape "
                         f"{tuple(mask.shape)}")
    visible = mask if mask.dtype == torch.bool else mask == 0  # additive: 0 where seen, a large negative where not
    candidates = [(causal, window), (False, None), (True, None)]
    for c, w in candidates:
        if bool((visible == _pattern(tq, tk, c, w, mask.device)).all()):
            return c, w
    raise ValueError(f"{_ATTENTION}: a 4-D attention_mask of shape {tuple(mask.shape)} hides keys that causal "
                     "attention and the layer's sliding window do not; only a causal, windowed or all-visible 4-D "
                     "mask is taken. For padding pass the (B, Tk) padding mask (what the mask function "
                     "kernel_ladder.hf.register registers hands over)")


#: The last plan made, ``(tensor it was read from, its version, the arguments, the plan)``: every layer of a
#: forward gets the same mask (or position_ids), so it is read on the host once per forward, not per layer.
_LAST_PLAN: list = [None]


def _cached_plan(tensor: torch.Tensor, args: tuple, make):
    last = _LAST_PLAN[0]
    if last is not None and last[0] is tensor and last[1] == tensor._version and last[2] == args:
        return last[3]
    plan = make()
    _LAST_PLAN[0] = (tensor, tensor._version, args, plan)  # holds the tensor: its id cannot be reused meanwhile
    return plan


def _plan(rows_q, rows_k, lengths_q, lengths_k):
    """What :func:`_varlen_attention` needs: the kept query and key rows as indices (None: all), the cumulative
    lengths (int32) and the longest sequences (host ints)."""

    def cumulative(lengths):
        return torch.nn.functional.pad(lengths.to(torch.int32).cumsum(0, dtype=torch.int32), (1, 0))

    index = [None if rows is None else rows.nonzero().squeeze(1) for rows in (rows_q, rows_k)]
    return (*index, cumulative(lengths_q), cumulative(lengths_k), int(lengths_q.max()), int(lengths_k.max()))


def _padding_plan(mask: torch.Tensor, batch: int, tq: int, tk: int, causal: bool, window: int | None):
    """The plan of a padded batch (None when nothing is padded) from its ``(B, Tk)`` mask (nonzero: a real token).

    The queries are the last ``Tq`` keys. With causal attention a padded query attends to nothing (its output
    is 0, as in transformers' flash-attention integration); without it every query sees its row's real keys
    (as transformers' bidirectional mask lets it).
    """
    if tuple(mask.shape) != (batch, tk):
        raise ValueError(f"{_ATTENTION}: a 2-D attention_mask must be the (B, Tk) = {(batch, tk)} padding mask of "
                         f"the keys, got shape {tuple(mask.shape)} (a static cache's mask, of another length than "
                         "its keys, is not supported)")

    def make():  # (the plan, whether every row's real tokens are one run)
        keep = mask.to(torch.bool)
        if bool(keep.all()):
            return None, True
        runs = keep[:, 0].to(torch.int32) + (keep[:, 1:] & ~keep[:, :-1]).sum(1, dtype=torch.int32)
        one_run = not bool((runs > 1).any())
        if causal:
            keep_q = keep[:, tk - tq:]
            return _plan(keep_q.reshape(-1), keep.reshape(-1), keep_q.sum(1), keep.sum(1)), one_run
        return _plan(None, keep.reshape(-1), torch.full((batch,), tq, device=keep.device), keep.sum(1)), one_run

    # not keyed by the window: layers with and without one (Qwen2's) share the plan
    plan, one_run = _cached_plan(mask, ("padding", batch, tq, tk, causal), make)
    if window is not None and not one_run:  # a window counts positions: compacting keeps distances within a run
        raise ValueError(f"{_ATTENTION}: a sliding window ({window}) over a padded batch needs each row's real "
                         "tokens in one run (left or right padding); this attention_mask has padding between tokens")
    return plan


def _packed_plan(batch: int, tq: int, tk: int, kwargs: dict):
    """The plan of sequences packed into rows without padding, or None.

    Told by flash-attention's varlen keywords (``cu_seq_lens_q`` / ``cu_seq_lens_k``, one packed row), or by
    ``position_ids`` that restart within a row (a step other than +1 starts a sequence: transformers' rule for
    packed rows), without a cache (``Tq == Tk``: a cached step continues one sequence). ``position_ids`` are
    not read under ``torch.compile`` (a host read of values would break the graph): there pass the
    ``cu_seq_lens_*`` keywords for packed rows.
    """
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        if cu_q is None or cu_k is None or batch != 1:
            raise ValueError(f"{_ATTENTION}: cu_seq_lens_q and cu_seq_lens_k describe one packed row: pass both, "
                             f"with a batch of 1 (got a batch of {batch}, cu_seq_lens_q "
                             f"{'given' if cu_q is not None else 'None'}, cu_seq_lens_k "
                             f"{'given' if cu_k is not None else 'None'})")
        return _cached_plan(cu_q, ("cu_seq_lens", cu_k), lambda: _plan(None, None, cu_q.diff(), cu_k.diff()))
    position_ids = kwargs.get("position_ids")
    if (position_ids is None or tq != tk or tq < 2 or position_ids.dim() != 2 or position_ids.shape[-1] != tq
            or position_ids.shape[0] not in (1, batch) or torch.compiler.is_compiling()):
        return None

    def make():
        positions = position_ids.expand(batch, tq)
        starts = torch.ones(batch, tq, dtype=torch.bool, device=positions.device)
        starts[:, 1:] = positions[:, 1:] - positions[:, :-1] != 1
        if not bool(starts[:, 1:].any()):
            return None
        first = starts.reshape(-1).nonzero().squeeze(1)  # each sequence's first token, in order
        lengths = torch.diff(first, append=first.new_full((1,), batch * tq))
        return _plan(None, None, lengths, lengths)

    return _cached_plan(position_ids, ("packed", batch, tq), make)


def _varlen_attention(query, key, value, plan, causal: bool, scaling, window, softcap, sinks) -> torch.Tensor:
    """The planned sequences' tokens packed (flash-attention's unpadding), :func:`kernel_ladder.flash_attention_varlen`,
    and put back: ``(B, Tq, H, Dv)``, 0 at the queries no sequence holds."""
    index_q, index_k, cu_q, cu_k, max_q, max_k = plan
    batch, hq, tq, dim = query.shape
    hkv, tk, dim_v = key.shape[1], key.shape[2], value.shape[-1]
    q = query.transpose(1, 2).reshape(batch * tq, hq, dim)
    k = key.transpose(1, 2).reshape(batch * tk, hkv, dim)
    v = value.transpose(1, 2).reshape(batch * tk, hkv, dim_v)
    if index_q is not None:
        q = q.index_select(0, index_q)
    if index_k is not None:
        k, v = k.index_select(0, index_k), v.index_select(0, index_k)
    if max_q == 0:
        return query.new_zeros(batch, tq, hq, dim_v)
    extra = {} if sinks is None else {"sinks": sinks}
    out = kernel_ladder.flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max(max_k, 1), causal=causal,
                                               softmax_scale=scaling, window=window, softcap=softcap, **extra)
    if index_q is None:
        return out.view(batch, tq, hq, dim_v)
    return out.new_zeros(batch * tq, hq, dim_v).index_copy(0, index_q, out).view(batch, tq, hq, dim_v)


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
              **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' ``AttentionInterface`` entry running :func:`kernel_ladder.flash_attention`.

    Takes what transformers' attention modules pass: ``query`` ``(B, H, Tq, D)``, ``key`` ``(B, Hkv, Tk, D)``,
    ``value`` ``(B, Hkv, Tk, Dv)`` (a cache's keys included, K/V never repeated for GQA; ``Dv`` may differ from
    ``D``: DeepSeek-V3's latent attention), ``scaling`` (None: ``1/sqrt(D)``), and the keywords
    ``sliding_window``, ``softcap``, ``s_aux`` (GPT-OSS's per-head sink logits ``(H,)``, which join every
    softmax's denominator: ``flash_attention(..., sinks=)``), ``is_causal``, ``position_ids`` and
    flash-attention's ``cu_seq_lens_q`` / ``cu_seq_lens_k`` where a model passes them (others are ignored).
    Returns ``(out (B, Tq, H, Dv), None)``, like transformers' own functions (no attention weights).

    Causal unless ``is_causal=False`` or the module says ``is_causal = False``. ``attention_mask``:

    * None — every row one sequence, unless packed: ``cu_seq_lens_q`` / ``cu_seq_lens_k`` given, or
      ``position_ids`` that restart within a row (without a cache; not read under ``torch.compile``); each
      packed sequence then attends only to itself (:func:`kernel_ladder.flash_attention_varlen`), as
      transformers' flash-attention integration computes it;
    * a ``(B, Tk)`` padding mask (what the registered mask function hands over when something is padded):
      the real tokens are packed, attended with :func:`kernel_ladder.flash_attention_varlen` and put back
      (flash-attention's unpadding). Real queries get exactly what transformers computes; with causal
      attention a padded query gets 0 (transformers' flash-attention integration does the same; its SDPA and
      eager give a right-padded query the real keys before it, which only a label predicted from a padded
      position can see). A sliding window needs each row's tokens in one run (left or right padding);
    * a 4-D bool or additive mask that is exactly causal, causal within the sliding window, or all visible
      (the computation then follows the mask).

    Anything else, attention dropout and a window on a non-causal layer raise ``ValueError``.
    """
    if dropout:
        raise ValueError(f"{_ATTENTION}: attention dropout {dropout} is not supported by kernel_ladder."
                         "flash_attention; set the config's attention dropout to 0 (or call model.eval())")
    is_causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    batch, tq, tk = query.shape[0], query.shape[2], key.shape[2]
    window = kwargs.get("sliding_window")
    if window is not None and window >= tk:
        window = None  # a window at least as wide as the keys hides nothing
    if window is not None and not causal:
        raise ValueError(f"{_ATTENTION}: a sliding window ({window}) on a non-causal layer is not supported")
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")
    extra = {}
    if sinks is not None:
        if not _takes_sinks():
            raise ValueError(f"{_ATTENTION}: s_aux (attention sinks) given, but this kernel_ladder.flash_attention "
                             "has no sinks argument")
        extra["sinks"] = sinks
    plan = None
    if attention_mask is not None and attention_mask.dim() == 2:
        plan = _padding_plan(attention_mask, batch, tq, tk, causal, window)
    elif attention_mask is not None:
        causal, window = _read_mask(attention_mask, tq, tk, causal, window)
    else:
        plan = _packed_plan(batch, tq, tk, kwargs)
    if plan is not None:
        return _varlen_attention(query, key, value, plan, causal, scaling, window, softcap, sinks), None
    out = kernel_ladder.flash_attention(query, key, value, causal=causal, softmax_scale=scaling, window=window,
                                        softcap=softcap, **extra)
    return out.transpose(1, 2), None


def _takes_sinks() -> bool:
    import inspect

    return "sinks" in inspect.signature(kernel_ladder.flash_attention).parameters


def _mask_function() -> Callable:
    from transformers.masking_utils import flash_attention_mask

    # None when nothing is padded, else the (B, Tk) padding mask: attention() unpads the batch with it.
    return flash_attention_mask


def experts(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' ``ExpertsInterface`` entry: the routed tokens through grouped GEMMs
    (:func:`kernel_ladder.ops.moe.experts_forward`) on the module's own stacked weights.

    Two layouts, told by the flags transformers' ``use_experts_implementation`` puts on the module:

    * ``[gate; up]`` concatenated ``gate_up_proj (E, 2F, H)``, ``down_proj (E, H, F)``, no biases, a SiLU gate
      (``MixtralExperts``, ``Qwen3MoeExperts``, ``DeepseekV3Experts``);
    * GPT-OSS's (``is_transposed``, ``has_bias``, gate and up interleaved): ``gate_up_proj (E, H, 2F)``,
      ``down_proj (E, F, H)``, their biases, and the clamped SwiGLU ``(up + 1) * gate * sigmoid(alpha * gate)``
      of ``gate.clamp(max=limit)`` and ``up.clamp(-limit, limit)`` (``activation="swiglu_oai"``).

    Anything else (another activation, a layout or flag of neither kind) raises ``ValueError``.
    """
    op = "kernel_ladder.hf.experts"
    weights = top_k_weights.to(hidden_states.dtype)
    layout = (bool(getattr(self, "is_concatenated", True)), bool(getattr(self, "is_transposed", False)),
              bool(getattr(self, "has_bias", False)), bool(getattr(self, "has_gate", True)),
              bool(getattr(self, "has_post_expert_norm", False)))
    if layout == (False, True, True, True, False):
        if not all(hasattr(self, name) for name in ("alpha", "limit", "gate_up_proj_bias", "down_proj_bias")):
            raise ValueError(f"{op}: {type(self).__name__} has GPT-OSS's layout (interleaved, transposed, with biases) "
                             "but not its alpha, limit, gate_up_proj_bias and down_proj_bias")
        return _experts_forward(hidden_states, top_k_index, weights, self.gate_up_proj, self.down_proj,
                                activation="swiglu_oai", alpha=float(self.alpha), limit=float(self.limit),
                                gate_up_bias=self.gate_up_proj_bias, down_bias=self.down_proj_bias,
                                gate_up_layout="gpt_oss")
    if layout != (True, False, False, True, False):
        raise ValueError(f"{op}: {type(self).__name__}'s layout is not supported: is_concatenated, is_transposed, "
                         f"has_bias, has_gate, has_post_expert_norm = {layout}; supported: (True, False, False, True, "
                         "False) (Mixtral, Qwen3-MoE, DeepSeek-V3) and (False, True, True, True, False) (GPT-OSS)")
    if getattr(self, "act_fn", None) is not None and type(self.act_fn).__name__ not in ("SiLU", "SiLUActivation"):
        raise ValueError(f"{op}: only SiLU-gated experts are supported, got {type(self.act_fn).__name__}")
    return _experts_forward(hidden_states, top_k_index, weights, self.gate_up_proj, self.down_proj)


def _experts_forward(*args, **kwargs) -> torch.Tensor:
    from .ops.moe import experts_forward

    return experts_forward(*args, **kwargs)


def register(name: str = NAME) -> dict[str, Callable]:
    """Register :func:`attention`, its mask function and :func:`experts` with transformers under ``name``.

    Idempotent (registering again puts the same functions under the same name). Afterwards
    ``from_pretrained(..., attn_implementation=name)``, ``from_config(config, attn_implementation=name)``
    and ``model.set_attn_implementation(name)`` / ``model.set_experts_implementation(name)`` select them.

    Returns what it registered: ``{"AttentionInterface": attention, "AttentionMaskInterface": <mask fn>,
    "ExpertsInterface": experts}``, without the interfaces this transformers lacks (the mask and
    experts interfaces are recent).

    The name must not contain ``flash`` (transformers takes such names for its flash-attn integrations)
    nor ``/`` (transformers loads such names from the Hub as kernel repositories).
    """
    if not isinstance(name, str) or not name or "flash" in name or "/" in name:
        raise ValueError(f"kernel_ladder.hf.register: name must be a non-empty string without 'flash' (transformers "
                         f"reserves such names for its flash-attn integrations) or '/' (a Hub kernel repository), "
                         f"got {name!r}")
    from transformers import AttentionInterface

    AttentionInterface.register(name, attention)
    registered: dict[str, Callable] = {"AttentionInterface": attention}
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        pass
    else:
        mask = _mask_function()
        AttentionMaskInterface.register(name, mask)
        registered["AttentionMaskInterface"] = mask
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError:
        pass
    else:
        ExpertsInterface.register(name, experts)
        registered["ExpertsInterface"] = experts
    return registered


# ----------------------------------------------------------------------------------------------
# kernels' layer mapping
# ----------------------------------------------------------------------------------------------


def layer_repository_path() -> Path:
    """The folder of :mod:`kernel_ladder.hf_layers`, the local layer repository ``kernels`` loads."""
    from . import hf_layers

    return Path(hf_layers.__file__).resolve().parent


def _devices() -> tuple[str, ...]:
    # Compiled kernels launch on CUDA tensors only; the interpreter runs CPU tensors (and CUDA ones, copied).
    return ("cpu", "cuda") if kernel_ladder.runtime.INTERPRETER else ("cuda",)


def _kernels(op: str):
    """Hugging Face's ``kernels``, of a version whose local repositories are this layout (0.19.1 on)."""
    try:
        from packaging.version import Version

        import kernels
    except ImportError as error:
        raise ImportError(f"{op}: needs Hugging Face's kernels>=0.19.1 (pip install kernels)") from error
    version = getattr(kernels, "__version__", None)  # None: a folder named kernels, not the package
    if version is None or Version(version) < Version("0.19.1"):
        raise ImportError(f"{op}: needs Hugging Face's kernels>=0.19.1 (its local layer repositories), found "
                          f"{version or 'no version'} at {getattr(kernels, '__file__', None) or kernels.__path__}")
    return kernels


def kernel_mapping(devices: tuple[str, ...] | None = None) -> dict:
    """The mapping for ``kernels.use_kernel_mapping`` / ``register_kernel_mapping``: each name of :data:`LAYERS`
    -> ``{device: kernels.LocalLayerRepository(<kernel_ladder.hf_layers>, layer_name=...)}``.

    ``devices``: the device types to map; None for where ``kernel_ladder``'s kernels launch in this process
    (``"cuda"``, and also ``"cpu"`` in Triton's interpreter). One repository per layer, for every mode
    (inference, training, ``torch.compile``): the layers are differentiable custom ops.
    """
    LocalLayerRepository = _kernels("kernel_ladder.hf.kernel_mapping").LocalLayerRepository
    devices = _devices() if devices is None else tuple(devices)
    path = layer_repository_path()
    return {hub_name: {device: LocalLayerRepository(repo_path=path, layer_name=layer) for device in devices}
            for hub_name, layer in LAYERS.items()}


def kernelize(model: torch.nn.Module, mode=None, device: str | torch.device | None = None) -> torch.nn.Module:
    """``kernels.kernelize(model, ...)`` with :func:`kernel_mapping` on top of the current mapping; returns ``model``.

    ``mode``: a ``kernels.Mode``; None for ``TRAINING`` if ``model.training`` else ``INFERENCE``.
    ``device``: None for the device of the model's parameters. Layers with no ``kernel_ladder``
    replacement keep their forward. Undo with ``kernels.kernelize`` under an empty mapping, or
    transformers' ``model.reset_kernels()``.

    A model that ``from_pretrained`` loaded with ``use_kernels`` on (transformers' default when ``kernels``
    is installed) kernelizes itself again with the global mapping when ``train()`` / ``eval()`` change its
    mode, which replaces these layers: call this after the switch, or load with ``use_kernels=False``.
    """
    kernels = _kernels("kernel_ladder.hf.kernelize")
    if mode is None:
        mode = kernels.Mode.TRAINING if model.training else kernels.Mode.INFERENCE
    quiet = _NoDigestWarning()
    validate_log = logging.getLogger("kernels._internals.validate")
    validate_log.addFilter(quiet)
    try:
        with kernels.use_kernel_mapping(kernel_mapping()):
            return kernels.kernelize(model, mode=mode, device=device)
    finally:
        validate_log.removeFilter(quiet)


class _NoDigestWarning(logging.Filter):
    """Drops ``kernels``' warning that our layer repository records no file digest: its files are this
    installed package's own (a digest would also have to leave out the ``__pycache__`` Python writes there)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("kernel-ladder-hf-layers" in message and "digest" in message)
