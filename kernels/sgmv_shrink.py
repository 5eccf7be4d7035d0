"""SGMV shrink: t[rows_s, i, :r] = x[rows_s] @ A_{slot_s, i}[:r]^T for every slice i of a group.

A's rows sit in pages of the KV storage (common/adapter_pages.py): row r of slice i's A, chunk c
of its columns, is at `store[layer_base + a_offsets[slot, first_module + i, r, c]]`. The slices'
rows are gathered into one [SLICES_P2 * RANK_BLOCK, BLOCK_K] tile, so each x tile is loaded once
for q, k and v (once for gate and up). Rows above the segment's rank for a slice are masked off,
so no bytes are read for rank an adapter does not have and none for slices it does not target.
One program per (work item, K split); split-K partials are added atomically in fp32. Where the
stacked accumulator would not fit (rank 128 and up over three slices), each slice is a launch.
This is the prefill-shaped path; sgmv_expand finishes it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.sgmv_tiles import check_dtype, check_rows, check_work, load_item, numerics


@triton.jit
def _sgmv_shrink_kernel(
        x_ptr, store_ptr, a_rows_ptr, t_ptr, items_ptr, rank_ptr,
        num_items, K, SPLIT_K, first_module, layer_base,
        stride_xt, stride_os, stride_om, stride_or, stride_tt, stride_rn,
        NUM_SLICES: tl.constexpr, SLICES_P2: tl.constexpr, RANK_BLOCK: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr, ATOMIC: tl.constexpr,
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
    # each row's table of chunk offsets: [J] pointers
    a_rows = (a_rows_ptr + slot.to(tl.int64) * stride_os + (first_module + sl) * stride_om
              + r * stride_or)
    j_mask = r < rank
    store_ptr += layer_base
    x_rows = x_ptr + rows.to(tl.int64) * stride_xt  # [BLOCK_M]
    acc = tl.zeros((BLOCK_M, SLICES_P2 * RANK_BLOCK), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_rows[:, None] + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_K]
        base = tl.load(a_rows + k0 // CHUNK, mask=j_mask, other=0)  # [J] (a tile: one chunk)
        a = tl.load(store_ptr + base[:, None] + (k0 % CHUNK + tl.arange(0, BLOCK_K))[None, :],
                    mask=j_mask[:, None] & k_mask[None, :], other=0.0)  # [J, BLOCK_K]
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


# The most fp32 accumulator elements (BLOCK_M x stacked rank rows) one program keeps: 64 KB.
MAX_ACC = 16384


def slices_per_launch(num_slices: int, rank_block: int, block_m: int) -> int:
    """How many of a group's slices one launch stacks: all of them while the accumulator fits
    MAX_ACC (x read once for q, k and v), else one per launch (rank 128 and up under three)."""
    stacked = triton.next_power_of_2(num_slices) * rank_block
    return num_slices if block_m * stacked <= MAX_ACC else 1


def shrink_tiles(num_slices: int, rank_block: int, block_m: int,
                 element_size: int) -> tuple[int, int]:
    """(BLOCK_K, num_warps): a stacked A tile of at most 32 KB per pipeline stage; 8 warps once
    the [BLOCK_M, slices * RANK_BLOCK] accumulator is large."""
    stacked = triton.next_power_of_2(num_slices) * rank_block
    return (max(32, min(128, 32768 // (stacked * element_size))),
            8 if block_m * stacked >= 8192 else 4)


def sgmv_shrink(x: torch.Tensor, store: torch.Tensor, a_offsets: torch.Tensor,
                items: torch.Tensor, ranks: torch.Tensor, *, first_module: int, layer_base: int,
                chunk: int, block_m: int, rank_block: int, target_ctas: int = 132,
                block_k: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """x [T, K]; store: the KV storage, 1-D, x's dtype; a_offsets [slots, 7, R, chunks] int64:
    each row chunk's offset of A (layer 0; `layer_base` adds the layer's), the group's slices
    at first_module, first_module + 1, ...; items [4, W] int32; ranks [n, S] int32 -> t [T, n,
    rank_block] fp32, written only on the items' rows (zero above each segment's rank)."""
    check_dtype("x", x, x.dtype)
    num_slices = ranks.shape[0]
    check_work(items, ranks, None, num_slices, x.device)
    if x.dim() != 2:
        raise ValueError(f"x {tuple(x.shape)} does not fit [T, K]")
    if rank_block < 16 or rank_block & (rank_block - 1):
        raise ValueError(f"rank_block must be a power of two >= 16, got {rank_block}")
    num_items, k = items.shape[1], x.shape[1]
    auto_k, auto_warps = shrink_tiles(num_slices, rank_block, block_m, x.element_size())
    block_k, num_warps = min(block_k or auto_k, chunk), num_warps or auto_warps
    check_rows(store, x.dtype, (a_offsets,), first_module, num_slices, chunk, block_k)
    split_k = max(1, min(triton.cdiv(target_ctas, max(num_items, 1)), triton.cdiv(k, block_k)))
    alloc = torch.zeros if split_k > 1 else torch.empty
    t = alloc(x.shape[0], num_slices, rank_block, device=x.device,
              dtype=torch.float32)  # [T, n, rank_block]
    if num_items == 0:
        return t
    per_launch = slices_per_launch(num_slices, rank_block, block_m)
    if per_launch < num_slices:
        block_k, num_warps = shrink_tiles(1, rank_block, block_m, x.element_size())
        block_k = min(block_k, chunk)
    for first in range(0, num_slices, per_launch):
        _sgmv_shrink_kernel[(num_items, split_k)](
            x, store, a_offsets, t[:, first:], items, ranks[first:], num_items, k, split_k,
            first_module + first, layer_base, x.stride(0), a_offsets.stride(0),
            a_offsets.stride(1), a_offsets.stride(2), t.stride(0), ranks.stride(0),
            NUM_SLICES=per_launch, SLICES_P2=triton.next_power_of_2(per_launch),
            RANK_BLOCK=rank_block, BLOCK_M=block_m, BLOCK_K=block_k, CHUNK=chunk,
            ATOMIC=split_k > 1, num_warps=num_warps, **numerics(x))
    return t
