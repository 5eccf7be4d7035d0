"""A step's adapter segments: the rows of a step come sorted by slot, so each adapter's rows form
one segment. Built on the host from the step's row slots; each LoRA backend builds its own
per-step metadata from them (executor/lora/torch_backend.py, executor/lora/triton_backend.py).

Slot -1 means "base model only" and gets no segment. Running example, 6 rows with slots
[3, 3, -1, 0, 0, 0] -> segments (start, end, slot) = (0, 2, 3), (3, 6, 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoraSegments:
    """The segments of a step with an adapter (slot >= 0), as host tuples for Python loops and as
    host tensors for the kernels' work list."""

    segments: tuple[tuple[int, int, int], ...]  # (start_row, end_row, slot)
    seg_starts: torch.Tensor  # [S] long, host
    seg_lens: torch.Tensor  # [S] long, host
    seg_slots: torch.Tensor  # [S] long, host
    max_seg_len: int

    @classmethod
    def from_row_slots(cls, row_slots: torch.Tensor) -> LoraSegments:
        """row_slots: [T] long on the host, the adapter slot of every row (-1 = none)."""
        slots, lens = torch.unique_consecutive(row_slots, return_counts=True)  # [S'], [S']
        starts = torch.cumsum(lens, 0) - lens
        keep = slots >= 0
        slots, lens, starts = slots[keep], lens[keep], starts[keep]
        segments = tuple(zip(starts.tolist(), (starts + lens).tolist(), slots.tolist()))
        return cls(segments=segments, seg_starts=starts, seg_lens=lens, seg_slots=slots,
                   max_seg_len=max((e - s for s, e, _ in segments), default=0))
