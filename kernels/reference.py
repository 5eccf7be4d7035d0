"""Pure-torch references of the SGMV kernels, with the same signatures and rounding points:
x @ A^T accumulates in fp32 and is rounded to the activation dtype; the expand accumulates in
fp32, is scaled, added to the fp32 output and rounded once. A's and B^T's rows are gathered from
the paged store through the same offset tables (kernels/page_rows.py). Loops over work items: for
tests and the GPU check, not for serving (executor.lora.torch_backend.TorchLoraBackend is the
serving reference).
"""

from __future__ import annotations

import torch

from kernels.page_rows import row_index

# Kernel vs reference: (rtol, atol as a fraction of the largest expected magnitude) per dtype.
# fp32 to 1e-5; bf16 / fp16 about one ulp (2^-7 / 2^-10 relative): kernels and references round
# at the same points and differ only in the order of fp32 accumulation.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2**-7, 2**-7),
              torch.float16: (2**-10, 2**-10)}


def _items(items: torch.Tensor):
    """Yield (row_start, row_end, slot, segment) of every work item, as ints."""
    yield from (tuple(int(v) for v in col) for col in items.t().tolist())


def gather_rows(store: torch.Tensor, offsets: torch.Tensor, slot: int, module: int, rank: int,
                length: int, *, layer_base: int, chunk: int) -> torch.Tensor:
    """The first `rank` rows (of `length` elements) of one slot's module: [rank, length]."""
    return store[row_index(offsets[slot, module, :rank], length, chunk) + layer_base]


def sgmv_shrink_ref(x: torch.Tensor, store: torch.Tensor, a_offsets: torch.Tensor,
                    items: torch.Tensor, ranks: torch.Tensor, *, first_module: int,
                    layer_base: int, chunk: int, rank_block: int, **_tuning) -> torch.Tensor:
    num_slices = ranks.shape[0]
    t = torch.zeros(x.shape[0], num_slices, rank_block, device=x.device)  # [T, n, RB]
    for start, end, slot, seg in _items(items):
        for i in range(num_slices):
            r = int(ranks[i, seg])
            a = gather_rows(store, a_offsets, slot, first_module + i, r, x.shape[1],
                            layer_base=layer_base, chunk=chunk)
            t[start:end, i, :r] = x[start:end].float() @ a.float().T
    return t


def _expand_rows(t_rows: torch.Tensor, bt: torch.Tensor, out_rows: torch.Tensor,
                 scale: float) -> None:
    """out_rows [m, N] += scale * round(t_rows [m, r]) @ bt [r, N], one rounding at the end."""
    t_rows = t_rows.to(out_rows.dtype).float()
    out_rows.copy_((out_rows.float() + scale * (t_rows @ bt.float())).to(out_rows.dtype))


def sgmv_expand_ref(t: torch.Tensor, store: torch.Tensor, b_offsets: torch.Tensor,
                    out: torch.Tensor, items: torch.Tensor, ranks: torch.Tensor,
                    scales: torch.Tensor, out_sizes: tuple[int, ...], *, first_module: int,
                    layer_base: int, chunk: int, **_tuning) -> None:
    for start, end, slot, seg in _items(items):
        offset = 0
        for i, n in enumerate(out_sizes):
            r = int(ranks[i, seg])
            if r:
                bt = gather_rows(store, b_offsets, slot, first_module + i, r, n,
                                 layer_base=layer_base, chunk=chunk)
                _expand_rows(t[start:end, i, :r], bt, out[start:end, offset: offset + n],
                             float(scales[i, seg]))
            offset += n


def sgmv_fused_ref(x: torch.Tensor, store: torch.Tensor, a_offsets: torch.Tensor,
                   b_offsets: torch.Tensor, out: torch.Tensor, items: torch.Tensor,
                   ranks: torch.Tensor, scales: torch.Tensor, out_sizes: tuple[int, ...], *,
                   first_module: int, layer_base: int, chunk: int, rank_block: int,
                   **_tuning) -> None:
    rows = dict(first_module=first_module, layer_base=layer_base, chunk=chunk)
    t = sgmv_shrink_ref(x, store, a_offsets, items, ranks, rank_block=rank_block, **rows)
    sgmv_expand_ref(t, store, b_offsets, out, items, ranks, scales, out_sizes, **rows)
