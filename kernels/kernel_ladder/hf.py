"""``kernel_ladder`` through Hugging Face's own extension points: no patching.

Two libraries, two kinds of extension point:

* **transformers' interfaces.** :func:`register` puts a ``"kernel_ladder"`` entry in
  ``AttentionInterface`` (:func:`attention`, running :func:`kernel_ladder.flash_attention`), the
  matching mask function in ``AttentionMaskInterface`` and the experts in ``ExpertsInterface``
  (:func:`experts`, grouped GEMMs on ``MixtralExperts``' stacked weights). After it, any model that
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

Limits of :func:`attention`, refused with a ``ValueError`` rather than computed wrongly: padded
batches (an attention mask that hides some keys beyond the causal triangle and the layer's sliding
window), attention dropout, and a sliding window on a non-causal layer. It reads a given mask's
values on the host (one synchronization per layer) to tell a causal mask from a padded one.
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
    """The ``(causal, window)`` that computes what ``mask`` asks for; raises for anything else (padding)."""
    padded = (f"{_ATTENTION}: padded batches are not supported (an attention_mask of shape {tuple(mask.shape)} "
              "hides keys that causal attention and the layer's sliding window do not); pass unpadded sequences "
              "of one length, or pack them and call kernel_ladder.flash_attention_varlen")
    if mask.dim() == 2:  # (B, Tk) padding mask, what the registered mask function hands over (None when unpadded)
        if mask.shape[-1] != tk or not bool(mask.all()):
            raise ValueError(padded)
        return causal, window
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
    raise ValueError(padded)


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
              **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' ``AttentionInterface`` entry running :func:`kernel_ladder.flash_attention`.

    Takes what transformers' attention modules pass: ``query`` ``(B, H, Tq, D)``, ``key`` / ``value``
    ``(B, Hkv, Tk, D)`` (a cache's keys included, K/V never repeated for GQA), ``scaling`` (None:
    ``1/sqrt(D)``), and the keywords ``sliding_window``, ``softcap`` and ``is_causal`` where a model
    passes them (others are ignored). Returns ``(out (B, Tq, H, D), None)``, like transformers' own
    functions (no attention weights).

    Causal unless ``is_causal=False`` or the module says ``is_causal = False``. ``attention_mask``: None;
    a ``(B, Tk)`` padding mask with nothing padded; or a 4-D bool or additive mask that is exactly
    causal, causal within the sliding window, or all visible (the computation then follows the mask).
    Anything else (padding) and attention dropout raise ``ValueError``.
    """
    if dropout:
        raise ValueError(f"{_ATTENTION}: attention dropout {dropout} is not supported by kernel_ladder."
                         "flash_attention; set the config's attention dropout to 0 (or call model.eval())")
    is_causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    tq, tk = query.shape[2], key.shape[2]
    window = kwargs.get("sliding_window")
    if window is not None and window >= tk:
        window = None  # a window at least as wide as the keys hides nothing
    if window is not None and not causal:
        raise ValueError(f"{_ATTENTION}: a sliding window ({window}) on a non-causal layer is not supported")
    if attention_mask is not None:
        causal, window = _read_mask(attention_mask, tq, tk, causal, window)
    out = kernel_ladder.flash_attention(query, key, value, causal=causal, softmax_scale=scaling, window=window,
                                        softcap=kwargs.get("softcap"))
    return out.transpose(1, 2), None


def _mask_function() -> Callable:
    from transformers.masking_utils import flash_attention_mask

    # None when nothing is padded, else the (B, Tk) padding mask: attention() takes the first and refuses the second.
    return flash_attention_mask


def experts(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' ``ExpertsInterface`` entry for ``MixtralExperts``: the routed tokens through grouped GEMMs
    (:mod:`kernel_ladder.ops.moe`) on the module's own stacked ``gate_up_proj`` / ``down_proj``."""
    from .ops.moe import experts_forward

    if getattr(self, "act_fn", None) is not None and type(self.act_fn).__name__ not in ("SiLU", "SiLUActivation"):
        raise ValueError(f"kernel_ladder.hf.experts: only SiLU-gated experts are supported, got "
                         f"{type(self.act_fn).__name__}")
    return experts_forward(hidden_states, top_k_index, top_k_weights.to(hidden_states.dtype), self.gate_up_proj,
                           self.down_proj)


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
