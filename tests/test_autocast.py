"""Autocast: under ``torch.autocast`` every ``kernel_ladder`` op returns the dtype torch's matching op
returns there, with values close to torch's on the same cast inputs (``kernels/kernel_ladder/_autocast.py``).

Each case builds tiny inputs whose dtypes exercise the op's policy (fp32 inputs for the
matmul-bound ops, 16-bit ones for those autocast runs in float32, mixed ones for the elementwise
ops that promote) and returns the kernels call and its torch counterpart; both run under the same
autocast. Ops that are not float compute (int indices, quantization, the cache write) are checked
to come out exactly as without autocast. The negative control removes the registration and shows
that every op whose CPU policy casts then fails its case.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import kernel_ladder
from kernel_ladder import _autocast
from kernel_ladder.ops import mla
from tests.helpers import paged_attention_reference, tolerance
from utils.trace import trace

F32 = torch.float32


def _randn(gen, *shape, dtype=F32, device="cpu", scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(device)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _moe_setup(gen, device, tokens=4, experts=2, top_k=2):
    logits = _randn(gen, tokens, experts)
    expert_ids = torch.topk(logits, top_k, dim=-1).indices.to(device)
    permutation, offsets = kernel_ladder.moe_permute(expert_ids, experts)
    return expert_ids, permutation, offsets


def _grouped_reference(x, w, offsets):
    """Each expert's rows times its (K, N) weight, in torch (autocast casts each matmul)."""
    outs, start = [], 0
    for e, end in enumerate(offsets.tolist()):
        outs.append(torch.matmul(x[start:end], w[e]))
        start = end
    return torch.cat(outs)


def cases(gen, device, low):
    """op name -> a thunk building (kernel_ladder call, torch counterpart, exact): each call a thunk run
    under autocast. ``exact``: the result must equal the torch side bit for bit (non-float ops whose
    'torch side' is the kernel_ladder op run without autocast)."""
    d = torch.device(device)

    def r(*shape, dtype=F32, scale=1.0):
        return _randn(gen, *shape, dtype=dtype, device=d, scale=scale)

    def linear():
        x, w, b = r(3, 16, dtype=low), r(8, 16), r(8)
        return lambda: kernel_ladder.linear(x, w, b), lambda: F.linear(x, w, b)

    def matmul():
        a, b = r(5, 16), r(16, 8, dtype=low)
        return lambda: kernel_ladder.matmul(a, b), lambda: torch.matmul(a, b)

    def gated_mlp():
        x, wg, wu, wd = r(3, 16), r(24, 16), r(24, 16), r(16, 24)
        return (lambda: kernel_ladder.gated_mlp(x, wg, wu, wd),
                lambda: F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd))

    def grouped_matmul():
        x, w = r(6, 16), r(2, 16, 8)
        offsets = torch.tensor([2, 6], dtype=torch.int32, device=d)
        return lambda: kernel_ladder.grouped_matmul(x, w, offsets), lambda: _grouped_reference(x, w, offsets)

    def moe_gate_up():
        _, permutation, offsets = _moe_setup(gen, d)
        x, w = r(4, 16), r(2, 16, 16)  # (E, 2F, H): gate rows, then up rows

        def reference():
            rows = x[(permutation // 2).long()]
            wt = w.transpose(1, 2)
            gate = _grouped_reference(rows, wt[:, :, :8], offsets)
            up = _grouped_reference(rows, wt[:, :, 8:], offsets)
            return F.silu(gate) * up

        return lambda: torch.ops.kernel_ladder.moe_gate_up(x, w, offsets, permutation, 2), reference

    def fused_linear_cross_entropy():
        x, w = r(4, 16), r(10, 16)
        target = torch.randint(0, 10, (4,), generator=gen).to(d)
        return (lambda: kernel_ladder.fused_linear_cross_entropy(x, w, target),
                lambda: F.cross_entropy(F.linear(x, w), target))

    def quantized_linear():
        w = r(8, 16)
        qweight = kernel_ladder.quantize_weight(w, "int8")
        x, b = r(3, 16), r(8)
        return (lambda: kernel_ladder.quantized_linear(x, qweight, b),
                lambda: F.linear(x, qweight.dequantize(F32), b))

    def flash_attention():
        q, k, v = r(1, 2, 8, 16), r(1, 2, 8, 16), r(1, 2, 8, 16, dtype=low)
        return (lambda: kernel_ladder.flash_attention(q, k, v, causal=True),
                lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))

    def flash_attention_varlen():
        q, k, v = r(8, 2, 16), r(8, 2, 16), r(8, 2, 16)
        cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=d)

        def reference():
            outs = [F.scaled_dot_product_attention(*(t[s:e].transpose(0, 1) for t in (q, k, v))).transpose(0, 1)
                    for s, e in ((0, 3), (3, 8))]
            return torch.cat(outs)

        return lambda: kernel_ladder.flash_attention_varlen(q, k, v, cu, cu, 5, 5), reference

    def block_sparse_attention():
        q, k, v = r(1, 1, 32, 16), r(1, 1, 32, 16), r(1, 1, 32, 16)
        mask = torch.tensor([[True, False], [True, True]], device=d).view(1, 1, 2, 2)
        dense = mask.repeat_interleave(16, dim=2).repeat_interleave(16, dim=3)
        return (lambda: kernel_ladder.block_sparse_attention(q, k, v, mask, block_size=16),
                lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense))

    def paged_attention():
        q = r(2, 2, 16)
        k_cache, v_cache = r(4, 8, 1, 16), r(4, 8, 1, 16)
        tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=d)
        lens = torch.tensor([5, 12], dtype=torch.int32, device=d)

        def reference():
            # torch's SDPA gives the autocast dtype; its value is the float64 reference on the cast inputs
            dtype = F.scaled_dot_product_attention(q[:, :, None], q[:, :, None], q[:, :, None]).dtype
            cast = [t.to(dtype) for t in (q, k_cache, v_cache)]
            return paged_attention_reference(cast[0], cast[1], cast[2], tables.cpu(), lens.cpu()).to(dtype)

        return lambda: kernel_ladder.paged_attention(q, k_cache, v_cache, tables, lens), reference

    def mla_attention():
        q_latent, q_rope, cache = r(2, 3, 16), r(2, 3, 8), r(4, 8, 24, dtype=low)
        tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=d)
        lens = torch.tensor([5, 12], dtype=torch.int32, device=d)

        def reference():  # SDPA's dtype; the float64 value of the attention over the cast inputs
            dtype = F.scaled_dot_product_attention(q_latent[:, :, None], q_latent[:, :, None],
                                                   q_latent[:, :, None]).dtype
            out = []
            for b, latent in enumerate(mla.gather_latent(cache.to(dtype).double(), tables, lens)):
                ql, qr = q_latent[b].to(dtype).double(), q_rope[b].to(dtype).double()
                p = torch.softmax(0.2 * (ql @ latent[:, :16].T + qr @ latent[:, 16:].T), -1)
                out.append(p @ latent[:, :16])
            return torch.stack(out).to(dtype)

        return lambda: kernel_ladder.mla_attention(q_latent, q_rope, cache, tables, lens, 0.2, 16), reference

    def softmax():
        x = r(4, 10, dtype=low, scale=3.0)
        return lambda: kernel_ladder.softmax(x, -1), lambda: F.softmax(x, -1)

    def log_softmax():
        x = r(4, 10, dtype=low, scale=3.0)
        return lambda: kernel_ladder.log_softmax(x, -1), lambda: F.log_softmax(x, -1)

    def cross_entropy():
        x = r(4, 10, dtype=low, scale=3.0)
        target = torch.randint(0, 10, (4,), generator=gen).to(d)
        return lambda: kernel_ladder.cross_entropy(x, target), lambda: F.cross_entropy(x, target)

    def layer_norm():
        x, w, b = r(3, 16, dtype=low), r(16, dtype=low), r(16, dtype=low)
        return lambda: kernel_ladder.layer_norm(x, 16, w, b), lambda: F.layer_norm(x, (16,), w, b)

    def rms_norm():
        x, w = r(3, 16, dtype=low), r(16, dtype=low)
        return lambda: kernel_ladder.rms_norm(x, w), lambda: F.rms_norm(x, (16,), w, 1e-6)

    def add_rms_norm():
        x, residual, w = r(3, 16, dtype=low), r(3, 16), r(16)

        def reference():
            s = x + residual
            return F.rms_norm(s, (16,), w, 1e-6), s

        return lambda: kernel_ladder.add_rms_norm(x, residual, w), reference

    def topk_routing():
        # distinct logits in every row (a tie in bf16 may be broken either way: torch.topk does not say which)
        ranks = torch.stack([torch.randperm(8, generator=gen) for _ in range(4)])
        logits = (ranks.to(F32) * 0.5 - 2.0 + r(4, 8, scale=0.01)).to(device=d, dtype=low)

        def reference():  # Mixtral's routing: the softmax in float32, then top-k
            weights, ids = torch.topk(F.softmax(logits, dim=-1, dtype=torch.float), 2, dim=-1)
            return weights / weights.sum(-1, keepdim=True), ids

        return lambda: kernel_ladder.topk_routing(logits, 2), reference

    def add():
        x, y = r(3, 16, dtype=low), r(3, 16)
        return lambda: kernel_ladder.add(x, y), lambda: torch.add(x, y)

    def swiglu():
        gate, up = r(3, 16, dtype=low), r(3, 16)
        return lambda: kernel_ladder.swiglu(gate, up), lambda: F.silu(gate) * up

    def geglu():
        gate, up = r(3, 16), r(3, 16, dtype=low)
        return lambda: kernel_ladder.geglu(gate, up), lambda: F.gelu(gate) * up

    def gelu():
        x = r(3, 16, dtype=low)
        return lambda: kernel_ladder.gelu(x), lambda: F.gelu(x)

    def silu():
        x = r(3, 16)
        return lambda: kernel_ladder.silu(x), lambda: F.silu(x)

    def dropout():
        x = r(3, 16, dtype=low)
        return lambda: kernel_ladder.dropout(x, 0.0), lambda: F.dropout(x, 0.0)

    def rope():
        q, k = r(1, 2, 4, 16, dtype=low), r(1, 1, 4, 16, dtype=low)
        cos, sin = kernel_ladder.rope_cos_sin(torch.arange(4, device=d), 16)

        def reference():
            c, s = cos[None, None], sin[None, None]
            return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s

        return lambda: kernel_ladder.rope(q, k, cos, sin), reference

    def moe_gather():
        _, permutation, _ = _moe_setup(gen, d)
        x = r(4, 16, dtype=low)
        return lambda: kernel_ladder.moe_gather(x, permutation, 2), lambda: x[(permutation // 2).long()]

    def moe_combine():
        _, permutation, _ = _moe_setup(gen, d)
        y, weights = r(8, 16, dtype=low), r(4, 2)

        def reference():
            entries = torch.empty_like(y)
            entries[permutation.long()] = y
            return (entries.view(4, 2, 16) * weights[..., None]).sum(1)

        return lambda: kernel_ladder.moe_combine(y, permutation, weights), reference

    # not float compute: exactly what the op gives without autocast
    def dropout_mask():
        return (lambda: kernel_ladder.dropout_mask((4, 16), 0.5, seed=3, device=d),
                _outside(lambda: kernel_ladder.dropout_mask((4, 16), 0.5, seed=3, device=d), d.type), True)

    def moe_permute():
        expert_ids = torch.randint(0, 3, (4, 2), generator=gen).to(d)
        run = lambda: kernel_ladder.moe_permute(expert_ids, 3)  # noqa: E731
        return run, _outside(run, d.type), True

    def quantize_rows():
        x = r(3, 16)
        run = lambda: kernel_ladder.quantize_activations(x)  # noqa: E731
        return run, _outside(run, d.type), True

    def quantize_int4():
        w = r(8, 32)
        def run():
            qweight = kernel_ladder.quantize_weight(w, "int4", group_size=32)
            return qweight.data, qweight.scales

        return run, _outside(run, d.type), True

    def write_kv_cache():
        k, v = r(3, 1, 16), r(3, 1, 16)
        slots = torch.tensor([0, 5, 9], dtype=torch.int32, device=d)

        def run(write):
            caches = [torch.zeros(2, 8, 1, 16, dtype=low, device=d) for _ in range(2)]
            write(caches)
            return tuple(caches)

        def with_kernels():
            return run(lambda c: kernel_ladder.write_kv_cache(k, v, c[0], c[1], slots))

        def with_torch():  # the cache's dtype decides: a store converts k and v to it
            def write(c):
                for src, cache in zip((k, v), c):
                    cache.view(-1, 1, 16).index_copy_(0, slots.long(), src.to(cache.dtype))
            return run(write)

        return with_kernels, with_torch

    def write_latent_cache():
        c_kv, k_rope = r(3, 16), r(3, 8)
        slots = torch.tensor([0, 5, 9], dtype=torch.int32, device=d)

        def with_kernels():
            cache = torch.zeros(2, 8, 24, dtype=low, device=d)
            kernel_ladder.write_latent_cache(c_kv, k_rope, cache, slots)
            return cache

        def with_torch():  # the cache's dtype decides: a store converts the rows to it
            cache = torch.zeros(2, 8, 24, dtype=low, device=d)
            cache.view(-1, 24).index_copy_(0, slots.long(), torch.cat([c_kv, k_rope], 1).to(low))
            return cache

        return with_kernels, with_torch

    built = dict(locals())
    return {name: built[name] for name in _autocast.TABLE}


def _outside(thunk, device_type="cpu"):
    """``thunk`` run with autocast off (what a non-float op must give under autocast too)."""

    def run():
        with torch.autocast(device_type, enabled=False):
            return thunk()

    return run


def _as_tuple(value):
    return (value,) if isinstance(value, torch.Tensor) else tuple(value)


def check_case(name, build, device_type, dtype):
    """Run one case under ``torch.autocast(device_type, dtype)``: dtypes equal, values close (or exact)."""
    made = build()
    ours_fn, theirs_fn = made[0], made[1]
    exact = len(made) > 2 and made[2]
    with torch.autocast(device_type, dtype=dtype):
        ours, theirs = _as_tuple(ours_fn()), _as_tuple(theirs_fn())
    assert len(ours) >= len(theirs), f"{name}: {len(ours)} results, torch gives {len(theirs)}"
    for i, (got, want) in enumerate(zip(ours, theirs)):
        assert got.dtype == want.dtype, f"kernel_ladder.{name} result {i}: dtype {got.dtype}, torch gives {want.dtype}"
        assert got.shape == want.shape, (f"kernel_ladder.{name} result {i}: "
                                         f"shape {tuple(got.shape)} vs {tuple(want.shape)}")
        if exact or not got.is_floating_point():
            assert torch.equal(got.cpu(), want.cpu()), f"kernel_ladder.{name} result {i}: not equal to torch's"
        else:
            # torch's result holds roundings to the autocast dtype (intermediates of a composition),
            # so both are compared at that precision, atol on the result's scale
            rtol, atol = tolerance(dtype, slack=4)
            atol *= max(1.0, want.detach().abs().max().item()) if want.numel() else 1.0
            torch.testing.assert_close(got.double().cpu(), want.double().cpu(), rtol=rtol, atol=atol,
                                       msg=lambda m, i=i: f"kernel_ladder.{name} result {i}: {m}")


CPU_OPS = sorted(_autocast.TABLE)


def test_every_op_has_a_policy():
    ops = _autocast.public_ops()
    assert len(ops) >= 30
    assert sorted(set(ops) - set(_autocast.TABLE)) == [], "ops without an autocast policy"
    assert sorted(set(_autocast.TABLE) - set(ops)) == [], "policies for ops that do not exist"
    assert all(p.on(dev) in _autocast.POLICIES for p in _autocast.TABLE.values() for dev in _autocast.DEVICE_TYPES)


def test_a_new_op_without_policy_is_refused(monkeypatch):
    # negative control of the registration's own check
    monkeypatch.setattr(_autocast, "public_ops", lambda: [*_autocast.TABLE, "brand_new_op"])
    monkeypatch.setattr(_autocast, "_LIB", None)
    with pytest.raises(RuntimeError, match="brand_new_op"):
        _autocast.register()


@torch.library.custom_op("kernel_ladder::_autocast_test_private", mutates_args=())
def _private_op(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


def test_private_ops_in_the_namespace_need_no_policy():
    # Helpers and ops other tests define under kernel_ladder:: start with an underscore: they are not
    # public ops, and registering again (as _deregistered does) must not refuse because of them.
    assert hasattr(torch.ops.kernel_ladder, "_autocast_test_private")
    assert "_autocast_test_private" not in _autocast.public_ops()
    with _deregistered():
        pass


def test_table_lists_and_registrations_match():
    rows = _autocast.table()
    assert [r["op"] for r in rows] == CPU_OPS and all(r["why"] for r in rows)
    assert "linear" in _autocast.describe()
    expected = {(n, dev) for n, p in _autocast.TABLE.items() for dev in _autocast.DEVICE_TYPES if p.on(dev) != "none"}
    assert set(_autocast.registered()) == expected
    for name, dev in expected:
        key = "AutocastCPU" if dev == "cpu" else "AutocastCUDA"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"kernel_ladder::{name}", key), (name, key)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16_cache", "fp8_cache"])
@pytest.mark.parametrize("packed", [False, True], ids=["decode", "packed"])
def test_paged_attention_takes_an_fp32_query_over_a_low_precision_cache(cache_dtype, packed, gen):
    """A model running in fp32 under autocast(bf16) queries a bf16 (or fp8) cache: like SDPA and flash_attention,
    paged_attention casts q to the autocast dtype instead of rejecting the mix, returns bf16, and equals the
    call on the cast query; the cache is used as it is (no copy of it). Without autocast the mix is an error."""
    q = _randn(gen, 5 if packed else 2, 4, 16)
    k_cache, v_cache = (_randn(gen, 4, 8, 2, 16, scale=0.5).to(cache_dtype) for _ in range(2))
    scales = (torch.tensor(1.5), torch.tensor(0.75)) if cache_dtype == torch.float8_e4m3fn else (None, None)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lens = torch.tensor([5, 12], dtype=torch.int32)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32) if packed else None

    def call(query):
        return kernel_ladder.paged_attention(query, k_cache, v_cache, tables, lens, cu_seqlens_q=cu,
                                             k_scale=scales[0], v_scale=scales[1])

    with torch.autocast("cpu", dtype=torch.bfloat16), trace() as tr:
        got = call(q)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sdpa = F.scaled_dot_product_attention(q[None], q[None], q[None])
    assert got.dtype == sdpa.dtype == torch.bfloat16
    assert [op.name for op in tr.torch_ops if "copy" in op.name] == ["aten._to_copy.default"]  # q's cast only
    assert torch.equal(got, call(q.to(torch.bfloat16)))
    if cache_dtype == torch.bfloat16:
        with pytest.raises(TypeError, match=r"kernel_ladder\.paged_attention: k_cache and v_cache must have q's dtype"):
            call(q)


def test_written_and_encoded_inputs_are_never_cast():
    assert {"k_cache", "v_cache"}.isdisjoint(_autocast._castable_args("write_kv_cache"))
    assert "scales" not in _autocast._castable_args("quantized_linear")
    assert {"k_scale", "v_scale"}.isdisjoint(_autocast._castable_args("paged_attention"))
    assert "latent_cache" not in _autocast._castable_args("write_latent_cache")


@pytest.mark.parametrize("name", CPU_OPS)
def test_cpu_autocast_matches_torch(name, gen):
    check_case(name, cases(gen, "cpu", torch.bfloat16)[name], "cpu", torch.bfloat16)


@contextlib.contextmanager
def _deregistered():
    """The autocast registration removed (and restored after)."""
    lib, done = _autocast._LIB, list(_autocast._REGISTERED)
    assert lib is not None
    lib._destroy()
    _autocast._LIB = None
    _autocast._REGISTERED.clear()
    try:
        yield
    finally:
        _autocast.register()
        assert sorted(_autocast.registered()) == sorted(done)


# Ops whose case comes out right without the registration too (add and geglu promote by themselves,
# moe_gather has one float input, fused_linear_cross_entropy's fp32 case gives an fp32 loss either way)
# are left out: the control is the rest, each of which must fail.
SAME_WITHOUT = {"add", "geglu", "moe_gather", "fused_linear_cross_entropy"}
CASTING_ON_CPU = [n for n in CPU_OPS if _autocast.TABLE[n].cpu != "none" and n not in SAME_WITHOUT]


@pytest.mark.parametrize("name", CASTING_ON_CPU)
def test_negative_control_without_registration_the_case_fails(name, gen):
    build = cases(gen, "cpu", torch.bfloat16)[name]
    with _deregistered():
        # a wrong dtype, or the op's own dtype check refusing the mixed inputs autocast no longer unifies
        with pytest.raises((AssertionError, TypeError)):
            check_case(name, build, "cpu", torch.bfloat16)
    check_case(name, cases(gen, "cpu", torch.bfloat16)[name], "cpu", torch.bfloat16)


def test_mixed_dtypes_still_rejected_without_autocast_and_in_backward():
    x, w = torch.randn(2, 16, dtype=torch.bfloat16), torch.randn(8, 16)
    with pytest.raises(TypeError, match=r"kernel_ladder\.linear: x and weight must have the same dtype"):
        kernel_ladder.linear(x, w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert kernel_ladder.linear(x, w).dtype == torch.bfloat16
        # a name that is not one of the op's cast inputs (a backward's grad_out) is never excused
        assert not _autocast.unifies("kernel_ladder.linear", ("grad_out", x), ("x", w))
        assert not _autocast.unifies("kernel_ladder.layer_norm", ("x", x), ("weight", w))  # CPU: run as given
        assert _autocast.unifies("kernel_ladder.linear", ("x", x), ("weight", w))


def test_gradients_come_back_in_each_inputs_dtype(gen):
    x = _randn(gen, 3, 16, dtype=torch.bfloat16).requires_grad_()
    w = _randn(gen, 8, 16).requires_grad_()
    logits16 = _randn(gen, 3, 10, dtype=torch.bfloat16).requires_grad_()
    target = torch.randint(0, 10, (3,), generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = kernel_ladder.linear(x, w)
        loss = kernel_ladder.cross_entropy(logits16, target) + y.float().square().mean()
        y_ref = F.linear(x, w)
        loss_ref = F.cross_entropy(logits16, target) + y_ref.float().square().mean()
    assert y.dtype == torch.bfloat16 and loss.dtype == F32
    grads = torch.autograd.grad(loss, (x, w, logits16))
    grads_ref = torch.autograd.grad(loss_ref, (x, w, logits16))
    for g, g_ref, t in zip(grads, grads_ref, (x, w, logits16)):
        assert g.dtype == t.dtype == g_ref.dtype
        rtol, atol = tolerance(torch.bfloat16, slack=4)
        torch.testing.assert_close(g.double(), g_ref.double(), rtol=rtol, atol=atol)


def test_compile_fullgraph_under_autocast(gen):
    x, w = _randn(gen, 3, 16), _randn(gen, 10, 16)
    target = torch.randint(0, 10, (3,), generator=gen)

    def step(x, w, target):
        logits = kernel_ladder.linear(x, w)
        return logits, kernel_ladder.cross_entropy(logits, target), kernel_ladder.softmax(logits, -1)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = compiled(x, w, target)
        want = step(x, w, target)
    assert [t.dtype for t in got] == [torch.bfloat16, F32, torch.bfloat16]
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", CPU_OPS)
def test_cuda_autocast_matches_torch(name, dtype, gen):
    check_case(name, cases(gen, "cuda", dtype)[name], "cuda", dtype)
