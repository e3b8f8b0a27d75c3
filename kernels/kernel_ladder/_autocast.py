"""Autocast rules for every ``kernel_ladder`` op: under ``torch.autocast`` each op casts its inputs, and
returns the dtype, that torch's matching op does on that device.

``torch.library.register_autocast`` takes one fixed dtype, but the autocast dtype is chosen at
run time (``torch.autocast(..., dtype=torch.float16)`` or ``bfloat16``), so this module does the
equivalent itself: for each public op (every ``torch.ops.kernel_ladder.*`` that is not a backward op) a
:class:`Policy` per device type, and a kernel registered at the ``AutocastCPU`` and
``AutocastCUDA`` dispatch keys that casts the op's floating-point inputs by that policy and calls
the op again with autocast excluded. The cast is an ordinary differentiable ``Tensor.to``, so each
input's gradient comes back in that input's own dtype, as under torch's own autocast.

The policies:

* ``"lower"`` — float inputs cast to ``torch.get_autocast_dtype(device)``: the matmul-bound ops
  (torch's ``linear``, ``matmul``, ``scaled_dot_product_attention`` lists);
* ``"fp32"`` — float inputs cast to float32: the reductions and norms torch runs in float32 there.
  An op with a ``dtype`` argument (softmax, log_softmax) is instead asked for a float32 result with
  its input read as it is, and runs as given when the caller named a dtype — torch's own rule for
  ``softmax`` (it passes ``dtype=float32`` rather than copying the input);
* ``"promote"`` — float inputs cast to the widest of their dtypes: what torch's elementwise ops do
  under autocast (they are in no list, so type promotion decides);
* ``"none"`` — run as given (nothing is registered: autocast falls through).

Only float32, float16 and bfloat16 tensors on the autocast device are cast (float64 stays, as in
torch; fp8 caches and int8/int4 quantized weights are data whose encoding a cast would destroy).
An op's inputs that it writes in place (``write_kv_cache``'s caches) are never cast: the write
would land in a copy. :func:`table` lists the rules; :func:`unifies` is the check the ops' dtype
validation uses, so that mixed dtypes autocast is about to make one are not rejected first.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = ["LOWER", "FP32", "PROMOTE", "NONE", "Policy", "TABLE", "DEVICE_TYPES", "public_ops", "table",
           "describe", "register", "registered", "unifies", "policy_for"]

LOWER, FP32, PROMOTE, NONE = "lower", "fp32", "promote", "none"
POLICIES = (LOWER, FP32, PROMOTE, NONE)

#: The device types that get a registration (the ones the package runs on).
DEVICE_TYPES = ("cpu", "cuda")

#: The dtypes a policy may cast (float64 stays, as in torch's autocast; fp8 is an encoding).
CASTABLE = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Policy:
    """An op's autocast rule on each device type, the torch op it follows, and why.

    ``keep`` names float inputs that are never cast (scales that belong to a quantized encoding);
    ``fp32_results`` the indices of results returned in float32 (a loss torch gives in float32 that
    the op computes in float32 but rounds to its input's dtype).
    """

    cpu: str
    cuda: str
    torch_op: str
    why: str
    keep: tuple[str, ...] = ()
    fp32_results: tuple[int, ...] = ()

    def on(self, device_type: str) -> str:
        """The policy on ``device_type`` (``"none"`` for a device type without autocast rules)."""
        return getattr(self, device_type, NONE) if device_type in DEVICE_TYPES else NONE


# Each rule follows what torch's matching op does under autocast. On the CPU that was found by
# running torch (2.13) under torch.autocast("cpu"): linear, matmul and scaled_dot_product_attention
# run in the autocast dtype; cross_entropy in float32; softmax, log_softmax, layer_norm, rms_norm and
# the elementwise ops run in the dtype they are given (bf16 in, bf16 out). On CUDA it is torch's
# documented op lists (https://pytorch.org/docs/stable/amp.html, "CUDA Ops that can autocast to
# float16" / "to float32"): softmax, log_softmax, layer_norm, cross_entropy run in float32 (and
# rms_norm, which torch also upcasts there), the matmuls in the autocast dtype.
_NORM_WHY = ("a norm's statistics (sum of squares, mean) lose precision in 16 bits: torch runs {op} in "
             "float32 under CUDA autocast; on the CPU torch runs it as given")
TABLE: dict[str, Policy] = {
    # matmul-bound: the autocast dtype
    "linear": Policy(LOWER, LOWER, "F.linear", "a GEMM: tensor cores want 16-bit inputs"),
    "matmul": Policy(LOWER, LOWER, "torch.matmul", "a GEMM: tensor cores want 16-bit inputs"),
    "gated_mlp": Policy(LOWER, LOWER, "F.linear (x3) + F.silu",
                        "three GEMMs (gate, up, down) whose inputs torch's linear would cast"),
    "grouped_matmul": Policy(LOWER, LOWER, "torch.matmul per expert", "one GEMM per expert"),
    "moe_gate_up": Policy(LOWER, LOWER, "torch.matmul per expert + F.silu", "the experts' gate/up GEMM"),
    "fused_linear_cross_entropy": Policy(
        LOWER, LOWER, "F.cross_entropy(F.linear(x, weight))",
        "the LM head's GEMM runs in the autocast dtype (as F.linear's); the loss is float32, as torch's "
        "cross_entropy's is under autocast (the op returns it in float32 always); the class weights stay as "
        "given (a loss's inputs, which torch's float32 cross_entropy would not round)", keep=("ce_weight",),
        fp32_results=(0, 1)),
    "quantized_linear": Policy(
        LOWER, LOWER, "F.linear(x, dequantized weight)",
        "x and bias in the autocast dtype, as F.linear's; the int8/int4/fp8 data is not float compute and "
        "its scales belong to the encoding, so both stay", keep=("scales",)),
    "flash_attention": Policy(LOWER, LOWER, "F.scaled_dot_product_attention",
                              "two GEMMs per tile; the sinks (per-head logits, read in float32) stay", keep=("sinks",)),
    "flash_attention_varlen": Policy(LOWER, LOWER, "F.scaled_dot_product_attention",
                                     "two GEMMs per tile; cu_seqlens are int32 and stay; so do the sinks",
                                     keep=("sinks",)),
    "block_sparse_attention": Policy(LOWER, LOWER, "F.scaled_dot_product_attention (masked)",
                                     "two GEMMs per allowed tile; the bool block mask stays"),
    "paged_attention": Policy(
        LOWER, LOWER, "F.scaled_dot_product_attention",
        "q and a float cache in the autocast dtype, as SDPA's; an fp8 cache is an encoding (not cast) and "
        "its per-tensor scales stay float32; the sinks (per-head logits, read in float32) stay",
        keep=("k_scale", "v_scale", "sinks")),
    "mla_attention": Policy(
        LOWER, LOWER, "F.scaled_dot_product_attention (over the expanded latent cache)",
        "q_latent, q_rope and the latent cache in the autocast dtype, as SDPA's inputs: two GEMMs per tile"),
    # reductions and norms: torch's policy per device
    "softmax": Policy(NONE, FP32, "F.softmax",
                      "exp and a row sum lose precision in 16 bits: torch runs softmax in float32 under CUDA "
                      "autocast; on the CPU torch runs it as given"),
    "log_softmax": Policy(NONE, FP32, "F.log_softmax",
                          "as softmax (torch's log_softmax rule on each device)"),
    "cross_entropy": Policy(FP32, FP32, "F.cross_entropy",
                            "a loss over a large vocabulary: torch runs it in float32 on both devices"),
    "layer_norm": Policy(NONE, FP32, "F.layer_norm", _NORM_WHY.format(op="layer_norm")),
    "rms_norm": Policy(NONE, FP32, "F.rms_norm", _NORM_WHY.format(op="rms_norm")),
    "add_rms_norm": Policy(PROMOTE, FP32, "F.rms_norm(x + residual)",
                           "the residual add promotes (elementwise) and then rms_norm's rule: on CUDA float32; "
                           "on the CPU as given, so the add's promotion decides"),
    "topk_routing": Policy(NONE, FP32, "F.softmax + torch.topk",
                           "a softmax over the experts: torch's softmax rule (Mixtral routes in float32 too); "
                           "the expert ids are int and stay"),
    # elementwise: torch's elementwise ops are in no autocast list
    "add": Policy(PROMOTE, PROMOTE, "torch.add", "elementwise: torch's type promotion decides"),
    "swiglu": Policy(PROMOTE, PROMOTE, "F.silu(gate) * up", "elementwise: the product promotes"),
    "geglu": Policy(PROMOTE, PROMOTE, "F.gelu(gate) * up", "elementwise: the product promotes"),
    "gelu": Policy(NONE, NONE, "F.gelu", "elementwise, one input: runs as given"),
    "silu": Policy(NONE, NONE, "F.silu", "elementwise, one input: runs as given"),
    "dropout": Policy(NONE, NONE, "F.dropout", "elementwise, one input: runs as given"),
    "rope": Policy(PROMOTE, PROMOTE, "q * cos + rotate_half(q) * sin",
                   "elementwise products: q, k, cos, sin (and QK-norm weights) promote to the widest"),
    "moe_gather": Policy(PROMOTE, PROMOTE, "x[permutation // top_k] (* weights)",
                         "a row gather (and weighting): elementwise, promotes"),
    "moe_combine": Policy(PROMOTE, PROMOTE, "index_add of y * weights",
                          "a weighted sum of rows: elementwise, promotes"),
    # not float compute
    "dropout_mask": Policy(NONE, NONE, "torch.rand(shape) >= p", "no tensor inputs; a bool mask out"),
    "moe_permute": Policy(NONE, NONE, "torch.sort(expert_ids)", "int expert ids in, int indices out"),
    "quantize_rows": Policy(NONE, NONE, "x / amax(x) * 127 (round)",
                            "quantization: the int8/fp8 codes and scales in the requested scale dtype are the "
                            "result; a cast to 16 bits first would only add a rounding"),
    "quantize_int4": Policy(NONE, NONE, "w / amax(w) * 7 (round, pack)",
                            "quantization: as quantize_rows (the packed int4 codes and their scales)"),
    "write_kv_cache": Policy(NONE, NONE, "cache.index_copy_(slot_mapping, k)",
                             "writes k and v into caches of a given dtype, converting on the store: the cache's "
                             "dtype decides, and a written (mutated) cache may never be cast"),
    "write_latent_cache": Policy(NONE, NONE, "cache.index_copy_(slot_mapping, cat(c_kv, k_rope))",
                                 "writes into a cache of a given dtype, converting on the store: the cache's dtype "
                                 "decides, and a written (mutated) cache may never be cast"),
}


def public_ops() -> list[str]:
    """Every public custom op in ``torch.ops.kernel_ladder`` (the ones a policy covers).

    Backward ops and private ops (a leading underscore: helpers, or ops a test defines in the
    namespace) are left out; a public name without a policy makes :func:`register` refuse.
    """
    names = []
    for name in dir(torch.ops.kernel_ladder):
        if name.startswith("_") or "_backward" in name:
            continue
        packet = getattr(torch.ops.kernel_ladder, name)
        if isinstance(packet, torch._ops.OpOverloadPacket):
            names.append(name)
    return sorted(names)


def policy_for(op: str, device_type: str) -> str:
    """The policy of ``op`` (``"linear"`` or ``"kernel_ladder.linear"``) on ``device_type``; ``"none"`` if none."""
    entry = TABLE.get(op.removeprefix("kernel_ladder."))
    return entry.on(device_type) if entry is not None else NONE


def table() -> list[dict[str, str]]:
    """The rules as rows (op, cpu, cuda, torch_op, why), sorted by op: for docs and tests."""
    return [{"op": name, "cpu": p.cpu, "cuda": p.cuda, "torch_op": p.torch_op, "why": p.why}
            for name, p in sorted(TABLE.items())]


def describe() -> str:
    """The table as aligned text, one op a line."""
    rows = table()
    width = max(len(r["op"]) for r in rows)
    lines = [f"{'op':<{width}}  {'cpu':<7}  {'cuda':<7}  follows"]
    lines += [f"{r['op']:<{width}}  {r['cpu']:<7}  {r['cuda']:<7}  {r['torch_op']}" for r in rows]
    return "\n".join(lines)


@functools.cache
def _castable_args(name: str) -> frozenset[str]:
    """The op's tensor arguments a policy may cast: not written in place, not in the policy's ``keep``."""
    schema = getattr(torch.ops.kernel_ladder, name).default._schema
    keep = set(TABLE[name].keep)
    names = set()
    for arg in schema.arguments:
        writes = arg.alias_info is not None and arg.alias_info.is_write
        if "Tensor" in str(arg.type) and not writes and arg.name not in keep:
            names.add(arg.name)
    return frozenset(names)


def _eligible(value: object, device_type: str) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype in CASTABLE and value.device.type == device_type


def _target_dtype(name: str, policy: str, device_type: str, values: dict[str, object]) -> torch.dtype | None:
    """The dtype the castable float inputs go to, or None when nothing is cast."""
    if policy == LOWER:
        return torch.get_autocast_dtype(device_type)
    if policy == FP32:
        return torch.float32
    floats = [values[n].dtype for n in _castable_args(name) if _eligible(values.get(n), device_type)]
    return functools.reduce(torch.promote_types, floats) if floats else None


def unifies(op: str, *named: tuple[str, torch.Tensor]) -> bool:
    """Whether autocast, active now, is about to cast the named inputs of ``op`` to one dtype.

    ``op`` is the public name (``"kernel_ladder.linear"``), ``named`` pairs of the op's argument name and
    its tensor. True only when autocast is enabled on the tensors' device type, the op's policy
    there casts, and every named tensor is one the policy casts: then a dtype mismatch between
    them is not an error (``F.linear(x_bf16, w_fp32)`` works under autocast too). Names that are
    not the op's castable arguments (a backward's ``grad_out``) are never excused.
    """
    name = op.removeprefix("kernel_ladder.")
    if name not in TABLE or not named:
        return False
    device_type = named[0][1].device.type
    if device_type not in DEVICE_TYPES or not torch.is_autocast_enabled(device_type):
        return False
    if TABLE[name].on(device_type) == NONE or (name, device_type) not in _REGISTERED:
        return False
    castable = _castable_args(name)
    return all(arg in castable and _eligible(t, device_type) for arg, t in named)


def _autocast_kernel(name: str, device_type: str):
    """The kernel at ``Autocast<Device>`` for op ``name``: cast by the policy, redispatch below autocast."""
    overload = getattr(torch.ops.kernel_ladder, name).default
    arg_names = [arg.name for arg in overload._schema.arguments]
    has_dtype_arg = "dtype" in arg_names
    policy = TABLE[name].on(device_type)
    castable = _castable_args(name)
    fp32_results = TABLE[name].fp32_results
    excluded = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, _autocast_key(device_type)))

    def kernel(_keyset, *args, **kwargs):
        values = dict(zip(arg_names, args))
        values.update(kwargs)
        if policy == FP32 and has_dtype_arg:
            # torch's softmax rule: ask for a float32 result instead of copying the input to float32
            if values.get("dtype") is None and _eligible(values[arg_names[0]], device_type):
                values["dtype"] = torch.float32
        else:
            target = _target_dtype(name, policy, device_type, values)
            if target is not None:
                for arg in castable:
                    if _eligible(values.get(arg), device_type):
                        values[arg] = values[arg].to(target)
        positional = [values[n] for n in arg_names[: len(args)]]
        rest = {n: values[n] for n in arg_names[len(args):] if n in values}
        with torch._C._ExcludeDispatchKeyGuard(excluded):
            out = overload(*positional, **rest)
        if fp32_results:
            out = tuple(t.to(torch.float32) if i in fp32_results else t for i, t in enumerate(out))
        return out

    return kernel


def _autocast_key(device_type: str) -> str:
    return "Autocast" + torch._C._dispatch_key_for_device(device_type)


#: The library holding the registrations (kept alive for the process; see :func:`register`).
_LIB: torch.library.Library | None = None
_REGISTERED: list[tuple[str, str]] = []


def register() -> list[tuple[str, str]]:
    """Register every op's autocast kernel (once); returns the (op, device type) pairs registered.

    Raises ``RuntimeError`` naming the ops that have no policy, or policies for ops that do not exist,
    so that a new op cannot ship without a rule.
    """
    global _LIB
    if _LIB is not None:
        return list(_REGISTERED)
    ops = public_ops()
    missing = sorted(set(ops) - set(TABLE))
    stale = sorted(set(TABLE) - set(ops))
    if missing or stale:
        raise RuntimeError(f"kernel_ladder autocast table: ops without a policy {missing}, "
                           f"policies without an op {stale}")
    for name, p in TABLE.items():
        for device_type in DEVICE_TYPES:
            if p.on(device_type) not in POLICIES:
                raise RuntimeError(f"kernel_ladder autocast table: {name} has unknown policy {p.on(device_type)!r}")
    lib = torch.library.Library("kernel_ladder", "IMPL")
    for name in ops:
        for device_type in DEVICE_TYPES:
            if TABLE[name].on(device_type) == NONE:
                continue  # autocast's fallthrough already runs the op as given
            lib.impl(name, _autocast_kernel(name, device_type), _autocast_key(device_type), with_keyset=True)
            _REGISTERED.append((name, device_type))
    _LIB = lib
    return list(_REGISTERED)


def registered() -> list[tuple[str, str]]:
    """The (op, device type) pairs that have an autocast kernel."""
    return list(_REGISTERED)
