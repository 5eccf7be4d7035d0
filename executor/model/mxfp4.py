"""MXFP4 weights (gpt-oss's experts, OCP microscaling FP4) dequantized at load to the serving dtype.

A checkpoint stores a weight [..., rows, cols] as `{name}_blocks` uint8 [..., rows, cols / 32, 16]
and `{name}_scales` uint8 [..., rows, cols / 32]: each group of 32 values of a row is 16 bytes of
two FP4 (E2M1) values, the low nibble first, and one shared power of two, 2^(scale - 127).
E2M1 codes 0..15 are +0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives. Every value is exactly
representable in bf16 and fp32, and so is its product with the scale: dequantizing is exact.
(gpt-oss keeps its experts' blocks in the (out, in) orientation loraplex keeps its weights in.)
"""

from __future__ import annotations

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_ROWS_PER_CHUNK = 1 << 16  # groups dequantized at a time (bounds the temporaries)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """blocks uint8 [..., rows, G, 16], scales uint8 [..., rows, G] -> [..., rows, G * 32]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and "
                         f"{scales.dtype}")
    if blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} "
                         "do not fit [..., G, 16] and [..., G]")
    table = torch.tensor(E2M1, dtype=dtype)
    flat_blocks = blocks.reshape(-1, 16)
    exponents = scales.reshape(-1, 1).to(torch.int32) - 127
    out = torch.empty(flat_blocks.shape[0], 32, dtype=dtype)  # [groups, 32]
    for at in range(0, flat_blocks.shape[0], _ROWS_PER_CHUNK):
        chunk, part = flat_blocks[at:at + _ROWS_PER_CHUNK], out[at:at + _ROWS_PER_CHUNK]
        part[:, 0::2] = table[(chunk & 0x0F).long()]
        part[:, 1::2] = table[(chunk >> 4).long()]
        torch.ldexp(part, exponents[at:at + _ROWS_PER_CHUNK], out=part)
    return out.view(*scales.shape[:-1], scales.shape[-1] * 32)
