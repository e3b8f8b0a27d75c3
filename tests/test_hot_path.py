"""The launch path's caches (launch configs, broadcast shapes) and the wrappers' short checks.

The caches are keyed on every input of the choice they cache, so a changed limit or a value of
another type is never answered from them; the wrappers that skip their full check still give
the op's clear error for a bad argument.
"""

from __future__ import annotations

import pytest
import torch

import kernel_ladder
from kernel_ladder import _validate
from kernel_ladder.ops import norm as _norm
from kernel_ladder.ops import softmax as _sm

DEVICE = kernel_ladder.runtime.DEVICE


def test_softmax_config_cache_does_not_answer_a_bool_with_a_cached_int():
    assert _sm.softmax_launch_config(1, torch.float32).block_cols == 1
    with pytest.raises(ValueError, match="kernel_ladder.softmax_launch_config: n_cols"):
        _sm.softmax_launch_config(True, torch.float32)  # True == 1 and hashes alike


def test_softmax_config_cache_follows_a_changed_limit(monkeypatch):
    assert not _sm.softmax_launch_config(4096, torch.float32).chunked
    monkeypatch.setattr(_sm, "MAX_BLOCK", 256)
    assert _sm.softmax_launch_config(4096, torch.float32).chunked


def test_softmax_config_bad_dtype_is_still_refused():
    with pytest.raises(TypeError, match="kernel_ladder.softmax_launch_config: dtype"):
        _sm.softmax_launch_config(64, torch.int32)
    with pytest.raises(TypeError, match="kernel_ladder.softmax_launch_config: dtype"):
        _sm.softmax_launch_config(64, [torch.float32])  # unhashable: the uncached path, same error


def test_norm_config_cache_follows_limits_and_sm_count(monkeypatch):
    base = _norm.norm_launch_config(64, 1024)
    assert not base.chunked
    monkeypatch.setattr(_norm, "MAX_FUSED_BLOCK", 256)
    monkeypatch.setattr(_norm, "CHUNK_BLOCK", 128)
    chunked = _norm.norm_launch_config(64, 1024)
    assert chunked.chunked and chunked.block_cols == 128
    monkeypatch.undo()
    assert _norm.norm_launch_config(64, 1024) == base
    monkeypatch.setattr(_norm._launch, "num_sms", lambda device=None: 1)
    one_sm = _norm.norm_launch_config(4096, 64, backward=True)
    monkeypatch.setattr(_norm._launch, "num_sms", lambda device=None: 132)
    many = _norm.norm_launch_config(4096, 64, backward=True)
    assert one_sm.rows_per_program > many.rows_per_program


def test_broadcast_cache_gives_torchs_shape_and_still_refuses():
    a, b = torch.empty(3, 1, 5), torch.empty(4, 1)
    assert _validate.check_broadcastable("op", "a", a, "b", b) == torch.Size([3, 4, 5])
    assert _validate.check_broadcastable("op", "a", a, "b", a) == torch.Size([3, 1, 5])
    for _ in range(2):  # an error is never cached as a result
        with pytest.raises(ValueError, match="op: a and b must have broadcastable shapes"):
            _validate.check_broadcastable("op", "a", a, "b", torch.empty(4, 3))


@pytest.mark.parametrize("call, message", [
    (lambda x, w: kernel_ladder.rms_norm(x.tolist(), w), "kernel_ladder.rms_norm: x must be a torch.Tensor"),
    (lambda x, w: kernel_ladder.rms_norm(x, w, eps="1e-6"), "kernel_ladder.rms_norm: eps"),
    (lambda x, w: kernel_ladder.rms_norm(x, w, casting=1), "kernel_ladder.rms_norm: casting"),
    (lambda x, w: kernel_ladder.rms_norm(x, w, eps=-1.0), "kernel_ladder.rms_norm: eps"),  # a value: the op's check
    (lambda x, w: kernel_ladder.add(x, [1.0]), "kernel_ladder.add: y must be a torch.Tensor"),
    (lambda x, w: kernel_ladder.add(x, torch.ones(3)), "kernel_ladder.add: x and y must have broadcastable shapes"),
    (lambda x, w: kernel_ladder.add_rms_norm(x, x, w, eps=None), "kernel_ladder.add_rms_norm: eps"),
    (lambda x, w: kernel_ladder.add_rms_norm(x, x[:, :3], w), "kernel_ladder.add_rms_norm: "),
])
def test_a_bad_argument_still_gets_the_op_and_argument_named(gen, call, message):
    x, w = torch.randn(4, 8, generator=gen).to(DEVICE), torch.randn(8, generator=gen).to(DEVICE)
    with pytest.raises((TypeError, ValueError), match=message):
        call(x, w)


def test_schema_types_accepts_plain_values_and_refuses_the_rest():
    t = torch.empty(1)
    assert _validate.schema_types(tensors=(t,), optional_tensors=(None, t), reals=(1, 2.0), optional_reals=(None,),
                                  ints=(3,), optional_ints=(None, 4), flags=(True,), strings=("s",))
    for bad in [dict(tensors=([1.0],)), dict(optional_tensors=(1,)), dict(reals=(True,)), dict(reals=("1",)),
                dict(optional_reals=(torch.tensor(1.0),)), dict(ints=(1.0,)), dict(ints=(False,)),
                dict(optional_ints=("4",)), dict(flags=(1,)), dict(strings=(None,))]:
        assert not _validate.schema_types(**bad), bad


@pytest.mark.parametrize("call, message", [
    (lambda t: kernel_ladder.flash_attention(t.tolist(), t, t),
     "kernel_ladder.flash_attention: q must be a torch.Tensor"),
    (lambda t: kernel_ladder.flash_attention(t[0, 0, 0, 0], t, t), "kernel_ladder.flash_attention: q"),
    # 0-d: not q.shape[-1]
    (lambda t: kernel_ladder.flash_attention(t, t, t, causal=1), "kernel_ladder.flash_attention: causal"),
    (lambda t: kernel_ladder.flash_attention(t, t, t, window="8"), "kernel_ladder.flash_attention: window"),
    (lambda t: kernel_ladder.flash_attention(t, t, t, softmax_scale=-1.0),
     "kernel_ladder.flash_attention: softmax_scale"),
    (lambda t: kernel_ladder.cross_entropy(t[0, 0], torch.zeros(4, dtype=torch.long), reduction=None),
     "kernel_ladder.cross_entropy: reduction"),
    (lambda t: kernel_ladder.linear(t[0, 0], t[0, 0], bias=[0.0]), "kernel_ladder.linear: bias must be a torch.Tensor"),
    (lambda t: kernel_ladder.rope(t, t, t[0, 0], t[0, 0], unsqueeze_dim=1.0), "kernel_ladder.rope: unsqueeze_dim"),
    (lambda t: kernel_ladder.topk_routing(t[0, 0], k="2"), "kernel_ladder.topk_routing: k"),
    (lambda t: kernel_ladder.moe_permute(torch.zeros(4, 2, dtype=torch.long), num_experts=4.0),
     "kernel_ladder.moe_permute: num_experts"),
    (lambda t: kernel_ladder.grouped_matmul(t[0, 0], t[0], [4]),
     "kernel_ladder.grouped_matmul: offsets must be a torch.Tensor"),
])
def test_a_guarded_wrapper_still_names_the_op_and_argument(gen, call, message):
    t = torch.randn(1, 2, 4, 8, generator=gen).to(DEVICE)
    with pytest.raises((TypeError, ValueError), match=message):
        call(t)


def test_shape_cache_is_typed_and_runs_unhashable_arguments_uncached():
    from kernel_ladder._launch import shape_cache

    calls = []

    @shape_cache
    def width(n, sizes=()):
        calls.append(n)
        return n * 2 + len(sizes)

    assert width(3) == 6 and width(3) == 6 and calls == [3]  # the second call came from the cache
    assert width(3.0) == 6.0 and calls == [3, 3.0]  # a float is not answered with the int's entry
    assert width(2, [1, 2]) == 6 and width(2, [1, 2]) == 6 and calls == [3, 3.0, 2, 2]  # a list: uncached
    assert width.cache_info().currsize == 2
