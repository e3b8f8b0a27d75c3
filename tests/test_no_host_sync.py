"""No op synchronizes with the host in its forward or backward (so every op can be captured in a CUDA
graph and run under ``torch.compile(mode="reduce-overhead")``), and the value-check policy.

On the CPU there is no device to wait for, so "a sync" means what would be one on a GPU: reading a
tensor's value on the host. Two independent instruments watch every case, with the value checks in
their CUDA default (off):

* the ``torch.Tensor`` methods that read values — ``item``, ``tolist``, ``cpu``, ``numpy``,
  ``__bool__``, ``__int__``, ``__float__``, ``__index__`` — patched to record any call made from
  ``kernel_ladder``' code (calls from inside Triton's interpreter are its CPU emulation of a launch: it
  copies the arguments to numpy and back, which a compiled launch does not);
* a ``utils.trace`` trace, which sees every aten op a ``kernel_ladder`` op runs inside: no
  ``aten._local_scalar_dense`` (what every host read of a value comes down to), no op whose output
  size depends on the data (``nonzero``, ``masked_select``, ``unique``...), no copy to the CPU from
  another device.

Every non-backward op in ``torch.ops.kernel_ladder`` must have a case here (a new op without one fails
:func:`test_every_op_has_a_no_sync_case`); a deliberately syncing op is caught (negative controls).
The GPU tests at the end capture a training step of ``utils.transformer``'s block in a CUDA graph,
and compile its forward with ``mode="reduce-overhead"``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable

import pytest
import torch

import kernel_ladder
from kernel_ladder import _autocast, runtime
from tests.helpers import DEVICE
from utils.trace import trace

#: The Tensor methods that read a tensor's values on the host.
SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
#: aten ops that read values on the host, or whose output's size depends on the data (a sync on CUDA).
SYNC_ATEN = ("_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "_unique", "unique_dim",
             "unique_consecutive", "bincount", "repeat_interleave", "histc", "equal", "is_nonzero")

_KERNELS_DIR = os.path.dirname(kernel_ladder.__file__) + os.sep
_TRITON_DIR = os.path.dirname(sys.modules["triton"].__file__) + os.sep


def _caller_in_kernels() -> str | None:
    """``file:line`` of the innermost ``kernel_ladder`` frame calling, unless Triton's interpreter is on the stack."""
    frame = sys._getframe(2)
    where = None
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_TRITON_DIR):
            return None  # the interpreter's emulation of a launch
        if where is None and name.startswith(_KERNELS_DIR):
            where = f"{name[len(_KERNELS_DIR):]}:{frame.f_lineno}"
        frame = frame.f_back
    return where


class HostSyncs:
    """Records host reads of tensor values made by ``kernel_ladder`` code, by both instruments (see the module)."""

    def __init__(self) -> None:
        self.calls: list[str] = []   # "method at file:line"
        self.aten: list[str] = []    # aten ops of SYNC_ATEN, or copies to the host

    @contextlib.contextmanager
    def watching(self):
        originals = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}

        def patched(name, original):
            def method(tensor, *args, **kwargs):
                where = _caller_in_kernels()
                if where is not None:
                    self.calls.append(f"Tensor.{name} at kernels/kernel_ladder/{where}")
                return original(tensor, *args, **kwargs)

            return method

        for name, original in originals.items():
            setattr(torch.Tensor, name, patched(name, original))
        try:
            with trace(torch_ops=True) as t:
                yield self
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)
        for op in t.torch_ops:
            base = op.name.split(".")[1] if op.name.startswith("aten.") else op.name
            if base in SYNC_ATEN:
                self.aten.append(f"{op.name} inside {op.inside or 'the caller'}")

    def __bool__(self) -> bool:
        return bool(self.calls or self.aten)

    def __str__(self) -> str:
        return "; ".join(self.calls + self.aten) or "no host sync"


def run_without_syncs(case: Callable[[], object]) -> HostSyncs:
    """Run ``case`` (forward and backward) with the CUDA-default value checks (off); what synced."""
    syncs = HostSyncs()
    with runtime.check_values(False), syncs.watching():
        case()
    return syncs


# ----------------------------------------------------------------------------------------------
# One case per op: a tiny input, the forward and (where there is one) the backward
# ----------------------------------------------------------------------------------------------

_gen = torch.Generator().manual_seed(0)


def _r(*shape, grad=True, dtype=torch.float32):
    t = torch.randn(shape, generator=_gen).to(DEVICE, dtype)
    return t.requires_grad_() if grad else t


def _backward(out) -> None:
    outs = out if isinstance(out, tuple) else (out,)
    total = sum((o.float() * torch.ones_like(o, dtype=torch.float32)).sum() for o in outs if o.requires_grad)
    total.backward()


def _int(values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def _case_varlen():
    q, k, v = _r(7, 2, 16), _r(7, 1, 16), _r(7, 1, 16)
    cu = _int([0, 3, 7])
    _backward(kernel_ladder.flash_attention_varlen(q, k, v, cu, cu, 4, 4, causal=True))


def _case_paged():
    q = _r(2, 2, 16, grad=False)
    k_cache, v_cache = _r(4, 8, 1, 16, grad=False), _r(4, 8, 1, 16, grad=False)
    kernel_ladder.paged_attention(q, k_cache, v_cache, _int([[0, 2], [3, 1]]), _int([9, 5]), num_splits=1)
    cu = _int([0, 2, 3])
    kernel_ladder.paged_attention(_r(3, 2, 16, grad=False), k_cache, v_cache, _int([[0, 2], [3, 1]]), _int([9, 5]),
                                  cu_seqlens_q=cu)


def _case_write_kv_cache():
    k_cache, v_cache = _r(3, 8, 1, 16, grad=False), _r(3, 8, 1, 16, grad=False)
    kernel_ladder.write_kv_cache(_r(4, 1, 16, grad=False), _r(4, 1, 16, grad=False), k_cache, v_cache,
                                 _int([0, 9, -1, 23], torch.int64))


def _case_mla():
    latent_cache = _r(4, 8, 24, grad=False)
    tables, lens = _int([[0, 2], [3, 1]]), _int([9, 5])
    kernel_ladder.mla_attention(_r(2, 3, 16, grad=False), _r(2, 3, 8, grad=False), latent_cache, tables, lens, 0.2, 16,
                                num_splits=2)
    kernel_ladder.mla_attention(_r(3, 3, 16, grad=False), _r(3, 3, 8, grad=False), latent_cache, tables, lens, 0.2, 16,
                                _int([0, 2, 3]))


def _case_write_latent_cache():
    kernel_ladder.write_latent_cache(_r(4, 16, grad=False), _r(4, 8, grad=False), _r(3, 8, 24, grad=False),
                                     _int([0, 9, -1, 23], torch.int64))


def _case_moe():
    x, logits = _r(6, 16), _r(6, 4)
    _backward(kernel_ladder.moe(x, logits, _r(4, 32, 16), _r(4, 16, 16), top_k=2))


def _case_moe_permute_gather_combine():
    ids = _int([[0, 2], [1, 2], [3, 0]])
    permutation, offsets = kernel_ladder.moe_permute(ids, 4)
    rows = kernel_ladder.moe_gather(_r(3, 16), permutation, 2)
    _backward(kernel_ladder.moe_combine(rows, permutation, _r(3, 2)))


def _case_topk_routing():
    logits = _r(5, 4)
    weights, ids = kernel_ladder.topk_routing(logits, 2)
    _backward(weights)
    _backward(kernel_ladder.moe_load_balancing_loss(_r(5, 4), ids, 4))


def _case_quantize():
    # kernel_ladder.quantize_weight (an offline conversion, not a step's op) checks its weight is finite on the
    # host, one sync by design: the weights are quantized before the watch, its ops are watched directly.
    w = _r(16, 64, grad=False)
    qweights = [kernel_ladder.quantize_weight(w, scheme, group_size=group)
                for scheme, group in (("int8", None), ("int4", 32), ("fp8", None))]

    def case():
        torch.ops.kernel_ladder.quantize_int4(w, 32, torch.float32)
        torch.ops.kernel_ladder.quantize_rows(w, False, torch.float32)
        torch.ops.kernel_ladder.quantize_rows(w, True, torch.float32)
        kernel_ladder.quantize_activations(_r(3, 64, grad=False))
        for qweight in qweights:
            _backward(kernel_ladder.quantized_linear(_r(3, 64), qweight, _r(16)))
        _backward(kernel_ladder.quantized_linear(_r(3, 64), qweights[0], activations="int8"))

    return case


def _case_grouped_matmul():
    _backward(kernel_ladder.grouped_matmul(_r(6, 16), _r(3, 16, 16), _int([2, 2, 5])))


def _case_block_sparse():
    q, k, v = _r(1, 2, 32, 16), _r(1, 2, 32, 16), _r(1, 2, 32, 16)
    mask = kernel_ladder.sliding_window_mask(2, 2, 1, device=DEVICE)
    _backward(kernel_ladder.block_sparse_attention(q, k, v, mask, block_size=16))


def _case_cross_entropy():
    target = _int([1, -100, 5, 0], torch.int64)
    _backward(kernel_ladder.cross_entropy(_r(4, 7), target))
    _backward(kernel_ladder.cross_entropy(_r(4, 7), target, reduction="none"))


def _case_flce():
    target = _int([1, -100, 5, 0], torch.int64)
    _backward(kernel_ladder.fused_linear_cross_entropy(_r(4, 16), _r(7, 16), target))
    _backward(kernel_ladder.fused_linear_cross_entropy(_r(4, 16), _r(7, 16), target, reduction="none"))


def _case_matmul():
    _backward(kernel_ladder.matmul(_r(8, 16), _r(16, 8)))
    kernel_ladder.matmul_split_k(_r(8, 32, grad=False), _r(32, 8, grad=False), 2)
    kernel_ladder.matmul_persistent(_r(8, 16, grad=False), _r(16, 8, grad=False))


class _Prepared:
    """A case whose inputs are made outside the watch: ``make()`` returns the case to watch."""

    def __init__(self, make: Callable[[], Callable[[], None]]) -> None:
        self.make = make


#: op name in torch.ops.kernel_ladder -> the case that runs it (forward and backward).
CASES: dict[str, Callable[[], None] | _Prepared] = {
    "add": lambda: _backward(kernel_ladder.add(_r(4, 8), _r(8))),
    "add_rms_norm": lambda: _backward(kernel_ladder.add_rms_norm(_r(4, 8), _r(4, 8), _r(8))),
    "block_sparse_attention": _case_block_sparse,
    "cross_entropy": _case_cross_entropy,
    "dropout": lambda: _backward(kernel_ladder.dropout(_r(4, 8), 0.5, seed=3)),
    "dropout_mask": lambda: kernel_ladder.dropout_mask((4, 8), 0.5, seed=3, device=DEVICE),
    "flash_attention": lambda: _backward(kernel_ladder.flash_attention(_r(1, 2, 8, 16), _r(1, 1, 8, 16),
                                                                       _r(1, 1, 8, 16), causal=True)),
    "flash_attention_varlen": _case_varlen,
    "fused_linear_cross_entropy": _case_flce,
    "gated_mlp": lambda: _backward(kernel_ladder.gated_mlp(_r(4, 16), _r(8, 16), _r(8, 16), _r(16, 8))),
    "geglu": lambda: _backward(kernel_ladder.geglu(_r(4, 8), _r(4, 8), in_place_backward=True)),
    "gelu": lambda: _backward(kernel_ladder.gelu(_r(4, 8))),
    "grouped_matmul": _case_grouped_matmul,
    "layer_norm": lambda: _backward(kernel_ladder.layer_norm(_r(4, 8), 8, _r(8), _r(8))),
    "linear": lambda: _backward(kernel_ladder.linear(_r(4, 16), _r(8, 16), _r(8), activation="gelu")),
    "log_softmax": lambda: _backward(kernel_ladder.log_softmax(_r(4, 8))),
    "matmul": _case_matmul,
    "mla_attention": _case_mla,
    "moe_combine": _case_moe_permute_gather_combine,
    "moe_gate_up": _case_moe,
    "moe_gather": _case_moe_permute_gather_combine,
    "moe_permute": _case_moe_permute_gather_combine,
    "paged_attention": _case_paged,
    "quantize_int4": _Prepared(_case_quantize),
    "quantize_rows": _Prepared(_case_quantize),
    "quantized_linear": _Prepared(_case_quantize),
    "rms_norm": lambda: (_backward(kernel_ladder.rms_norm(_r(4, 8), _r(8))),
                         _backward(kernel_ladder.rms_norm(_r(4, 8), _r(8), in_place_backward=True))),
    "rope": lambda: _backward(kernel_ladder.rope(_r(1, 2, 4, 8), _r(1, 1, 4, 8),
                                                 *kernel_ladder.rope_cos_sin(torch.arange(4, device=DEVICE), 8))),
    "silu": lambda: _backward(kernel_ladder.silu(_r(4, 8))),
    "softmax": lambda: _backward(kernel_ladder.softmax(_r(4, 8))),
    "swiglu": lambda: (_backward(kernel_ladder.swiglu(_r(4, 8), _r(4, 8))),
                       _backward(kernel_ladder.swiglu(_r(4, 8), _r(4, 8), in_place_backward=True))),
    "topk_routing": _case_topk_routing,
    "write_kv_cache": _case_write_kv_cache,
    "write_latent_cache": _case_write_latent_cache,
}


def _forward_ops() -> set[str]:
    # the public ops (no backward ops, no private ops other tests define under kernel_ladder::)
    return set(_autocast.public_ops())


def test_every_op_has_a_no_sync_case():
    """A new op without a case here fails: every op must be shown not to sync."""
    missing = sorted(_forward_ops() - set(CASES))
    assert not missing, f"ops without a no-host-sync case in tests/test_no_host_sync.py: {missing}"
    assert not set(CASES) - _forward_ops(), "cases for ops that no longer exist"


@pytest.mark.parametrize("op", sorted(CASES))
def test_op_makes_no_host_sync(op):
    case = CASES[op]
    syncs = run_without_syncs(case.make() if isinstance(case, _Prepared) else case)
    assert not syncs, f"kernel_ladder.{op} synchronized with the host: {syncs}"


def test_the_decoder_block_training_step_makes_no_host_sync():
    from utils.transformer import BlockConfig, TinyDecoder, block_training_step

    model = TinyDecoder(BlockConfig(n_kv_heads=1), torch.Generator().manual_seed(0), device=DEVICE)
    tokens = torch.randint(0, 64, (1, 8), generator=_gen).to(DEVICE)
    targets = torch.randint(0, 64, (1, 8), generator=_gen).to(DEVICE)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    syncs = run_without_syncs(lambda: block_training_step(model, tokens, targets, optimizer))
    assert not syncs, str(syncs)


# ----------------------------------------------------------------------------------------------
# Negative controls: the checker catches syncing code
# ----------------------------------------------------------------------------------------------


def _define_syncing_op(name: str, read: Callable[[torch.Tensor], object]):
    """A throwaway op in the kernels package's namespace whose launch path reads a value on the host."""
    lib = torch.library.Library("kernels_sync_control", "FRAGMENT")  # noqa: TOR901
    lib.define(f"{name}(Tensor x) -> Tensor")
    # The implementation is compiled as if it lived in kernels/kernel_ladder/ops (that is what the checker looks for).
    source = "def impl(x):\n    read(x)\n    return x.clone()\n"
    namespace = {"read": read}
    exec(compile(source, os.path.join(_KERNELS_DIR, "ops", "sync_control.py"), "exec"), namespace)  # noqa: S102
    # Composite: it decomposes before the trace's dispatch mode, which so sees the aten ops it runs.
    lib.impl(name, namespace["impl"], "CompositeImplicitAutograd")
    return lib, getattr(torch.ops.kernels_sync_control, name)


@pytest.mark.parametrize("read", [
    lambda x: x.sum().item(),
    lambda x: x.tolist(),
    lambda x: bool((x > 0).any()),
    lambda x: int(x.argmax()),
    lambda x: float(x.max()),
    lambda x: range(x.shape[0])[x.argmin()],   # __index__
], ids=["item", "tolist", "bool", "int", "float", "index"])
def test_a_syncing_op_is_caught(read):
    lib, op = _define_syncing_op("control", read)
    try:
        syncs = run_without_syncs(lambda: op(_r(4, grad=False)))
    finally:
        lib._destroy()
    assert syncs.calls, "the patched Tensor methods missed a host read"
    assert any("_local_scalar_dense" in s for s in syncs.aten) or "tolist" in str(syncs), str(syncs)


def test_a_data_dependent_shape_is_caught():
    lib, op = _define_syncing_op("control", lambda x: torch.nonzero(x > 0))
    try:
        syncs = run_without_syncs(lambda: op(_r(4, grad=False)))
    finally:
        lib._destroy()
    assert any("nonzero" in s for s in syncs.aten), str(syncs)


def test_host_reads_inside_kernels_ops_are_caught():
    """Both instruments see inside a real ``kernel_ladder::`` op: its value checks, when on, read values."""
    cache = (_r(3, 8, 1, 16, grad=False), _r(3, 8, 1, 16, grad=False))
    syncs = HostSyncs()
    with runtime.check_values(True), syncs.watching(), pytest.raises(ValueError):
        kernel_ladder.write_kv_cache(_r(1, 1, 16, grad=False), _r(1, 1, 16, grad=False), *cache,
                                     _int([99], torch.int64))
    at = "Tensor.item at kernels/kernel_ladder/ops/write_kv_cache.py"
    assert any(call.startswith(at) for call in syncs.calls), str(syncs)
    assert "aten.nonzero.default inside kernel_ladder.write_kv_cache.default" in syncs.aten, str(syncs)
    assert any(s.startswith("aten._local_scalar_dense.default inside kernel_ladder.write_kv_cache") for s in syncs.aten)
    syncs = HostSyncs()
    with runtime.check_values(True), syncs.watching(), pytest.raises(ValueError):
        kernel_ladder.grouped_matmul(_r(6, 16, grad=False), _r(3, 16, 16, grad=False), _int([4, 2, 5]))
    at = "Tensor.tolist at kernels/kernel_ladder/ops/grouped_matmul.py"
    assert any(call.startswith(at) for call in syncs.calls), str(syncs)


def test_the_interpreters_own_copies_are_not_counted():
    """Triton's interpreter copies arguments to numpy: the emulation of a launch, not the op's."""
    syncs = run_without_syncs(lambda: kernel_ladder.gelu(_r(64, grad=False)))
    assert not syncs, str(syncs)


# ----------------------------------------------------------------------------------------------
# The value-check policy
# ----------------------------------------------------------------------------------------------


def test_value_checks_default_on_for_cpu_tensors_and_settable():
    cpu = torch.zeros(2, dtype=torch.int32)
    assert runtime.check_values.setting() is None
    assert runtime.values_checked(cpu)
    with runtime.check_values(False):
        assert not runtime.values_checked(cpu)
        with runtime.check_values(True):
            assert runtime.values_checked(cpu)
        assert runtime.check_values.setting() is False
    assert runtime.check_values.setting() is None
    fake = torch.empty(2, device="meta")
    with runtime.check_values(True):
        assert not runtime.values_checked(fake)  # no values to read
    with pytest.raises(TypeError, match=r"kernel_ladder\.runtime\.check_values: enabled must be True, False or None"):
        runtime.check_values("yes")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA default differs")
def test_value_checks_follow_the_environment():
    import subprocess

    code = ("import kernel_ladder, torch; from kernel_ladder import runtime; "
            "print(runtime.check_values.setting(), runtime.values_checked(torch.zeros(1)))")
    env = {**os.environ, runtime.CHECK_VALUES_ENV: "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
    env[runtime.CHECK_VALUES_ENV] = "maybe"
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "KERNELS_CHECK_VALUES must be 1, 0 or auto" in bad.stderr


#: (what, a call with one bad value) for every data-dependent value check.
BAD_VALUES = {
    "cross_entropy targets": (lambda: kernel_ladder.cross_entropy(_r(2, 5, grad=False), _int([1, 5], torch.int64)),
                              r"kernel_ladder\.cross_entropy: target must hold class indices in \[0, 5\)"),
    "flce targets": (lambda: kernel_ladder.fused_linear_cross_entropy(_r(2, 8, grad=False), _r(5, 8, grad=False),
                                                                      _int([-3, 1], torch.int64)),
                     r"kernel_ladder\.cross_entropy: target must hold class indices in \[0, 5\)"),
    "grouped_matmul offsets": (lambda: kernel_ladder.grouped_matmul(_r(6, 16, grad=False), _r(2, 16, 16, grad=False),
                                                                    _int([4, 2])),
                               r"kernel_ladder\.grouped_matmul: offsets must be non-negative, non-decreasing"),
    "moe_permute expert ids": (lambda: kernel_ladder.moe_permute(_int([[0, 4]]), 4),
                               r"kernel_ladder\.moe_permute: expert_ids must be in \[0, num_experts\) = \[0, 4\); "
                               r"got ids from 0 to 4"),
    "paged seq_lens": (lambda: kernel_ladder.paged_attention(_r(1, 2, 16, grad=False), _r(4, 8, 1, 16, grad=False),
                                                             _r(4, 8, 1, 16, grad=False), _int([[0, 1]]), _int([17])),
                       r"kernel_ladder\.paged_attention: seq_lens must be in \[0, max_blocks \* block_size\]"),
    "paged block tables": (lambda: kernel_ladder.paged_attention(_r(1, 2, 16, grad=False),
                                                                 _r(4, 8, 1, 16, grad=False),
                                                                 _r(4, 8, 1, 16, grad=False), _int([[0, 4]]),
                                                                 _int([9])),
                           r"kernel_ladder\.paged_attention: every block_tables entry a sequence uses .* in \[0, "
                           r"num_blocks = 4\); got block_tables\[0, 1\] = 4 \(sequence 0 has seq_len 9\)"),
    "write_kv_cache slots": (lambda: kernel_ladder.write_kv_cache(_r(2, 1, 16, grad=False), _r(2, 1, 16, grad=False),
                                                                  _r(3, 8, 1, 16, grad=False),
                                                                  _r(3, 8, 1, 16, grad=False),
                                                                  _int([0, 24], torch.int64)),
                             r"kernel_ladder\.write_kv_cache: slot_mapping must hold slots below num_blocks \* "
                             r"block_size = 24 \(or a negative slot for padding\); got slot_mapping\[1\] = 24"),
    "moe_gather permutation": (lambda: kernel_ladder.moe_gather(_r(2, 16, grad=False), _int([0, 1, 2, 9]), 2),
                               r"kernel_ladder\.moe_gather: permutation must be a permutation of \[0, T \* k\) = "
                               r"\[0, 4\) \(each entry once\); got permutation\[3\] = 9"),
    "moe_combine permutation": (lambda: kernel_ladder.moe_combine(_r(4, 16, grad=False), _int([0, 0, 2, 3]),
                                                                  _r(2, 2, grad=False)),
                                r"kernel_ladder\.moe_combine: permutation must be a permutation .* got entry 0 at "
                                r"positions 0 and 1"),
    "varlen cu_seqlens": (lambda: kernel_ladder.flash_attention_varlen(_r(5, 1, 16, grad=False),
                                                                       _r(5, 1, 16, grad=False),
                                                                       _r(5, 1, 16, grad=False), _int([0, 3, 4]),
                                                                       _int([0, 3, 5]), 4, 4),
                          r"kernel_ladder\.flash_attention_varlen: cu_seqlens_q must start at 0"),
}


#: Every kernel stays inside its tensors on a bad value (it clamps or masks it), so each call can be
#: made with the checks off (the CUDA default): no host check, no error, no access out of bounds
#: (the op's own tests trace that).
SAFE_UNCHECKED = set(BAD_VALUES)


@pytest.mark.parametrize("what", sorted(BAD_VALUES))
def test_each_value_check_raises_by_default_on_the_cpu_and_is_skipped_when_off(what):
    call, message = BAD_VALUES[what]
    if DEVICE.type == "cpu":
        with pytest.raises(ValueError, match=message):
            call()
        if what in SAFE_UNCHECKED:
            with runtime.check_values(False):  # the CUDA default: no host check, and no error
                call()
    with runtime.check_values(True):  # asked for: the host check on any device
        with pytest.raises(ValueError, match=message):
            call()


def test_device_assertion_message_says_how_to_turn_the_checks_on():
    assert "kernel_ladder.runtime.check_values(True)" in runtime.CHECK_VALUES_HINT
    assert runtime.CHECK_VALUES_ENV + "=1" in runtime.CHECK_VALUES_HINT


# ----------------------------------------------------------------------------------------------
# On a GPU: a training step of the block in a CUDA graph, and reduce-overhead compilation
# ----------------------------------------------------------------------------------------------


def _gpu_model_and_batch():
    from utils.transformer import BlockConfig, TinyDecoder

    gen = torch.Generator().manual_seed(1)
    config = BlockConfig(hidden=64, n_heads=4, n_kv_heads=2, ffn=128, vocab=128)
    model = TinyDecoder(config, gen, device="cuda")
    tokens = torch.randint(0, config.vocab, (2, 32), generator=gen).cuda()
    targets = torch.randint(0, config.vocab, (2, 32), generator=gen).cuda()
    return model, tokens, targets


@pytest.mark.gpu
def test_gpu_training_step_captured_in_a_cuda_graph_matches_eager():
    import copy

    from utils.transformer import block_training_step

    model, tokens, targets = _gpu_model_and_batch()
    # The embedding is torch's (its backward is not this package's to vouch for): frozen, so the captured
    # step differentiates kernels ops only.
    model.embed.requires_grad_(False)
    eager = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    eager_optimizer = torch.optim.SGD(eager.parameters(), lr=0.05)
    static_tokens, static_targets = tokens.clone(), targets.clone()

    # Warm up on a side stream (autotuning, Triton compilation, allocator pools), as CUDA graphs need.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            optimizer.zero_grad(set_to_none=True)
            block_training_step(model, static_tokens, static_targets, optimizer)
    torch.cuda.current_stream().wait_stream(side)
    eager.load_state_dict(model.state_dict())  # the same weights after the warm-up steps

    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = block_training_step(model, static_tokens, static_targets, optimizer)

    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        new_tokens = torch.randint(0, model.config.vocab, tokens.shape, generator=gen).cuda()
        new_targets = torch.randint(0, model.config.vocab, targets.shape, generator=gen).cuda()
        static_tokens.copy_(new_tokens)
        static_targets.copy_(new_targets)
        graph.replay()
        eager_optimizer.zero_grad(set_to_none=True)
        want = block_training_step(eager, new_tokens, new_targets, eager_optimizer)
        torch.cuda.synchronize()
        torch.testing.assert_close(static_loss, want, rtol=1e-4, atol=1e-5)
        for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.gpu
def test_gpu_reduce_overhead_compile_of_the_block_forward_matches_eager():
    from torch._dynamo.utils import counters

    model, tokens, targets = _gpu_model_and_batch()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model.hidden_states, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        want = model.hidden_states(tokens)
        for _ in range(3):  # the first call warms up, the second records the CUDA graph, the third replays it
            got = compiled(tokens).clone()  # replays overwrite the graph's outputs
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # Inductor says why it falls back to no CUDA graph (a host sync, a CPU tensor, ...): it must not.
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
