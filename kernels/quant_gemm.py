"""Weight-only integer GEMM, W4A16 / W8A16 with group-wise scales and zeros: out = x @ W^T, W
dequantized tile by tile inside the matmul, never written out (the layout:
kernels/quant_gemm_ref.py, which is also the reference).

One program per (M-tile, N-tile). Per K-tile it loads x [BLOCK_M, BLOCK_K] and the codes
[BLOCK_N, BLOCK_K] (int4: each byte read for its two columns, the nibble picked by the column's
parity), each column's group (k // GROUP, or the act-order g_idx), the scales (and zeros) of
those groups, dequantizes to the activations' dtype and accumulates x @ W^T in fp32; NF4 / FP4
look their nibbles up in a 16-entry codebook instead. Rounded once to x's dtype.

Running example, int4, GROUP 128, BLOCK_K 64, row n, K-tile k0 = 192: bytes [96, 128) of row n,
columns 192..255, all in group 1: scale[n, 1], zero[n, 1].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.sgmv_tiles import cast_rne, check_dtype, numerics


@triton.jit
def _int_gemm_kernel(
        x_ptr, codes_ptr, scales_ptr, zeros_ptr, gidx_ptr, codebook_ptr, out_ptr,
        M, N, K, GROUP,
        stride_xm, stride_cn, stride_sn, stride_om,
        BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr,
        HAS_CODEBOOK: tl.constexpr, TILE_IN_GROUP: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        DT: tl.constexpr, UPCAST: tl.constexpr, EMULATE_RNE: tl.constexpr, IEEE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    x_rows = x_ptr + rows.to(tl.int64) * stride_xm  # [BLOCK_M]
    c_rows = codes_ptr + cols.to(tl.int64) * stride_cn  # [BLOCK_N]
    s_rows = scales_ptr + cols.to(tl.int64) * stride_sn  # (zeros: the same strides)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        w_mask = col_mask[:, None] & k_mask[None, :]
        x = tl.load(x_rows[:, None] + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_K]
        if BITS == 4:
            byte = tl.load(c_rows[:, None] + (ks // 2)[None, :], mask=w_mask, other=0)
            q = ((byte >> ((ks % 2) * 4).to(tl.uint8)[None, :]) & 0xF).to(tl.int32)
        else:
            q = tl.load(c_rows[:, None] + ks[None, :], mask=w_mask, other=0).to(tl.int32)
        if HAS_GIDX:
            g = tl.load(gidx_ptr + ks, mask=k_mask, other=0)[None, :]  # [1, BLOCK_K]
        elif TILE_IN_GROUP:  # (the tile lies in one group: one scale per row)
            g = tl.zeros((1, 1), dtype=tl.int32) + k0 // GROUP
        else:
            g = (ks // GROUP)[None, :]
        if TILE_IN_GROUP:
            g_mask = col_mask[:, None]
        else:
            g_mask = w_mask
        s = tl.load(s_rows[:, None] + g, mask=g_mask, other=0.0)  # [BLOCK_N, BLOCK_K or 1]
        if HAS_CODEBOOK:
            v = tl.load(codebook_ptr + q, mask=w_mask, other=0.0)
        else:
            if BITS == 4:
                q = q - 8
            if HAS_ZEROS:
                q = q - tl.load(zeros_ptr + (cols.to(tl.int64) * stride_sn)[:, None] + g,
                                mask=g_mask, other=0).to(tl.int32)
            v = q.to(tl.float32)
        w = cast_rne(v * s, DT, EMULATE_RNE)  # [BLOCK_N, BLOCK_K] in x's dtype, as the reference
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out_ptrs, cast_rne(acc, DT, EMULATE_RNE), mask=row_mask[:, None] & col_mask[None, :])


def int_tiles(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps): decode rows (M <= 16) in one short M-tile, wide
    N-tiles for the weight stream; prefill in 64 x 128 tiles."""
    if m <= 16:
        return 16, 64, 128, 4
    return 64, 128, 64, 8


def int_gemm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
             zeros: torch.Tensor | None, g_idx: torch.Tensor | None,
             codebook: torch.Tensor | None, *, bits: int, group_size: int,
             block_m: int | None = None, block_n: int | None = None, block_k: int | None = None,
             num_warps: int | None = None) -> torch.Tensor:
    """x [M, K] (fp32 / bf16 / fp16) @ W^T -> [M, N] in x's dtype; W in the layout of
    kernels/quant_gemm_ref.py (codes, scales [N, G] fp32, zeros [N, G] int8 or None, g_idx [K]
    int32 or None, codebook [16] fp32 or None)."""
    check_dtype("x", x, x.dtype)
    if bits not in (4, 8):
        raise ValueError(f"int_gemm takes 4 or 8 bits, got {bits}")
    m, k = x.shape
    n = codes.shape[0]
    want = (torch.uint8, k // 2) if bits == 4 else (torch.int8, k)
    if codes.dtype != want[0] or codes.shape[1] != want[1] or not codes.is_contiguous():
        raise ValueError(f"codes {codes.dtype} {tuple(codes.shape)} do not fit {bits}-bit "
                         f"[N, {want[1]}] {want[0]} for x {tuple(x.shape)} (contiguous)")
    if scales.dtype != torch.float32 or scales.shape[0] != n or not scales.is_contiguous():
        raise ValueError(f"scales must be contiguous fp32 [{n}, G], got {scales.dtype} "
                         f"{tuple(scales.shape)}")
    if zeros is not None and (zeros.dtype != torch.int8 or zeros.shape != scales.shape):
        raise ValueError(f"zeros must be int8 {tuple(scales.shape)}, got {zeros.dtype} "
                         f"{tuple(zeros.shape)}")
    if g_idx is not None and (g_idx.dtype != torch.int32 or g_idx.shape != (k,)):
        raise ValueError(f"g_idx must be int32 [{k}], got {g_idx.dtype} {tuple(g_idx.shape)}")
    if codebook is not None and (bits != 4 or codebook.dtype != torch.float32
                                 or codebook.shape != (16,)):
        raise ValueError("a codebook is 16 fp32 values of 4-bit codes")
    for name, t in (("codes", codes), ("scales", scales), ("zeros", zeros), ("g_idx", g_idx),
                    ("codebook", codebook)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    auto_m, auto_n, auto_k, auto_warps = int_tiles(m)
    block_m, block_n = block_m or auto_m, block_n or auto_n
    block_k, num_warps = block_k or auto_k, num_warps or auto_warps
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return out
    dummy = scales  # (a pointer for the absent tensors; never read)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int_gemm_kernel[grid](
        x, codes, scales, zeros if zeros is not None else dummy,
        g_idx if g_idx is not None else dummy, codebook if codebook is not None else dummy, out,
        m, n, k, group_size or k, x.stride(0), codes.stride(0), scales.stride(0), out.stride(0),
        BITS=bits, HAS_ZEROS=zeros is not None, HAS_GIDX=g_idx is not None,
        HAS_CODEBOOK=codebook is not None,
        TILE_IN_GROUP=g_idx is None and (not group_size or group_size % block_k == 0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, **numerics(x))
    return out
