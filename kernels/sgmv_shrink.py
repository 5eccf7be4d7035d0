"""SGMV shrink: t[rows_s, i, :r] = x[rows_s] @ A_{slot_s, i}[:r]^T for every slice i of a group.

The slices' A rows are stacked into one [SLICES_P2 * RANK_BLOCK, BLOCK_K] tile, so each x tile
is loaded once for q, k and v (once for gate and up). Rows of A above the segment's rank for
that slice are masked off, so no bytes are read for padded rank and none at all for slices the
adapter does not target. One program per (work item, K split); split-K partials are added
atomically in fp32. This is the prefill-shaped path; sgmv_expand finishes it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.sgmv_tiles import check_dtype, check_work, load_item, numerics


@triton.jit
def _sgmv_shrink_kernel(
        x_ptr, a_ptr, t_ptr, items_ptr, rank_ptr,
        num_items, K, SPLIT_K,
        stride_xt, stride_as, stride_an, stride_ar, stride_tt, stride_rn,
        NUM_SLICES: tl.constexpr, SLICES_P2: tl.constexpr, RANK_BLOCK: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr,
        DT: tl.constexpr, UPCAST: tl.constexpr, EMULATE_RNE: tl.constexpr, IEEE: tl.constexpr):
    row_start, row_end, slot, seg = load_item(items_ptr, num_items, tl.program_id(0))
    pid_k = tl.program_id(1)
    rows = row_start + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    # Stacked rank index j = slice * RANK_BLOCK + r, e.g. q rows 0..15, k 16..31, v 32..47.
    j = tl.arange(0, SLICES_P2 * RANK_BLOCK)
    sl = j // RANK_BLOCK
    r = j % RANK_BLOCK
    is_slice = sl < NUM_SLICES
    rank = tl.load(rank_ptr + sl * stride_rn + seg, mask=is_slice, other=0)  # [J]
    a_rows = a_ptr + slot.to(tl.int64) * stride_as + sl * stride_an + r * stride_ar  # [J]
    j_mask = r < rank
    x_rows = x_ptr + rows.to(tl.int64) * stride_xt  # [BLOCK_M]
    acc = tl.zeros((BLOCK_M, SLICES_P2 * RANK_BLOCK), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_rows[:, None] + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_K]
        a = tl.load(a_rows[:, None] + ks[None, :], mask=j_mask[:, None] & k_mask[None, :],
                    other=0.0)  # [J, BLOCK_K]
        if UPCAST:
            x = x.to(tl.float32)
            a = a.to(tl.float32)
        if IEEE:
            acc += tl.dot(x, tl.trans(a), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(a))
    t_ptrs = t_ptr + rows[:, None].to(tl.int64) * stride_tt + j[None, :]
    t_mask = row_mask[:, None] & is_slice[None, :]
    if ATOMIC:
        tl.atomic_add(t_ptrs, acc, mask=t_mask)
    else:
        tl.store(t_ptrs, acc, mask=t_mask)


def shrink_tiles(num_slices: int, rank_block: int, block_m: int,
                 element_size: int) -> tuple[int, int]:
    """(BLOCK_K, num_warps): a stacked A tile of at most 32 KB per pipeline stage; 8 warps once
    the [BLOCK_M, slices * RANK_BLOCK] accumulator is large."""
    stacked = triton.next_power_of_2(num_slices) * rank_block
    return (max(32, min(128, 32768 // (stacked * element_size))),
            8 if block_m * stacked >= 8192 else 4)


def sgmv_shrink(x: torch.Tensor, a: torch.Tensor, items: torch.Tensor, ranks: torch.Tensor, *,
                block_m: int, rank_block: int, target_ctas: int = 132,
                block_k: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """x [T, K]; a [num_slots, n, R, K] (one layer of a SliceGroup); items [4, W] int32;
    ranks [n, S] int32 -> t [T, n, rank_block] fp32, written only on the items' rows (zero
    above each segment's rank)."""
    check_dtype("x", x, x.dtype)
    check_dtype("a", a, x.dtype)
    num_slices = a.shape[1]
    check_work(items, ranks, None, num_slices, x.device)
    if x.dim() != 2 or a.dim() != 4 or a.shape[3] != x.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and a {tuple(a.shape)} do not fit [T, K] and "
                         f"[slots, n, R, K]")
    if rank_block < 16 or rank_block & (rank_block - 1):
        raise ValueError(f"rank_block must be a power of two >= 16, got {rank_block}")
    num_items, k = items.shape[1], x.shape[1]
    slices_p2 = triton.next_power_of_2(num_slices)
    auto_k, auto_warps = shrink_tiles(num_slices, rank_block, block_m, x.element_size())
    block_k, num_warps = block_k or auto_k, num_warps or auto_warps
    split_k = max(1, min(triton.cdiv(target_ctas, max(num_items, 1)), triton.cdiv(k, block_k)))
    alloc = torch.zeros if split_k > 1 else torch.empty
    t = alloc(x.shape[0], num_slices, rank_block, device=x.device,
              dtype=torch.float32)  # [T, n, rank_block]
    if num_items == 0:
        return t
    _sgmv_shrink_kernel[(num_items, split_k)](
        x, a, t, items, ranks, num_items, k, split_k,
        x.stride(0), a.stride(0), a.stride(1), a.stride(2), t.stride(0), ranks.stride(0),
        NUM_SLICES=num_slices, SLICES_P2=slices_p2,
        RANK_BLOCK=rank_block, BLOCK_M=block_m, BLOCK_K=block_k, ATOMIC=split_k > 1,
        num_warps=num_warps, **numerics(x))
    return t
