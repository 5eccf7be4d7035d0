"""The pure-torch LoRA backend (the serving reference, and the backend on CPU), and its per-step
metadata. For every segment s with slot j, in PEFT's order:

    out[rows_s] += (x[rows_s] @ A_j^T) @ B_j^T * scale_j      (shrink to rank r, expand back)

Segments longer than `gather_max_rows` (prefill chunks) get one shrink and one expand matmul
each, at the exact rank. The shorter ones (decode: a row or a few per adapter) go all at once,
padded to the longest of them: their adapters' A and B gathered per segment, one batched shrink
per group and one batched expand per slice at the group's largest rank in the step, ranks above
a segment's own masked off. That is a handful of ops per group instead of two matmuls per segment
and projection: what keeps a CPU decode step over 64 adapters near one over a single adapter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor.lora_segments import LoraSegments
from executor.slot_pool import LoraSlotPool, SliceGroup


@dataclass(frozen=True)
class _ShortSegments:
    """Segments the torch backend handles together, padded to the longest: [S, Lmax] rows."""

    rows: torch.Tensor  # [S, Lmax] long: each segment's row indices, padded with its first row
    valid: torch.Tensor  # [S, Lmax] bool: False on padding
    flat_rows: torch.Tensor  # [N] long: rows[valid], the rows to update, in that order
    slots: torch.Tensor  # [S] long
    ranks: torch.Tensor  # [L, S, 7] int32: rank per layer and module (0 = not targeted)
    scales: torch.Tensor  # [L, S, 7] fp32

    @classmethod
    def build(cls, segments: list[tuple[int, int, int]], pool: LoraSlotPool) -> _ShortSegments:
        longest = max(end - start for start, end, _ in segments)
        offsets = torch.arange(longest)
        starts = torch.tensor([start for start, _, _ in segments]).unsqueeze(1)
        lens = torch.tensor([end - start for start, end, _ in segments]).unsqueeze(1)
        valid = offsets < lens
        rows = torch.where(valid, starts + offsets, starts)
        slots = torch.tensor([slot for _, _, slot in segments])
        device = pool.device
        return cls(rows.to(device), valid.to(device), rows[valid].to(device), slots.to(device),
                   pool.rank_table[:, slots], pool.scale_table[:, slots])


@dataclass(frozen=True)
class TorchBatchMeta:
    """The torch backend's per-step metadata, built once and read by every layer and group."""

    long: tuple[tuple[int, int, int], ...]  # (start_row, end_row, slot): one matmul pair each
    short: _ShortSegments | None  # the short segments, done all at once (None: there are none)


class TorchLoraBackend:
    """Pure torch (see the module docstring). `gather_max_rows=0` keeps every segment on the
    exact per-segment path (the reference)."""

    def __init__(self, pool: LoraSlotPool, *, gather_max_rows: int = 8) -> None:
        self.pool, self.gather_max_rows = pool, gather_max_rows

    def prepare(self, row_slots: torch.Tensor) -> TorchBatchMeta:
        segments = LoraSegments.from_row_slots(row_slots).segments
        short = [seg for seg in segments if seg[1] - seg[0] <= self.gather_max_rows]
        long = tuple(seg for seg in segments if seg[1] - seg[0] > self.gather_max_rows)
        return TorchBatchMeta(long, _ShortSegments.build(short, self.pool) if short else None)

    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor,
              meta: TorchBatchMeta) -> None:
        """out [T, sum of the group's out_features] += the group's adapter contributions to
        x [T, in], in place."""
        g = self.pool.groups[group]
        for module, out_m in zip(g.modules, out.split(g.out_sizes, dim=-1)):
            self._apply_module(layer, module, x, out_m, meta.long)
        if meta.short is not None:
            self._apply_short(layer, g, x, out, meta.short)

    def _apply_module(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor,
                      segments: tuple[tuple[int, int, int], ...]) -> None:
        for start, end, slot in segments:
            target = self.pool.state(slot).targets.get((layer, module))
            if target is None:
                continue
            rank, scale = target
            a = self.pool.a[module][layer, slot, :rank]  # [r, in]
            b = self.pool.b[module][layer, slot, :, :rank]  # [out, r]
            # Same operation order as PEFT: (B(A(x))) * scale, then added to the base output.
            out[start:end] += (x[start:end] @ a.T) @ b.T * scale

    @staticmethod
    def _apply_short(layer: int, g: SliceGroup, x: torch.Tensor, out: torch.Tensor,
                     segs: _ShortSegments) -> None:
        n = len(g.modules)
        m = slice(g.first_module, g.first_module + n)
        ranks = segs.ranks[layer, :, m]  # [S, n]
        max_rank = int(ranks.max())
        if max_rank == 0:
            return  # no short segment's adapter targets this group here
        num = len(segs.slots)
        a = g.a[layer, :, :, :max_rank].index_select(0, segs.slots)  # [S, n, R, in]
        t = x[segs.rows] @ a.reshape(num, n * max_rank, -1).transpose(1, 2)  # [S, Lmax, n*R]
        keep = (torch.arange(max_rank, device=x.device)
                < ranks.to(x.device).unsqueeze(-1))  # [S, n, R]
        t = t.view(num, -1, n, max_rank).masked_fill(~keep.unsqueeze(1), 0.0)
        bt = g.bt[layer, :, :max_rank].index_select(0, segs.slots)  # [S, R, sum(out)]
        scales = segs.scales[layer, :, m].to(x.device, x.dtype)  # [S, n]
        pieces, offset = [], 0
        for s, out_f in enumerate(g.out_sizes):
            y = t[:, :, s] @ bt[:, :, offset:offset + out_f]  # [S, Lmax, out]
            pieces.append(y * scales[:, s, None, None])
            offset += out_f
        out.index_add_(0, segs.flat_rows, torch.cat(pieces, dim=-1)[segs.valid])
