"""Fused SGMV shrink+expand for decode-shaped steps (few rows per adapter): one launch per group.

Each program takes one work item and one column chunk of one slice: it computes the item's
rank-r intermediate x[rows] @ A^T for that slice in registers (never written to memory), then
expands it into its columns. With many items (many adapters) each slice is one chunk and every
A and B byte is read once; with few items the slice is cut into more chunks so the GPU stays
busy, and the re-read of A (tiny: r x K) comes from L2. Slices the adapter does not target cost
no memory traffic. A's and B's rows are read from pages of the KV storage through offset tables,
as sgmv_shrink and sgmv_expand read them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.sgmv_tiles import (
    check_dtype,
    check_rows,
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
        x_ptr, store_ptr, a_rows_ptr, b_rows_ptr, out_ptr, items_ptr, rank_ptr, scale_ptr,
        num_items, K, N0, N1, N2, CHUNK_N, first_module, layer_base,
        stride_xt, stride_os, stride_om, stride_or, stride_ot, stride_rn, stride_sn,
        RANK_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
        BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
        DT: tl.constexpr, UPCAST: tl.constexpr, EMULATE_RNE: tl.constexpr, IEEE: tl.constexpr):
    row_start, row_end, slot, seg = load_item(items_ptr, num_items, tl.program_id(0))
    sl, n_start, n_end, n_offset = chunk_to_slice(tl.program_id(1), N0, N1, N2, CHUNK_N)
    rank = tl.load(rank_ptr + sl * stride_rn + seg)
    if rank > 0:
        scale = tl.load(scale_ptr + sl * stride_sn + seg)
        rows = row_start + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        r = tl.arange(0, RANK_BLOCK)
        r_mask = r < rank
        store_ptr += layer_base
        table = slot.to(tl.int64) * stride_os + (first_module + sl) * stride_om  # (its module)
        a_rows = a_rows_ptr + table + r * stride_or  # [RB]: each row's chunk offsets
        x_rows = x_ptr + rows.to(tl.int64) * stride_xt  # [BLOCK_M]
        acc = tl.zeros((BLOCK_M, RANK_BLOCK), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < K
            x = tl.load(x_rows[:, None] + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                        other=0.0)  # [BLOCK_M, BLOCK_K]
            base = tl.load(a_rows + k0 // CHUNK, mask=r_mask, other=0)  # [RB]
            a = tl.load(store_ptr + base[:, None] + (k0 % CHUNK + tl.arange(0, BLOCK_K))[None, :],
                        mask=r_mask[:, None] & k_mask[None, :], other=0.0)  # [RB, BLOCK_K]
            if UPCAST:
                x = x.to(tl.float32)
                a = a.to(tl.float32)
            if IEEE:
                acc += tl.dot(x, tl.trans(a), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(a))
        expand_into(acc, store_ptr, b_rows_ptr + table, out_ptr + n_offset, rows.to(tl.int64),
                    row_mask, rank, scale, n_start, n_end, stride_or, stride_ot, RANK_BLOCK,
                    BLOCK_N, CHUNK, DT, UPCAST, EMULATE_RNE, IEEE)


def fused_block_k(rank_block: int, element_size: int) -> int:
    """BLOCK_K for an A tile of at most 32 KB per pipeline stage."""
    return max(32, min(256, 32768 // (rank_block * element_size)))


def sgmv_fused(x: torch.Tensor, store: torch.Tensor, a_offsets: torch.Tensor,
               b_offsets: torch.Tensor, out: torch.Tensor, items: torch.Tensor,
               ranks: torch.Tensor, scales: torch.Tensor, out_sizes: tuple[int, ...], *,
               first_module: int, layer_base: int, chunk: int, block_m: int, rank_block: int,
               target_ctas: int = 132, block_k: int | None = None, block_n: int = 128,
               num_warps: int = 4) -> None:
    """out [T, sum(out_sizes)] += per slice i and item rows: scale * (x @ A_i^T) @ B_i^T.

    x [T, K]; store: the KV storage, 1-D, x's dtype; a_offsets, b_offsets [slots, 7, R, chunks]
    int64 (layer 0; `layer_base` adds the layer's), the slices at first_module, ...; items
    [4, W] int32; ranks [n, S] int32, scales [n, S] fp32."""
    check_dtype("x", x, x.dtype)
    check_dtype("out", out, x.dtype)
    num_slices = len(out_sizes)
    check_work(items, ranks, scales, num_slices, x.device)
    if x.dim() != 2 or out.dim() != 2 or out.shape != (x.shape[0], sum(out_sizes)):
        raise ValueError(f"x {tuple(x.shape)}, out {tuple(out.shape)} do not fit [T, K], "
                         f"[T, N] with N = sum{out_sizes}")
    if rank_block < 16 or rank_block & (rank_block - 1):
        raise ValueError(f"rank_block must be a power of two >= 16, got {rank_block}")
    block_k = min(block_k or fused_block_k(rank_block, x.element_size()), chunk)
    block_n = min(block_n, chunk)
    check_rows(store, x.dtype, (a_offsets, b_offsets), first_module, num_slices, chunk,
               max(block_k, block_n))
    num_items = items.shape[1]
    if num_items == 0:
        return
    chunk_n, num_chunks = column_chunks(out_sizes, num_items, block_n, target_ctas)
    _sgmv_fused_kernel[(num_items, num_chunks)](
        x, store, a_offsets, b_offsets, out, items, ranks, scales, num_items, x.shape[1],
        *padded_sizes(out_sizes), chunk_n, first_module, layer_base, x.stride(0),
        a_offsets.stride(0), a_offsets.stride(1), a_offsets.stride(2), out.stride(0),
        ranks.stride(0), scales.stride(0),
        RANK_BLOCK=rank_block, BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_N=block_n, CHUNK=chunk,
        num_warps=num_warps, **numerics(x))
