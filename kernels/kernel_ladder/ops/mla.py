"""DeepSeek-V3's multi-head latent attention (MLA) over a paged *latent* cache, absorbed, as
``kernel_ladder::mla_attention``; the cache write ``kernel_ladder::write_latent_cache``; and the exact byte
counts of the latent cache against GQA/MHA caches of the same model. Forward only: an inference op.

**What the cache holds.** DeepSeek-V3's attention (transformers' ``DeepseekV3Attention``) projects each
token's hidden state with ``kv_a_proj_with_mqa`` to ``[c | k_pe]``: ``c`` (``kv_lora_rank = L`` features,
then RMS-normalized by ``kv_a_layernorm``) and one RoPE key ``k_pe`` (``qk_rope_head_dim = R``, rotated, shared
by every head). ``kv_b_proj`` (weight ``(H * (qk_nope_head_dim + v_head_dim), L)``, viewed as
``(H, nope + v, L)``) expands ``c`` per head into ``k_nope_h = W_UK_h c`` (its first ``nope`` rows) and
``v_h = W_UV_h c`` (the last ``v`` rows). The cache stores only ``[c | k_pe]``: ``L + R`` numbers a token, one
vector shared by all heads, instead of ``H (qk_head_dim + v_head_dim)`` (see :func:`cache_bytes_per_token`).

**Absorption.** The expansion never has to happen at decode time::

    q_nope_h . k_nope_h,j = q_nope_h^T W_UK_h c_j = (W_UK_h^T q_nope_h) . c_j = q_latent_h . c_j
    sum_j p_j v_h,j       = W_UV_h (sum_j p_j c_j)

so with ``q_latent_h = W_UK_h^T q_nope_h`` (:func:`absorb_query`) each head's score is
``scale * (q_latent_h . c_j + q_rope_h . k_pe_j)`` and its output ``softmax(scores) @ c``, an ``L``-vector
that ``W_UV_h`` (:func:`project_output`) turns into the ``v_head_dim`` output. The scale stays DeepSeek's
``qk_head_dim ** -0.5`` (nope + rope, 192 for V3; times YaRN's mscale squared): absorption changes no score.

**The kernel.** :func:`mla_attention_kernel` is paged attention (see :mod:`kernel_ladder.ops.paged_attention`)
with one KV "head" that every query head shares, like MQA: a program holds up to ``heads_per_program``
query heads of one sequence (every head in the interpreter; 32 on a GPU, 16 in fp32, where a 32 x 512
float32 accumulator is what fits in registers without spills, see tests/aot/mla.py: a 16-head shard of
DeepSeek-V3 is one program, all 128 heads four, each reading the cache) — and, with ``cu_seqlens_q``, a few
query tokens — as the rows of one tile. Per step it gathers ``PAGES`` blocks' table entries (or walks a block
larger than a step in ``BLOCK_N``-token pieces) and loads the step's tokens' ``c`` (a ``BLOCK_N x L`` tile) and
``k_pe`` (``BLOCK_N x R``) ONCE; ``c`` serves as the key of the first dot (``q_latent c^T``, to which
``q_rope k_pe^T`` is added) and as the value of the second (``p c``). No per-head K or V exists anywhere.
Online softmax in float32, base 2, as paged attention.

**Positions and masks** are paged attention's: decode (``q`` rows = sequences, one token at position
``seq_lens[b] - 1``) or packed chunked prefill with ``cu_seqlens_q`` (causal, bottom-right). Split-KV
(``num_splits``) writes float32 partials and log-sum-exps merged by
:func:`kernel_ladder.ops.paged_attention.paged_attention_merge_kernel`.

**Bad values stay inside the tensors** (as paged attention): a block table entry outside ``[0, num_blocks)``
is clamped into it, ``seq_lens`` to ``[0, max_blocks * block_size]``, query rows that ``cu_seqlens_q`` puts
outside ``q`` are neither read nor written. Value checks (``kernel_ladder.runtime``'s policy) reject them on
the host for CPU tensors; a sequence of length 0 gives output 0.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import _autocast, _launch, runtime
from .._launch import next_power_of_2
from .._validate import FLOAT_DTYPES, check_tensor, schema_types
from .._validate import is_int as _is_int
from .paged_attention import (
    _index_64,
    cache_block,
    check_block_size,
    check_block_table_values,
    check_block_tables,
    check_num_splits,
    merge_splits,
    plan_paged_attention,
    query_tile,
    split_partials,
)
from .write_kv_cache import check_slot_mapping, check_slot_values, max_offset, token_slots, tokens_per_program

__all__ = [
    "DEEPSEEK_V3",
    "GPU_CONFIG",
    "INTERPRETER_CONFIG",
    "MAX_KV_LORA_RANK",
    "MAX_ROPE_DIM",
    "MLAConfig",
    "MLASizes",
    "absorb_query",
    "cache_bytes_per_token",
    "cache_bytes_table",
    "decode_bytes",
    "gather_latent",
    "mla_attention",
    "mla_attention_kernel",
    "mla_sizes",
    "project_output",
    "split_kv_b_weight",
    "write_latent_cache",
    "write_latent_cache_kernel",
]

_OP = "kernel_ladder.mla_attention"
_WRITE_OP = "kernel_ladder.write_latent_cache"

#: The largest kv_lora_rank (DeepSeek-V2/V3: 512) and RoPE dim (64) the kernel takes.
MAX_KV_LORA_RANK: int = 512
MAX_ROPE_DIM: int = 128

_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)
_FLOAT_MIN = tl.constexpr(-3.4028234663852886e38)


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _attend(rows_ptr, keys, key_mask, position, q_lat, q_rot, acc, m_i, l_i, offs_l, offs_r, l_mask, r_mask,
            kv_lora_rank, stride_cd, sm_scale, INPUT_PRECISION: tl.constexpr):
    """Fold one step of cached tokens (``rows_ptr``: each token's row of the cache) into the running
    ``(acc, max, sum)``: the latent tile ``c`` is loaded once, the key of the first dot and the value of the second."""
    c = tl.load(rows_ptr[:, None] + offs_l[None, :] * stride_cd, mask=key_mask[:, None] & l_mask[None, :], other=0.0)
    k_rot = tl.load(rows_ptr[:, None] + (kv_lora_rank + offs_r)[None, :] * stride_cd,
                    mask=key_mask[:, None] & r_mask[None, :], other=0.0)
    qk = tl.dot(q_lat, tl.trans(c), input_precision=INPUT_PRECISION)
    qk = tl.dot(q_rot, tl.trans(k_rot), qk, input_precision=INPUT_PRECISION)
    s = qk * (sm_scale * _LOG2E)
    visible = key_mask[None, :] & (keys[None, :] <= position[:, None])
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(c.dtype), c, acc * alpha[:, None], input_precision=INPUT_PRECISION)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["num_seqs", "num_heads", "heads_per_program", "kv_lora_rank", "rope_dim",
                               "num_splits", "num_rows", "num_blocks", "max_blocks"])
def mla_attention_kernel(
    q_latent_ptr, q_rope_ptr, cache_ptr, out_ptr,      # q_latent, out (rows, H, L); q_rope (rows, H, R)
    partial_out_ptr, partial_lse_ptr,                  # SPLIT: fp32 (splits, rows, H, L) and (splits, rows, H)
    block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr,  # int32 (B, max_blocks), (B,), VARLEN: (B + 1,)
    stride_qlt, stride_qlh, stride_qld,                # q_latent as (rows, H, L)
    stride_qrt, stride_qrh, stride_qrd,                # q_rope as (rows, H, R)
    stride_cb, stride_cs, stride_cd,                   # latent_cache as (block, slot, L + R)
    stride_ot, stride_oh, stride_od,                   # out as (rows, H, L)
    stride_pos, stride_pot, stride_poh, stride_pod,    # partial_out as (split, rows, H, L)
    stride_pls, stride_plt, stride_plh,                # partial_lse as (split, rows, H)
    stride_btb, stride_btp, stride_sl,                 # block_tables as (B, max_blocks); seq_lens
    num_seqs, num_heads, heads_per_program, kv_lora_rank, rope_dim, num_splits,
    sm_scale, num_rows, num_blocks, max_blocks,
    VARLEN: tl.constexpr, SPLIT: tl.constexpr, INDEX_64: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, PAGES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_P: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_RD: tl.constexpr,
):
    """Absorbed MLA of one tile of query rows (heads x tokens of one sequence) over one split of the
    sequence's visible latent pages; grid ``(query programs, cdiv(H, heads_per_program), splits)``.
    Each page's latent vectors are loaded once and used as keys (with their RoPE part) and as values."""
    BLOCK_Q: tl.constexpr = BLOCK_R // GROUP_P  # query tokens per tile
    STEP_PAGES: tl.constexpr = PAGES if PAGES > 0 else 1  # a split holds whole steps
    pid_q = tl.program_id(0)
    pid_h = tl.program_id(1)
    split = tl.program_id(2)
    seq, q_start, q_len, tile = query_tile(cu_seqlens_q_ptr, pid_q, num_seqs, BLOCK_Q, VARLEN)
    seq_len = tl.minimum(tl.maximum(tl.load(seq_lens_ptr + seq * stride_sl), 0), max_blocks * BLOCK_SIZE)
    m0 = tile * BLOCK_Q
    if m0 < q_len:
        rows = tl.arange(0, BLOCK_R)
        tok = m0 + rows // GROUP_P
        g = rows % GROUP_P
        head = pid_h * heads_per_program + g
        q_row = q_start + tok
        row_mask = (tok < q_len) & (g < heads_per_program) & (head < num_heads)
        if VARLEN:
            row_mask = row_mask & (q_row >= 0) & (q_row < num_rows)
        position = seq_len - q_len + tok
        offs_l = tl.arange(0, BLOCK_L)
        offs_r = tl.arange(0, BLOCK_RD)
        l_mask = offs_l < kv_lora_rank
        r_mask = offs_r < rope_dim
        seq_row = seq
        if INDEX_64:
            q_row = q_row.to(tl.int64)
            head = head.to(tl.int64)
            seq_row = seq_row.to(tl.int64)
        q_lat = tl.load(q_latent_ptr + q_row[:, None] * stride_qlt + head[:, None] * stride_qlh
                        + offs_l[None, :] * stride_qld, mask=row_mask[:, None] & l_mask[None, :], other=0.0)
        q_rot = tl.load(q_rope_ptr + q_row[:, None] * stride_qrt + head[:, None] * stride_qrh
                        + offs_r[None, :] * stride_qrd, mask=row_mask[:, None] & r_mask[None, :], other=0.0)

        last = tl.minimum(m0 + BLOCK_Q, q_len) - 1
        hi = tl.maximum(seq_len - q_len + last + 1, 0)
        hi_page = tl.cdiv(hi, BLOCK_SIZE)
        per_split = tl.cdiv(tl.cdiv(hi_page, num_splits), STEP_PAGES) * STEP_PAGES
        start_page = split * per_split
        end_page = tl.minimum(start_page + per_split, hi_page)
        k_hi = tl.minimum(end_page * BLOCK_SIZE, hi)

        offs_n = tl.arange(0, BLOCK_N)
        table_row = block_tables_ptr + seq_row * stride_btb
        acc = tl.zeros([BLOCK_R, BLOCK_L], dtype=tl.float32)
        m_i = tl.full([BLOCK_R], _FLOAT_MIN, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
        if PAGES > 0:  # a step of PAGES whole blocks: their table entries gathered at once
            offs_p = tl.arange(0, PAGES)
            slot = offs_n % BLOCK_SIZE
            for page0 in range(start_page, end_page, PAGES):
                pages = page0 + offs_p
                physical = cache_block(tl.load(table_row + pages * stride_btp, mask=pages < end_page, other=0),
                                       num_blocks, INDEX_64)
                block_of_key = tl.reshape(tl.broadcast_to(physical[:, None], (PAGES, BLOCK_SIZE)), (BLOCK_N,))
                keys = page0 * BLOCK_SIZE + offs_n
                acc, m_i, l_i = _attend(cache_ptr + block_of_key * stride_cb + slot * stride_cs,
                                        keys, keys < k_hi, position, q_lat, q_rot, acc, m_i, l_i, offs_l, offs_r,
                                        l_mask, r_mask, kv_lora_rank, stride_cd, sm_scale, INPUT_PRECISION)
        else:  # a block larger than a step: one table entry, then the block in steps of BLOCK_N tokens
            for page in range(start_page, end_page):
                physical = cache_block(tl.load(table_row + page * stride_btp), num_blocks, INDEX_64)
                block_ptr = cache_ptr + physical * stride_cb
                for sub in range(0, BLOCK_SIZE, BLOCK_N):
                    keys = page * BLOCK_SIZE + sub + offs_n
                    acc, m_i, l_i = _attend(block_ptr + (sub + offs_n) * stride_cs, keys, keys < k_hi,
                                            position, q_lat, q_rot, acc, m_i, l_i, offs_l, offs_r, l_mask, r_mask,
                                            kv_lora_rank, stride_cd, sm_scale, INPUT_PRECISION)
        empty = l_i == 0.0
        l_safe = tl.where(empty, 1.0, l_i)
        out = acc / l_safe[:, None]
        out_mask = row_mask[:, None] & l_mask[None, :]
        if SPLIT:
            tl.store(partial_out_ptr + split * stride_pos + q_row[:, None] * stride_pot + head[:, None] * stride_poh
                     + offs_l[None, :] * stride_pod, out, mask=out_mask)
            lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * _LN2)
            tl.store(partial_lse_ptr + split * stride_pls + q_row * stride_plt + head * stride_plh, lse,
                     mask=row_mask)
        else:
            tl.store(out_ptr + q_row[:, None] * stride_ot + head[:, None] * stride_oh + offs_l[None, :] * stride_od,
                     out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def write_latent_cache_kernel(
    c_ptr, k_rope_ptr, cache_ptr, slot_ptr,            # c_kv (T, L), k_rope (T, R), cache (blocks, bs, L + R)
    n_tokens, num_slots, block_size, kv_lora_rank, rope_dim,
    stride_ct, stride_cd, stride_rt, stride_rd,
    stride_cb, stride_cs, stride_cw, stride_slot,
    INDEX_64: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """``cache[slot // bs, slot % bs] = [c_kv[t] | k_rope[t]]`` for ``BLOCK_T`` tokens, one store of the
    whole ``L + R`` row; slots < 0 (padding) or past the cache are skipped."""
    tokens, write, block, offset = token_slots(slot_ptr, stride_slot, n_tokens, num_slots, block_size, BLOCK_T,
                                               INDEX_64)
    w = tl.arange(0, BLOCK_W)
    is_c = w < kv_lora_rank
    is_r = (w >= kv_lora_rank) & (w < kv_lora_rank + rope_dim)
    rope_index = tl.where(is_r, w - kv_lora_rank, 0)
    c = tl.load(c_ptr + tokens[:, None] * stride_ct + w[None, :] * stride_cd, mask=write[:, None] & is_c[None, :])
    r = tl.load(k_rope_ptr + tokens[:, None] * stride_rt + rope_index[None, :] * stride_rd,
                mask=write[:, None] & is_r[None, :])
    row = tl.where(is_c[None, :], c.to(tl.float32), r.to(tl.float32))
    tl.store(cache_ptr + (block * stride_cb + offset * stride_cs)[:, None] + w[None, :] * stride_cw,
             row.to(cache_ptr.dtype.element_ty), mask=write[:, None] & (is_c | is_r)[None, :])


# ----------------------------------------------------------------------------------------------
# Tiles and launches
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MLAConfig:
    """The tiles of :func:`mla_attention_kernel`: ``block_n`` cached tokens per step (whole cache blocks),
    at most ``max_heads`` query heads per program, ``block_rows`` rows (heads x tokens) per program with
    ``cu_seqlens_q``, ``num_warps``, ``num_stages``."""

    block_n: int
    max_heads: int
    block_rows: int
    num_warps: int = 8
    num_stages: int = 1

    def heads(self, fp32: bool = False) -> int:
        """Query heads per program (rows per program with ``cu_seqlens_q``): half for an fp32 tile on a GPU."""
        return self.max_heads // 2 if fp32 and self is GPU_CONFIG else self.max_heads

    def step(self, block_size: int, fp32: bool = False, index_64: bool = False) -> tuple[int, int]:
        """``(PAGES, BLOCK_N)``: whole blocks per step and the step's tokens; ``PAGES = 0`` when a block is
        larger than a step (the kernel walks it in steps of ``BLOCK_N``). On a GPU an fp32 tile, or int64
        offsets (whose address arithmetic takes twice the registers), take half the tokens."""
        block_n = self.block_n // 2 if (fp32 or index_64) and self is GPU_CONFIG else self.block_n
        if block_n >= block_size:
            return block_n // block_size, block_n
        return 0, block_n


#: The GPU's tiles: 32 heads' 32 x 512 float32 accumulator and a 32-token x 576 latent tile over 8 warps fit in
#: registers without spills on sm_90 (212 registers for bf16; fp32 takes 16 heads and 16 tokens: 229;
#: tests/aot/mla.py prints them).
GPU_CONFIG: MLAConfig = MLAConfig(block_n=32, max_heads=32, block_rows=32, num_warps=8, num_stages=1)
#: The interpreter's: every head of a sequence in one program, few large steps.
INTERPRETER_CONFIG: MLAConfig = MLAConfig(block_n=64, max_heads=128, block_rows=64, num_warps=4, num_stages=1)


def _config() -> MLAConfig:
    return INTERPRETER_CONFIG if runtime.INTERPRETER else GPU_CONFIG


@dataclass(frozen=True)
class _Launch:
    rows: int
    num_seqs: int
    num_heads: int
    varlen: bool
    config: MLAConfig
    fp32: bool = False

    @property
    def heads_per_program(self) -> int:
        return max(1, min(self.num_heads, self.config.heads(self.fp32)))

    @property
    def group_p(self) -> int:
        return next_power_of_2(self.heads_per_program)

    @property
    def block_rows(self) -> int:
        if self.varlen:
            halve = self.fp32 and self.config is GPU_CONFIG
            return max(16, self.group_p, self.config.block_rows // (2 if halve else 1))
        return max(16, self.group_p)

    @property
    def block_q(self) -> int:
        return self.block_rows // self.group_p

    @property
    def query_programs(self) -> int:
        return self.rows // self.block_q + self.num_seqs if self.varlen else self.rows

    @property
    def head_programs(self) -> int:
        return _launch.cdiv(self.num_heads, self.heads_per_program)


def _forward(q_latent, q_rope, latent_cache, block_tables, seq_lens, cu_seqlens_q, out, softmax_scale,
             kv_lora_rank, num_splits) -> None:
    rows, heads, _ = q_latent.shape
    rope_dim = q_rope.shape[-1]
    num_blocks, block_size, _ = latent_cache.shape
    if rows == 0 or heads == 0:
        return
    varlen = cu_seqlens_q is not None
    config = _config()
    plan = _Launch(rows, seq_lens.shape[0], heads, varlen, config, q_latent.dtype == torch.float32)
    split = num_splits > 1
    partial_out, partial_lse, pstrides, lstrides = split_partials(out, num_splits)
    index_64 = _index_64(q_latent, q_rope, latent_cache, out, block_tables, *((partial_out,) if split else ()))
    block_l = max(16, next_power_of_2(kv_lora_rank))
    pages, block_n = config.step(block_size, q_latent.dtype == torch.float32, index_64)
    mla_attention_kernel[(plan.query_programs, plan.head_programs, num_splits)](
        q_latent, q_rope, latent_cache, out, partial_out, partial_lse,
        block_tables, seq_lens, cu_seqlens_q if varlen else seq_lens,
        *q_latent.stride(), *q_rope.stride(), *latent_cache.stride(), *out.stride(), *pstrides, *lstrides,
        block_tables.stride(0), block_tables.stride(1), seq_lens.stride(0),
        seq_lens.shape[0], heads, plan.heads_per_program, kv_lora_rank, rope_dim, num_splits,
        float(softmax_scale), rows, num_blocks, block_tables.shape[1] if num_blocks else 0,
        VARLEN=varlen, SPLIT=split, INDEX_64=index_64, INPUT_PRECISION=_launch.dot_input_precision(q_latent.dtype),
        BLOCK_SIZE=block_size, PAGES=pages, BLOCK_N=block_n, BLOCK_R=plan.block_rows, GROUP_P=plan.group_p,
        BLOCK_L=block_l, BLOCK_RD=max(16, next_power_of_2(rope_dim)), num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if split:
        merge_splits(partial_out, partial_lse, out, index_64)


# ----------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------


def _check(q_latent, q_rope, latent_cache, block_tables, seq_lens, softmax_scale, kv_lora_rank, cu_seqlens_q,
           num_splits) -> None:
    op = _OP
    for name, t in (("q_latent", q_latent), ("q_rope", q_rope), ("latent_cache", latent_cache),
                    ("block_tables", block_tables), ("seq_lens", seq_lens)):
        check_tensor(op, name, t)
    if not _is_int(kv_lora_rank):
        raise TypeError(f"{op}: kv_lora_rank must be an int (the latent width L of the cache's [c | k_pe] rows), "
                        f"got {type(kv_lora_rank).__name__}")
    if not 1 <= kv_lora_rank <= MAX_KV_LORA_RANK:
        raise ValueError(f"{op}: kv_lora_rank must be in [1, {MAX_KV_LORA_RANK}], got {kv_lora_rank}")
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"{op}: softmax_scale must be a float (DeepSeek: qk_head_dim ** -0.5, times YaRN's "
                        f"mscale squared), got {type(softmax_scale).__name__}")
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"{op}: softmax_scale must be a positive finite number, got {softmax_scale}")
    for name, t in (("q_latent", q_latent), ("q_rope", q_rope)):
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{op}: {name} must be float32, float16 or bfloat16, got {t.dtype}")
        if t.dim() != 3:
            layout = "(total_q, H, {})" if cu_seqlens_q is not None else "(B, H, {})"
            raise ValueError(f"{op}: {name} must be 3-D {layout.format('L' if name == 'q_latent' else 'R')}, got "
                             f"shape {tuple(t.shape)}")
    if q_rope.dtype != q_latent.dtype and not _autocast.unifies(op, ("q_latent", q_latent), ("q_rope", q_rope)):
        raise TypeError(f"{op}: q_rope must have q_latent's dtype ({q_latent.dtype}), got {q_rope.dtype}")
    if latent_cache.dim() != 3:
        raise ValueError(f"{op}: latent_cache must be 3-D (num_blocks, block_size, kv_lora_rank + rope_dim), got "
                         f"shape {tuple(latent_cache.shape)} (for one layer of a (layers, ...) cache, pass "
                         "cache[layer])")
    if latent_cache.dtype != q_latent.dtype and not _autocast.unifies(op, ("q_latent", q_latent),
                                                                      ("latent_cache", latent_cache)):
        raise TypeError(f"{op}: latent_cache must have q_latent's dtype ({q_latent.dtype}), got {latent_cache.dtype}")
    for name, t in (("q_rope", q_rope), ("latent_cache", latent_cache), ("block_tables", block_tables),
                    ("seq_lens", seq_lens)):
        if t.device != q_latent.device:
            raise ValueError(f"{op}: q_latent and {name} must be on the same device, got {q_latent.device} and "
                             f"{t.device}")
    num_blocks, block_size, width = latent_cache.shape
    check_block_size(op, "latent_cache", block_size)
    if q_latent.shape[-1] != kv_lora_rank:
        raise ValueError(f"{op}: q_latent's last dim must be kv_lora_rank = {kv_lora_rank} (q_nope absorbed "
                         f"through W_UK), got {q_latent.shape[-1]}")
    rope_dim = width - kv_lora_rank
    if not 1 <= rope_dim <= MAX_ROPE_DIM:
        raise ValueError(f"{op}: latent_cache's last dim must be kv_lora_rank + rope_dim with rope_dim in "
                         f"[1, {MAX_ROPE_DIM}]; got {width} for kv_lora_rank {kv_lora_rank}")
    if q_rope.shape[-1] != rope_dim:
        raise ValueError(f"{op}: q_rope's last dim must be the cache's rope_dim = {width} - {kv_lora_rank} = "
                         f"{rope_dim}, got {q_rope.shape[-1]}")
    if q_rope.shape[:2] != q_latent.shape[:2]:
        raise ValueError(f"{op}: q_rope and q_latent must have the same (rows, H), got {tuple(q_rope.shape[:2])} "
                         f"and {tuple(q_latent.shape[:2])}")
    check_block_tables(op, "q_latent", q_latent, block_tables, seq_lens, cu_seqlens_q)
    check_num_splits(op, num_splits)


def _check_write(c_kv, k_rope, latent_cache, slot_mapping) -> None:
    op = _WRITE_OP
    for name, t in (("c_kv", c_kv), ("k_rope", k_rope), ("latent_cache", latent_cache),
                    ("slot_mapping", slot_mapping)):
        check_tensor(op, name, t)
    for name, t in (("c_kv", c_kv), ("k_rope", k_rope)):
        if t.dim() != 2:
            raise ValueError(f"{op}: {name} must be 2-D (T, {'L' if name == 'c_kv' else 'R'}): one row per token, "
                             f"got shape {tuple(t.shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{op}: {name} must be float32, float16 or bfloat16, got {t.dtype}")
    if latent_cache.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: latent_cache must be float32, float16 or bfloat16, got {latent_cache.dtype}")
    if latent_cache.dim() != 3:
        raise ValueError(f"{op}: latent_cache must be 3-D (num_blocks, block_size, kv_lora_rank + rope_dim), got "
                         f"shape {tuple(latent_cache.shape)}")
    if k_rope.shape[0] != c_kv.shape[0]:
        raise ValueError(f"{op}: c_kv and k_rope must have the same number of tokens, got {c_kv.shape[0]} and "
                         f"{k_rope.shape[0]}")
    if c_kv.shape[1] + k_rope.shape[1] != latent_cache.shape[2]:
        raise ValueError(f"{op}: the cache's last dim must be kv_lora_rank + rope_dim = {c_kv.shape[1]} + "
                         f"{k_rope.shape[1]} (c_kv's and k_rope's widths), got {latent_cache.shape[2]}")
    check_slot_mapping(op, slot_mapping, "c_kv", c_kv.shape[0])
    for name, t in (("k_rope", k_rope), ("latent_cache", latent_cache), ("slot_mapping", slot_mapping)):
        if t.device != c_kv.device:
            raise ValueError(f"{op}: c_kv and {name} must be on the same device, got {c_kv.device} and {t.device}")


# ----------------------------------------------------------------------------------------------
# The custom ops
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("kernel_ladder::mla_attention", mutates_args=())
def _mla_attention_op(q_latent: torch.Tensor, q_rope: torch.Tensor, latent_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor | None,
                      softmax_scale: float, kv_lora_rank: int, num_splits: int) -> torch.Tensor:
    _check(q_latent, q_rope, latent_cache, block_tables, seq_lens, softmax_scale, kv_lora_rank, cu_seqlens_q,
           num_splits)
    runtime.require_launchable(_OP, q_latent, q_rope, latent_cache, block_tables, seq_lens)
    check_block_table_values(_OP, q_latent, block_tables, seq_lens, cu_seqlens_q, latent_cache.shape[1],
                             latent_cache.shape[0])
    out = _launch.empty_output(q_latent.shape, q_latent)
    _forward(q_latent, q_rope, latent_cache, block_tables, seq_lens, cu_seqlens_q, out, softmax_scale, kv_lora_rank,
             num_splits)
    return out


@_mla_attention_op.register_fake
def _mla_attention_fake(q_latent, q_rope, latent_cache, block_tables, seq_lens, cu_seqlens_q, softmax_scale,
                        kv_lora_rank, num_splits):
    _check(q_latent, q_rope, latent_cache, block_tables, seq_lens, softmax_scale, kv_lora_rank, cu_seqlens_q,
           num_splits)
    return _launch.empty_output(q_latent.shape, q_latent)


def _no_backward(ctx, grad_out):
    raise NotImplementedError(f"{_OP} is forward only (an inference op over a latent cache): it has no gradient. "
                              "Run it under torch.no_grad(), or train with the unabsorbed attention "
                              "(kernel_ladder.flash_attention over the expanded keys and values)")


def _setup_context(ctx, inputs, output) -> None:
    pass


_mla_attention_op.register_autograd(_no_backward, setup_context=_setup_context)


@torch.library.custom_op("kernel_ladder::write_latent_cache", mutates_args=("latent_cache",))
def _write_latent_cache_op(c_kv: torch.Tensor, k_rope: torch.Tensor, latent_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
    _check_write(c_kv, k_rope, latent_cache, slot_mapping)
    runtime.require_launchable(_WRITE_OP, c_kv, k_rope, latent_cache, slot_mapping)
    num_blocks, block_size, width = latent_cache.shape
    check_slot_values(_WRITE_OP, slot_mapping, num_blocks * block_size)
    n_tokens = c_kv.shape[0]
    if n_tokens == 0 or num_blocks == 0:
        return
    block_w = next_power_of_2(width)
    block_t = tokens_per_program(n_tokens, width)
    # The largest offsets written (a valid slot's) and read (the last program's padding tokens included).
    index_64 = _launch.needs_int64(max_offset(latent_cache), num_blocks * block_size,
                                   max_offset(c_kv) + block_t * abs(c_kv.stride(0)),
                                   max_offset(k_rope) + block_t * abs(k_rope.stride(0)))
    write_latent_cache_kernel[(triton.cdiv(n_tokens, block_t),)](
        c_kv, k_rope, latent_cache, slot_mapping,
        n_tokens, num_blocks * block_size, block_size, c_kv.shape[1], k_rope.shape[1],
        *c_kv.stride(), *k_rope.stride(), *latent_cache.stride(), slot_mapping.stride(0),
        INDEX_64=index_64, BLOCK_T=block_t, BLOCK_W=block_w, num_warps=4,
    )


@_write_latent_cache_op.register_fake
def _write_latent_cache_fake(c_kv, k_rope, latent_cache, slot_mapping) -> None:
    _check_write(c_kv, k_rope, latent_cache, slot_mapping)


# ----------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------


def _resolve_splits(q_latent, latent_cache, block_tables, cu_seqlens_q, num_splits) -> int:
    if num_splits is not None:
        return int(num_splits)
    plan = _Launch(q_latent.shape[0], block_tables.shape[0], q_latent.shape[1], cu_seqlens_q is not None, _config(),
                   q_latent.dtype == torch.float32)
    block_size = latent_cache.shape[1]
    return plan_paged_attention(plan.query_programs, plan.head_programs, block_tables.shape[1] * block_size,
                                block_size, q_latent.device)


def mla_attention(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int,
    cu_seqlens_q: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """DeepSeek-V3's absorbed attention over a paged latent cache (decode, or chunked prefill with ``cu_seqlens_q``).

    ``score_j = softmax_scale * (q_latent . c_j + q_rope . k_pe_j)``, ``out = softmax(score) @ c`` per head,
    where the cache's row for token ``j`` is ``[c_j | k_pe_j]``. See the module docstring.

    Args:
        q_latent: ``(rows, H, kv_lora_rank)`` float32/float16/bfloat16, any strides: ``q_nope`` absorbed
            through ``W_UK`` (:func:`absorb_query`). Decode: ``rows = B``, one token per sequence at position
            ``seq_lens[b] - 1``; with ``cu_seqlens_q``: the newest ``q_len_b`` tokens of each sequence packed.
        q_rope: ``(rows, H, rope_dim)``, q_latent's dtype: the rotated RoPE part of each head's query.
        latent_cache: ``(num_blocks, block_size, kv_lora_rank + rope_dim)``, q_latent's dtype, any strides:
            token ``j`` of sequence ``b`` in block ``block_tables[b, j // block_size]``, slot ``j % block_size``
            (:func:`write_latent_cache`). ``block_size`` a power of two from 8 to 128.
        block_tables: int32 ``(B, max_blocks)``; the entries a sequence uses must be in ``[0, num_blocks)``
            (a value check); unchecked, an entry outside is clamped into the cache.
        seq_lens: int32 ``(B,)``: cached tokens per sequence, the new ones included; 0 gives output 0.
        softmax_scale: the scale of the scores: DeepSeek's ``qk_head_dim ** -0.5`` (nope + rope dims: absorption
            changes no score), times YaRN's ``mscale ** 2`` where the model uses it.
        kv_lora_rank: ``L``, the width of ``c`` in the cache's rows.
        cu_seqlens_q: int32 ``(B + 1,)``: packed query ends; query ``i`` of sequence ``b`` is at position
            ``seq_lens[b] - q_len_b + i`` and sees cached tokens at positions ``<=`` its own.
        num_splits: split-KV: each query tile's tokens in ``num_splits`` ranges merged by log-sum-exp;
            ``None``: :func:`kernel_ladder.ops.paged_attention.plan_paged_attention` chooses.

    Returns:
        ``(rows, H, kv_lora_rank)`` in q_latent's dtype (float32 accumulation): ``softmax @ c`` per head, for
        :func:`project_output` (``W_UV``) to turn into each head's ``v_head_dim`` output.

    Forward only (a backward raises ``NotImplementedError``).
    """
    _check(q_latent, q_rope, latent_cache, block_tables, seq_lens, softmax_scale, kv_lora_rank, cu_seqlens_q,
           num_splits)
    splits = _resolve_splits(q_latent, latent_cache, block_tables, cu_seqlens_q, num_splits)
    return _mla_attention_op(q_latent, q_rope, latent_cache, block_tables, seq_lens, cu_seqlens_q,
                             float(softmax_scale), kv_lora_rank, splits)


def write_latent_cache(c_kv: torch.Tensor, k_rope: torch.Tensor, latent_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """Write each token's ``[c_kv[t] | k_rope[t]]`` into its slot of a paged latent cache, in place.

    Args:
        c_kv: ``(T, kv_lora_rank)`` float32/float16/bfloat16, any strides: the normalized compressed KV.
        k_rope: ``(T, rope_dim)``, any float dtype and strides: the rotated shared RoPE key.
        latent_cache: ``(num_blocks, block_size, kv_lora_rank + rope_dim)`` float32/float16/bfloat16 (values are
            cast to it, rounding to nearest even), any strides; written in place, nothing else of it touched.
        slot_mapping: ``(T,)`` int32 or int64: token ``t`` goes to block ``slot // block_size``, offset
            ``slot % block_size``. Negative slots are padding, skipped; a slot ``>= num_blocks * block_size`` is
            an error (a value check) and, unchecked, is never written.
    """
    if not schema_types(tensors=(c_kv, k_rope, latent_cache, slot_mapping)):
        _check_write(c_kv, k_rope, latent_cache, slot_mapping)
    _write_latent_cache_op(c_kv, k_rope, latent_cache, slot_mapping)


def gather_latent(latent_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> list[torch.Tensor]:
    """Each sequence's cached ``[c | k_pe]`` rows as a dense ``(seq_len, L + R)`` tensor (torch gathers; syncs
    with the host): the reference's view of a paged latent cache."""
    block_size = latent_cache.shape[1]
    result = []
    for b, length in enumerate(seq_lens.tolist()):
        n_blocks = triton.cdiv(length, block_size)
        blocks = block_tables[b, :n_blocks].long()
        result.append(latent_cache[blocks].reshape(n_blocks * block_size, latent_cache.shape[-1])[:length])
    return result


# ----------------------------------------------------------------------------------------------
# Absorption (torch): the weights of kv_b_proj, per head
# ----------------------------------------------------------------------------------------------


def split_kv_b_weight(weight: torch.Tensor, num_heads: int, qk_nope_head_dim: int,
                      v_head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_b_proj.weight`` ``(H * (nope + v), L)`` as ``(W_UK (H, nope, L), W_UV (H, v, L))`` (views).

    HF's ``kv_b_proj(c).view(..., H, nope + v)`` puts head ``h``'s ``nope`` key rows then its ``v`` value rows
    together: rows ``h * (nope + v) + [0, nope)`` and ``+ [nope, nope + v)``, not the first ``H * nope`` rows."""
    rows = num_heads * (qk_nope_head_dim + v_head_dim)
    if weight.dim() != 2 or weight.shape[0] != rows:
        raise ValueError(f"kernel_ladder.ops.mla.split_kv_b_weight: weight must be (H * (qk_nope_head_dim + "
                         f"v_head_dim), kv_lora_rank) = ({rows}, L), got shape {tuple(weight.shape)}")
    per_head = weight.view(num_heads, qk_nope_head_dim + v_head_dim, weight.shape[1])
    return per_head[:, :qk_nope_head_dim], per_head[:, qk_nope_head_dim:]


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """``q_latent_h = W_UK_h^T q_nope_h``: ``q_nope (..., H, nope)``, ``w_uk (H, nope, L)`` -> ``(..., H, L)``."""
    return torch.einsum("...hn,hnl->...hl", q_nope, w_uk)


def project_output(out_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """``o_h = W_UV_h (softmax @ c)``: ``out_latent (..., H, L)``, ``w_uv (H, v, L)`` -> ``(..., H, v)``."""
    return torch.einsum("...hl,hvl->...hv", out_latent, w_uv)


# ----------------------------------------------------------------------------------------------
# Bytes: the latent cache against GQA/MHA caches of the same model, and the decode kernel's traffic
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MLASizes:
    """The attention sizes that decide a cache's bytes (HF ``DeepseekV3Config``'s names)."""

    num_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


#: DeepSeek-V3 (671B): 128 heads, kv_lora_rank 512, RoPE 64, qk head dim 128 + 64 = 192, v head dim 128.
DEEPSEEK_V3: MLASizes = MLASizes(num_heads=128, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                                 v_head_dim=128)


def mla_sizes(config: object) -> MLASizes:
    """:class:`MLASizes` from an :class:`MLASizes`, an HF config (``num_attention_heads``, ``kv_lora_rank``, ...)
    or a dict with those keys."""
    if isinstance(config, MLASizes):
        return config
    get = config.get if isinstance(config, dict) else lambda name: getattr(config, name)
    return MLASizes(int(get("num_attention_heads")), int(get("kv_lora_rank")), int(get("qk_rope_head_dim")),
                    int(get("qk_nope_head_dim")), int(get("v_head_dim")))


_KINDS = ("mla", "mha", "gqa", "mqa")


def _element_size(dtype: torch.dtype | int) -> int:
    return dtype if isinstance(dtype, int) else torch.empty((), dtype=dtype).element_size()


def cache_bytes_per_token(config: object, kind: str = "mla", *, dtype: torch.dtype | int = torch.bfloat16,
                          num_kv_heads: int | None = None) -> int:
    """Bytes one token adds to one layer's cache, exactly.

    ``kind``: ``"mla"`` the latent cache, ``(kv_lora_rank + qk_rope_head_dim) * elem``; ``"mha"`` a K/V cache of
    every head (keys ``qk_head_dim`` wide, values ``v_head_dim``): ``H * (qk_head_dim + v_head_dim) * elem``
    (``2 * H * head_dim * elem`` when the two are equal); ``"gqa"`` the same with ``num_kv_heads`` heads;
    ``"mqa"`` one head. ``dtype``: the cache's dtype, or its element size in bytes.
    """
    sizes = mla_sizes(config)
    elem = _element_size(dtype)
    if kind == "mla":
        return (sizes.kv_lora_rank + sizes.qk_rope_head_dim) * elem
    heads = {"mha": sizes.num_heads, "mqa": 1, "gqa": num_kv_heads}.get(kind, -1)
    if kind not in _KINDS:
        raise ValueError(f"kernel_ladder.ops.mla.cache_bytes_per_token: kind must be one of {_KINDS}, got {kind!r}")
    if heads is None or heads < 1:
        raise ValueError(f"kernel_ladder.ops.mla.cache_bytes_per_token: kind 'gqa' needs num_kv_heads >= 1, got "
                         f"{num_kv_heads}")
    return heads * (sizes.qk_head_dim + sizes.v_head_dim) * elem


def cache_bytes_table(config: object, *, dtype: torch.dtype | int = torch.bfloat16,
                      gqa_heads: tuple[int, ...] = (8,)) -> list[dict[str, object]]:
    """Rows ``{"cache", "kv_heads", "bytes_per_token", "vs_mla"}``: MHA, GQA with each of ``gqa_heads``, MQA
    and the latent cache of the same model, per token per layer."""
    sizes = mla_sizes(config)
    mla = cache_bytes_per_token(sizes, "mla", dtype=dtype)
    rows = [("MHA", sizes.num_heads, cache_bytes_per_token(sizes, "mha", dtype=dtype))]
    rows += [(f"GQA-{h}", h, cache_bytes_per_token(sizes, "gqa", dtype=dtype, num_kv_heads=h)) for h in gqa_heads]
    rows += [("MQA", 1, cache_bytes_per_token(sizes, "mqa", dtype=dtype)), ("MLA (latent)", 0, mla)]
    return [{"cache": name, "kv_heads": heads, "bytes_per_token": b, "vs_mla": b / mla} for name, heads, b in rows]


def decode_bytes(seq_lens: list[int], num_heads: int, kv_lora_rank: int, rope_dim: int, block_size: int,
                 dtype: torch.dtype | int = torch.bfloat16, *, head_programs: int = 1) -> dict[str, int]:
    """The bytes a decode step of :func:`mla_attention` moves (no split), exactly.

    ``ideal``: every cached token's ``[c | k_pe]`` row read once, the queries read once, the output written once,
    the table entries the sequences use and ``seq_lens`` read once. ``kernel``: what the kernel moves with
    ``head_programs`` programs per sequence (``cdiv(H, heads per program)``: 1 in the interpreter, 8 for 128
    heads on a GPU), each reading the rows, the table entries and the length again.
    """
    elem = _element_size(dtype)
    tokens = sum(seq_lens)
    entries = sum(_launch.cdiv(n, block_size) for n in seq_lens)
    batch = len(seq_lens)
    cache = tokens * (kv_lora_rank + rope_dim) * elem
    queries = batch * num_heads * (kv_lora_rank + rope_dim) * elem
    out = batch * num_heads * kv_lora_rank * elem
    index = 4 * (entries + batch)
    return {"ideal": cache + queries + out + index,
            "kernel": head_programs * (cache + index) + queries + out,
            "cache": cache, "queries": queries, "out": out, "index": index}
