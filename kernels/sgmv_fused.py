"""Fused SGMV shrink+expand for decode-shaped steps (few rows per adapter): one launch per group.

Each program takes one work item and one column chunk of one slice: it computes the item's
rank-r intermediate x[rows] @ A^T for that slice in registers (never written to memory), then
expands it into its columns. With many items (many adapters) each slice is one chunk and every
A and B byte is read once; with few items the slice is cut into more chunks so the GPU stays
busy, and the re-read of A (tiny: r x K) comes from L2. Slices the adapter does not target cost
no memory traffic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.sgmv_tiles import (
    check_dtype,
    check_work,
    chunk_to_slice,
    column_chunks,
    expand_into,
    load_item,
    numerics,
    padded_sizes,
)


@triton.jit
def _sgmv_fused_kernel(
        x_ptr, a_ptr, bt_ptr, out_ptr, items_ptr, rank_ptr, scale_ptr,
        num_items, K, N0, N1, N2, CHUNK_N,
        stride_xt, stride_as, stride_an, stride_ar, stride_bs, stride_br, stride_ot,
        stride_rn, stride_sn,
        RANK_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DT: tl.constexpr, UPCAST: tl.constexpr, EMULATE_RNE: tl.constexpr, IEEE: tl.constexpr):
    row_start, row_end, slot, seg = load_item(items_ptr, num_items, tl.program_id(0))
    sl, n_start, n_end, n_offset = chunk_to_slice(tl.program_id(1), N0, N1, N2, CHUNK_N)
    rank = tl.load(rank_ptr + sl * stride_rn + seg)
    if rank > 0:
        scale = tl.load(scale_ptr + sl * stride_sn + seg)
        rows = row_start + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        r = tl.arange(0, RANK_BLOCK)
        a_rows = a_ptr + slot.to(tl.int64) * stride_as + sl * stride_an + r * stride_ar  # [RB]
        x_rows = x_ptr + rows.to(tl.int64) * stride_xt  # [BLOCK_M]
        acc = tl.zeros((BLOCK_M, RANK_BLOCK), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < K
            x = tl.load(x_rows[:, None] + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                        other=0.0)  # [BLOCK_M, BLOCK_K]
            a = tl.load(a_rows[:, None] + ks[None, :], mask=(r < rank)[:, None] & k_mask[None, :],
                        other=0.0)  # [RB, BLOCK_K]
            if UPCAST:
                x = x.to(tl.float32)
                a = a.to(tl.float32)
            if IEEE:
                acc += tl.dot(x, tl.trans(a), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(a))
        expand_into(acc, bt_ptr + slot.to(tl.int64) * stride_bs + n_offset,
                    out_ptr + n_offset, rows.to(tl.int64), row_mask, rank, scale,
                    n_start, n_end, stride_br, stride_ot, RANK_BLOCK, BLOCK_N, DT, UPCAST,
                    EMULATE_RNE, IEEE)


def fused_block_k(rank_block: int, element_size: int) -> int:
    """BLOCK_K for an A tile of at most 32 KB per pipeline stage."""
    return max(32, min(256, 32768 // (rank_block * element_size)))


def sgmv_fused(x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, out: torch.Tensor,
               items: torch.Tensor, ranks: torch.Tensor, scales: torch.Tensor,
               out_sizes: tuple[int, ...], *, block_m: int, rank_block: int,
               target_ctas: int = 132, block_k: int | None = None, block_n: int = 128,
               num_warps: int = 4) -> None:
    """out [T, sum(out_sizes)] += per slice i and item rows: scale * (x @ A_i^T) @ B_i^T.

    x [T, K]; a [num_slots, n, R, K]; bt [num_slots, R, sum(out_sizes)] (one layer of a
    SliceGroup); items [4, W] int32; ranks [n, S] int32, scales [n, S] fp32."""
    check_dtype("x", x, x.dtype)
    for name, t in (("a", a), ("bt", bt), ("out", out)):
        check_dtype(name, t, x.dtype)
    num_slices = len(out_sizes)
    check_work(items, ranks, scales, num_slices, x.device)
    if (x.dim() != 2 or a.dim() != 4 or bt.dim() != 3 or out.dim() != 2
            or a.shape[1] != num_slices or a.shape[3] != x.shape[1]
            or out.shape != (x.shape[0], sum(out_sizes)) or bt.shape[2] != out.shape[1]):
        raise ValueError(f"x {tuple(x.shape)}, a {tuple(a.shape)}, bt {tuple(bt.shape)}, out "
                         f"{tuple(out.shape)} do not fit [T, K], [slots, {num_slices}, R, K], "
                         f"[slots, R, N], [T, N] with N = sum{out_sizes}")
    if rank_block < 16 or rank_block & (rank_block - 1):
        raise ValueError(f"rank_block must be a power of two >= 16, got {rank_block}")
    num_items = items.shape[1]
    if num_items == 0:
        return
    block_k = block_k or fused_block_k(rank_block, x.element_size())
    chunk_n, num_chunks = column_chunks(out_sizes, num_items, block_n, target_ctas)
    _sgmv_fused_kernel[(num_items, num_chunks)](
        x, a, bt, out, items, ranks, scales, num_items, x.shape[1], *padded_sizes(out_sizes),
        chunk_n, x.stride(0), a.stride(0), a.stride(1), a.stride(2), bt.stride(0), bt.stride(1),
        out.stride(0), ranks.stride(0), scales.stride(0),
        RANK_BLOCK=rank_block, BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_N=block_n,
        num_warps=num_warps, **numerics(x))
