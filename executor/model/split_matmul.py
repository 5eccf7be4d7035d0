"""Whether a fused gate|up projection runs as one matmul or as two over its halves, on CPU.

The weights keep gate and up fused ([2 I, hidden]: one matmul, one LoRA call per layer). On a CPU
the BLAS's GEMM for that width is not always the faster way: measured with MKL on this project's
2-vCPU machine (one thread, fp32), the two halves apart took 0.88-0.91x the fused time at 4-64
rows for a 1024-wide model (I = 2,816, 23 MB of weight), 0.92-0.97x at Llama-8B's shapes, and
1.01-1.03x for a 256-wide one (I = 688, 1.4 MB: in cache either way). Which way wins depends on the
CPU's caches and its BLAS, so the executor times both on its own weight when it starts
(`faster_in_halves`) and keeps the faster. Each output element is the same dot product either way:
the halves are used only when they give the same bits as the fused matmul on probes of 1, 16 and
67 rows (EQUAL_ROWS), so the choice never changes a token.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

PROBE_ROWS = 16  # a decode batch's rows: where the choice matters most (compute-bound steps)
PROBE_REPEATS = 5  # each way; the median is compared
EQUAL_ROWS = (1, 16, 67)  # the row counts the two ways must agree at (a BLAS may switch kernels)


def in_halves(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, in] @ weight^T, weight [2 n, in], as two matmuls over weight's halves (views):
    [T, 2 n], the fused matmul's result."""
    return torch.cat([F.linear(x, half) for half in weight.chunk(2)], dim=-1)


def faster_in_halves(weight: torch.Tensor, rows: int = PROBE_ROWS,
                     repeats: int = PROBE_REPEATS) -> bool:
    """Whether x @ weight^T of `rows` rows is faster in halves (in_halves) than fused, on this
    machine (the medians of `repeats` alternating timings), and equal to it bit for bit at
    EQUAL_ROWS rows."""
    g = torch.Generator(device=weight.device).manual_seed(0)  # (the global generator untouched)
    for n in EQUAL_ROWS:
        x = torch.randn(n, weight.shape[1], dtype=weight.dtype, device=weight.device, generator=g)
        if not torch.equal(F.linear(x, weight), in_halves(x, weight)):
            return False
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device, generator=g)
    fused_s, halves_s = [], []
    for _ in range(repeats):
        fused_s.append(_seconds(lambda: F.linear(x, weight)))
        halves_s.append(_seconds(lambda: in_halves(x, weight)))
    return sorted(halves_s)[repeats // 2] < sorted(fused_s)[repeats // 2]


def _seconds(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start
