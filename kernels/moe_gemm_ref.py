"""The grouped MoE matmul's pure-torch reference (kernels/moe_gemm.py's signature): per run, its
rows times its expert's weight transposed, accumulated in fp32 and rounded once."""

from __future__ import annotations

import torch


def moe_gemm_ref(x: torch.Tensor, w: torch.Tensor, runs: tuple[tuple[int, int, int], ...],
                 **_tuning) -> torch.Tensor:
    out = torch.zeros(x.shape[0], w.shape[1], device=x.device, dtype=x.dtype)
    for start, end, e in runs:
        out[start:end] = (x[start:end].float() @ w[e].float().T).to(x.dtype)
    return out
