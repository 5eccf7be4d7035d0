"""Pure-torch references of the dequantize-in-the-GEMM kernels (kernels/quant_gemm.py,
kernels/quant_fp8_gemm.py), same signatures, and the serving layouts' dequantization they and the
executor's CPU path share (executor/model/quant.py keeps weights in these layouts, whatever their
checkpoint's).

Integer weights W [N, K] (int4 / int8, group-wise):

    codes    int4: uint8 [N, K / 2], column 2j in the low nibble of byte j, 2j + 1 in the high
             one, each nibble the signed value + 8; int8: int8 [N, K], the signed value
    scales   fp32 [N, G]: group g of row n covers columns [g * group, (g + 1) * group) (group
             0: one group, the whole row)
    zeros    int8 [N, G], signed like the codes (None: symmetric, zero)
    g_idx    int32 [K]: column k's group (act-order; None: k // group)
    codebook fp32 [16] (NF4 / FP4): a nibble is an index, W = codebook[nibble] * scale

    W[n, k] = (code[n, k] - zero[n, g]) * scale[n, g],  g = g_idx[k] or k // group

FP8 weights: fp8 e4m3 [N, K] and fp32 scales [ceil(N / BN), ceil(K / BK)] (a block of BN rows
by BK columns per scale; per channel: BN 1, BK >= K), W = fp8 * scale. W8A8 quantizes each
activation row to fp8 with its own scale, amax / 448 (quantize_rows).

Dequantized weights are rounded once to the activations' dtype, then multiplied in fp32 and
rounded once more: what the kernels compute.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # the largest e4m3 value
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # a row of zeros still gets a finite scale


def unpack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K / 2] -> the nibbles [N, K] as int16 (0..15), column 2j from the low one."""
    nibbles = torch.stack([codes & 0x0F, codes >> 4], dim=-1)  # [N, K / 2, 2]
    return nibbles.reshape(codes.shape[0], -1).to(torch.int16)


def pack_int4(nibbles: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 -> uint8 [N, K / 2] (unpack_int4's inverse)."""
    nibbles = nibbles.to(torch.uint8)
    return nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)


def group_index(k: int, group_size: int, g_idx: torch.Tensor | None,
                device: torch.device) -> torch.Tensor:
    """[K] long: each column's group."""
    if g_idx is not None:
        return g_idx.long()
    return torch.arange(k, device=device) // group_size


def dequantize_int(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                   g_idx: torch.Tensor | None, codebook: torch.Tensor | None, *, bits: int,
                   group_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The serving layout above -> W [N, K] in `dtype` (computed in fp32, rounded once): each
    value's (code - zero) exact, times its scale (in place, a pass each: this is also the CPU
    path's dequantization, executor/model/quant.py)."""
    n = codes.shape[0]
    offset = 0
    if bits == 4 and codebook is not None:
        values = codebook[unpack_int4(codes).long()]  # [N, K]
    elif bits == 4:
        values = torch.empty(n, codes.shape[1], 2, device=codes.device)  # the nibbles, as fp32
        values[..., 0] = codes & 0x0F
        values[..., 1] = codes >> 4
        values, offset = values.view(n, -1), 8  # (a nibble is the value + 8)
    else:
        values = codes.float()
    k = values.shape[1]
    group_size = group_size or k  # (0: one group per row)
    if g_idx is None and k % group_size == 0:  # (as the tools compute it: per group, broadcast)
        grouped = values.view(n, k // group_size, group_size)
        if zeros is not None:
            grouped.sub_(zeros.float()[:, :, None] + offset)
        elif offset:
            grouped.sub_(offset)
        grouped.mul_(scales[:, :, None])
        return values.to(dtype)
    group = group_index(k, group_size, g_idx, codes.device)
    if zeros is not None:
        values.sub_(zeros.float()[:, group] + offset)
    elif offset:
        values.sub_(offset)
    values.mul_(scales[:, group])
    return values.to(dtype)


def int_gemm_ref(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor | None, g_idx: torch.Tensor | None,
                 codebook: torch.Tensor | None, *, bits: int, group_size: int,
                 **_tuning) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype."""
    w = dequantize_int(codes, scales, zeros, g_idx, codebook, bits=bits, group_size=group_size,
                       dtype=x.dtype)
    return (x.float() @ w.float().T).to(x.dtype)


def dequantize_fp8(weight: torch.Tensor, scales: torch.Tensor, block: tuple[int, int],
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fp8 [N, K] with scales [ceil(N / BN), ceil(K / BK)] -> W [N, K] in `dtype`."""
    n, k = weight.shape
    rows = scales.repeat_interleave(block[0], 0)[:n] if scales.shape[0] > 1 else scales
    full = rows.repeat_interleave(block[1], 1)[:, :k] if scales.shape[1] > 1 else rows
    return (weight.float() * full).to(dtype)


def fp8_gemm_ref(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                 block: tuple[int, int], **_tuning) -> torch.Tensor:
    """W8A16: x [M, K] @ W^T -> [M, N] in x's dtype."""
    w = dequantize_fp8(weight, scales, block, x.dtype)
    return (x.float() @ w.float().T).to(x.dtype)


def row_scales(amax: torch.Tensor) -> torch.Tensor:
    """Each activation row's fp8 scale from its largest magnitude [M]: amax / 448."""
    return (amax.float() / FP8_MAX).clamp(min=FP8_MIN_SCALE)


def quantize_rows(x: torch.Tensor,
                  scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], fp32 scales [M]): each row divided by its scale (given: [M], or
    [1] for a static one; else its own amax / 448), clamped, rounded to e4m3."""
    if scales is None:
        scales = row_scales(x.abs().amax(-1))  # [M]
    scales = scales.float().reshape(-1).expand(x.shape[0])
    q = (x.float() / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scales.contiguous()


def fp8_w8a8_gemm_ref(xq: torch.Tensor, x_scales: torch.Tensor, weight: torch.Tensor,
                      scales: torch.Tensor, block: tuple[int, int], *, out_dtype: torch.dtype,
                      **_tuning) -> torch.Tensor:
    """W8A8: (xq [M, K] * x_scales [M]) @ W^T -> [M, N] in out_dtype."""
    w = dequantize_fp8(weight, scales, block)
    return ((xq.float() @ w.T) * x_scales[:, None]).to(out_dtype)
