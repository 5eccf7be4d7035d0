"""The pure-torch LoRA backend (the serving reference, and the backend on CPU), and its per-step
metadata. For every segment s with slot j, in PEFT's order:

    out[rows_s] += (x[rows_s] @ A_j^T) @ B_j^T * scale_j      (shrink to rank r, expand back)

Segments longer than `gather_max_rows` (prefill chunks) get one shrink and one expand matmul
each, at the exact rank. The shorter ones (decode: a row or a few per adapter) go all at once,
padded to the longest of them: one batched shrink per group and one batched expand per slice, at
the group's largest rank among them, ranks above a segment's own masked off. That is a handful of
ops per group instead of two matmuls per segment and projection: what keeps a CPU decode step over
64 adapters near one over a single adapter.

The batched path reads its adapters' A and B stacked side by side ([S, ...], gathered from the
pool). Decode steps run the same adapters step after step, so the stack is built once and kept
(`_Stack`) while its slots hold the same weights (the pool's write counts); a step whose adapters
are a large enough subset of the kept stack (STACK_REUSE_FRACTION) runs over the whole stack, the
absent slots' rows masked off, rather than copying a new one. The stack costs at most one more
copy of the slots it holds (the pool's size with every slot in it).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch

from executor.lora_segments import LoraSegments
from executor.slot_pool import LoraSlotPool, SliceGroup

# A step reuses the kept stack when its short segments' slots are in it and are at least this
# fraction of it (below, the wasted rows of absent slots would cost more than a new stack).
STACK_REUSE_FRACTION = 0.75


@dataclass
class _Stack:
    """Adapters of a set of slots stacked for the batched path, filled per (layer, group) on
    first use and kept while the pool's write counts of `slots` are `writes`."""

    slots: tuple[int, ...]
    writes: tuple[int, ...]
    ranks: torch.Tensor  # [L, S, 7] int32: rank per layer and module (0 = not targeted)
    scales: torch.Tensor  # [L, S, 7] fp32
    # slot -> its positions in the stack (a slot whose rows are not contiguous in a step has a
    # segment, and a position, for each run of rows)
    index: dict[int, list[int]] = field(init=False)
    groups: dict[tuple[int, str], _StackedGroup | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.index = {}
        for i, slot in enumerate(self.slots):
            self.index.setdefault(slot, []).append(i)

    def holds(self, slots: list[int]) -> bool:
        """Whether every segment of `slots` has a position of its slot in the stack."""
        return all(len(self.index.get(slot, ())) >= count
                   for slot, count in collections.Counter(slots).items())

    def group(self, layer: int, g: SliceGroup, name: str, device: torch.device,
              dtype: torch.dtype) -> _StackedGroup | None:
        """The stacked A, B^T, rank mask and scales of group `g` at `layer` (None when no slot
        of the stack targets it there)."""
        key = (layer, name)
        if key not in self.groups:
            self.groups[key] = _StackedGroup.build(layer, g, self, device, dtype)
        return self.groups[key]


@dataclass(frozen=True)
class _StackedGroup:
    """Contiguous, as the batched matmuls read them (a strided view would be copied per call)."""

    a_t: torch.Tensor  # [S, in, n * R]: each slot's A of the group's slices, transposed
    bt: tuple[torch.Tensor, ...]  # per slice [S, R, out]
    drop: torch.Tensor  # [S, 1, n, R] bool: rank at or above the slot's own for that slice
    scales: torch.Tensor  # [S, n] in the activations' dtype

    @classmethod
    def build(cls, layer: int, g: SliceGroup, stack: _Stack, device: torch.device,
              dtype: torch.dtype) -> _StackedGroup | None:
        n = len(g.modules)
        m = slice(g.first_module, g.first_module + n)
        ranks = stack.ranks[layer, :, m]  # [S, n]
        max_rank = int(ranks.max())
        if max_rank == 0:
            return None
        slots = torch.tensor(stack.slots, device=g.a.device)
        num = len(stack.slots)
        a = g.a[layer, :, :, :max_rank].index_select(0, slots)  # [S, n, R, in]
        drop = torch.arange(max_rank) >= ranks.unsqueeze(-1)  # [S, n, R]
        bt = g.bt[layer, :, :max_rank].index_select(0, slots)  # [S, R, sum(out)]
        return cls(a_t=a.reshape(num, n * max_rank, -1).transpose(1, 2).contiguous(),
                   bt=tuple(b.contiguous() for b in bt.split(g.out_sizes, dim=-1)),
                   drop=drop.unsqueeze(1).to(device),
                   scales=stack.scales[layer, :, m].to(device, dtype))


@dataclass(frozen=True)
class _ShortSegments:
    """Segments the torch backend handles together, one row of [S, Lmax] per slot of `stack`
    (padded to the longest segment; a slot of the stack without a segment is all padding)."""

    rows: torch.Tensor  # [S, Lmax] long: each segment's row indices, padding repeats a row
    valid: torch.Tensor  # [S, Lmax] bool: False on padding
    flat_rows: torch.Tensor  # [N] long: rows[valid], the rows to update, in that order
    stack: _Stack
    dense: bool  # no padding (e.g. decode, a row per adapter): rows.flatten() is flat_rows

    @classmethod
    def build(cls, segments: list[tuple[int, int, int]], stack: _Stack,
              device: torch.device) -> _ShortSegments:
        longest = max(end - start for start, end, _ in segments)
        starts = [0] * len(stack.slots)
        lens = [0] * len(stack.slots)
        taken = collections.Counter()
        for start, end, slot in segments:
            i = stack.index[slot][taken[slot]]
            taken[slot] += 1
            starts[i], lens[i] = start, end - start
        offsets = torch.arange(longest)
        starts_t = torch.tensor(starts).unsqueeze(1)
        valid = offsets < torch.tensor(lens).unsqueeze(1)
        rows = torch.where(valid, starts_t + offsets, starts_t)
        return cls(rows.to(device), valid.to(device), rows[valid].to(device), stack,
                   dense=bool(valid.all()))


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
        self._stack: _Stack | None = None  # the short segments' adapters, kept across steps

    def prepare(self, row_slots: torch.Tensor) -> TorchBatchMeta:
        segments = LoraSegments.from_row_slots(row_slots).segments
        short = [seg for seg in segments if seg[1] - seg[0] <= self.gather_max_rows]
        long = tuple(seg for seg in segments if seg[1] - seg[0] > self.gather_max_rows)
        if not short:
            return TorchBatchMeta(long, None)
        return TorchBatchMeta(long, _ShortSegments.build(short, self._stack_for(short),
                                                         self.pool.device))

    def _stack_for(self, short: list[tuple[int, int, int]]) -> _Stack:
        """The kept stack if it holds these segments' slots as they are now, else a new one."""
        slots = [slot for _, _, slot in short]
        kept = self._stack
        if (kept is not None and len(slots) >= STACK_REUSE_FRACTION * len(kept.slots)
                and kept.holds(slots)
                and self.pool.write_counts(list(kept.slots)) == kept.writes):
            return kept
        index = torch.tensor(slots)
        self._stack = _Stack(tuple(slots), self.pool.write_counts(slots),
                             self.pool.rank_table[:, index], self.pool.scale_table[:, index])
        return self._stack

    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor,
              meta: TorchBatchMeta) -> None:
        """out [T, sum of the group's out_features] += the group's adapter contributions to
        x [T, in], in place."""
        g = self.pool.groups[group]
        for module, out_m in zip(g.modules, out.split(g.out_sizes, dim=-1)):
            self._apply_module(layer, module, x, out_m, meta.long)
        if meta.short is not None:
            self._apply_short(layer, group, g, x, out, meta.short)

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
    def _apply_short(layer: int, name: str, g: SliceGroup, x: torch.Tensor, out: torch.Tensor,
                     segs: _ShortSegments) -> None:
        stacked = segs.stack.group(layer, g, name, x.device, x.dtype)
        if stacked is None:
            return  # no short segment's adapter targets this group here
        num, n = stacked.a_t.shape[0], len(g.modules)
        if segs.dense:
            xs = x.index_select(0, segs.flat_rows).view(num, -1, x.shape[-1])  # [S, Lmax, in]
        else:
            xs = x[segs.rows]
        t = xs @ stacked.a_t  # [S, Lmax, n*R]
        t = t.view(num, -1, n, stacked.drop.shape[-1]).masked_fill(stacked.drop, 0.0)
        pieces = [(t[:, :, s] @ bt) * stacked.scales[:, s, None, None]  # [S, Lmax, out]
                  for s, bt in enumerate(stacked.bt)]
        y = torch.cat(pieces, dim=-1)
        out.index_add_(0, segs.flat_rows, y.view(-1, y.shape[-1]) if segs.dense else y[segs.valid])
