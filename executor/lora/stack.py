"""Adapters stacked side by side for the torch backend's batched matmuls
(executor/lora/torch_backend.py).

A stack gives each of its positions one slot of the pool, and per (layer, group) holds the A and
B of those slots contiguous in the layout the batched matmuls read ([S, n * R, in] and per slice
[S, out, R]). Decode steps run nearly the same adapters step after step, so the backend keeps one
stack and updates it in place instead of copying all of it when the set changes:

    - a slot the stack lacks gets the next free position (its weights copied there, nothing else);
    - a slot the pool has written since (another adapter loaded into it) is copied again where it
      sits (the pool's write counts tell);
    - a group whose largest rank grows past what it was built at is built again, whole.

Running example, a kept stack over slots [4, 7, 2]: a step over slots [7, 2, 9] appends 9 at
position 3 and copies only slot 9's weights; the step reads positions 0-3, position 0 (slot 4,
absent from the step) as padding. Positions are only appended, so a batch built over the first S
positions stays valid while a later batch of the same step appends more.

A step reads from the pool only the slots it runs (`readable`): the scheduler keeps those fixed
for the step, while any other slot may be rewritten meanwhile by a load on the loader's thread
(its rank table, offsets and pages change under a reader). A position whose slot is absent from
the step and needs copying (rewritten since its copy, or in a group built now) is made dormant
instead: rank 0, weights zero, to be copied when a step runs its slot again. In the example, if
slot 4 is being rewritten during that step, position 0 goes dormant; a later step over slot 4
copies it again where it sits.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch

from executor.lora.slot_pool import LoraSlotPool, SliceGroup

DORMANT = -1  # a position's write count when it holds no copy: never the pool's (counts >= 0)


class AdapterStack:
    """Slots at positions, their rank and scale tables, and per (layer, group) their stacked
    weights, filled on first use and kept up to date by `update`."""

    def __init__(self, pool: LoraSlotPool, slots: list[int], capacity: int,
                 readable: frozenset[int]) -> None:
        self.pool, self.capacity = pool, capacity
        self.slots: list[int] = []  # position -> slot
        # the pool's write count of each position's slot, as copied (DORMANT: no copy)
        self.writes: list[int] = []
        # The slots the current step runs: the only ones whose pool state may be read now.
        self.readable: frozenset[int] = frozenset()
        # slot -> its positions (a slot whose rows are not contiguous in a step has a segment,
        # and a position, for each run of rows)
        self.index: dict[int, list[int]] = {}
        num_layers = pool.rank_table.shape[0]
        self.ranks = torch.zeros(num_layers, capacity, pool.rank_table.shape[2],
                                 dtype=pool.rank_table.dtype)  # [L, cap, 7]; 0 = not targeted
        self.scales = torch.zeros(num_layers, capacity, pool.scale_table.shape[2],
                                  dtype=pool.scale_table.dtype)  # [L, cap, 7]
        self.groups: dict[tuple[int, str], StackedGroup | None] = {}
        self.update(slots, readable)

    def __len__(self) -> int:
        return len(self.slots)

    def missing(self, slots: list[int]) -> list[int]:
        """The slots (a slot once per segment) without a position of their own yet."""
        return [slot for slot, count in collections.Counter(slots).items()
                for _ in range(count - len(self.index.get(slot, ())))]

    def update(self, slots: list[int], readable: frozenset[int]) -> None:
        """Give every segment of `slots` a position, and make every position of a `readable`
        slot (the step's: `slots` among them) hold its weights as the pool has them now; a
        position of another slot that its copy no longer matches goes dormant. Copies only what
        is new or rewritten."""
        if not readable.issuperset(slots):
            raise ValueError("a stack's batch runs slots its step does not")
        self.readable = readable
        counts = self.pool.write_counts(self.slots)
        stale = [p for p, (now, then) in enumerate(zip(counts, self.writes)) if now != then]
        new = self.missing(slots)
        if len(self.slots) + len(new) > self.capacity:
            raise ValueError(f"stack of {self.capacity} positions cannot take {len(new)} more")
        for slot in new:
            stale.append(len(self.slots))
            self.index.setdefault(slot, []).append(len(self.slots))
            self.slots.append(slot)
            self.writes.append(DORMANT)
        copy = [p for p in stale if self.slots[p] in readable]
        idle = [p for p in stale if self.slots[p] not in readable and self.writes[p] != DORMANT]
        if copy or idle:
            self._refresh(copy, idle)

    def _refresh(self, copy: list[int], idle: list[int]) -> None:
        """Copy the positions `copy` (of readable slots) from the pool and make `idle` dormant,
        in the tables and in every group built (a group whose rank no longer covers its
        positions' is dropped, to be built again whole on its next use)."""
        for p, count in zip(copy, self.pool.write_counts([self.slots[p] for p in copy])):
            self.writes[p] = count
        for p in idle:
            self.writes[p] = DORMANT
        positions = torch.tensor(copy + idle, dtype=torch.long)
        of = torch.tensor([self.slots[p] for p in copy], dtype=torch.long)
        self.ranks[:, positions[:len(copy)]] = self.pool.rank_table[:, of]
        self.scales[:, positions[:len(copy)]] = self.pool.scale_table[:, of]
        self.ranks[:, positions[len(copy):]] = 0
        self.scales[:, positions[len(copy):]] = 0.0
        for (layer, name), group in list(self.groups.items()):
            g = self.pool.groups[name]
            if group is None or group.rank < int(self.ranks[layer, :len(self), g.modules_slice]
                                                  .max()):
                del self.groups[(layer, name)]  # built again, whole, on its next use
            else:
                group.copy(layer, g, self, copy + idle)

    def group(self, layer: int, name: str, device: torch.device,
              dtype: torch.dtype) -> StackedGroup | None:
        """The stacked weights of group `name` at `layer` (None when no slot of the stack
        targets it there)."""
        key = (layer, name)
        if key not in self.groups:
            # (it copies every position: none of a slot outside the step may still need one)
            idle = [p for p, slot in enumerate(self.slots)
                    if slot not in self.readable and self.writes[p] != DORMANT]
            if idle:
                self._refresh([], idle)
            self.groups[key] = StackedGroup.build(layer, self.pool.groups[name], self, device,
                                                  dtype)
        return self.groups[key]


@dataclass
class StackedGroup:
    """One group's weights at one layer for every position of a stack, contiguous as the batched
    matmuls read them (a strided view would be copied per call); the first S positions are a
    batch's view."""

    rank: int  # R: the group's largest rank over the stack's slots when built
    a: torch.Tensor  # [cap, n * R, in]: each position's A of the group's slices
    b: tuple[torch.Tensor, ...]  # per slice [cap, out, R]
    scales: torch.Tensor  # [cap, n, 1, 1] in the activations' dtype
    # [S, 1, n, R] bool: rank at or above the slot's own for that slice (None: every slot has
    # the group's largest rank in every slice, the usual case, and nothing is masked)
    drop: torch.Tensor | None

    @classmethod
    def build(cls, layer: int, g: SliceGroup, stack: AdapterStack, device: torch.device,
              dtype: torch.dtype) -> StackedGroup | None:
        rank = int(stack.ranks[layer, :len(stack), g.modules_slice].max())
        if rank == 0:
            return None
        n, cap, in_f, pool = len(g.modules), stack.capacity, g.in_features, stack.pool
        group = cls(rank, torch.empty(cap, n * rank, in_f, device=device, dtype=pool.dtype),
                    tuple(torch.empty(cap, out, rank, device=device, dtype=pool.dtype)
                          for out in g.out_sizes),
                    torch.zeros(cap, n, 1, 1, device=device, dtype=dtype), None)
        group.copy(layer, g, stack, list(range(len(stack))))
        return group

    def copy(self, layer: int, g: SliceGroup, stack: AdapterStack, positions: list[int]) -> None:
        """Copy the weights of the positions `positions` from the pool at the ranks the stack's
        table gives them (a dormant position's: 0, all zeros); recompute the mask."""
        n, rank, device, pool = len(g.modules), self.rank, self.a.device, stack.pool
        at = torch.tensor(positions, device=device)
        k = len(positions)
        a = torch.zeros(k, n, rank, g.in_features, dtype=pool.dtype, device=device)  # [k,n,R,in]
        b = [torch.zeros(k, out, rank, dtype=pool.dtype, device=device) for out in g.out_sizes]
        ranks = stack.ranks[layer, positions, g.modules_slice].tolist()  # [k][n]
        for j, p in enumerate(positions):  # (each slot's rows from its pages, zero above rank)
            for i, module in enumerate(g.modules):
                if ranks[j][i] == 0:
                    continue
                if stack.slots[p] not in stack.readable:
                    raise RuntimeError(f"slot {stack.slots[p]} is not in the step: its rows may "
                                       "be being rewritten")
                a_rows, b_rows = pool.rows(layer, stack.slots[p], module)
                a[j, i, :ranks[j][i]] = a_rows
                b[i][j, :, :ranks[j][i]] = b_rows
        self.a.index_copy_(0, at, a.reshape(k, n * rank, -1))
        for buf, rows in zip(self.b, b):
            buf.index_copy_(0, at, rows)
        scales = stack.scales[layer, positions, g.modules_slice]  # [k, n]
        self.scales.index_copy_(0, at, scales[:, :, None, None].to(device, self.scales.dtype))
        ranks = stack.ranks[layer, :len(stack), g.modules_slice]  # [S, n]
        drop = torch.arange(rank) >= ranks.unsqueeze(-1)  # [S, n, R]
        self.drop = drop.unsqueeze(1).to(device) if bool(drop.any()) else None


class SlotCache:
    """Per slot, what was made from its weights (gathered rows, stacked experts), made again
    once the pool rewrites the slot (its write count moves). Ask it only for slots the current
    step runs: a load may be rewriting any other."""

    def __init__(self, pool: LoraSlotPool) -> None:
        self.pool = pool
        self._kept: dict[int, tuple[int, dict]] = {}  # slot -> (write count, key -> value)

    def get(self, slot: int, key, make):
        """The value of `key` for `slot`: kept, or `make()` now."""
        (count,) = self.pool.write_counts([slot])
        kept = self._kept.get(slot)
        if kept is None or kept[0] != count:
            kept = self._kept[slot] = (count, {})
        if key not in kept[1]:
            kept[1][key] = make()
        return kept[1][key]

