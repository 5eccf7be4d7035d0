"""Paged attention: each sequence's queries attend to its keys read in place from the paged KV
cache through its block table; no gather, no padding to the batch's longest context.

One program per (sequence, KV head, tile of query rows). Under GQA the GROUP query heads that
share a KV head are rows of the same tile, so each K/V byte is read once for all of them. Row i
of a tile is (query j, head g of the group) with i = j * GROUP + g. Running example, GROUP 4,
BLOCK_M 16, a decode row (1 query) and a prefill chunk of 6 queries:

    decode : tile 0 rows 0..3 = query 0, heads 4h..4h+3 of KV head h; rows 4..15 masked off
    prefill: tile 0 rows 0..15 = queries 0..3; tile 1 rows 0..7 = queries 4..5, rest masked

The program walks the keys its tile's queries can see in tiles of BLOCK_N positions: key p comes
from block table[p // PAGE] at offset p % PAGE; the causal (and sliding-window) mask is applied
per (row, key); softmax is online (running max and sum in fp32, base-2 exponentials with the
score scale, 1/sqrt(D) unless the model gives its own, folded in), so the keys are read once. A
sequence costs its own context only. With a soft cap (Gemma 2) a score s becomes
cap * tanh(s / cap) before the mask, tanh from exp2 in fp32 (no libdevice: the interpreter runs it).
With sinks (gpt-oss) each head's sink logit joins the softmax's sum after the last key, as a
column with no value.
Numerics: q k^T in the cache dtype with fp32 accumulation; p v with p kept in fp32 (tf32 on the
GPU for bf16/fp16, IEEE for fp32); the output rounded once. Not done: splitting one long
sequence's keys over several programs (flash-decoding); its KV heads' programs walk it alone.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.attention_work import PagedAttentionWork
from kernels.sgmv_tiles import cast_rne, numerics

LOG2E: tl.constexpr = tl.constexpr(math.log2(math.e))


@triton.jit
def _paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, ctx_ptr, q_start_ptr, q_len_ptr, sinks_ptr,
        scale_log2e, scale, softcap, window, head_dim,
        stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        stride_ot, stride_oh, stride_tables,
        GROUP: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
        HAS_SINKS: tl.constexpr,
        DT: tl.constexpr, UPCAST: tl.constexpr, EMULATE_RNE: tl.constexpr, IEEE: tl.constexpr):
    seq, kv_head, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_len = tl.load(q_len_ptr + seq)
    if tile * BLOCK_M < q_len * GROUP:  # else the tile holds none of the sequence's queries
        ctx = tl.load(ctx_ptr + seq)
        q_row0 = tl.load(q_start_ptr + seq)
        i = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        j = i // GROUP  # [BLOCK_M] query of each row
        head = kv_head * GROUP + i % GROUP  # [BLOCK_M]
        is_row = j < q_len
        q_pos = ctx - q_len + j  # [BLOCK_M] position of each row's query
        d = tl.arange(0, BLOCK_D)
        is_d = d < head_dim
        q = tl.load(q_ptr + (q_row0 + j).to(tl.int64)[:, None] * stride_qt
                    + head[:, None] * stride_qh + d[None, :],
                    mask=is_row[:, None] & is_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
        if UPCAST:
            q = q.to(tl.float32)
        # Keys [lo, hi): up to the tile's last query, from its first query's window.
        hi = ctx - q_len + tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // GROUP, q_len - 1) + 1
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(ctx - q_len + tile * BLOCK_M // GROUP - window + 1, 0)
        table = tables_ptr + seq.to(tl.int64) * stride_tables
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # running max of scores (log2)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2(score - m_i)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            k_pos = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
            is_key = k_pos < hi
            block = tl.load(table + k_pos // PAGE, mask=is_key, other=0).to(tl.int64)
            kv_mask = is_key[:, None] & is_d[None, :]
            k = tl.load(k_ptr + (block * stride_kb + (k_pos % PAGE) * stride_kt
                                 + kv_head * stride_kh)[:, None] + d[None, :],
                        mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
            v = tl.load(v_ptr + (block * stride_vb + (k_pos % PAGE) * stride_vt
                                 + kv_head * stride_vh)[:, None] + d[None, :],
                        mask=kv_mask, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]
            if UPCAST:
                k = k.to(tl.float32)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N] fp32
            if HAS_SOFTCAP:  # cap * tanh(s / cap), tanh(y) = 1 - 2 / (exp(2y) + 1)
                s = s * scale
                s = (softcap - 2.0 * softcap / (tl.exp2(s * (2.0 * LOG2E / softcap)) + 1.0)) * LOG2E
            else:
                s = s * scale_log2e
            seen = k_pos[None, :] <= q_pos[:, None]
            if HAS_WINDOW:
                seen &= k_pos[None, :] > q_pos[:, None] - window
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)  # [BLOCK_M] rescales what was summed so far
            p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, BLOCK_N]
            l_i = l_i * alpha + tl.sum(p, 1)
            if IEEE:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p, v)  # [BLOCK_M, BLOCK_D] fp32 (tf32 inputs on the GPU)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        if HAS_SINKS:  # (a last column of the softmax with no value)
            sink = tl.load(sinks_ptr + head, mask=is_row, other=0.0).to(tl.float32) * LOG2E
            m_new = tl.maximum(m_i, sink)
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.exp2(sink - m_new)
            acc = acc * alpha[:, None]
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + (q_row0 + j).to(tl.int64)[:, None] * stride_ot
                 + head[:, None] * stride_oh + d[None, :],
                 cast_rne(o, DT, EMULATE_RNE), mask=is_row[:, None] & is_d[None, :])


def attention_tiles(max_query_len: int, group: int) -> int:
    """BLOCK_M: the query rows (query x head of the group) of the longest sequence, at least 16
    (the smallest dot tile), at most 64."""
    return min(64, max(16, triton.next_power_of_2(max_query_len * group)))


def check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 work: PagedAttentionWork, out: torch.Tensor | None,
                 sliding_window: int | None, scale: float | None = None,
                 softcap: float | None = None) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache "
                         f"{tuple(v_cache.shape)} do not fit [T, H, D] and "
                         f"[num_blocks, block_size, Hkv, D] (k and v alike)")
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if k_cache.shape[3] != q.shape[2] or num_heads % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} and cache {tuple(k_cache.shape)}: head_dim must "
                         f"match and query heads be a multiple of KV heads")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if t is not None and (t.dtype != q.dtype or t.device != q.device):
            raise ValueError(f"{name} is {t.dtype} on {t.device}, q {q.dtype} on {q.device}")
    if out is not None and out.shape != q.shape:
        raise ValueError(f"out {tuple(out.shape)} must have q's shape {tuple(q.shape)}")
    if any(t.stride(-1) != 1 for t in (q, k_cache, v_cache, *([out] if out is not None else []))):
        raise ValueError("q, k_cache, v_cache and out need a contiguous last dimension")
    for name in ("block_tables", "context_lens", "query_starts", "query_lens"):
        t = getattr(work, name)
        if t.dtype != torch.int32 or t.device != q.device or t.stride(-1) != 1:
            raise ValueError(f"work.{name} must be contiguous int32 on {q.device}, got "
                             f"{t.dtype} on {t.device}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be > 0 or None, got {sliding_window}")
    for name, value in (("scale", scale), ("softcap", softcap)):
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be > 0 and finite, or None, got {value}")


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    work: PagedAttentionWork, *, sliding_window: int | None = None,
                    scale: float | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None, out: torch.Tensor | None = None,
                    block_m: int | None = None, block_n: int = 64,
                    num_warps: int = 4) -> torch.Tensor:
    """q [T, H, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D] (one layer of the paged
    cache); work: the step's sequences (kernels/attention_work.py) -> out [T, H, D] holding
    softmax(cap(q k^T * scale)) v of every sequence's query rows (scale None: 1 / sqrt(D);
    softcap None: no cap; sinks [H] fp32: each head's sink logit, or None); other rows are
    left as they are."""
    check_inputs(q, k_cache, v_cache, work, out, sliding_window, scale, softcap)
    if sinks is not None and (sinks.shape != (q.shape[1],) or sinks.device != q.device):
        raise ValueError(f"sinks {tuple(sinks.shape)} on {sinks.device} must be [H = "
                         f"{q.shape[1]}] on {q.device}")
    out = torch.empty_like(q) if out is None else out
    scale = 1 / math.sqrt(q.shape[2]) if scale is None else scale
    num_heads, num_kv_heads, head_dim = q.shape[1], k_cache.shape[2], q.shape[2]
    group = num_heads // num_kv_heads
    block_m = block_m or attention_tiles(work.max_query_len, group)
    for name, b in (("block_m", block_m), ("block_n", block_n)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {b}")
    num_tiles = triton.cdiv(work.max_query_len * group, block_m)
    if work.num_seqs == 0 or num_tiles == 0:
        return out
    _paged_attention_kernel[(work.num_seqs, num_kv_heads, num_tiles)](
        q, k_cache, v_cache, out, work.block_tables, work.context_lens, work.query_starts,
        work.query_lens, q if sinks is None else sinks, math.log2(math.e) * scale, scale,
        softcap or 1.0, sliding_window or 0, head_dim,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        work.block_tables.stride(0),
        GROUP=group, PAGE=k_cache.shape[1], BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=softcap is not None, HAS_SINKS=sinks is not None,
        num_warps=num_warps, **numerics(q))
    return out
