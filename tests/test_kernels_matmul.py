"""kernel_ladder.matmul and its launchers: values, layouts, batches, dtypes, dispatch, traffic, autograd, errors.

Every result is compared with a float64 reference (of the inputs as stored) on fresh random inputs;
outputs are poisoned (NaN) before the kernels write them. Tiles are 16-32 wide via explicit configs
so each case runs a handful of program instances in the interpreter.
"""

from __future__ import annotations

import pytest
import torch
from helpers import DTYPES
from helpers import assert_matches as _assert_matches

import kernel_ladder
from kernel_ladder import _launch
from kernel_ladder.autotune import INTERPRETER_CONFIG, MatmulConfig, fit_config
from kernel_ladder.ops import matmul as mm

pytestmark = pytest.mark.usefixtures("poisoned")  # every buffer the ops allocate starts as NaN

DEVICE = kernel_ladder.runtime.DEVICE

SMALL = MatmulConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=1, num_warps=4, num_stages=2)
SMALL_GROUPED = MatmulConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=8, num_warps=4, num_stages=2)
WIDE = MatmulConfig(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=2)

# name -> f(a, b) running one kernel variant with an explicit small config
VARIANTS = {
    "tiled_row_major": lambda a, b: mm.matmul_tiled(a, b, SMALL),
    "tiled_grouped": lambda a, b: mm.matmul_tiled(a, b, SMALL_GROUPED),
    "split_k": lambda a, b: mm.matmul_split_k(a, b, 3, SMALL_GROUPED),
    "persistent": lambda a, b: mm.matmul_persistent(a, b, SMALL_GROUPED, num_programs=3),
    "matmul": lambda a, b: mm.matmul(a, b),
}


def rand(gen, *shape, dtype=torch.float32):
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).to(DEVICE)


def assert_matches(out, reference64, dtype, k=None):
    """A K-long fp32 accumulation (its order differs from the reference's): twice the tolerance."""
    _assert_matches(out, reference64, dtype, slack=2.0)


def reference(a, b):
    return torch.matmul(a.double(), b.double())


# --------------------------------------------------------------------------- values


@pytest.mark.parametrize("config", [SMALL, SMALL_GROUPED], ids=["GROUP_M=1", "GROUP_M=8"])
@pytest.mark.parametrize(
    "M, N, K",
    [(1, 1, 1), (1, 37, 19), (19, 1, 37), (33, 17, 40), (48, 32, 64), (50, 3, 5), (17, 20, 0)],
    ids=str,
)
def test_tiled_shapes_and_remainders(M, N, K, config, gen):
    a, b = rand(gen, M, K), rand(gen, K, N)
    assert_matches(mm.matmul_tiled(a, b, config), reference(a, b), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_variant_each_dtype(variant, dtype, gen):
    a, b = rand(gen, 20, 50, dtype=dtype), rand(gen, 50, 24, dtype=dtype)
    assert_matches(VARIANTS[variant](a, b), reference(a, b), dtype)


@pytest.mark.parametrize("variant", ["split_k", "persistent"])
@pytest.mark.parametrize("M, N, K", [(1, 1, 1), (1, 33, 70), (40, 17, 16), (9, 20, 0)], ids=str)
def test_split_k_and_persistent_shapes(variant, M, N, K, gen):
    a, b = rand(gen, M, K), rand(gen, K, N)
    assert_matches(VARIANTS[variant](a, b), reference(a, b), torch.float32)


def test_split_k_uses_whole_k_slices_and_is_deterministic(gen):
    a, b = rand(gen, 3, 100), rand(gen, 100, 20)
    with_many = mm.matmul_split_k(a, b, 16, SMALL)  # at most ceil(100 / 16) = 7 splits of 16
    assert_matches(with_many, reference(a, b), torch.float32)
    assert torch.equal(with_many, mm.matmul_split_k(a, b, 16, SMALL))
    assert_matches(mm.matmul_split_k(a, b, 1, SMALL), reference(a, b), torch.float32)


def test_persistent_with_more_programs_than_tiles(gen):
    a, b = rand(gen, 20, 30), rand(gen, 30, 10)
    assert_matches(mm.matmul_persistent(a, b, SMALL, num_programs=64), reference(a, b), torch.float32)


def _layout(gen, rows, cols, layout, dtype=torch.float32):
    if layout == "contiguous":
        return rand(gen, rows, cols, dtype=dtype)
    if layout == "transposed":
        return rand(gen, cols, rows, dtype=dtype).t()
    if layout == "sliced":  # a row offset and a column step
        return rand(gen, rows + 2, 2 * cols, dtype=dtype)[1:-1, ::2]
    if layout == "expanded":  # every row the same (stride 0)
        return rand(gen, 1, cols, dtype=dtype).expand(rows, cols)
    raise AssertionError(layout)


@pytest.mark.parametrize("b_layout", ["contiguous", "transposed", "sliced"])
@pytest.mark.parametrize("a_layout", ["contiguous", "transposed", "sliced", "expanded"])
def test_strided_operands(a_layout, b_layout, gen):
    a, b = _layout(gen, 21, 35, a_layout), _layout(gen, 35, 18, b_layout)
    assert_matches(mm.matmul_tiled(a, b, WIDE), reference(a, b), torch.float32)


@pytest.mark.interpreter
def test_strided_operands_are_not_copied(gen):
    from utils.trace import trace

    a, b = _layout(gen, 21, 35, "transposed"), _layout(gen, 35, 18, "sliced")
    with trace() as t:
        mm.matmul(a, b)
    assert [x.kernel for x in t.launches] == ["matmul_kernel"]
    assert all(op.launches == 0 for op in t.torch_ops), [op.name for op in t.torch_ops if op.launches]


@pytest.mark.parametrize(
    "a_shape, b_shape",
    [
        ((2, 3, 9, 20), (20, 7)),  # activations @ weight: batch folded into M
        ((9, 20), (3, 20, 7)),  # one matrix against a batch
        ((2, 1, 9, 20), (3, 20, 7)),  # both broadcast
        ((1, 9, 20), (4, 20, 7)),
        ((3, 9, 20), (3, 20, 7)),
        ((20,), (20,)),  # vectors, like torch.matmul
        ((20,), (3, 20, 7)),
        ((3, 9, 20), (20,)),
        ((9, 20), (20,)),
        ((20,), (20, 7)),
    ],
    ids=str,
)
def test_batched_and_vector_shapes_like_torch_matmul(a_shape, b_shape, gen):
    a, b = rand(gen, *a_shape), rand(gen, *b_shape)
    out = mm.matmul(a, b)
    assert out.shape == torch.matmul(a, b).shape
    torch.testing.assert_close(out.double(), reference(a, b), rtol=2e-5, atol=2e-5)


def test_batches_that_cannot_merge_and_chunked_grids(monkeypatch, gen):
    # Permuted batch dims (no two merge) launch once per outer index, on views.
    a = rand(gen, 3, 2, 9, 20).permute(1, 0, 2, 3)
    b = rand(gen, 2, 3, 20, 7).transpose(-1, -2).contiguous().transpose(-1, -2)
    assert_matches(mm.matmul_tiled(a, b, WIDE), reference(a, b), torch.float32)
    a3 = rand(gen, 20, 5, 9).permute(1, 2, 0)  # (5, 9, 20), rows cannot fold into M
    b2 = rand(gen, 20, 7)
    assert len(mm._plan_launches(a3, b2, torch.empty(5, 9, 7), None, None)) == 1
    assert_matches(mm.matmul_tiled(a3, b2, WIDE), reference(a3, b2), torch.float32)
    # More batch entries than a grid axis holds: chunked.
    monkeypatch.setattr(mm, "_MAX_GRID_YZ", 2)
    a5, b5 = rand(gen, 5, 4, 6), rand(gen, 5, 6, 3)
    assert len(mm._plan_launches(a5, b5, torch.empty(5, 4, 3), None, None)) == 3
    for variant in ("tiled_grouped", "split_k", "persistent"):
        assert_matches(VARIANTS[variant](a5, b5), reference(a5, b5), torch.float32)


def test_int64_offsets(monkeypatch, gen):
    """The int64 offset path (taken when an offset can pass 2**31) computes the same values."""
    monkeypatch.setattr(_launch, "INT32_MAX", 100)
    a, b = rand(gen, 2, 20, 33).transpose(-1, -2), rand(gen, 20, 18)
    assert mm._needs_int64(a)
    for variant in ("tiled_grouped", "split_k", "persistent"):
        assert_matches(VARIANTS[variant](a, b), reference(a, b), torch.float32)


@pytest.mark.parametrize("variant", ["tiled_grouped", "split_k", "persistent", "matmul"])
def test_empty_problems(variant, gen):
    for a_shape, b_shape in [((0, 5), (5, 3)), ((4, 5), (5, 0)), ((0, 4, 5), (5, 3)), ((2, 4, 0), (2, 0, 3))]:
        a, b = rand(gen, *a_shape), rand(gen, *b_shape)
        out = VARIANTS[variant](a, b)
        assert out.shape == torch.matmul(a, b).shape
        assert torch.equal(out, torch.zeros_like(out))  # K == 0 writes zeros; empty outputs are empty


# --------------------------------------------------------------------------- dispatch


def test_dispatch_rule():
    sms = _launch.num_sms()
    cfg = mm.default_config(1, 64, 4096, torch.float16, "split_k")
    # Decode-shaped: one row, long K -> split so that ~2 programs per SM run.
    split = mm.choose_split_k(1, 64, 4096, 1, cfg, sms)
    assert split == min(2 * sms // (64 // cfg.BLOCK_N), 4096 // mm.SPLIT_K_MIN_K_PER_SPLIT, mm.SPLIT_K_MAX) >= 2
    assert mm.choose_split_k(128, 64, 4096, 1, cfg, sms) == 1  # 128 rows: K too short for the wide rule's splits
    assert mm.choose_split_k(1, 64, 256, 1, cfg, sms) == 1  # K too short to split
    assert mm.choose_split_k(1, 64 * sms, 4096, 1, cfg, sms) == 1  # the tile grid fills the GPU
    assert mm.choose_split_k(16, 64, 4096, 8 * sms, cfg, sms) == 1  # so does the batch
    plan = mm.plan_matmul(1, 64, 4096, torch.float16)
    assert plan.method == "split_k" and plan.split_k > 1
    plan = mm.plan_matmul(256, 256, 256, torch.float16)
    assert plan.method == "tiled"
    if kernel_ladder.runtime.INTERPRETER:
        assert plan.config == INTERPRETER_CONFIG  # the fixed interpreter config (fits this problem)
        assert mm.plan_matmul(5, 300, 20).config == fit_config(INTERPRETER_CONFIG, 5, 300, 20)
        assert mm.plan_matmul(5, 300, 20).config.BLOCK_M == 16
    else:
        assert plan.config is None  # autotuned


def test_split_k_rule_for_short_m_long_k_on_an_h200():
    """The wide rule at an H200's 132 SMs, with the split-K config a GPU uses for each problem."""
    def choose(M, N, K):
        cfg = mm.default_config(M, N, K, torch.bfloat16, "split_k", interpreter=False)
        return cfg, mm.choose_split_k(M, N, K, 1, cfg, 132)

    # A fused linear cross-entropy's grad_x at Liger's 256-row chunks: 64 tiles of 128 x 128 unsplit (64 of 132
    # SMs); split two ways, 128 programs in one wave (the fewest splits among the best-filled).
    cfg, split = choose(256, 4096, 128256)
    tiles = (256 // cfg.BLOCK_M) * (4096 // cfg.BLOCK_N)
    assert (cfg.BLOCK_M, cfg.BLOCK_N, tiles) == (128, 128, 64)
    assert split == 2 and 128 <= tiles * split <= 132
    assert mm.wave_efficiency(tiles * split, 132) > 0.96 > 0.49 > mm.wave_efficiency(tiles, 132)
    plan = mm.plan_matmul(256, 4096, 128256, torch.bfloat16, num_sms=132, interpreter=False)
    assert (plan.method, plan.split_k, plan.config) == ("split_k", 2, cfg)
    assert choose(4096, 4096, 4096)[1] == 1  # square: 1024 tiles fill the GPU
    assert mm.plan_matmul(4096, 4096, 4096, torch.bfloat16, num_sms=132, interpreter=False).method == "tiled"
    assert choose(256, 4096, 4096)[1] == 1  # 64 tiles, but K too short for partials to pay (< 2 x 8192)
    assert choose(2048, 4096, 128256)[1] == 1  # the default chunk's grad_x: 512 tiles, 3.9 waves
    assert choose(1, 4096, 4096)[1] == 4  # decode-shaped: the 64 x 64 rule, two programs per SM, unchanged
    # 40 tiles: three splits fill 120 of 132 SMs, more would start a mostly empty second wave
    assert choose(128, 5120, 65536)[1] == 3


def test_wave_efficiency():
    assert mm.wave_efficiency(132, 132) == 1.0
    assert mm.wave_efficiency(133, 132) == pytest.approx(133 / 264)
    assert mm.wave_efficiency(64, 132) == pytest.approx(64 / 132)
    assert mm.wave_efficiency(0, 132) == 0.0


def _wide_case(gen, M, N, K, dtype, layout):
    if layout == "transposed":
        return rand(gen, K, M, dtype=dtype).t(), rand(gen, N, K, dtype=dtype).t()
    if layout == "sliced":
        return rand(gen, M + 3, 2 * K, dtype=dtype)[2:-1, ::2], rand(gen, K, N + 5, dtype=dtype)[:, 3:-2]
    return rand(gen, M, K, dtype=dtype), rand(gen, K, N, dtype=dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("M, N, K, layout", [(70, 20, 300, "contiguous"), (97, 33, 257, "transposed"),
                                             (65, 1, 200, "sliced")], ids=str)
def test_matmul_splits_short_m_long_k_with_the_rule_forced(M, N, K, layout, dtype, gen, monkeypatch):
    """More than 64 rows, few tiles, a long K: with each split keeping >= 64 of K (not 8192), the interpreter's
    4-SM GPU runs the chosen split; values match float64, the partials are summed in a fixed order (bitwise
    the same result twice), and C += A @ B accumulates through the same path."""
    from utils.trace import trace

    monkeypatch.setattr(mm, "SPLIT_K_WIDE_MIN_K_PER_SPLIT", 64)
    a, b = _wide_case(gen, M, N, K, dtype, layout)
    plan = mm.plan_matmul(M, N, K, dtype)
    assert plan.method == "split_k" and plan.split_k >= 2
    with trace() as t:
        out = mm.matmul(a, b)
    assert [x.kernel for x in t.launches] == ["matmul_split_k_kernel", "matmul_split_k_reduce_kernel"]
    tiles = -(-M // plan.config.BLOCK_M) * -(-N // plan.config.BLOCK_N)
    assert t.launches[0].grid == (tiles, plan.split_k, 1)
    assert_matches(out, reference(a, b), dtype)
    assert torch.equal(out, mm.matmul(a, b))
    c = rand(gen, M, N)
    expected = c.double() + reference(a, b)
    mm.launch_matmul(a, b, c, accumulate=True)  # a float32 c, as a gradient accumulator
    assert_matches(c, expected, torch.float32)


@pytest.mark.interpreter
def test_matmul_runs_split_k_for_skinny_problems(gen):
    from utils.trace import trace

    a, b = rand(gen, 1, 1024), rand(gen, 1024, 16)
    with trace() as t:
        out = mm.matmul(a, b)
    assert [x.kernel for x in t.launches] == ["matmul_split_k_kernel", "matmul_split_k_reduce_kernel"]
    split = mm.plan_matmul(1, 16, 1024).split_k
    assert t.launches[0].grid == (1, split, 1)
    assert_matches(out, reference(a, b), torch.float32)


# --------------------------------------------------------------------------- traffic (interpreter)


@pytest.mark.interpreter
@pytest.mark.parametrize("config", [MatmulConfig(32, 32, 16, 1), MatmulConfig(16, 32, 32, 8)], ids=str)
def test_tracer_counts_the_tiled_kernels_flops_and_bytes(config, gen):
    from utils.trace import trace

    M, N, K = 64, 64, 64
    a, b = rand(gen, M, K, dtype=torch.float16), rand(gen, K, N, dtype=torch.float16)
    with trace() as t:
        mm.matmul_tiled(a, b, config)
    (launch,) = t.launches
    assert launch.flops == 2 * M * N * K
    BM, BN = config.BLOCK_M, config.BLOCK_N
    element = a.element_size()
    assert launch.per_tensor["a_ptr"].bytes_read == M * K * (N // BN) * element
    assert launch.per_tensor["b_ptr"].bytes_read == K * N * (M // BM) * element
    assert launch.bytes_read == (M * K * (N // BN) + K * N * (M // BM)) * element
    assert launch.bytes_written == M * N * element
    assert launch.out_of_bounds == 0
    # The persistent kernel moves exactly the same bytes; split-K adds its fp32 partials.
    with trace() as t:
        mm.matmul_persistent(a, b, config, num_programs=3)
        mm.matmul_split_k(a, b, 2, config)
    persistent, split, reduce = t.launches
    assert (persistent.bytes_read, persistent.bytes_written, persistent.flops) == (
        launch.bytes_read, launch.bytes_written, launch.flops)
    assert split.flops == 2 * M * N * K and split.bytes_written == 2 * M * N * 4
    assert reduce.bytes_read == 2 * M * N * 4 and reduce.bytes_written == M * N * element


@pytest.mark.interpreter
def test_grouped_order_assigns_tiles_as_documented(gen):
    from utils.trace import trace

    M, N, K, B = 96, 64, 16, 16  # 6 x 4 tiles
    a, b = rand(gen, M, K), rand(gen, K, N)
    for group in (1, 4):
        with trace(record_access=True) as t:
            mm.matmul_tiled(a, b, MatmulConfig(B, B, B, group))
        owner = t.launches[0].access["c_ptr"][0, ::B, ::B]  # program that wrote each tile (c is (1, M, N))
        expected = torch.empty(6, 4, dtype=torch.int64)
        for pid in range(24):
            first = (pid // (group * 4)) * group
            size = min(6 - first, group)
            expected[first + (pid % (group * 4)) % size, (pid % (group * 4)) // size] = pid
        assert (owner == expected.numpy()).all(), (group, owner)
        if group == 1:  # row-major: tile (m, n) is program 4 m + n
            assert (owner == torch.arange(24).view(6, 4).numpy()).all()


# --------------------------------------------------------------------------- autograd


@pytest.mark.parametrize(
    "a_shape, b_shape",
    [((9, 20), (20, 7)), ((2, 3, 9, 20), (20, 7)), ((9, 20), (3, 20, 7)), ((2, 1, 9, 20), (3, 20, 7)),
     ((20,), (3, 20, 7)), ((3, 9, 20), (20,))],
    ids=str,
)
def test_gradients_match_torch(a_shape, b_shape, gen):
    a, b = rand(gen, *a_shape).requires_grad_(), rand(gen, *b_shape).requires_grad_()
    out = mm.matmul(a, b)
    grad = rand(gen, *out.shape)
    got = torch.autograd.grad(out, (a, b), grad)
    leaves = [t.detach().double().requires_grad_() for t in (a, b)]
    want = torch.autograd.grad(torch.matmul(*leaves), leaves, grad.double())
    for g, w, t in zip(got, want, (a, b)):
        assert g.shape == t.shape and g.dtype == t.dtype
        torch.testing.assert_close(g.double(), w, rtol=2e-5, atol=2e-5)


def test_gradients_of_strided_inputs_and_bf16(gen):
    a = rand(gen, 20, 9).t().requires_grad_()  # transposed leaf
    b = rand(gen, 20, 14, dtype=torch.bfloat16)[:, ::2].requires_grad_()
    a16 = a.detach().bfloat16().requires_grad_()
    out = mm.matmul(a16, b)
    grad = rand(gen, 9, 7, dtype=torch.bfloat16)
    got = torch.autograd.grad(out, (a16, b), grad)
    leaves = [t.detach().double().requires_grad_() for t in (a16, b)]
    want = torch.autograd.grad(torch.matmul(*leaves), leaves, grad.double())
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.double(), w.bfloat16().double(), rtol=1.6e-2, atol=1.6e-2)
    # Only b needs a gradient: a's is not computed.
    w = rand(gen, 20, 3).requires_grad_()
    out = mm.matmul(a.detach(), w)
    (gw,) = torch.autograd.grad(out, (w,), torch.ones_like(out))
    torch.testing.assert_close(gw.double(), a.detach().double().t() @ torch.ones(9, 3, dtype=torch.float64),
                               rtol=2e-5, atol=2e-5)


def test_broadcast_gradient_paths(gen):
    """dB of a shared 2-D b: one GEMM over the folded batch; a non-foldable one sums fp32 partials."""
    a = rand(gen, 3, 9, 20)
    g = rand(gen, 3, 9, 7)
    want = torch.einsum("bmk,bmn->kn", a.double(), g.double())
    merged = mm.reduced_product(a.mT, g, (20, 7))
    torch.testing.assert_close(merged.double(), want, rtol=2e-5, atol=2e-5)
    a_perm = rand(gen, 9, 3, 20).transpose(0, 1)  # batch cannot fold into K
    want = torch.einsum("bmk,bmn->kn", a_perm.double(), g.double())
    torch.testing.assert_close(mm.reduced_product(a_perm.mT, g, (20, 7)).double(), want, rtol=2e-5, atol=2e-5)
    # Partially broadcast: (2, 1, ...) against (2, 3, ...) keeps dim 0 and sums dim 1.
    x, y = rand(gen, 2, 3, 5, 6), rand(gen, 2, 3, 6, 4)
    want = (x.double() @ y.double()).sum(1, keepdim=True)
    torch.testing.assert_close(mm.reduced_product(x, y, (2, 1, 5, 4)).double(), want, rtol=2e-5, atol=2e-5)


def test_opcheck(gen):
    # Batched, broadcast, a transposed operand, both needing gradients.
    a, b = rand(gen, 2, 5, 6).requires_grad_(), rand(gen, 3, 6).t().requires_grad_()
    torch.library.opcheck(mm._matmul_op, (a, b))


def test_torch_compile_fullgraph_forward_and_backward(gen):
    torch._dynamo.reset()
    compiled = torch.compile(mm.matmul, fullgraph=True)
    a, b = rand(gen, 2, 9, 20).requires_grad_(), rand(gen, 20, 7).requires_grad_()
    grad = rand(gen, 2, 9, 7)
    got = compiled(a, b)
    got_grads = torch.autograd.grad(got, (a, b), grad)
    want = mm.matmul(a, b)
    want_grads = torch.autograd.grad(want, (a, b), grad)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda: (torch.randn(3, 5), torch.randn(6, 4)), ValueError,
         r"kernel_ladder\.matmul: a's last dim \(5\) must equal b's dim -2 \(second to last\) \(6\).*"
         r"a of shape \(3, 5\) and b of shape \(6, 4\)"),
        (lambda: (torch.randn(3, 5), torch.randn(6)), ValueError, r"b's dim 0 \(6\).*b of shape \(6,\)"),
        (lambda: (torch.randn(2, 3, 5), torch.randn(4, 5, 2)), ValueError,
         r"kernel_ladder\.matmul: the batch dims of a \(2,\) and b \(4,\) must broadcast"),
        (lambda: (torch.randn(()), torch.randn(3)), ValueError, r"kernel_ladder\.matmul: a must be at least 1-D"),
        (lambda: (torch.randn(3, 5), torch.randn(5, 2, dtype=torch.float16)), TypeError,
         r"kernel_ladder\.matmul: a and b must have the same dtype, got torch\.float32 and torch\.float16"),
        (lambda: (torch.randn(3, 5, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)), TypeError,
         r"kernel_ladder\.matmul: a must be float32, float16 or bfloat16, got torch\.float64"),
        (lambda: (torch.ones(3, 5, dtype=torch.int32), torch.ones(5, 2, dtype=torch.int32)), TypeError,
         r"kernel_ladder\.matmul: a must be float32, float16 or bfloat16, got torch\.int32"),
        (lambda: (torch.randn(3, 5), torch.randn(5, 2, device="meta")), ValueError,
         r"kernel_ladder\.matmul: a and b must be on the same device, got cpu and meta"),
        (lambda: ([[1.0]], torch.randn(1, 1)), TypeError,
         r"kernel_ladder\.matmul: a must be a torch\.Tensor, got list"),
    ],
)
def test_bad_input_errors(make, error, message):
    a, b = make()
    if isinstance(a, torch.Tensor) and a.device.type == "cpu" and DEVICE.type != "cpu":
        a = a.to(DEVICE)
    with pytest.raises(error, match=message):
        mm.matmul(a, b)


def test_launcher_argument_errors(gen):
    a, b = rand(gen, 4, 5), rand(gen, 5, 3)
    with pytest.raises(ValueError, match=r"kernel_ladder\.matmul_split_k: split_k must be an int >= 1, got 0"):
        mm.matmul_split_k(a, b, 0)
    with pytest.raises(ValueError, match=r"kernel_ladder\.matmul_persistent: num_programs must be an int >= 1"):
        mm.matmul_persistent(a, b, num_programs=-1)
    with pytest.raises(TypeError,
                       match=r"kernel_ladder\.matmul_tiled: config must be a kernel_ladder\.MatmulConfig or None"):
        mm.matmul_tiled(a, b, {"BLOCK_M": 16})
    with pytest.raises(ValueError, match=r"kernel_ladder\.matmul_tiled: a must be at least 2-D"):
        mm.matmul_tiled(rand(gen, 5), b)
    with pytest.raises(ValueError, match=r"kernel_ladder\.matmul_tiled: a's last dim \(5\) must equal b's"):
        mm.matmul_tiled(a, rand(gen, 4, 3))


# --------------------------------------------------------------------------- real sizes (GPU only)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "a_shape, b_shape",
    [((1024, 1024), (1024, 1024)), ((1000, 777), (777, 1500)), ((1, 4096), (4096, 4096)),
     ((16, 8192), (8192, 1024)), ((8, 512, 256), (256, 384)), ((4, 256, 512), (4, 512, 128))],
    ids=str,
)
def test_gpu_real_sizes(a_shape, b_shape, dtype, gen):
    a, b = rand(gen, *a_shape, dtype=dtype), rand(gen, *b_shape, dtype=dtype)
    out = mm.matmul(a, b)
    want = torch.matmul(a.float(), b.float())  # cuBLAS in fp32 (TF32 off by default) as the reference
    scale = a.shape[-1] ** 0.5
    rtol, atol = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}[dtype]
    torch.testing.assert_close(out.float(), want, rtol=rtol, atol=atol * scale)


@pytest.mark.gpu
def test_gpu_tf32_follows_torch_flag(gen):
    a, b = rand(gen, 512, 2048), rand(gen, 2048, 512)
    exact = a.double() @ b.double()
    previous = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        ieee = (mm.matmul(a, b).double() - exact).abs().max().item()
        torch.backends.cuda.matmul.allow_tf32 = True
        tf32 = (mm.matmul(a, b).double() - exact).abs().max().item()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    assert ieee < 1e-3 < tf32 < 1.0  # TF32 keeps 10 mantissa bits: visibly less exact, still close


@pytest.mark.gpu
def test_gpu_each_variant_and_gradients(gen):
    a, b = rand(gen, 777, 1024, dtype=torch.bfloat16), rand(gen, 1024, 333, dtype=torch.bfloat16)
    want = torch.matmul(a.float(), b.float())
    for out in (mm.matmul_tiled(a, b), mm.matmul_tiled(a, b, MatmulConfig(128, 128, 64, 1, 8, 3)),
                mm.matmul_split_k(a, b, 4), mm.matmul_persistent(a, b)):
        torch.testing.assert_close(out.float(), want, rtol=1.6e-2, atol=0.5)
    a.requires_grad_(), b.requires_grad_()
    grad = rand(gen, 777, 333, dtype=torch.bfloat16)
    got = torch.autograd.grad(mm.matmul(a, b), (a, b), grad)
    ref = torch.autograd.grad(torch.matmul(a, b), (a, b), grad)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g.float(), r.float(), rtol=1.6e-2, atol=1.0)


@pytest.mark.parametrize("method", ["tiled", "split_k", "persistent"])
def test_launch_matmul_accumulates_into_c(method, gen):
    """``accumulate=True`` adds a @ b into c's old values (how chunked gradients are summed), in fp32."""
    a, b = rand(gen, 33, 40), rand(gen, 40, 21)
    c = rand(gen, 33, 21)
    before = c.clone()
    mm.launch_matmul(a, b, c, method=method, config=SMALL_GROUPED, split_k=3, num_programs=3, accumulate=True)
    _assert_matches(c, before.double() + reference(a, b), torch.float32, slack=2.0)
