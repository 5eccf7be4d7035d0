"""Pure-torch references of the SGMV kernels, with the same signatures and rounding points:
x @ A^T accumulates in fp32 and is rounded to the activation dtype; the expand accumulates in
fp32, is scaled, added to the fp32 output and rounded once. Loops over work items: for tests and
the GPU check, not for serving (executor.lora.TorchLoraBackend is the serving reference).
"""

from __future__ import annotations

import torch

# Kernel vs reference: (rtol, atol as a fraction of the largest expected magnitude) per dtype.
# fp32 to 1e-5; bf16 / fp16 about one ulp (2^-7 / 2^-10 relative): kernels and references round
# at the same points and differ only in the order of fp32 accumulation.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2**-7, 2**-7),
              torch.float16: (2**-10, 2**-10)}


def _items(items: torch.Tensor):
    """Yield (row_start, row_end, slot, segment) of every work item, as ints."""
    yield from (tuple(int(v) for v in col) for col in items.t().tolist())


def sgmv_shrink_ref(x: torch.Tensor, a: torch.Tensor, items: torch.Tensor, ranks: torch.Tensor,
                    *, block_m: int, rank_block: int, **_tuning) -> torch.Tensor:
    num_slices = a.shape[1]
    t = torch.zeros(x.shape[0], num_slices, rank_block, device=x.device)  # [T, n, RB]
    for start, end, slot, seg in _items(items):
        for i in range(num_slices):
            r = int(ranks[i, seg])
            t[start:end, i, :r] = x[start:end].float() @ a[slot, i, :r].float().T
    return t


def _expand_rows(t_rows: torch.Tensor, bt: torch.Tensor, out_rows: torch.Tensor,
                 scale: float) -> None:
    """out_rows [m, N] += scale * round(t_rows [m, r]) @ bt [r, N], one rounding at the end."""
    t_rows = t_rows.to(out_rows.dtype).float()
    out_rows.copy_((out_rows.float() + scale * (t_rows @ bt.float())).to(out_rows.dtype))


def sgmv_expand_ref(t: torch.Tensor, bt: torch.Tensor, out: torch.Tensor, items: torch.Tensor,
                    ranks: torch.Tensor, scales: torch.Tensor, out_sizes: tuple[int, ...], *,
                    block_m: int, **_tuning) -> None:
    for start, end, slot, seg in _items(items):
        offset = 0
        for i, n in enumerate(out_sizes):
            r = int(ranks[i, seg])
            if r:
                _expand_rows(t[start:end, i, :r], bt[slot, :r, offset: offset + n],
                             out[start:end, offset: offset + n], float(scales[i, seg]))
            offset += n


def sgmv_fused_ref(x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, out: torch.Tensor,
                   items: torch.Tensor, ranks: torch.Tensor, scales: torch.Tensor,
                   out_sizes: tuple[int, ...], *, block_m: int, rank_block: int,
                   **_tuning) -> None:
    t = sgmv_shrink_ref(x, a, items, ranks, block_m=block_m, rank_block=rank_block)
    sgmv_expand_ref(t, bt, out, items, ranks, scales, out_sizes, block_m=block_m)
