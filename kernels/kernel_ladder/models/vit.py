"""``kernel_ladder.models.ViT``: a vision transformer encoder written only with ``kernel_ladder`` ops, loadable
from Hugging Face's ``ViTModel`` and ``CLIPVisionModel``.

The two differ in small ways, all carried by :class:`ViTConfig`: ViT's patch projection has a bias
and its encoder ends in a layer norm over every token; CLIP's has no patch bias, normalizes the
embeddings before the first layer (``pre_layrnorm``) and applies its final norm to the class token
only (the pooled output), so its ``last_hidden_state`` is the last layer's output as it is.

What runs where: the patch projection is one :func:`kernel_ladder.linear` over the image cut into
patches (the cut is a view and a copy, no arithmetic); the norms :func:`kernel_ladder.layer_norm`;
attention :func:`kernel_ladder.flash_attention` (not causal); the MLP's first GEMM carries its GELU
(``activation=``), except CLIP's ``quick_gelu`` (``x·σ(1.702x)``), which ``kernel_ladder`` has no fused
form of and is computed by torch between the two linears; residuals :func:`kernel_ladder.add`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

import kernel_ladder

from ._hf import build_from_hf, mismatch_error

_OP = "kernel_ladder.models.ViT"
#: ``hidden_act`` → the ``activation=`` of :func:`kernel_ladder.linear` (``quick_gelu`` is computed apart).
_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "quick_gelu": None}
SUPPORTED_MODEL_TYPES = ("vit", "clip_vision_model")


@dataclass
class ViTConfig:
    """The encoder's shape; :meth:`from_hf` reads it from a ``ViTConfig`` or ``CLIPVisionConfig``."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    qkv_bias: bool = True
    style: str = "vit"  # "vit" or "clip" (see the module docstring)

    def __post_init__(self) -> None:
        if self.style not in ("vit", "clip"):
            raise ValueError(f"{_OP}: style must be 'vit' or 'clip', got {self.style!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"{_OP}: hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                             f"({self.num_attention_heads})")
        if self.image_size % self.patch_size:
            raise ValueError(f"{_OP}: image_size ({self.image_size}) must be a multiple of patch_size "
                             f"({self.patch_size})")
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"{_OP}: hidden_act {self.hidden_act!r} is not supported ({', '.join(_ACTIVATIONS)})")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @classmethod
    def from_hf(cls, config) -> ViTConfig:
        c = config if isinstance(config, dict) else config.to_dict()
        model_type = c.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"{_OP}: model_type {model_type!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)} "
                             "(for other families see kernel_ladder.patch.patch_model)")
        clip = model_type == "clip_vision_model"
        return cls(
            hidden_size=c["hidden_size"], num_hidden_layers=c["num_hidden_layers"],
            num_attention_heads=c["num_attention_heads"], intermediate_size=c["intermediate_size"],
            image_size=c["image_size"], patch_size=c["patch_size"], num_channels=c.get("num_channels", 3),
            layer_norm_eps=c.get("layer_norm_eps", 1e-5 if clip else 1e-12), hidden_act=c.get("hidden_act", "gelu"),
            qkv_bias=True if clip else bool(c.get("qkv_bias", True)), style="clip" if clip else "vit")

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _linear(module: torch.nn.Linear, x: torch.Tensor, activation: str | None = None) -> torch.Tensor:
    return kernel_ladder.linear(x, module.weight, module.bias, activation=activation)


def _norm(module: torch.nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    return kernel_ladder.layer_norm(x, module.normalized_shape, module.weight, module.bias, module.eps)


class EncoderLayer(torch.nn.Module):
    """Pre-norm block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.heads, self.head_dim = config.num_attention_heads, h // config.num_attention_heads
        self.act = config.hidden_act
        self.norm1 = torch.nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.q = torch.nn.Linear(h, h, bias=config.qkv_bias)
        self.k = torch.nn.Linear(h, h, bias=config.qkv_bias)
        self.v = torch.nn.Linear(h, h, bias=config.qkv_bias)
        self.o = torch.nn.Linear(h, h)
        self.norm2 = torch.nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.fc1 = torch.nn.Linear(h, i)
        self.fc2 = torch.nn.Linear(i, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        y = _norm(self.norm1, x)
        q, k, v = (_linear(p, y).view(b, t, self.heads, self.head_dim).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        attn = kernel_ladder.flash_attention(q, k, v, causal=False).transpose(1, 2).reshape(b, t, -1)
        x = kernel_ladder.add(x, _linear(self.o, attn))
        y = _norm(self.norm2, x)
        if self.act == "quick_gelu":
            y = _linear(self.fc1, y)
            y = y * torch.sigmoid(1.702 * y)
        else:
            y = _linear(self.fc1, y, activation=_ACTIVATIONS[self.act])
        return kernel_ladder.add(x, _linear(self.fc2, y))


class ViT(torch.nn.Module):
    """``ViT(config)(pixel_values) -> last_hidden_state`` of shape ``(B, 1 + num_patches, hidden)``,
    equal to ``transformers``' ``last_hidden_state`` for the same weights (:meth:`from_hf`)."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.config = config
        h, p, c = config.hidden_size, config.patch_size, config.num_channels
        self.cls = torch.nn.Parameter(torch.zeros(h))
        self.pos = torch.nn.Parameter(torch.zeros(1 + config.num_patches, h))
        self.patch = torch.nn.Linear(c * p * p, h, bias=config.style == "vit")
        self.pre_norm = torch.nn.LayerNorm(h, eps=config.layer_norm_eps) if config.style == "clip" else None
        self.layers = torch.nn.ModuleList(EncoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = torch.nn.LayerNorm(h, eps=config.layer_norm_eps)  # ViT: every token; CLIP: the pooled one

    def patches(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W)`` → ``(B, num_patches, C·p·p)``, each patch flattened as a conv weight is."""
        c, p, size = self.config.num_channels, self.config.patch_size, self.config.image_size
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (c, size, size):
            raise ValueError(f"{_OP}: pixel_values must be (batch, {c}, {size}, {size}), got "
                             f"{tuple(pixel_values.shape)} (resize the images; position embeddings are not "
                             "interpolated)")
        b, g = pixel_values.shape[0], size // p
        x = pixel_values.reshape(b, c, g, p, g, p).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(b, g * g, c * p * p)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = _linear(self.patch, self.patches(pixel_values.to(self.patch.weight.dtype)))
        cls = self.cls.view(1, 1, -1).expand(x.shape[0], 1, -1)
        x = kernel_ladder.add(torch.cat([cls, x], dim=1), self.pos)
        if self.pre_norm is not None:
            x = _norm(self.pre_norm, x)
        for layer in self.layers:
            x = layer(x)
        return _norm(self.norm, x) if self.config.style == "vit" else x

    def pooled(self, last_hidden_state: torch.Tensor) -> torch.Tensor:
        """CLIP's ``pooler_output``: the class token through the final norm."""
        return _norm(self.norm, last_hidden_state[:, 0])

    @classmethod
    def from_hf(cls, hf_model: torch.nn.Module) -> ViT:
        """The same encoder as a ``transformers`` ``ViTModel`` or ``CLIPVisionModel`` (weights copied,
        dtype and device kept); a whole ``CLIPModel`` (what ``AutoModel`` loads from a CLIP checkpoint)
        gives its vision tower."""
        model_type = getattr(getattr(hf_model, "config", None), "model_type", None)
        if model_type == "clip" and hasattr(hf_model, "vision_model"):
            hf_model = hf_model.vision_model
        return build_from_hf(cls, ViTConfig, hf_model, _OP)

    def _hf_names(self) -> dict[str, str]:
        """Our parameter name → the name in a ``transformers`` (5.x) state dict of the encoder."""
        names = {}
        if self.config.style == "vit":
            e = "embeddings."
            names.update({"cls": e + "cls_token", "pos": e + "position_embeddings",
                          "patch.weight": e + "patch_embeddings.projection.weight",
                          "patch.bias": e + "patch_embeddings.projection.bias",
                          "norm.weight": "layernorm.weight", "norm.bias": "layernorm.bias"})
            parts = {"norm1": "layernorm_before", "q": "attention.q_proj", "k": "attention.k_proj",
                     "v": "attention.v_proj", "o": "attention.o_proj", "norm2": "layernorm_after",
                     "fc1": "mlp.fc1", "fc2": "mlp.fc2"}
            layer = "layers.{}."
        else:
            e = "embeddings."
            names.update({"cls": e + "class_embedding", "pos": e + "position_embedding.weight",
                          "patch.weight": e + "patch_embedding.weight",
                          "pre_norm.weight": "pre_layrnorm.weight",
                          "pre_norm.bias": "pre_layrnorm.bias",
                          "norm.weight": "post_layernorm.weight",
                          "norm.bias": "post_layernorm.bias"})
            parts = {"norm1": "layer_norm1", "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
                     "o": "self_attn.out_proj", "norm2": "layer_norm2", "fc1": "mlp.fc1", "fc2": "mlp.fc2"}
            layer = "encoder.layers.{}."
        for i, ours in enumerate(self.layers):
            for name, _ in ours.named_parameters():
                module, kind = name.rsplit(".", 1)
                names[f"layers.{i}.{name}"] = layer.format(i) + parts[module] + "." + kind
        return names

    @torch.no_grad()
    def load_hf_state_dict(self, state: dict[str, torch.Tensor], source: str = "the state dict") -> None:
        """Copy weights from a Hugging Face state dict; names every missing or mis-shaped tensor."""
        prefix = "vision_model."  # CLIPModel's vision tower, or an older CLIPVisionModel's keys
        state = {k.removeprefix(prefix): v for k, v in state.items()}
        params = dict(self.named_parameters())
        missing, shapes = [], []
        for ours, theirs in self._hf_names().items():
            if theirs not in state:
                missing.append(theirs)
                continue
            target, value = params[ours], state[theirs]
            if value.numel() != target.numel():
                shapes.append(f"{theirs} {tuple(value.shape)} (expected {tuple(target.shape)})")
                continue
            target.copy_(value.reshape(target.shape))  # cls (1, 1, h) / conv weight (h, c, p, p) flattened
        if missing or shapes:
            raise mismatch_error(_OP, source, f"a {self.config.style} encoder of this config", missing, (), shapes,
                                 most=8)
