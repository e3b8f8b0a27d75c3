"""The roofline model: turn bytes moved and FLOPs into a predicted time on a named GPU.

A kernel cannot finish faster than its bytes take to cross HBM at the peak bandwidth, nor faster
than its FLOPs take at the peak tensor-core rate; the model predicts the larger of the two.
Peaks are the vendors' datasheet numbers (dense, i.e. without 2:4 sparsity), which real kernels
approach but do not reach, and launch overheads and caches are ignored: every prediction is a
*model*, a lower bound on time, never a measurement.

    >>> from utils.roofline import predict
    >>> print(predict(12 * 2**20, gpu="H200"))          # doctest: +SKIP
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["GPU", "GPUS", "Prediction", "predict", "predict_trace", "arithmetic_intensity", "get_gpu",
           "dtype_key"]

TERA = 1e12


@dataclass(frozen=True)
class GPU:
    """Datasheet peaks of one GPU.

    ``peak_flops`` maps a dtype key to dense FLOP/s: ``"fp64"`` (FP64 tensor core), ``"fp32"`` (CUDA cores, not tensor
    cores), ``"tf32"``, ``"bf16"``, ``"fp16"``, ``"fp8"`` (tensor cores, FP32 accumulate where the
    datasheet distinguishes) and ``"int8"`` (tensor-core OPS/s).
    """

    name: str
    hbm_bytes_per_s: float
    peak_flops: dict[str, float]
    l2_bytes: int
    sm_count: int
    source: str
    memory: str = ""

    def ridge_point(self, dtype: Any = "bf16") -> float:
        """Arithmetic intensity (FLOP/byte) where the memory roof meets the compute roof."""
        return self.peak(dtype) / self.hbm_bytes_per_s

    def peak(self, dtype: Any = "bf16") -> float:
        """Dense peak FLOP/s for ``dtype`` (a key, a torch dtype or a name like ``"bfloat16"``)."""
        key = dtype_key(dtype)
        if key not in self.peak_flops:
            raise ValueError(f"utils.roofline: {self.name} has no peak for {dtype!r}; "
                             f"known: {', '.join(self.peak_flops)}")
        return self.peak_flops[key]


_MB = 1024 * 1024

GPUS: dict[str, GPU] = {
    "H100": GPU(
        name="H100 SXM",
        hbm_bytes_per_s=3.35 * TERA,
        peak_flops={"fp64": 67 * TERA, "fp32": 67 * TERA, "tf32": 494.5 * TERA, "bf16": 989.5 * TERA,
                    "fp16": 989.5 * TERA, "fp8": 1979 * TERA, "int8": 1979 * TERA},
        l2_bytes=50 * _MB,
        sm_count=132,
        memory="80 GB HBM3",
        source=("NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column: GPU memory bandwidth 3.35 TB/s; "
                "FP64 Tensor Core 67 TFLOPS, FP32 67 TFLOPS, TF32 989 / BF16 1,979 / FP16 1,979 / FP8 3,958 "
                "TFLOPS and INT8 3,958 TOPS with sparsity (dense = half). L2 50 MB and 132 SMs: NVIDIA H100 "
                "Tensor Core GPU Architecture whitepaper (H100 SXM5)."),
    ),
    "H200": GPU(
        name="H200 SXM",
        hbm_bytes_per_s=4.8 * TERA,
        peak_flops={"fp64": 67 * TERA, "fp32": 67 * TERA, "tf32": 494.5 * TERA, "bf16": 989.5 * TERA,
                    "fp16": 989.5 * TERA, "fp8": 1979 * TERA, "int8": 1979 * TERA},
        l2_bytes=50 * _MB,
        sm_count=132,
        memory="141 GB HBM3e",
        source=("NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column: GPU memory 141 GB, bandwidth 4.8 TB/s; "
                "FP64 Tensor Core 67 TFLOPS, FP32 67 TFLOPS, TF32 989 / BF16 1,979 / FP16 1,979 / FP8 3,958 "
                "TFLOPS and INT8 3,958 TOPS with sparsity (dense = half). Same GH100 chip as H100 SXM: L2 50 MB "
                "and 132 SMs per the NVIDIA H100 Tensor Core GPU Architecture whitepaper."),
    ),
    "A100": GPU(
        name="A100 SXM 80GB",
        hbm_bytes_per_s=2.039 * TERA,
        peak_flops={"fp64": 19.5 * TERA, "fp32": 19.5 * TERA, "tf32": 156 * TERA, "bf16": 312 * TERA,
                    "fp16": 312 * TERA, "int8": 624 * TERA},
        l2_bytes=40 * _MB,
        sm_count=108,
        memory="80 GB HBM2e",
        source=("NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column: GPU memory bandwidth 2,039 GB/s; "
                "FP64 Tensor Core 19.5 TFLOPS, FP32 19.5 TFLOPS, TF32 156 / BF16 312 / FP16 312 TFLOPS and INT8 "
                "624 TOPS dense (twice that with sparsity); no FP8. L2 40 MB and 108 SMs: NVIDIA A100 Tensor "
                "Core GPU Architecture whitepaper."),
    ),
    "RTX 4090": GPU(
        name="GeForce RTX 4090",
        hbm_bytes_per_s=1.008 * TERA,
        peak_flops={"fp32": 82.6 * TERA, "tf32": 82.6 * TERA, "bf16": 165.2 * TERA, "fp16": 165.2 * TERA,
                    "fp8": 330.3 * TERA, "int8": 660.6 * TERA},
        l2_bytes=72 * _MB,
        sm_count=128,
        memory="24 GB GDDR6X",
        source=("NVIDIA Ada GPU Architecture whitepaper, GeForce RTX 4090 column: memory bandwidth 1,008 GB/s, "
                "L2 72 MB, 128 SMs; peak FP32 82.6 TFLOPS; dense tensor TFLOPS with FP32 accumulate: TF32 82.6, "
                "BF16 165.2, FP16 165.2, FP8 330.3; INT8 660.6 TOPS (FP16 accumulate doubles FP16/FP8; "
                "sparsity doubles all). fp64 is not listed: it is not a tensor-core dtype on this GPU."),
    ),
}

_ALIASES = {
    "h100": "H100", "h100 sxm": "H100", "h100-sxm": "H100", "h100 sxm5": "H100",
    "h200": "H200", "h200 sxm": "H200",
    "a100": "A100", "a100 sxm": "A100", "a100 80gb": "A100", "a100 sxm 80gb": "A100",
    "rtx 4090": "RTX 4090", "rtx4090": "RTX 4090", "4090": "RTX 4090", "geforce rtx 4090": "RTX 4090",
}

_DTYPE_KEYS = {
    "float64": "fp64", "double": "fp64", "fp64": "fp64",
    "float32": "fp32", "float": "fp32", "fp32": "fp32",
    "tf32": "tf32",
    "bfloat16": "bf16", "bf16": "bf16",
    "float16": "fp16", "half": "fp16", "fp16": "fp16",
    "float8_e4m3fn": "fp8", "float8_e5m2": "fp8", "float8_e4m3fnuz": "fp8", "float8_e5m2fnuz": "fp8", "fp8": "fp8",
    "int8": "int8", "uint8": "int8",
}


def dtype_key(dtype: Any) -> str:
    """``torch.bfloat16``, ``"bfloat16"``, ``"bf16"`` -> ``"bf16"`` (the keys of ``GPU.peak_flops``)."""
    text = str(dtype).lower().removeprefix("torch.").removeprefix("tl.")
    if text not in _DTYPE_KEYS:
        raise ValueError(f"utils.roofline: unknown dtype {dtype!r}; use one of {sorted(set(_DTYPE_KEYS.values()))}")
    return _DTYPE_KEYS[text]


def get_gpu(gpu: str | GPU) -> GPU:
    """A ``GPU`` from its key (``"H200"``), a common spelling (``"h100 sxm"``), or itself."""
    if isinstance(gpu, GPU):
        return gpu
    key = gpu if gpu in GPUS else _ALIASES.get(str(gpu).strip().lower())
    if key is None:
        raise ValueError(f"utils.roofline: unknown GPU {gpu!r}; known: {', '.join(GPUS)}")
    return GPUS[key]


def arithmetic_intensity(bytes: float, flops: float) -> float:
    """FLOPs per byte moved (``inf`` for FLOPs without traffic, 0 when there are neither)."""
    if bytes <= 0:
        return math.inf if flops > 0 else 0.0
    return flops / bytes


@dataclass(frozen=True)
class Prediction:
    """A roofline prediction. It is a model (a lower bound from datasheet peaks), not a measurement."""

    time_s: float
    memory_time_s: float
    compute_time_s: float
    bound: str  # "memory" | "compute"
    gpu: str
    label: str = "model"
    bytes: float = 0
    flops: float = 0
    dtype: str = "bf16"

    @property
    def time_us(self) -> float:
        return self.time_s * 1e6

    @property
    def arithmetic_intensity(self) -> float:
        return arithmetic_intensity(self.bytes, self.flops)

    def __str__(self) -> str:
        # At most ~100 characters: "model (H200 SXM, fp32): 164 ns, memory-bound (memory 164 ns, compute 0 s), not ..."
        return (f"model ({self.gpu}, {self.dtype}): {_format_time(self.time_s)}, {self.bound}-bound "
                f"(memory {_format_time(self.memory_time_s)}, compute {_format_time(self.compute_time_s)}), "
                "not a measurement")


def _format_time(seconds: float) -> str:
    if seconds == 0:
        return "0 s"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def predict(bytes: float, flops: float = 0, gpu: str | GPU = "H200", dtype: Any = "bf16") -> Prediction:
    """Roofline time for moving ``bytes`` through HBM and doing ``flops`` at the ``dtype`` peak."""
    spec = get_gpu(gpu)
    key = dtype_key(dtype)
    memory_time = bytes / spec.hbm_bytes_per_s
    compute_time = flops / spec.peak(key) if flops else 0.0
    return Prediction(
        time_s=max(memory_time, compute_time),
        memory_time_s=memory_time,
        compute_time_s=compute_time,
        bound="compute" if compute_time > memory_time else "memory",
        gpu=spec.name,
        bytes=bytes,
        flops=flops,
        dtype=key,
    )


def predict_trace(t: Any, gpu: str | GPU = "H200", dtype: Any = "bf16") -> Prediction:
    """``predict`` for everything a ``utils.trace`` recorded (its total bytes and FLOPs)."""
    return predict(t.bytes, t.flops, gpu=gpu, dtype=dtype)
