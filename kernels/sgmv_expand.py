"""SGMV expand: out[rows_s, columns of slice i] += scale_si * t[rows_s, i, :r] @ B_si[:, :r]^T,
for segment s with its adapter's slice i (B_si of rank r = the segment's rank for that slice).
B's columns (rows of B^T) sit in pages of the KV storage: chunk c of row r of slice i is at
`store[layer_base + b_offsets[slot, first_module + i, r, c]]` (common/adapter_pages.py).

The output is a group's fused base output (q | k | v side by side, q wider than k and v under
GQA); the grid is (work item, column chunk) with chunks cut per slice (see sgmv_tiles), so no
program straddles two slices or has nothing to do. Slices the segment's adapter does not target
(rank 0) leave the output untouched: no read-modify-write of their columns.
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
def _sgmv_expand_kernel(
        t_ptr, store_ptr, b_rows_ptr, out_ptr, items_ptr, rank_ptr, scale_ptr,
        num_items, N0, N1, N2, CHUNK_N, first_module, layer_base,
        stride_tt, stride_tn, stride_os, stride_om, stride_or, stride_ot, stride_rn, stride_sn,
        RANK_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CHUNK: tl.constexpr,
        DT: tl.constexpr, UPCAST: tl.constexpr, EMULATE_RNE: tl.constexpr, IEEE: tl.constexpr):
    row_start, row_end, slot, seg = load_item(items_ptr, num_items, tl.program_id(0))
    sl, n_start, n_end, n_offset = chunk_to_slice(tl.program_id(1), N0, N1, N2, CHUNK_N)
    rank = tl.load(rank_ptr + sl * stride_rn + seg)
    if rank > 0:
        scale = tl.load(scale_ptr + sl * stride_sn + seg)
        rows = row_start + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        r = tl.arange(0, RANK_BLOCK)
        t = tl.load(t_ptr + rows[:, None].to(tl.int64) * stride_tt + sl * stride_tn + r[None, :],
                    mask=row_mask[:, None] & (r < rank)[None, :], other=0.0)  # [BLOCK_M, RB]
        b_rows = b_rows_ptr + slot.to(tl.int64) * stride_os + (first_module + sl) * stride_om
        expand_into(t, store_ptr + layer_base, b_rows, out_ptr + n_offset, rows.to(tl.int64),
                    row_mask, rank, scale, n_start, n_end, stride_or, stride_ot, RANK_BLOCK,
                    BLOCK_N, CHUNK, DT, UPCAST, EMULATE_RNE, IEEE)


def sgmv_expand(t: torch.Tensor, store: torch.Tensor, b_offsets: torch.Tensor,
                out: torch.Tensor, items: torch.Tensor, ranks: torch.Tensor,
                scales: torch.Tensor, out_sizes: tuple[int, ...], *, first_module: int,
                layer_base: int, chunk: int, block_m: int, target_ctas: int = 132,
                block_n: int = 128, num_warps: int = 4) -> None:
    """t [T, n, RB] fp32 (sgmv_shrink's output); store: the KV storage, 1-D, out's dtype;
    b_offsets [slots, 7, R, chunks] int64: each chunk's offset of B^T's rows (layer 0;
    `layer_base` adds the layer's), the slices at first_module, ...; out [T, sum(out_sizes)]
    updated in place; items [4, W] int32; ranks [n, S] int32, scales [n, S] fp32."""
    check_dtype("out", out, out.dtype)
    check_dtype("t", t, torch.float32)
    num_slices = len(out_sizes)
    check_work(items, ranks, scales, num_slices, out.device)
    if (out.dim() != 2 or out.shape[1] != sum(out_sizes)
            or t.shape[:2] != (out.shape[0], num_slices) or not t.is_contiguous()):
        raise ValueError(f"t {tuple(t.shape)}, out {tuple(out.shape)} do not fit [T, "
                         f"{num_slices}, RB] (contiguous), [T, N] with N = sum{out_sizes}")
    block_n = min(block_n, chunk)
    check_rows(store, out.dtype, (b_offsets,), first_module, num_slices, chunk, block_n)
    num_items = items.shape[1]
    if num_items == 0:
        return
    chunk_n, num_chunks = column_chunks(out_sizes, num_items, block_n, target_ctas)
    _sgmv_expand_kernel[(num_items, num_chunks)](
        t, store, b_offsets, out, items, ranks, scales, num_items, *padded_sizes(out_sizes),
        chunk_n, first_module, layer_base, t.stride(0), t.stride(1), b_offsets.stride(0),
        b_offsets.stride(1), b_offsets.stride(2), out.stride(0), ranks.stride(0),
        scales.stride(0), RANK_BLOCK=t.shape[2], BLOCK_M=block_m, BLOCK_N=block_n, CHUNK=chunk,
        num_warps=num_warps, **numerics(out))
