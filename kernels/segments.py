"""Per-step work for the SGMV kernels: built once per step on the host, copied to the device in
one transfer, and read by every layer and projection of the step. Pure torch (no triton).

A work item is one M-tile of one segment: at most `block_m` consecutive rows sharing an adapter.
Kernels launch one program per (item, column chunk): no program is launched for rows without an
adapter or for the empty tail of a short segment. Running example, block_m 4, row slots
[3, 3, -1, 0, 0, 0, 0, 0] -> segments (start, end, slot) (0, 2, 3), (3, 8, 0) ->

    items (row_start, row_end, slot, segment): (0, 2, 3, 0), (3, 7, 0, 1), (7, 8, 0, 1)

Row 2 (no adapter) appears in no item. ranks / scales [L, 7, S] hold each segment's rank (0 =
the adapter does not target that module) and scale per layer and module, so kernels loop to
each adapter's own rank and skip untargeted slices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SegmentWork:
    items: torch.Tensor  # [4, W] int32 on device: row_start, row_end, slot, segment
    ranks: torch.Tensor  # [L, M, S] int32 on device
    scales: torch.Tensor  # [L, M, S] fp32 on device
    block_m: int
    max_ranks: tuple[int, ...]  # [M] host: the largest rank of each module over layers, segments

    @property
    def num_items(self) -> int:
        return self.items.shape[1]

    def rank_block(self, first_module: int, num_modules: int) -> int:
        """The kernels' rank tile for a group: a power of two >= 16 covering every rank of the
        group in this step, or 0 when no segment's adapter targets the group."""
        r = max(self.max_ranks[first_module: first_module + num_modules])
        return 0 if r == 0 else max(16, 1 << (r - 1).bit_length())

    @classmethod
    def build(cls, seg_starts: torch.Tensor, seg_lens: torch.Tensor, seg_slots: torch.Tensor,
              rank_table: torch.Tensor, scale_table: torch.Tensor, *, block_m: int,
              device: str | torch.device) -> SegmentWork:
        """seg_*: [S] host tensors (segments may be empty); rank_table, scale_table:
        [L, num_slots, M] host tables of the slot pool."""
        starts, lens = seg_starts.long(), seg_lens.long()
        num_segs = starts.numel()
        tiles = (lens + block_m - 1) // block_m  # [S] items per segment
        seg_of = torch.repeat_interleave(torch.arange(num_segs), tiles)  # [W]
        first_item = torch.cumsum(tiles, 0) - tiles  # [S]
        tile_of = torch.arange(seg_of.numel()) - first_item[seg_of]  # [W] tile within segment
        row_start = starts[seg_of] + tile_of * block_m
        row_end = torch.minimum(row_start + block_m, (starts + lens)[seg_of])
        items = torch.stack([row_start, row_end, seg_slots.long()[seg_of], seg_of])  # [4, W]
        slots = seg_slots.long()
        ranks = rank_table[:, slots].transpose(1, 2)  # [L, M, S]
        scales = scale_table[:, slots].transpose(1, 2).float()  # [L, M, S]
        max_ranks = ranks.amax(dim=(0, 2)) if num_segs else torch.zeros(ranks.shape[1])
        # One host-to-device copy for everything: int32 items | ranks | fp32 scales (as bits).
        flat = torch.cat([items.int().flatten(), ranks.int().flatten(),
                          scales.contiguous().view(torch.int32).flatten()]).to(device)
        n_items, n_ranks = items.numel(), ranks.numel()
        return cls(items=flat[:n_items].view(4, -1),
                   ranks=flat[n_items: n_items + n_ranks].view(ranks.shape),
                   scales=flat[n_items + n_ranks:].view(torch.float32).view(scales.shape),
                   block_m=block_m, max_ranks=tuple(int(r) for r in max_ranks.tolist()))
