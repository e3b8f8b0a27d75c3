"""kernel_ladder.grouped_matmul: values per expert, empty groups, tile remainders, dtypes, strides, the rows past the
last group, gradients, one launch whatever E, traffic, opcheck, torch.compile, bad input.

Every result is compared with a float64 loop over the experts on fresh random inputs; every buffer the op
allocates starts as NaN. Explicit 16-row tiles make a group span several tiles with a handful of programs.
"""

from __future__ import annotations

import pytest
import torch
import triton
from helpers import DTYPES
from helpers import assert_matches as _assert_matches

import kernel_ladder
from kernel_ladder import _launch
from kernel_ladder.autotune import MatmulConfig
from kernel_ladder.ops import grouped_matmul as gm
from kernel_ladder.ops import moe_configs as mc

pytestmark = pytest.mark.usefixtures("poisoned")  # every buffer the ops allocate starts as NaN

DEVICE = kernel_ladder.runtime.DEVICE
SMALL = MatmulConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=1, num_warps=4, num_stages=2)


def rand(gen, *shape, dtype=torch.float32):
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).to(DEVICE)


def offsets_of(sizes) -> torch.Tensor:
    """Cumulative group ends (torch._grouped_mm's offs) of these group sizes."""
    ends, total = [], 0
    for s in sizes:
        total += s
        ends.append(total)
    return torch.tensor(ends, dtype=torch.int32, device=DEVICE)


def reference(x, w, offsets):
    """float64, expert by expert; rows past offsets[-1] are zero."""
    out = torch.zeros(x.shape[0], w.shape[2], dtype=torch.float64)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        out[start:end] = x[start:end].double().cpu() @ w[e].double().cpu()
        start = end
    return out


def assert_matches(out, ref, dtype):
    """A K-long fp32 accumulation: twice the tolerance (as tests/test_kernels_matmul.py)."""
    _assert_matches(out, ref, dtype, slack=2.0)


def run_small(x, w, offsets):
    out = _launch.empty_output((x.shape[0], w.shape[2]), x)
    gm.launch_grouped_matmul(x, w, offsets, out, SMALL)
    return out


# --------------------------------------------------------------------------- values

CASES = {  # name -> (group sizes, M, K, N)
    "uneven": ([7, 20, 1, 17], 45, 40, 24),
    "empty_first_middle_last": ([0, 12, 0, 9, 0], 21, 24, 40),
    "single_group": ([33], 33, 40, 24),
    "rows_past_last_group": ([5, 10], 30, 16, 17),
    "all_groups_empty": ([0, 0, 0], 10, 8, 5),
    "one_row_each": ([1, 1, 1], 3, 5, 3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_groups_and_remainders(case, gen):
    sizes, M, K, N = CASES[case]
    x, w, offsets = rand(gen, M, K), rand(gen, len(sizes), K, N), offsets_of(sizes)
    assert_matches(run_small(x, w, offsets), reference(x, w, offsets), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_each_dtype_public_function(dtype, gen):
    sizes, M, K, N = [9, 0, 30, 14], 56, 40, 24
    x, w, offsets = rand(gen, M, K, dtype=dtype), rand(gen, len(sizes), K, N, dtype=dtype), offsets_of(sizes)
    out = kernel_ladder.grouped_matmul(x, w, offsets)
    assert out.shape == (M, N) and out.dtype == dtype
    assert_matches(out, reference(x, w, offsets), dtype)


def test_strided_operands_are_read_in_place(gen):
    sizes, M, K, N = [10, 0, 23], 36, 40, 24
    offsets = offsets_of(sizes)
    w_t = rand(gen, 3, N, K).transpose(1, 2)  # an (E, N, K) weight viewed as (E, K, N)
    x_sliced = rand(gen, M + 2, 2 * K)[1:-1, ::2]
    x_t = rand(gen, K, M).t()
    for x in (x_sliced, x_t):
        assert_matches(run_small(x, w_t, offsets), reference(x, w_t, offsets), torch.float32)
    w_sliced = rand(gen, 3, K, 2 * N)[:, :, 1::2]
    assert_matches(run_small(x_sliced, w_sliced, offsets), reference(x_sliced, w_sliced, offsets), torch.float32)


def test_empty_problems(gen):
    # M == 0; no experts; K == 0 (every row zero); N == 0.
    for sizes, M, K, N in [([0, 0], 0, 8, 4), ([], 6, 8, 4), ([2, 4], 6, 0, 4), ([2, 4], 6, 8, 0)]:
        x, w, offsets = rand(gen, M, K), rand(gen, len(sizes), K, N), offsets_of(sizes)
        out = kernel_ladder.grouped_matmul(x, w, offsets)
        assert out.shape == (M, N)
        assert torch.equal(out, torch.zeros_like(out))


def test_int64_offsets(monkeypatch, gen):
    monkeypatch.setattr(_launch, "INT32_MAX", 100)
    sizes, M, K, N = [10, 0, 13], 25, 20, 18
    x, w, offsets = rand(gen, K, M).t(), rand(gen, 3, N, K).transpose(1, 2), offsets_of(sizes)
    assert gm._index_64(x, w)
    assert_matches(run_small(x, w, offsets), reference(x, w, offsets), torch.float32)
    x.requires_grad_(), w.requires_grad_()
    out = kernel_ladder.grouped_matmul(x, w, offsets)
    g = rand(gen, M, N)
    gx, gw = torch.autograd.grad(out, (x, w), g)
    _check_grads(x, w, offsets, g, gx, gw, torch.float32)


# --------------------------------------------------------------------------- the schedule


def test_tile_map():
    assert kernel_ladder.grouped_tile_map([0, 10, 10, 33, 40], 16) == [(1, 0, 10), (3, 10, 26), (3, 26, 33),
                                                                       (4, 33, 40)]
    assert kernel_ladder.grouped_tile_map([5, 5], 4, num_rows=11) == [(0, 0, 4), (0, 4, 5), (None, 5, 9), (None, 9, 11)]
    assert kernel_ladder.grouped_tile_map([], 16, num_rows=3) == [(None, 0, 3)]
    # Never more tiles than the grid's cdiv(M, BLOCK_M) + E row programs.
    for ends in ([1, 2, 3, 4, 5], [15, 17, 33, 49], [0, 0, 0], [16, 32]):
        M = ends[-1] + 7
        assert len(kernel_ladder.grouped_tile_map(ends, 16, M)) <= -(-M // 16) + len(ends)


@pytest.mark.interpreter
def test_programs_visit_the_tile_map(gen):
    from utils.trace import trace

    sizes, M, K, N = [7, 0, 20, 1], 40, 16, 16  # one column tile: program i is row tile i
    x, w, offsets = rand(gen, M, K), rand(gen, len(sizes), K, N), offsets_of(sizes)
    with trace(record_access=True) as t:
        run_small(x, w, offsets)
    (launch,) = t.launches
    assert launch.grid == (-(-M // 16) + len(sizes), 1)
    owner = launch.access["out_ptr"][:, 0]
    tiles = kernel_ladder.grouped_tile_map(offsets.tolist(), 16, M)
    for program, (_, start, end) in enumerate(tiles):
        assert (owner[start:end] == program).all(), (program, start, end, owner)
    assert launch.out_of_bounds == 0


# --------------------------------------------------------------------------- launches and traffic


@pytest.mark.interpreter
def test_one_launch_whatever_the_number_of_experts(gen):
    from utils.trace import trace

    M, K, N = 48, 16, 16
    x = rand(gen, M, K)
    counts = []
    for E in (2, 16):
        sizes = [M // E] * E
        w, offsets = rand(gen, E, N, K).transpose(1, 2), offsets_of(sizes)  # transposed: still no copy
        with trace() as t:
            out = kernel_ladder.grouped_matmul(x, w, offsets)
        assert [launch.kernel for launch in t.launches] == ["grouped_matmul_kernel"]
        # Besides the kernel, only the on-device check of offsets runs (a few E-element torch ops): no copy
        # of x or w (the transposed weight is read in place).
        checks = [op for op in t.torch_ops if op.launches]
        assert all(op.bytes_read <= 2 * offsets.nbytes for op in checks), [(op.name, op.bytes_read) for op in checks]
        counts.append((len(t.launches), len(checks)))
        assert_matches(out, reference(x, w, offsets), torch.float32)
    assert counts[0] == counts[1] and counts[0][0] == 1


@pytest.mark.interpreter
def test_traffic_close_to_ideal(gen):
    from utils.trace import trace

    sizes, K, N = [64, 0, 50, 64, 30], 64, 64  # one column tile, group tiles of 64 rows (interpreter config)
    M = sum(sizes) + 8  # and a few rows past the last group
    x, w = rand(gen, M, K, dtype=torch.float16), rand(gen, len(sizes), K, N, dtype=torch.float16)
    offsets = offsets_of(sizes)
    with trace() as t:
        out = kernel_ladder.grouped_matmul(x, w, offsets)
    (launch,) = t.launches
    ideal = kernel_ladder.grouped_matmul_ideal_bytes(x, w, offsets, out)
    assert ideal == (x.numel() + 4 * K * N + out.numel()) * 2 + 5 * 4  # the empty expert's weight is not read
    assert launch.bytes <= 1.1 * ideal, (launch.bytes, ideal)
    assert launch.per_tensor["w_ptr"].bytes_read == 4 * K * N * 2
    assert launch.flops == 2 * sum(-(-s // 64) * 64 for s in sizes) * K * N  # the dots of full tiles
    assert launch.out_of_bounds == 0


# --------------------------------------------------------------------------- autograd


def _reference_grads(x, w, offsets, g):
    """float64 autograd through the expert loop (rows past the groups are constant zero)."""
    leaves = [t.detach().double().cpu().requires_grad_() for t in (x, w)]
    pieces, start = [], 0
    for e, end in enumerate(offsets.tolist()):
        pieces.append(leaves[0][start:end] @ leaves[1][e])
        start = end
    pieces.append(torch.zeros(x.shape[0] - start, w.shape[2], dtype=torch.float64))
    grads = torch.autograd.grad(torch.cat(pieces), leaves, g.double().cpu(), allow_unused=True)
    return [torch.zeros(t.shape, dtype=torch.float64) if r is None else r for r, t in zip(grads, (x, w))]


def _check_grads(x, w, offsets, g, gx, gw, dtype):
    for got, ref, t, name in zip((gx, gw), _reference_grads(x, w, offsets, g), (x, w), ("dx", "dw")):
        assert got.shape == t.shape and got.dtype == t.dtype
        # dx is contiguous; dw lies in memory like w (the gradient of a transposed (E, N, K) weight is,
        # transposed back, contiguous like that weight): PyTorch's gradient layout contract.
        assert got.stride() == (t.stride() if name == "dw" else t.contiguous().stride()), (name, got.stride())
        _assert_matches(got, ref, dtype, slack=2.0 if dtype == torch.float32 else 4.0, what=name, contiguous=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gradients(dtype, gen):
    sizes, M, K, N = [0, 11, 0, 20, 3, 0], 40, 24, 40  # empty groups first, middle and last; 6 rows past
    x = rand(gen, M, K, dtype=dtype).requires_grad_()
    w = rand(gen, len(sizes), N, K, dtype=dtype).transpose(1, 2).requires_grad_()
    offsets = offsets_of(sizes)
    out = kernel_ladder.grouped_matmul(x, w, offsets)
    g = rand(gen, M, N, dtype=dtype)
    gx, gw = torch.autograd.grad(out, (x, w), g)
    _check_grads(x, w, offsets, g, gx, gw, dtype)
    assert torch.equal(gw[[0, 2, 5]], torch.zeros_like(gw[[0, 2, 5]]))  # empty experts: zero gradient
    assert torch.equal(gx[34:], torch.zeros_like(gx[34:]))  # rows past the groups: zero


def test_gradient_of_one_input_only(gen):
    sizes, M, K, N = [5, 0, 9], 17, 16, 8
    x, w, offsets = rand(gen, M, K), rand(gen, 3, K, N), offsets_of(sizes)
    g = rand(gen, M, N)
    want_x, want_w = _reference_grads(x, w, offsets, g)
    (gx,) = torch.autograd.grad(kernel_ladder.grouped_matmul(x.requires_grad_(), w, offsets), (x,), g)
    _assert_matches(gx, want_x, torch.float32, slack=2.0, what="dx")
    (gw,) = torch.autograd.grad(kernel_ladder.grouped_matmul(x.detach(), w.requires_grad_(), offsets), (w,), g)
    _assert_matches(gw, want_w, torch.float32, slack=2.0, what="dw")


def test_double_backward_is_refused(gen):
    x = rand(gen, 6, 8).requires_grad_()
    w = rand(gen, 2, 8, 4).requires_grad_()
    out = kernel_ladder.grouped_matmul(x, w, offsets_of([2, 4]))
    (gx,) = torch.autograd.grad(out.sum(), (x,), create_graph=True)
    with pytest.raises(RuntimeError, match=r"kernel_ladder\.grouped_matmul \(backward\): double backward"):
        torch.autograd.grad(gx.sum(), (w,))


def test_opcheck(gen):
    x = rand(gen, 13, 8).requires_grad_()
    w = rand(gen, 3, 5, 8).transpose(1, 2).requires_grad_()
    torch.library.opcheck(gm._grouped_matmul_op, (x, w, offsets_of([4, 0, 7])))


def test_torch_compile_fullgraph_forward_and_backward(gen):
    torch._dynamo.reset()
    compiled = torch.compile(kernel_ladder.grouped_matmul, fullgraph=True)
    x, w, offsets = rand(gen, 20, 16).requires_grad_(), rand(gen, 3, 16, 8).requires_grad_(), offsets_of([6, 0, 11])
    g = rand(gen, 20, 8)
    got = compiled(x, w, offsets)
    got_grads = torch.autograd.grad(got, (x, w), g)
    want = kernel_ladder.grouped_matmul(x, w, offsets)
    want_grads = torch.autograd.grad(want, (x, w), g)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# --------------------------------------------------------------------------- bad input


def _args(M=6, K=8, N=4, E=2, **over):
    args = {"x": torch.randn(M, K), "w": torch.randn(E, K, N), "offsets": torch.tensor([2, M], dtype=torch.int32)}
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over, error, message",
    [
        ({"x": torch.randn(2, 6, 8)}, ValueError,
         r"kernel_ladder\.grouped_matmul: x must be 2-D \(rows, K\).*\(2, 6, 8\)"),
        ({"w": torch.randn(8, 4)}, ValueError, r"kernel_ladder\.grouped_matmul: w must be 3-D \(experts, K, N\)"),
        ({"w": torch.randn(2, 7, 4)}, ValueError,
         r"kernel_ladder\.grouped_matmul: w's dim 1 \(7\) must equal x's last dim K \(8\)"),
        ({"offsets": torch.tensor([2, 6])}, TypeError,
         r"kernel_ladder\.grouped_matmul: offsets must be int32.*got torch\.int64"),
        ({"offsets": torch.tensor([6], dtype=torch.int32)}, ValueError,
         r"kernel_ladder\.grouped_matmul: offsets must have shape \(E,\) = \(2,\).*got shape \(1,\)"),
        ({"offsets": torch.tensor([[2, 6]], dtype=torch.int32)}, ValueError, r"offsets must have shape \(E,\)"),
        ({"w": torch.randn(2, 8, 4, dtype=torch.float16)}, TypeError,
         r"kernel_ladder\.grouped_matmul: x and w must have the same dtype, got torch\.float32 and torch\.float16"),
        ({"x": torch.randn(6, 8, dtype=torch.float64), "w": torch.randn(2, 8, 4, dtype=torch.float64)}, TypeError,
         r"kernel_ladder\.grouped_matmul: x must be float32, float16 or bfloat16, got torch\.float64"),
        ({"w": torch.randn(2, 8, 4, device="meta")}, ValueError,
         r"kernel_ladder\.grouped_matmul: x and w must be on the same device"),
        ({"offsets": torch.tensor([2, 6], dtype=torch.int32, device="meta")}, ValueError,
         r"kernel_ladder\.grouped_matmul: x and offsets must be on the same device"),
        ({"x": [[1.0]]}, TypeError, r"kernel_ladder\.grouped_matmul: x must be a torch\.Tensor, got list"),
    ],
)
def test_bad_input_errors(over, error, message):
    args = _args(**over)
    with pytest.raises(error, match=message):
        kernel_ladder.grouped_matmul(args["x"], args["w"], args["offsets"])


@pytest.mark.skipif(DEVICE.type != "cpu", reason="on a GPU the offsets are checked by torch._assert_async")
@pytest.mark.parametrize("ends", [[4, 2], [-1, 6], [3, 7]], ids=["decreasing", "negative", "past_M"])
def test_bad_offset_values(ends):
    args = _args(offsets=torch.tensor(ends, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"kernel_ladder\.grouped_matmul: offsets must be non-negative, non-decreasing "
                                         r"and at most x's rows M = 6.*got \[" + ", ".join(map(str, ends))):
        kernel_ladder.grouped_matmul(args["x"], args["w"], args["offsets"])


# --------------------------------------------------------------------------- tiles: candidates, table, pruning


def _smem_limit(monkeypatch, kib):
    monkeypatch.setattr(kernel_ladder.autotune, "_shared_memory_limit", lambda: kib * 1024)


def test_default_table_holds_candidates_from_decode_to_prefill():
    for (kind, wide), rows in mc.DEFAULT_TABLE.items():
        candidates = (mc.GPU_CANDIDATES_FP32 if wide else mc.GPU_CANDIDATES)[kind]
        bounds = [bound for bound, _ in rows]
        assert bounds == sorted(bounds) and bounds[-1] >= 2 ** 40, (kind, wide)  # ascending, the last is "any"
        assert all(config in candidates for _, config in rows), (kind, wide)
        tiles = [config.BLOCK_M for _, config in rows]
        assert tiles == sorted(tiles), (kind, wide)  # more rows per expert, no fewer rows per tile
    bf16 = torch.bfloat16
    for kind in ("matmul", "gate_up"):  # decode: 16-row tiles; prefill: H200-class 128-row tiles, two warp groups
        assert mc.default_config(kind, 3, 4096, 14336, bf16).BLOCK_M == 16
        big = mc.default_config(kind, 1024, 14336, 4096, bf16)
        assert (big.BLOCK_M, big.BLOCK_K, big.num_warps) == (128, 64, 8) and big.num_stages >= 3
        assert big.BLOCK_N * (2 if kind == "gate_up" else 1) == 256  # 128 x 256 outputs per program
    assert mc.default_config("matmul", 100, 64, 64, bf16).BLOCK_M == 64  # <= 128 rows: a partial tile wastes < 64
    # GPT-OSS's interleaved gate/up columns: never a tile measured to spill with them, still the most rows allowed.
    for rows in (1, 20, 100, 1000):
        for kind in ("gate_up", "gate_up_backward"):
            plain = mc.default_config(kind, rows, 2880, 2880, bf16)
            config = mc.default_config(kind, rows, 2880, 2880, bf16, interleaved=True)
            assert config.interleaved and config in mc.GPU_CANDIDATES[kind] and config.BLOCK_M == plain.BLOCK_M
    assert mc.default_config("gate_up", 1000, 2880, 2880, bf16, interleaved=True) != mc.default_config(
        "gate_up", 1000, 2880, 2880, bf16)
    with pytest.raises(ValueError, match=r"^kernel_ladder\.grouped_matmul: kind must be one of .* got 'up'"):
        mc.default_config("up", 16, 64, 64, bf16)


def test_every_candidate_fits_hopper_shared_memory_and_the_pair_counts_twice():
    for table, element_size in ((mc.GPU_CANDIDATES, 2), (mc.GPU_CANDIDATES_FP32, 4)):
        for kind, candidates in table.items():
            assert len(set(candidates)) == len(candidates)
            assert all(c.shared_memory_bytes(kind, element_size) <= 227 * 1024 for c in candidates), kind
            assert any(c.BLOCK_M <= 16 for c in candidates), kind  # decode has a tile
    pair = mc.GroupedConfig(128, 128, 64, 8, 4)
    assert pair.shared_memory_bytes("gate_up", 2) == 4 * (128 * 64 + 2 * 64 * 128) * 2  # 192 KiB
    assert pair.shared_memory_bytes("matmul", 2) == 4 * (128 * 64 + 64 * 128) * 2
    assert mc.GroupedConfig(64, 128, 128, 8, 3).shared_memory_bytes("dw", 2) == 3 * 64 * (128 + 128) * 2
    assert any(c.BLOCK_M == 128 and c.BLOCK_N == 256 for c in mc.GPU_CANDIDATES["matmul"])


@pytest.mark.skipif(not kernel_ladder.runtime.INTERPRETER, reason="the interpreter's configuration")
def test_interpreter_keeps_its_one_small_config(monkeypatch):
    assert mc.INTERPRETER_CONFIG == MatmulConfig(64, 64, 32, 1, 4, 2)
    monkeypatch.setattr(mc, "autotuned", lambda *a: pytest.fail("autotuner used in the interpreter"))
    for kind in mc.KINDS:
        assert mc.fixed_config(kind, 1000, 8, 14336, 4096, torch.bfloat16) == mc.INTERPRETER_CONFIG
        assert mc.fixed_config(kind, 5, 8, 40, 20, torch.float32) == MatmulConfig(16, 64, 32, 1, 4, 2)


def test_gpu_launch_config_autotuned_or_the_table(monkeypatch):
    monkeypatch.setattr(mc.runtime, "INTERPRETER", False)  # the choice alone, nothing launched
    assert mc.fixed_config("gate_up", 8192, 8, 14336, 4096, torch.bfloat16) is None  # autotuned
    monkeypatch.setattr(mc, "AUTOTUNE", False)
    assert mc.fixed_config("gate_up", 8192, 8, 14336, 4096, torch.bfloat16) == MatmulConfig(128, 128, 64, 1, 8, 4)
    assert mc.fixed_config("matmul", 8, 8, 4096, 14336, torch.bfloat16) == MatmulConfig(16, 128, 128, 1, 4, 4)
    assert mc.fixed_config("matmul", 8192, 8, 40, 20, torch.bfloat16) == MatmulConfig(128, 64, 32, 1, 8, 4)  # fitted


def _named(rows_per_expert, N, K, dtype=torch.bfloat16):
    return {"x_ptr": torch.empty(0, dtype=dtype), "ROWS_BUCKET": mc.rows_bucket(rows_per_expert * 8, 8), "N": N,
            "K": K}


def _prune(kind, named, wide=False, **flags):
    candidates = (mc.GPU_CANDIDATES_FP32 if wide else mc.GPU_CANDIDATES)[kind]
    kept = mc._pruner(kind, candidates)([c.to_triton() for c in candidates], named, **flags)
    by_key = {c.key: c for c in candidates}
    return [by_key[(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages)]
            for c in kept]


def test_pruning_keeps_what_fits_with_the_table_first(monkeypatch):
    _smem_limit(monkeypatch, 227)
    assert [mc.rows_bucket(r, 8) for r in (1, 8 * 16, 8 * 17, 8192)] == [16, 16, 32, 1024]
    prefill = _prune("gate_up", _named(1024, 14336, 4096))
    assert prefill[0] == mc.default_config("gate_up", 1024, 14336, 4096, torch.bfloat16)
    # everything fits at 227 KiB; tiles of fewer than 64 rows (mma.sync on sm_90) only for short problems
    assert prefill == [c for c in mc.GPU_CANDIDATES["gate_up"] if c.BLOCK_M >= 64]
    decode = _prune("matmul", _named(2, 4096, 14336))
    assert decode[0] == mc.default_config("matmul", 2, 4096, 14336, torch.bfloat16)
    assert all(c.BLOCK_M <= 64 for c in decode)  # no 128-row tile for 2 rows per expert
    gpt_oss = _prune("gate_up", _named(1024, 2880, 2880), INTERLEAVED=True)
    assert gpt_oss and all(c.interleaved for c in gpt_oss)
    assert gpt_oss[0] == mc.default_config("gate_up", 1024, 2880, 2880, torch.bfloat16, interleaved=True)
    dw = _prune("dw", _named(1024, 28672, 4096))
    assert dw[0] == mc.default_config("dw", 1024, 28672, 4096, torch.bfloat16)
    _smem_limit(monkeypatch, 163)  # an A100: the 192 KiB pipelines go
    smaller = _prune("matmul", _named(1024, 4096, 14336))
    assert smaller and all(c.shared_memory_bytes("matmul", 2) <= 163 * 1024 for c in smaller)
    assert len(smaller) < len(mc.GPU_CANDIDATES["matmul"])
    fp32 = _prune("gate_up", _named(1024, 14336, 4096, torch.float32), wide=True)
    assert fp32 and all(c.shared_memory_bytes("gate_up", 4) <= 163 * 1024 for c in fp32)


def test_autotuner_wiring_is_built_without_a_gpu(monkeypatch):
    recorded, real = {}, triton.autotune

    def spy(*args, **kwargs):
        recorded.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(triton, "autotune", spy)
    monkeypatch.setattr(kernel_ladder.autotune, "autotune_supports_disk_cache", lambda: True)
    for kind in mc.KINDS:
        recorded.clear()
        tuned = mc.make_grouped_autotuned(kind)
        kernel = gm.grouped_matmul_dw_kernel if kind == "dw" else gm.grouped_matmul_kernel
        assert set(tuned.keys) <= set(kernel.arg_names) and {"ROWS_BUCKET", "N", "K", "E"} <= set(tuned.keys)
        assert [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages)
                for c in tuned.configs] == [c.key for c in mc.GPU_CANDIDATES[kind]]
        assert recorded["cache_results"] is True  # tunings kept on disk across runs (matmul's wrapper)
        assert tuned.early_config_prune is not kernel_ladder.autotune.prune_configs  # the grouped kernels' own
        assert isinstance(tuned.fn, triton.runtime.Heuristics) == (kind != "dw")  # EVEN_K per candidate


# --------------------------------------------------------------------------- real sizes (GPU only)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_moe_sizes(dtype, gen):
    E, K, N = 16, 1024, 768
    sizes = torch.randint(0, 300, (E,), generator=gen).tolist()
    sizes[3] = 0
    M = sum(sizes) + 5
    x, w, offsets = rand(gen, M, K, dtype=dtype), rand(gen, E, N, K, dtype=dtype).transpose(1, 2), offsets_of(sizes)
    out = kernel_ladder.grouped_matmul(x, w, offsets)
    want = reference(x, w, offsets)
    rtol, atol = {torch.float32: (1e-4, 1e-2), torch.float16: (2e-3, 0.1), torch.bfloat16: (1.6e-2, 1.0)}[dtype]
    torch.testing.assert_close(out.double().cpu(), want, rtol=rtol, atol=atol)
