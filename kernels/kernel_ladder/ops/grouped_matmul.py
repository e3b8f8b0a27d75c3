"""The grouped GEMM of a mixture-of-experts layer, forward and backward, as ``kernel_ladder::grouped_matmul``.

``out[rows of expert e] = x[rows of expert e] @ w[e]`` with ``x`` ``(M, K)`` sorted by expert (the
router's permutation already applied), ``w`` ``(E, K, N)`` and ``offsets`` ``(E,)`` int32, the
cumulative *ends* of the groups (``torch._grouped_mm``'s ``offs``): expert ``e`` owns rows
``offsets[e-1] .. offsets[e] - 1`` (``offsets[-1]`` before expert 0 is 0). Empty groups are allowed
(``offsets[e] == offsets[e-1]``). Rows past ``offsets[E-1]`` belong to no expert: **their output is
zero** (``torch._grouped_mm`` leaves them undefined; zeros are safe to add into a residual).

**One launch, whatever E.** A loop of E matmuls costs E launches and, worse, a host
synchronization to learn each group's size. Here the grid is fixed by the shapes alone:
``cdiv(M, BLOCK_M) + E`` row tiles x ``cdiv(N, BLOCK_N)`` column tiles — an upper bound on the row
tiles (each group's last tile may be partial: at most one extra tile per group, the rows past the
last group included). Every program loads ``offsets`` (``E`` int32), computes each group's tile
count ``cdiv(len_e, BLOCK_M)`` and their running sum in registers (``tl.cumsum``), and finds its own
``(group, tile)`` by counting the groups whose tiles end at or before it. Programs past the last
group zero the rows past ``offsets[E-1]``; the spare ones store nothing. No prologue kernel, no
``.item()``: :func:`grouped_tile_map` is the same schedule in plain Python, for reading.

Each tile is then an ordinary GEMM tile: rows masked to its group, ``w[e]`` read through its
strides (a transposed ``(E, N, K)`` weight viewed as ``(E, K, N)`` costs no copy), fp32
accumulation, one store.

**Backward.** With ``dy = d out``:

* ``dx = grouped_matmul(dy, w^T)``: the same kernel with ``w``'s K and N strides swapped;
* ``dw[e] = x_e^T dy_e``: :func:`grouped_matmul_dw_kernel`, one program per ``(expert, K tile,
  N tile)`` reducing over that expert's rows (dw's shape depends on E anyway); an empty group's
  program stores zeros.

Invalid offsets (decreasing, negative, past M) cannot be checked on the host without a
synchronization: by the value-check policy of :mod:`kernel_ladder.runtime`, on a GPU ``torch._assert_async``
checks them on the device (``kernel_ladder.runtime.check_values(True)``: on the host); on the CPU they raise
``ValueError``. The kernels clamp what they read, so bad offsets never send them out of bounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _activations, _launch, runtime
from .._validate import check_float_dtype, check_same_device, check_same_dtype, check_tensor, check_values, schema_types
from ..autotune import MatmulConfig
from . import moe_configs

__all__ = [
    "grouped_matmul",
    "grouped_matmul_dw_kernel",
    "grouped_matmul_ideal_bytes",
    "grouped_matmul_kernel",
    "grouped_tile_map",
    "launch_grouped_dw",
    "launch_grouped_matmul",
]

_OP = "kernel_ladder.grouped_matmul"


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _group_bounds(offs_ptr, M, E, BLOCK_E: tl.constexpr):
    """Each group's (start, end) rows, clamped to [0, M] so bad offsets stay in bounds; lanes >= E are empty."""
    idx = tl.arange(0, BLOCK_E)
    ends = tl.load(offs_ptr + idx, mask=idx < E, other=0)
    starts = tl.load(offs_ptr + idx - 1, mask=(idx >= 1) & (idx < E), other=0)
    ends = tl.minimum(tl.maximum(ends, 0), M)
    starts = tl.minimum(tl.maximum(starts, 0), ends)
    return idx, starts, ends


@triton.jit
def _pick(values, idx, i):
    """values[i] of a register vector (0 when no lane is i)."""
    return tl.sum(tl.where(idx == i, values, 0), axis=0)


#: The grouped kernel's epilogues: a plain product, or the gate/up pair of a gated MLP's first GEMM
#: with the gate applied (``w`` ``(E, K, 2N)``: the gate's N columns then up's, or, INTERLEAVED, gate
#: column ``n`` at ``2n`` and its up column at ``2n + 1``), or that gate's backward (the gate/up tiles
#: recomputed, ``dh`` read, ``[d gate | d up]`` stored in the same column layout).
EPILOGUE_NONE: tl.constexpr = tl.constexpr(0)
EPILOGUE_SWIGLU: tl.constexpr = tl.constexpr(1)
EPILOGUE_SWIGLU_BACKWARD: tl.constexpr = tl.constexpr(2)


@triton.jit
def _clamped_swiglu(gate, up, alpha, limit):
    """GPT-OSS's gate: ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``."""
    g = tl.minimum(gate, limit)
    u = tl.minimum(tl.maximum(up, -limit), limit)
    return (u + 1.0) * g * tl.sigmoid(alpha * g)


@triton.jit
def _clamped_swiglu_grads(gate, up, dh, alpha, limit):
    """(d gate, d up) of :func:`_clamped_swiglu`: zero where the clamp held the value (torch's clamp passes the
    gradient on its bounds, ``-limit <= up <= limit`` and ``gate <= limit``, and so does this)."""
    g = tl.minimum(gate, limit)
    u = tl.minimum(tl.maximum(up, -limit), limit)
    s = tl.sigmoid(alpha * g)
    d_gate = dh * (u + 1.0) * (s + alpha * g * s * (1.0 - s))
    d_up = dh * g * s
    return tl.where(gate <= limit, d_gate, 0.0), tl.where((up >= -limit) & (up <= limit), d_up, 0.0)


@triton.jit
def grouped_matmul_kernel(
    x_ptr, w_ptr, out_ptr, offs_ptr,
    idx_ptr,                                 # GATHER_K > 0: row r of the product is x[idx[r] // GATHER_K]
    dh_ptr,                                  # EPILOGUE_SWIGLU_BACKWARD: the gradient of the gate's output
    bias_ptr,                                # HAS_BIAS: (E, N), or (E, 2N) gate/up biases in w's column layout
    M, N, K, E,
    ROWS_BUCKET,                             # not used: the autotuner's key (moe_configs.rows_bucket)
    stride_xm, stride_xk,                    # x (M, K), or (tokens, K) when gathering
    stride_we, stride_wk, stride_wn,         # w (E, K, N), or (E, K, 2N) with a gate epilogue
    stride_om, stride_on,                    # out (M, N), or (M, 2N) for the gate's backward
    stride_dm, stride_dn,                    # dh (M, N)
    stride_be, stride_bn,                    # bias (E, N), or (E, 2N) with a gate epilogue
    alpha, limit,                            # CLAMPED: GPT-OSS's gate
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    EVEN_K: tl.constexpr, INPUT_PRECISION: tl.constexpr, INDEX_64: tl.constexpr,
    GATHER_K: tl.constexpr = 0, EPILOGUE: tl.constexpr = 0, HAS_BIAS: tl.constexpr = False,
    CLAMPED: tl.constexpr = False, INTERLEAVED: tl.constexpr = False,
):
    """out[tile] = x[tile rows] @ w[e][:, tile cols] (+ bias[e]) for the tile-th row tile of the schedule; grid
    (cdiv(M, BLOCK_M) + E, cdiv(N, BLOCK_N)). Tiles past the groups zero the rows past offsets[E-1].

    ``GATHER_K > 0`` reads the rows through an index (the MoE permutation: sorted row ``r`` is token
    ``idx[r] // k``), so the sorted copy of the tokens is never written. With a gate epilogue each
    program computes the gate tile and the matching up tile (``N`` columns further, or, INTERLEAVED,
    the next column: the strides stay the tensor's own, so a unit column stride is still a
    compile-time constant) from the same ``x`` tiles — two dots per K step — adds their biases, and
    stores ``silu(gate) * up`` (or, CLAMPED, GPT-OSS's clamped SwiGLU; N columns), or, in the
    backward, ``[d gate | d up]`` (2N columns, in w's column layout)."""
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    idx, starts, ends = _group_bounds(offs_ptr, M, E, BLOCK_E)
    tiles = tl.cdiv(ends - starts, BLOCK_M)
    tile_ends = tl.cumsum(tiles, axis=0)
    group = tl.sum((tile_ends <= tile).to(tl.int32), axis=0)  # groups whose tiles all come before this one
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    if INDEX_64:
        offs_n = offs_n.to(tl.int64)
    # A gate column's position and its up column's offset, in w, out (the backward's) and bias.
    if INTERLEAVED:
        cols = 2 * offs_n
        up_w, up_out, up_bias = stride_wn, stride_on, stride_bn
    else:
        cols = offs_n
        up_w, up_out, up_bias = N * stride_wn, N * stride_on, N * stride_bn
    if group < E:
        first_tile = _pick(tile_ends - tiles, idx, group)
        row_start = _pick(starts, idx, group) + (tile - first_tile) * BLOCK_M
        row_end = _pick(ends, idx, group)
        rows = row_start + tl.arange(0, BLOCK_M)
        m_ok = rows < row_end
        if GATHER_K > 0:
            src = tl.load(idx_ptr + rows, mask=m_ok, other=0) // GATHER_K
        else:
            src = rows
        ks = tl.arange(0, BLOCK_K)
        expert = group
        if INDEX_64:
            rows = rows.to(tl.int64)
            src = src.to(tl.int64)
            ks = ks.to(tl.int64)
            expert = expert.to(tl.int64)
        x_ptrs = x_ptr + src[:, None] * stride_xm + ks[None, :] * stride_xk
        w_ptrs = w_ptr + expert * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if EPILOGUE != EPILOGUE_NONE:
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
                b = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
                if EPILOGUE != EPILOGUE_NONE:
                    b_up = tl.load(w_ptrs + up_w, mask=n_ok[None, :], other=0.0)
            else:
                k_ok = ks < K - k0
                a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                if EPILOGUE != EPILOGUE_NONE:
                    b_up = tl.load(w_ptrs + up_w, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
            if EPILOGUE != EPILOGUE_NONE:
                acc_up = tl.dot(a, b_up, acc_up, input_precision=INPUT_PRECISION)
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
        if HAS_BIAS:  # the expert's bias row, added in fp32 before any gate
            b_ptrs = bias_ptr + expert * stride_be + cols * stride_bn
            acc += tl.load(b_ptrs, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            if EPILOGUE != EPILOGUE_NONE:
                acc_up += tl.load(b_ptrs + up_bias, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if EPILOGUE == EPILOGUE_SWIGLU:
            if CLAMPED:
                out = _clamped_swiglu(acc, acc_up, alpha, limit).to(out_ptr.dtype.element_ty)
            else:
                out = (_activations.silu(acc) * acc_up).to(out_ptr.dtype.element_ty)
        elif EPILOGUE == EPILOGUE_SWIGLU_BACKWARD:
            dh = tl.load(dh_ptr + rows[:, None] * stride_dm + offs_n[None, :] * stride_dn,
                         mask=m_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
            if CLAMPED:
                d_gate, d_up = _clamped_swiglu_grads(acc, acc_up, dh, alpha, limit)
                out = d_gate.to(out_ptr.dtype.element_ty)
                out_up = d_up.to(out_ptr.dtype.element_ty)
            else:
                out = (dh * acc_up * _activations.silu_grad(acc)).to(out_ptr.dtype.element_ty)
                out_up = (dh * _activations.silu(acc)).to(out_ptr.dtype.element_ty)
        else:
            out = acc.to(out_ptr.dtype.element_ty)
    else:
        # Past every group: the rows after offsets[E-1] (no expert) get zeros; spare programs store nothing.
        last_end = tl.max(ends, axis=0)
        row_start = last_end + (tile - tl.sum(tiles, axis=0)) * BLOCK_M
        rows = row_start + tl.arange(0, BLOCK_M)
        m_ok = rows < M
        if INDEX_64:
            rows = rows.to(tl.int64)
        out = tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty)
        out_up = out
    if EPILOGUE == EPILOGUE_SWIGLU_BACKWARD:
        out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on
        tl.store(out_ptrs, out, mask=m_ok[:, None] & n_ok[None, :])
        tl.store(out_ptrs + up_out, out_up, mask=m_ok[:, None] & n_ok[None, :])
    else:
        out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on
        tl.store(out_ptrs, out, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def grouped_matmul_dw_kernel(
    x_ptr, dy_ptr, dw_ptr, offs_ptr,
    idx_ptr,                                 # GATHER_K > 0: row r of x is x[idx[r] // GATHER_K]
    db_ptr,                                  # HAS_BIAS: db (E, N), each expert's column sums of dy
    M, N, K,
    E, ROWS_BUCKET,                          # not used (the grid has E programs on axis 0): the autotuner's key
    stride_xm, stride_xk,                    # x (M, K)
    stride_ym, stride_yn,                    # dy (M, N)
    stride_we, stride_wk, stride_wn,         # dw (E, K, N)
    stride_dbe, stride_dbn,                  # db (E, N)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, INDEX_64: tl.constexpr, GATHER_K: tl.constexpr = 0,
    HAS_BIAS: tl.constexpr = False,
):
    """dw[e][k tile, n tile] = x[rows of e, k tile]^T @ dy[rows of e, n tile]; grid (E, K tiles, N tiles).

    BLOCK_M is the reduction slice (rows of the group per step); BLOCK_K x BLOCK_N the output tile.
    An empty group runs no step and stores zeros. HAS_BIAS: the programs of the first K tile also sum
    their dy tiles over the rows, the bias gradient (deterministic: no atomics).
    """
    e = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_n = tl.program_id(2)
    end = tl.minimum(tl.maximum(tl.load(offs_ptr + e), 0), M)
    start = tl.minimum(tl.maximum(tl.load(offs_ptr + e - 1, mask=e > 0, other=0), 0), end)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok = offs_k < K
    n_ok = offs_n < N
    ms = tl.arange(0, BLOCK_M)
    if INDEX_64:
        offs_k = offs_k.to(tl.int64)
        offs_n = offs_n.to(tl.int64)
        ms = ms.to(tl.int64)
        e = e.to(tl.int64)
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    if HAS_BIAS:
        acc_b = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + ms
        m_ok = rows < end
        if GATHER_K > 0:
            src = (tl.load(idx_ptr + rows, mask=m_ok, other=0) // GATHER_K).to(rows.dtype)
        else:
            src = rows
        xt = tl.load(x_ptr + offs_k[:, None] * stride_xk + src[None, :] * stride_xm,
                     mask=k_ok[:, None] & m_ok[None, :], other=0.0)       # x^T tile (BLOCK_K, BLOCK_M)
        dy = tl.load(dy_ptr + rows[:, None] * stride_ym + offs_n[None, :] * stride_yn,
                     mask=m_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(xt, dy.to(xt.dtype), acc, input_precision=INPUT_PRECISION)
        if HAS_BIAS:
            acc_b += tl.sum(dy.to(tl.float32), axis=0)
    tl.store(dw_ptr + e * stride_we + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn,
             acc.to(dw_ptr.dtype.element_ty), mask=k_ok[:, None] & n_ok[None, :])
    if HAS_BIAS:
        if pid_k == 0:  # every K tile summed the same dy: the first stores
            tl.store(db_ptr + e * stride_dbe + offs_n * stride_dbn, acc_b.to(db_ptr.dtype.element_ty), mask=n_ok)


# ----------------------------------------------------------------------------------------------
# The schedule, for reading
# ----------------------------------------------------------------------------------------------


def grouped_tile_map(offsets: list[int], block_m: int,
                     num_rows: int | None = None) -> list[tuple[int | None, int, int]]:
    """The row tiles :func:`grouped_matmul_kernel` visits, in program order: ``(group, row_start, row_end)``.

    Program ``i`` along the grid's first axis computes tile ``i`` (for every column tile). Each
    group's rows are cut into ``block_m``-row tiles, its last one partial; empty groups get none.
    Given ``num_rows`` (M), the rows past ``offsets[-1]`` follow as tiles of group ``None`` (the
    kernel writes zeros there). The grid has ``cdiv(M, block_m) + E`` row programs: those past
    this list are spare and store nothing.
    """
    tiles: list[tuple[int | None, int, int]] = []
    start = 0
    for group, end in enumerate(offsets):
        for row in range(start, end, block_m):
            tiles.append((group, row, min(row + block_m, end)))
        start = max(start, end)
    if num_rows is not None:
        for row in range(start, num_rows, block_m):
            tiles.append((None, row, min(row + block_m, num_rows)))
    return tiles


def grouped_matmul_ideal_bytes(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor) -> int:
    """The least traffic of a grouped GEMM: x, the weights of experts with at least one row, out and
    offsets, each once. (Reads ``offsets`` on the host: a benchmark helper, not for the forward path.)"""
    ends = offsets.detach().cpu().to(torch.int64).clamp(0, x.shape[0])
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    used = int(((ends - starts) > 0).sum())
    per_expert = w.shape[1] * w.shape[2] * w.element_size()
    return (x.numel() * x.element_size() + used * per_expert + out.numel() * out.element_size()
            + offsets.numel() * offsets.element_size())


# ----------------------------------------------------------------------------------------------
# Launch
# ----------------------------------------------------------------------------------------------


def _index_64(*tensors: torch.Tensor) -> bool:
    return _launch.needs_int64(*(sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()) if s > 0) + 1024
                                 for t in tensors))


_EPILOGUES = {"none": 0, "swiglu": 1, "swiglu_backward": 2, "swiglu_oai": 1, "swiglu_oai_backward": 2}


def launch_grouped_matmul(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor,
                          config: MatmulConfig | None = None, *, gather: torch.Tensor | None = None,
                          gather_k: int = 1, epilogue: str = "none", dh: torch.Tensor | None = None,
                          bias: torch.Tensor | None = None, interleaved: bool = False, alpha: float = 1.702,
                          limit: float = 7.0) -> None:
    """out = grouped x @ w (+ bias[e]) (one launch; rows past offsets[-1] zeroed). Inputs already checked.

    ``gather`` (int32, one entry per output row): row ``r`` reads ``x[gather[r] // gather_k]``.
    ``epilogue="swiglu"``: ``w`` is ``(E, K, 2N)`` (gate columns, then up; ``interleaved``: gate, up,
    gate, up, ...), out ``(M, N)`` gets ``silu(gate) * up``; ``"swiglu_oai"`` GPT-OSS's clamped gate
    with ``alpha`` and ``limit``; ``"swiglu_backward"`` / ``"swiglu_oai_backward"``: out ``(M, 2N)``
    gets ``[d gate | d up]`` (in w's column layout) from ``dh`` ``(M, N)``. ``bias`` ``(E, N)``, or
    ``(E, 2N)`` in w's column layout with a gate epilogue, is added before the gate.
    """
    M = out.shape[0]
    K = x.shape[1]
    E = w.shape[0]
    gated = epilogue != "none"
    N = w.shape[2] // 2 if gated else w.shape[2]
    if out.numel() == 0:
        return
    if E == 0 or (K == 0 and bias is None):
        out.zero_()  # no expert, or an empty reduction: every row is zero (for the SwiGLU and its
        return       # backward too: gate = up = 0 gives silu(0) * 0 = 0 and zero gradients)
    kind = "gate_up_backward" if epilogue.endswith("_backward") else "gate_up" if gated else "matmul"
    if config is None:
        config = moe_configs.fixed_config(kind, M, E, N, K, x.dtype, interleaved=gated and interleaved)
    idx = offsets if gather is None else gather
    dh_ = out if dh is None else dh
    bias_ = out if bias is None else bias
    args = (x, w, out, offsets, idx, dh_, bias_, M, N, K, E, moe_configs.rows_bucket(M, E), *x.stride(),
            *w.stride(), *out.stride(), *dh_.stride(), *((0, 0) if bias is None else bias.stride()), float(alpha),
            float(limit))
    constexprs = dict(
        BLOCK_E=max(2, _launch.next_power_of_2(E)), INPUT_PRECISION=_launch.dot_input_precision(x.dtype),
        INDEX_64=_index_64(x, w, out, dh_, bias_), GATHER_K=0 if gather is None else gather_k,
        EPILOGUE=_EPILOGUES[epilogue], HAS_BIAS=bias is not None, CLAMPED=epilogue.startswith("swiglu_oai"),
        INTERLEAVED=gated and interleaved,
    )
    if config is None:  # on a GPU: autotuned (moe_configs), the grid from the chosen tile
        grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) + E, triton.cdiv(N, meta["BLOCK_N"]))  # noqa: E731
        moe_configs.autotuned(kind, x.dtype == torch.float32)[grid](*args, **constexprs)
        return
    grid = (triton.cdiv(M, config.BLOCK_M) + E, triton.cdiv(N, config.BLOCK_N))
    grouped_matmul_kernel[grid](*args, BLOCK_M=config.BLOCK_M, BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K,
                                EVEN_K=K % config.BLOCK_K == 0, **constexprs, **config.launch_options)


def launch_grouped_dw(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, dw: torch.Tensor,
                      config: MatmulConfig | None = None, *, gather: torch.Tensor | None = None,
                      gather_k: int = 1, db: torch.Tensor | None = None) -> None:
    """dw[e] = x_e^T dy_e for every expert (zeros for empty ones), one launch; with ``gather``, row
    ``r`` of x is ``x[gather[r] // gather_k]``; with ``db`` ``(E, N)``, also each expert's column sums of dy."""
    M = dy.shape[0]
    K = x.shape[1]
    E, _, N = dw.shape
    if dw.numel() == 0 and (db is None or db.numel() == 0):
        return
    if M == 0 or K == 0:
        dw.zero_()
        if db is not None:
            if M == 0:
                db.zero_()
            else:  # no K tile to carry the bias sums: do them in torch (a degenerate shape)
                launch_grouped_dw(x.new_zeros(x.shape[0], 1), dy, offsets, dw.new_empty(E, 1, N), config,
                                  gather=gather, gather_k=gather_k, db=db)
        return
    if config is None:
        config = moe_configs.fixed_config("dw", M, E, N, K, x.dtype)
    db_ = dw if db is None else db
    args = (x, dy, dw, offsets, offsets if gather is None else gather, db_, M, N, K, E, moe_configs.rows_bucket(M, E),
            *x.stride(), *dy.stride(), *dw.stride(), *(db.stride() if db is not None else (0, 0)))
    constexprs = dict(INPUT_PRECISION=_launch.dot_input_precision(x.dtype), INDEX_64=_index_64(x, dy, dw, db_),
                      GATHER_K=0 if gather is None else gather_k, HAS_BIAS=db is not None)
    if config is None:  # on a GPU: autotuned (moe_configs)
        grid = lambda meta: (E, triton.cdiv(K, meta["BLOCK_K"]), triton.cdiv(N, meta["BLOCK_N"]))  # noqa: E731
        moe_configs.autotuned("dw", x.dtype == torch.float32)[grid](*args, **constexprs)
        return
    grid = (E, triton.cdiv(K, config.BLOCK_K), triton.cdiv(N, config.BLOCK_N))
    grouped_matmul_dw_kernel[grid](*args, BLOCK_M=config.BLOCK_M, BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K,
                                   **constexprs, **config.launch_options)


# ----------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------


def _check_args(x: object, w: object, offsets: object, bias: object = None) -> None:
    check_tensor(_OP, "x", x)
    check_tensor(_OP, "w", w)
    check_tensor(_OP, "offsets", offsets)
    check_float_dtype(_OP, "x", x)
    check_float_dtype(_OP, "w", w)
    check_same_dtype(_OP, "x", x, "w", w)
    check_same_device(_OP, "x", x, "w", w)
    check_same_device(_OP, "x", x, "offsets", offsets)
    if x.dim() != 2:
        raise ValueError(f"{_OP}: x must be 2-D (rows, K), rows sorted by expert; got shape {tuple(x.shape)}")
    if w.dim() != 3:
        raise ValueError(f"{_OP}: w must be 3-D (experts, K, N); got shape {tuple(w.shape)}")
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"{_OP}: w's dim 1 ({w.shape[1]}) must equal x's last dim K ({x.shape[1]}); got x of "
                         f"shape {tuple(x.shape)} and w of shape {tuple(w.shape)} (a (E, N, K) weight: pass "
                         "w.transpose(1, 2), no copy)")
    if offsets.dtype != torch.int32:
        raise TypeError(f"{_OP}: offsets must be int32 (cumulative group ends, torch._grouped_mm's offs), "
                        f"got {offsets.dtype} (convert with .to(torch.int32))")
    if tuple(offsets.shape) != (w.shape[0],):
        raise ValueError(f"{_OP}: offsets must have shape (E,) = ({w.shape[0]},), one cumulative end per expert "
                         f"of w; got shape {tuple(offsets.shape)}")
    if bias is not None:
        check_tensor(_OP, "bias", bias)
        check_float_dtype(_OP, "bias", bias)
        check_same_device(_OP, "x", x, "bias", bias)
        if tuple(bias.shape) != (w.shape[0], w.shape[2]):
            raise ValueError(f"{_OP}: bias must be (E, N) = ({w.shape[0]}, {w.shape[2]}), one row per expert; got "
                             f"shape {tuple(bias.shape)}")


def _check_values(x: torch.Tensor, offsets: torch.Tensor) -> None:
    """offsets non-negative, non-decreasing and at most M, by the value-check policy (no host sync on CUDA)."""
    if offsets.numel() == 0:
        return
    message = (f"{_OP}: offsets must be non-negative, non-decreasing and at most x's rows M = {x.shape[0]} "
               "(offsets[e] is the end of expert e's rows)")
    check_values(
        (offsets,),
        lambda: (offsets[0] >= 0) & (offsets[-1] <= x.shape[0]) & (offsets[1:] >= offsets[:-1]).all(),
        message, lambda: f"{message}; got {offsets.tolist()}",
    )


# ----------------------------------------------------------------------------------------------
# The custom ops
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("kernel_ladder::grouped_matmul", mutates_args=())
def _grouped_matmul_op(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    _check_args(x, w, offsets, bias)
    runtime.require_launchable(_OP, x, w, offsets)
    _check_values(x, offsets)
    out = _launch.empty_output((x.shape[0], w.shape[2]), x)
    launch_grouped_matmul(x, w, offsets, out, bias=bias)
    return out


@_grouped_matmul_op.register_fake
def _grouped_matmul_fake(x, w, offsets, bias=None):
    _check_args(x, w, offsets, bias)
    return _launch.empty_output((x.shape[0], w.shape[2]), x)


@torch.library.custom_op("kernel_ladder::grouped_matmul_backward", mutates_args=())
def _grouped_matmul_backward_op(
    grad_out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, need_x: bool, need_w: bool,
    need_bias: bool = False, bias_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    op = f"{_OP} (backward)"
    check_same_device(op, "grad_out", grad_out, "x", x)
    runtime.require_launchable(op, grad_out, x)
    grad_out = grad_out.to(x.dtype)
    grad_x = x.new_empty(0)
    grad_w = x.new_empty(0)
    grad_b = x.new_empty(0)
    if need_x:
        grad_x = _launch.empty_output(x.shape, x)
        launch_grouped_matmul(grad_out, w.transpose(1, 2), offsets, grad_x)  # dx = dy w^T, rows past the groups 0
    if need_w or need_bias:
        # w.transpose(1, 2) of a contiguous weight: a contiguous gradient. The bias's (each expert's column sums
        # of dy) rides on the weight-gradient kernel.
        grad_w = _launch.empty_in_layout(w)
        if need_bias:
            grad_b = _launch.empty((w.shape[0], w.shape[2]), bias_dtype or x.dtype, x.device)
        launch_grouped_dw(x, grad_out, offsets, grad_w, db=grad_b if need_bias else None)
        if not need_w:
            grad_w = x.new_empty(0)
    return grad_x, grad_w, grad_b


@_grouped_matmul_backward_op.register_fake
def _grouped_matmul_backward_fake(grad_out, x, w, offsets, need_x, need_w, need_bias=False, bias_dtype=None):
    grad_x = _launch.empty_output(x.shape, x) if need_x else x.new_empty(0)
    grad_w = _launch.empty_in_layout(w) if need_w else x.new_empty(0)
    grad_b = x.new_empty((w.shape[0], w.shape[2]), dtype=bias_dtype or x.dtype) if need_bias else x.new_empty(0)
    return grad_x, grad_w, grad_b


def _setup_context(ctx, inputs, output) -> None:
    x, w, offsets, bias = inputs
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.save_for_backward(x, w, offsets)


def _backward(ctx, grad_out: torch.Tensor):
    x, w, offsets = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_b = ctx.bias_dtype is not None and ctx.needs_input_grad[3]
    grad_x, grad_w, grad_b = _grouped_matmul_backward_op(grad_out, x, w, offsets, need_x, need_w, need_b,
                                                         ctx.bias_dtype)
    return (grad_x if need_x else None, grad_w if need_w else None, None, grad_b if need_b else None)


_grouped_matmul_op.register_autograd(_backward, setup_context=_setup_context)


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, *,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """Each expert's rows of ``x`` times its weight: ``out[offsets[e-1]:offsets[e]] = x[...] @ w[e]``.

    Args:
        x: ``(M, K)`` float32, float16 or bfloat16 rows sorted by expert, any strides (not copied).
        w: ``(E, K, N)`` weights, x's dtype and device, any strides (an ``(E, N, K)`` weight passed as
            ``w.transpose(1, 2)`` is read in place).
        offsets: ``(E,)`` int32 on x's device: the cumulative end row of each expert's group
            (``torch._grouped_mm``'s ``offs``); non-decreasing, at most M. Empty groups are allowed.
        bias: optional ``(E, N)`` float, any strides: ``bias[e]`` is added to expert ``e``'s rows in the
            epilogue (in fp32; GPT-OSS's ``down_proj_bias``). Rows past ``offsets[-1]`` stay zero.

    Returns:
        A new contiguous ``(M, N)`` tensor of x's dtype, fp32-accumulated. Rows past ``offsets[-1]``
        are zero. One kernel launch whatever E, with no host synchronization (see the module
        docstring; :func:`grouped_tile_map` lists its tiles). Differentiable in ``x``, ``w`` and ``bias``
        (``kernel_ladder::grouped_matmul_backward``; the bias's gradient, each expert's column sums of the
        output's, comes from the weight-gradient kernel).
    """
    if not schema_types(tensors=(x, w, offsets), optional_tensors=(bias,)):
        _check_args(x, w, offsets, bias)  # the op checks values
    return _grouped_matmul_op(x, w, offsets, bias)
