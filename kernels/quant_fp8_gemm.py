"""FP8 (e4m3) weight GEMM: W8A16 (weights dequantized tile by tile inside the matmul) and W8A8
(activations quantized per token, kernels/quant_gemm_ref.py's quantize_rows, and an fp8 x fp8
dot). The layout and the reference: kernels/quant_gemm_ref.py.

One program per (M-tile, N-tile). A weight scale covers a block of BN rows by BK columns (per
channel: BN 1 and one block across K; DeepSeek / Qwen3 FP8: 128 x 128), and a K-tile never
straddles two blocks (BLOCK_K divides BK), so each tile takes one scale per row:

    W8A16   acc += x @ (round(w * scale[n]))^T                 (w in the activations' dtype)
    W8A8    acc += (xq @ w^T) * scale[n],  then acc *= x_scale[m]   (fp8 tensor cores on sm_90)

fp32 accumulation, rounded once to the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.quant_gemm_ref import quantize_rows
from kernels.sgmv_tiles import cast_rne, check_dtype, numerics


@triton.jit
def _fp8_gemm_kernel(
        x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, M, N, K, BN, BK,
        stride_xm, stride_wn, stride_sn, stride_om,
        W8A8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        DT: tl.constexpr, UPCAST: tl.constexpr, EMULATE_RNE: tl.constexpr, IEEE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    x_rows = x_ptr + rows.to(tl.int64) * stride_xm  # [BLOCK_M]
    w_rows = w_ptr + cols.to(tl.int64) * stride_wn  # [BLOCK_N]
    s_rows = ws_ptr + (cols // BN).to(tl.int64) * stride_sn  # [BLOCK_N]: each row's block row
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_rows[:, None] + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_rows[:, None] + ks[None, :], mask=col_mask[:, None] & k_mask[None, :],
                    other=0.0)  # [BLOCK_N, BLOCK_K] fp8
        s = tl.load(s_rows + k0 // BK, mask=col_mask, other=0.0)  # [BLOCK_N]
        if W8A8:
            if UPCAST:
                part = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)),
                              input_precision="ieee")
            else:
                part = tl.dot(x, tl.trans(w))  # fp8 x fp8 -> fp32
            acc += part * s[None, :]
        else:
            wv = cast_rne(w.to(tl.float32) * s[:, None], DT, EMULATE_RNE)
            if UPCAST:
                x = x.to(tl.float32)
                wv = wv.to(tl.float32)
            if IEEE:
                acc += tl.dot(x, tl.trans(wv), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(wv))
    if W8A8:
        acc = acc * tl.load(xs_ptr + rows, mask=row_mask, other=0.0)[:, None]
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out_ptrs, cast_rne(acc, DT, EMULATE_RNE), mask=row_mask[:, None] & col_mask[None, :])


def fp8_block_k(k: int, bk: int, block_k: int) -> int:
    """The K-tile: `block_k` (a power of two >= 16), halved until it divides the scale block's
    columns when they are fewer than K (a tile never straddles two scales)."""
    if bk >= k:
        return block_k
    while bk % block_k:
        block_k //= 2
    if block_k < 16:
        raise ValueError(f"FP8 scale blocks of {bk} columns: the kernel needs a multiple of 16")
    return block_k


def _check(weight: torch.Tensor, scales: torch.Tensor, block: tuple[int, int], k: int,
           device: torch.device) -> tuple[int, int]:
    n = weight.shape[0]
    if weight.dtype != torch.float8_e4m3fn or weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"weight must be float8_e4m3fn [N, {k}] with contiguous rows, got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    bn, bk = block[0] or n, block[1] or k
    want = (-(-n // bn), -(-k // bk))
    if scales.dtype != torch.float32 or tuple(scales.shape) != want or scales.stride(1) != 1:
        raise ValueError(f"scales must be fp32 {want} for blocks {block} of [{n}, {k}], got "
                         f"{scales.dtype} {tuple(scales.shape)}")
    if weight.device != device or scales.device != device:
        raise ValueError("weight, scales and activations must be on one device")
    return bn, bk


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
             block: tuple[int, int], *, block_m: int | None = None, block_n: int = 64,
             block_k: int = 128, num_warps: int = 4) -> torch.Tensor:
    """W8A16: x [M, K] (fp32 / bf16 / fp16) @ (weight [N, K] fp8 x scales)^T -> [M, N] in x's
    dtype; `block` (rows, columns) per scale, 0 for a whole dimension."""
    check_dtype("x", x, x.dtype)
    m, k = x.shape
    bn, bk = _check(weight, scales, block, k, x.device)
    return _launch(x, None, weight, scales, bn, bk, x.dtype, block_m, block_n,
                   fp8_block_k(k, bk, block_k), num_warps)


def fp8_w8a8_gemm(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                  block: tuple[int, int], *, x_scales: torch.Tensor | None = None,
                  block_m: int | None = None, block_n: int = 64, block_k: int = 128,
                  num_warps: int = 4) -> torch.Tensor:
    """W8A8: x [M, K] quantized to fp8 by x_scales ([M] per token, [1] static; None: each row's
    own amax / 448), then the fp8 GEMM -> [M, N] in x's dtype."""
    check_dtype("x", x, x.dtype)
    m, k = x.shape
    bn, bk = _check(weight, scales, block, k, x.device)
    xq, x_scales = quantize_rows(x, x_scales)
    return _launch(xq, x_scales, weight, scales, bn, bk, x.dtype, block_m, block_n,
                   fp8_block_k(k, bk, block_k), num_warps)


def _launch(x, x_scales, weight, scales, bn, bk, out_dtype, block_m, block_n, block_k,
            num_warps) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=out_dtype)
    if m == 0:
        return out
    block_m = block_m or (16 if m <= 16 else 64)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp8_gemm_kernel[grid](
        x, x_scales if x_scales is not None else scales, weight, scales, out, m, n, k, bn, bk,
        x.stride(0), weight.stride(0), scales.stride(0), out.stride(0), W8A8=x_scales is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, **numerics(out))
    return out
