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

Rank tiers (`tiers`, for the groups asked for at build): a group's items split by the rank tile
their segment's adapter needs (a power of two >= 16 covering its ranks of the group's slices in
every layer), so a launch per tier computes a rank-8 adapter's rows with a 16-row tile beside a
rank-64 one's, not with the 64-row tile of the step's largest rank. In the running example, if
slot 3 has rank 8 and slot 0 rank 64 in a group: tiers (16, items [(0, 2, 3, 0)]) and
(64, items [(3, 7, 0, 1), (7, 8, 0, 1)]).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

Group = tuple[int, int]  # (first module, number of modules): a group of slices


def rank_tile(rank: int) -> int:
    """The rank tile of a rank: a power of two >= 16 covering it; 0 for rank 0."""
    return 0 if rank == 0 else max(16, 1 << (rank - 1).bit_length())


@dataclass(frozen=True)
class SegmentWork:
    items: torch.Tensor  # [4, W] int32 on device: row_start, row_end, slot, segment
    ranks: torch.Tensor  # [L, M, S] int32 on device
    scales: torch.Tensor  # [L, M, S] fp32 on device
    block_m: int
    max_ranks: tuple[int, ...]  # [M] host: the largest rank of each module over layers, segments
    # group -> (rank tile, its items [4, w] on device) in increasing tiles: the groups asked for
    tiers: dict[Group, tuple[tuple[int, torch.Tensor], ...]] = field(default_factory=dict)

    @property
    def num_items(self) -> int:
        return self.items.shape[1]

    def rank_block(self, first_module: int, num_modules: int) -> int:
        """The kernels' rank tile for a group: a power of two >= 16 covering every rank of the
        group in this step, or 0 when no segment's adapter targets the group."""
        return rank_tile(max(self.max_ranks[first_module: first_module + num_modules]))

    @classmethod
    def build(cls, seg_starts: torch.Tensor, seg_lens: torch.Tensor, seg_slots: torch.Tensor,
              rank_table: torch.Tensor, scale_table: torch.Tensor, *, block_m: int,
              device: str | torch.device, tiered: tuple[Group, ...] = ()) -> SegmentWork:
        """seg_*: [S] host tensors (segments may be empty); rank_table, scale_table:
        [L, num_slots, M] host tables of the slot pool; `tiered`: the groups to split in rank
        tiers."""
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
        tier_items = {group: _tier_items(items, seg_of, ranks, group) for group in tiered}
        # One host-to-device copy for everything: int32 items | ranks | fp32 scales (as bits) |
        # each tier's items.
        parts = [items.int(), ranks.int(), scales.contiguous().view(torch.int32),
                 *(t for tiers in tier_items.values() for _, t in tiers)]
        flat = torch.cat([part.flatten() for part in parts]).to(device)
        views, at = [], 0
        for part in parts:
            views.append(flat[at: at + part.numel()].view(part.shape))
            at += part.numel()
        items_d, ranks_d, scales_d, *tier_views = views
        tiers, k = {}, 0
        for group, group_tiers in tier_items.items():
            tiers[group] = tuple((tile, tier_views[k + i]) for i, (tile, _) in
                                 enumerate(group_tiers))
            k += len(group_tiers)
        return cls(items=items_d, ranks=ranks_d, scales=scales_d.view(torch.float32),
                   block_m=block_m, max_ranks=tuple(int(r) for r in max_ranks.tolist()),
                   tiers=tiers)


def _tier_items(items: torch.Tensor, seg_of: torch.Tensor, ranks: torch.Tensor,
                group: Group) -> list[tuple[int, torch.Tensor]]:
    """(rank tile, its items [4, w] int32) of one group, increasing tiles, host tensors."""
    first, num = group
    seg_ranks = ranks[:, first: first + num].amax(dim=(0, 1)).tolist()  # [S]
    tiles = torch.tensor([rank_tile(r) for r in seg_ranks], dtype=torch.long)[seg_of]  # [W]
    return [(tile, items[:, tiles == tile].int().contiguous())
            for tile in sorted(set(tiles.tolist()) - {0})]
