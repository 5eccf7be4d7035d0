"""Grouped MoE matmul: out[rows_i] = x[rows_i] @ W[e_i]^T for every run i of rows routed to expert
e_i (executor/model/moe.py sorts a layer's (row, expert) pairs by expert, so each expert's are one
run).

One program per (M-tile of a run, N-tile): it loads its expert's [BLOCK_N, BLOCK_K] weight tiles
once for its BLOCK_M rows and accumulates in fp32; every tile of an expert's weight is read by the
programs of its own rows only, none for experts without rows. The work list is the runs cut into
M-tiles on the host (moe_tiles), one transfer, as the SGMV kernels' (kernels/segments.py).
Rounded once to the activations' dtype. The reference: kernels/moe_gemm_ref.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.sgmv_tiles import cast_rne, check_dtype, numerics


@triton.jit
def _moe_gemm_kernel(
        x_ptr, w_ptr, out_ptr, tiles_ptr, num_tiles, N, K,
        stride_xm, stride_we, stride_wn, stride_om,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        DT: tl.constexpr, UPCAST: tl.constexpr, EMULATE_RNE: tl.constexpr, IEEE: tl.constexpr):
    tile = tl.program_id(0)
    row_start = tl.load(tiles_ptr + tile)
    row_end = tl.load(tiles_ptr + num_tiles + tile)
    expert = tl.load(tiles_ptr + 2 * num_tiles + tile)
    rows = row_start + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w_rows = w_ptr + expert.to(tl.int64) * stride_we + cols.to(tl.int64) * stride_wn  # [BLOCK_N]
    x_rows = x_ptr + rows.to(tl.int64) * stride_xm  # [BLOCK_M]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_rows[:, None] + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_rows[:, None] + ks[None, :], mask=col_mask[:, None] & k_mask[None, :],
                    other=0.0)  # [BLOCK_N, BLOCK_K]
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out_ptrs, cast_rne(acc, DT, EMULATE_RNE), mask=row_mask[:, None] & col_mask[None, :])


def moe_tiles(runs: tuple[tuple[int, int, int], ...], block_m: int,
              device: torch.device) -> torch.Tensor:
    """The work list [3, W] int32 (row_start, row_end, expert) of runs (start, end, expert) cut
    into tiles of at most block_m rows. Example, block_m 4: runs (0, 6, 2), (6, 7, 5) -> tiles
    (0, 4, 2), (4, 6, 2), (6, 7, 5)."""
    tiles = [(at, min(at + block_m, end), e) for start, end, e in runs
             for at in range(start, end, block_m)]
    return torch.tensor(tiles, dtype=torch.int32).reshape(-1, 3).T.contiguous().to(device)


def moe_gemm(x: torch.Tensor, w: torch.Tensor, runs: tuple[tuple[int, int, int], ...], *,
             block_m: int = 16, block_n: int = 64, block_k: int = 64,
             num_warps: int = 4) -> torch.Tensor:
    """x [P, K] (rows sorted by expert), w [E, N, K] (x's dtype, contiguous), runs: (start,
    end, expert) -> out [P, N], each run's rows times its expert's weight transposed (rows in
    no run: zeros)."""
    check_dtype("x", x, x.dtype)
    check_dtype("w", w, x.dtype)
    if x.dim() != 2 or w.dim() != 3 or w.shape[2] != x.shape[1] or not w.is_contiguous():
        raise ValueError(f"x {tuple(x.shape)}, w {tuple(w.shape)} do not fit [P, K] and "
                         "[E, N, K] (contiguous)")
    if any(not 0 <= e < w.shape[0] or not 0 <= s <= t <= x.shape[0] for s, t, e in runs):
        raise ValueError(f"a run lies outside the {x.shape[0]} rows or {w.shape[0]} experts")
    out = torch.zeros(x.shape[0], w.shape[1], device=x.device, dtype=x.dtype)
    tiles = moe_tiles(runs, block_m, x.device)
    if tiles.shape[1] == 0:
        return out
    grid = (tiles.shape[1], triton.cdiv(w.shape[1], block_n))
    _moe_gemm_kernel[grid](
        x, w, out, tiles, tiles.shape[1], w.shape[1], x.shape[1], x.stride(0), w.stride(0),
        w.stride(1), out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, **numerics(x))
    return out
