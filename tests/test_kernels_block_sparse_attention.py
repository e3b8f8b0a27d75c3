"""kernel_ladder.block_sparse_attention: values and gradients against a masked dense float64 reference (the
block mask expanded to elements), random masks of several densities, broadcast and per-head masks, GQA,
lengths that are not multiples of the block, empty rows, every dtype; the all-true mask against
kernel_ladder.flash_attention; traced FLOPs and K/V bytes proportional to the density; the mask builders;
custom-op plumbing, torch.compile and errors.

Every buffer the ops allocate is poisoned (NaN) first. Low-precision results are judged by
flash-attention's criterion: at most twice torch's own error in that dtype.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_matches

import kernel_ladder
from kernel_ladder.ops import block_sparse_attention as bsa
from utils.trace import trace

pytestmark = pytest.mark.usefixtures("poisoned")

DEVICE = kernel_ladder.runtime.DEVICE
LOW = (torch.float16, torch.bfloat16)


def rand(*shape, gen, dtype=torch.float32):
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).to(DEVICE)


def leaf(t):
    return t.detach().requires_grad_()


def random_mask(batch, heads, tq, tk, block, density, gen):
    nq, nk = -(-tq // block), -(-tk // block)
    return (torch.rand((batch, heads, nq, nk), generator=gen) < density).to(DEVICE)


def element_mask(block_mask, tq, tk, block):
    return block_mask.repeat_interleave(block, -2).repeat_interleave(block, -1)[..., :tq, :tk]


def reference(q, k, v, block_mask, block, softmax_scale=None, dtype=torch.float64):
    """Masked dense attention: scores, -inf outside the allowed blocks, softmax, P V; rows that see no key
    give 0 and lse -inf. A low ``dtype`` is torch's own low-precision result (softmax in float32)."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.float() if dtype != torch.float64 else s
    visible = element_mask(block_mask, q.shape[2], k.shape[2], block).expand(s.shape)
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    seen = visible.any(-1)
    p = torch.where(seen[..., None], torch.exp(s - torch.where(seen, lse, 0.0)[..., None]), 0.0)
    return p.to(dtype) @ v, lse


def reference_grads(q, k, v, grad_out, grad_lse, block_mask, block, dtype=torch.float64):
    q2, k2, v2 = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out, lse = reference(q2, k2, v2, block_mask, block, dtype=dtype)
    finite = torch.isfinite(lse)
    dq, dk, dv = torch.autograd.grad([out, torch.where(finite, lse, 0.0)], (q2, k2, v2),
                                     [grad_out.to(dtype), torch.where(finite, grad_lse.to(lse.dtype), 0.0)])
    return out.detach(), lse.detach(), dq, dk, dv


def check(q, k, v, block_mask, block, gen):
    q, k, v = leaf(q), leaf(k), leaf(v)
    out, lse = kernel_ladder.block_sparse_attention(q, k, v, block_mask, block_size=block, return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    g, gl = rand(*out.shape, gen=gen, dtype=q.dtype), rand(*lse.shape, gen=gen)
    got = [out, lse, *torch.autograd.grad([out, lse], (q, k, v), [g, gl])]
    want = reference_grads(q, k, v, g, gl, block_mask, block)
    lowp = reference_grads(q, k, v, g, gl, block_mask, block, dtype=q.dtype) if q.dtype in LOW else [None] * 5
    for name, ours, exact, theirs in zip(("out", "lse", "dq", "dk", "dv"), got, want, lowp):
        if name == "lse":
            assert torch.equal(torch.isinf(ours).cpu(), torch.isinf(exact).cpu()), "lse: -inf rows"
            ok = torch.isfinite(exact)
            assert_matches(torch.where(ok, ours, 0.0), torch.where(ok, exact, 0.0), lowp=None if theirs is None
                           else torch.where(ok, theirs.float(), 0.0), what="lse")
            continue
        assert_matches(ours, exact, q.dtype, lowp=theirs, what=name)
    return got


# ----------------------------------------------------------------------------- values and gradients

CASES = [  # (B, H, Hkv, Tq, Tk, D, block, density, mask batch/head: "full", "broadcast", "heads")
    (1, 2, 2, 64, 64, 16, 16, 0.5, "full"),
    (2, 2, 1, 50, 70, 32, 16, 0.3, "heads"),  # GQA, lengths not multiples of the block, Tq != Tk
    (1, 2, 2, 64, 96, 16, 32, 0.7, "broadcast"),
    (2, 1, 1, 45, 45, 24, 16, 0.9, "full"),  # odd head dim
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}H{c[1]}:{c[2]}T{c[3]}x{c[4]}D{c[5]}b{c[6]}d{c[7]}{c[8]}")
def test_matches_masked_reference(case, gen):
    batch, hq, hkv, tq, tk, d, block, density, kind = case
    q, k, v = rand(batch, hq, tq, d, gen=gen), rand(batch, hkv, tk, d, gen=gen), rand(batch, hkv, tk, d, gen=gen)
    shape = {"full": (batch, hq), "heads": (1, hq), "broadcast": (1, 1)}[kind]
    check(q, k, v, random_mask(*shape, tq, tk, block, density, gen), block, gen)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision(dtype, gen):
    q, k, v = (rand(1, 2, 48, 32, gen=gen, dtype=dtype) for _ in range(3))
    check(q, k, v, random_mask(1, 2, 48, 48, 16, 0.5, gen), 16, gen)


def test_empty_rows_give_zero_and_minus_inf(gen):
    q, k, v = (rand(1, 2, 40, 16, gen=gen) for _ in range(3))
    mask = random_mask(1, 2, 40, 40, 16, 0.6, gen)
    mask[0, 0, 1] = False  # query block 1 of head 0 sees nothing
    mask[0, 1] = False
    mask[0, 1, 2, 0] = True  # head 1: only the last (partial) query block sees one block
    out, lse, dq, dk, dv = check(q, k, v, mask, 16, gen)
    assert (out[0, 0, 16:32] == 0).all() and torch.isneginf(lse[0, 0, 16:32]).all()
    assert (out[0, 1, :32] == 0).all() and (dq[0, 1, :32] == 0).all()
    assert (dk[0, 1, 16:] == 0).all() and (dv[0, 1, 16:] == 0).all()  # key blocks nobody attends


def test_all_true_mask_equals_flash_attention(gen):
    q, k, v = rand(1, 4, 64, 32, gen=gen), rand(1, 2, 64, 32, gen=gen), rand(1, 2, 64, 32, gen=gen)
    mask = torch.ones(1, 1, 2, 2, dtype=torch.bool, device=DEVICE)
    ours = kernel_ladder.block_sparse_attention(q, k, v, mask, block_size=32, return_lse=True)
    theirs = kernel_ladder.flash_attention(q, k, v, return_lse=True)  # the interpreter's tile is 32 x 32 too
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_expanded_mask_is_read_in_place(gen):
    """A stride-0 expand over batch and heads gives what the (1, 1) mask gives, and is sorted once."""
    q, k, v = (rand(2, 2, 32, 16, gen=gen) for _ in range(3))
    small = random_mask(1, 1, 32, 32, 16, 0.5, gen)
    small[..., 0, 0] = True
    big = small.expand(2, 2, 2, 2)
    assert bsa.block_lists(big, 16).counts.shape == (1, 1, 2)
    torch.testing.assert_close(kernel_ladder.block_sparse_attention(q, k, v, big, block_size=16),
                               kernel_ladder.block_sparse_attention(q, k, v, small, block_size=16), rtol=0, atol=0)


def test_block_lists_put_allowed_blocks_first_in_order():
    mask = torch.tensor([[True, False, True, True], [False] * 4, [False, False, False, True]])[None, None]
    lists = bsa.block_lists(mask, 16)
    assert lists.counts.tolist() == [[[3, 0, 1]]]
    assert lists.indices[0, 0, 0, :3].tolist() == [0, 2, 3] and lists.indices[0, 0, 2, 0].item() == 3
    assert lists.counts.dtype == lists.indices.dtype == torch.int32


# ----------------------------------------------------------------------------- work proportional to density


@pytest.mark.interpreter
@pytest.mark.parametrize("density", [0.15, 0.5])
def test_flops_and_kv_bytes_scale_with_density(density, gen):
    t, d, block = 128, 16, 16
    q, k, v = (leaf(rand(1, 1, t, d, gen=gen)) for _ in range(3))
    mask = random_mask(1, 1, t, t, block, density, gen)
    mask[0, 0, 0, 0] = True
    density = mask.float().mean().item()
    with trace() as sparse:
        out = kernel_ladder.block_sparse_attention(q, k, v, mask, block_size=block)
    with trace() as sparse_bwd:
        out.backward(torch.ones_like(out))
    with trace() as dense:
        kernel_ladder.flash_attention(q, k, v)
    dense_flops = dense.flops
    assert dense_flops == 2 * (2 * t * t * d)  # QK^T and PV
    launch = next(x for x in sparse.launches if x.kernel == "flash_attention_forward_kernel")
    assert abs(launch.flops - density * dense_flops) <= 0.05 * density * dense_flops
    assert launch.flops == mask.sum().item() * 2 * (2 * block * block * d)  # exactly the allowed tiles
    tile_bytes = block * d * 4
    for name in ("k_ptr", "v_ptr"):  # one K and one V tile per allowed block, nothing for the others
        assert launch.per_tensor[name].bytes_read == mask.sum().item() * tile_bytes
    kinds = {x.kernel: x.flops for x in sparse_bwd.launches}
    tile_flops = 2 * block * block * d
    assert kinds["flash_attention_backward_dkdv_kernel"] == 4 * mask.sum().item() * tile_flops
    assert kinds["flash_attention_backward_dq_kernel"] == 3 * mask.sum().item() * tile_flops


# ----------------------------------------------------------------------------- mask builders


def test_sliding_window_mask():
    mask = bsa.sliding_window_mask(6, 6, window_blocks=2, global_blocks=1)
    assert mask.shape == (1, 1, 6, 6) and mask.dtype == torch.bool
    expected = torch.zeros(6, 6, dtype=torch.bool)
    for i in range(6):
        expected[i, max(0, i - 1):i + 1] = True
        expected[i, 0] = True
    expected[0] = True
    assert torch.equal(mask[0, 0], expected)
    # bottom-right aligned when there are more key blocks
    assert bsa.sliding_window_mask(2, 4, window_blocks=1)[0, 0].tolist() == [[False, False, True, False],
                                                                           [False, False, False, True]]


def test_bigbird_mask_is_seeded_and_adds_random_blocks(gen):
    a = bsa.bigbird_mask(8, 8, window_blocks=1, global_blocks=0, random_blocks=2, num_heads=2, seed=3)
    b = bsa.bigbird_mask(8, 8, window_blocks=1, global_blocks=0, random_blocks=2, num_heads=2, seed=3)
    assert a.shape == (1, 2, 8, 8) and torch.equal(a, b)
    assert (a.sum(-1) >= 2).all() and (a.sum(-1) <= 3).all()  # the diagonal plus 2 distinct random blocks
    assert torch.diagonal(a, dim1=-2, dim2=-1).all()
    assert not torch.equal(a, bsa.bigbird_mask(8, 8, window_blocks=1, global_blocks=0, random_blocks=2,
                                               num_heads=2, seed=4))
    q, k, v = (rand(1, 2, 64, 16, gen=gen) for _ in range(3))  # usable as is (T = 64, block 16: 4 blocks)
    mask = bsa.bigbird_mask(4, 4, num_heads=2, device=DEVICE)
    check(q, k, v, mask, 16, gen)


# ----------------------------------------------------------------------------- plumbing and errors


def test_opcheck(gen):
    q, k = rand(1, 2, 20, 16, gen=gen), rand(1, 1, 24, 16, gen=gen)
    mask = random_mask(1, 2, 20, 24, 16, 0.6, gen)
    torch.library.opcheck(torch.ops.kernel_ladder.block_sparse_attention.default, (q, k, k * 0.5, mask, 16, 0.25))


def test_torch_compile_fullgraph_forward_and_backward(gen):
    torch._dynamo.reset()
    q, k, v = rand(1, 2, 24, 16, gen=gen), rand(1, 1, 40, 16, gen=gen), rand(1, 1, 40, 16, gen=gen)
    mask = random_mask(1, 2, 24, 40, 16, 0.6, gen)

    def step(q, k, v):
        out, lse = kernel_ladder.block_sparse_attention(q, k, v, mask, block_size=16, return_lse=True)
        return (out * 2).sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    leaves = [leaf(t) for t in (q, k, v)]
    loss = compiled(*leaves)
    loss.backward()
    eager = [leaf(t) for t in (q, k, v)]
    want = step(*eager)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=0, atol=0)
    for a, b in zip(leaves, eager):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def test_bad_input_is_refused_clearly(gen):
    q = rand(1, 2, 40, 16, gen=gen)
    good = torch.ones(1, 2, 3, 3, dtype=torch.bool, device=DEVICE)
    op = kernel_ladder.block_sparse_attention
    with pytest.raises(ValueError,
                       match=r"kernel_ladder\.block_sparse_attention: block_mask must be .*got \(1, 2, 3, 2\)"):
        op(q, q, q, good[..., :2], block_size=16)
    with pytest.raises(ValueError, match=r"block_mask must be"):
        op(q, q, q, torch.ones(1, 3, 3, 3, dtype=torch.bool, device=DEVICE), block_size=16)  # 3 heads for 2
    with pytest.raises(ValueError, match=r"block_mask must be"):
        op(q, q, q, good[0], block_size=16)
    with pytest.raises(TypeError, match=r"block_mask must be a bool tensor.*torch.float32"):
        op(q, q, q, good.float(), block_size=16)
    with pytest.raises(ValueError, match=r"block_size must be one of \(16, 32, 64, 128\).*got 24"):
        op(q, q, q, good, block_size=24)
    with pytest.raises(TypeError, match=r"block_size must be an int"):
        op(q, q, q, good, block_size=16.0)
    with pytest.raises(TypeError, match=r"q must be float32, float16 or bfloat16"):
        op(q.double(), q.double(), q.double(), good, block_size=16)
    with pytest.raises(ValueError, match=r"softmax_scale must be a positive"):
        op(q, q, q, good, block_size=16, softmax_scale=-1.0)
