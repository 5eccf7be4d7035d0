"""The pure-torch LoRA backend (the serving reference, and the backend on CPU), and its per-step
metadata. For every segment s with slot j, in PEFT's order:

    out[rows_s] += (x[rows_s] @ A_j^T) @ B_j^T * scale_j      (shrink to rank r, expand back)

Segments of similar length and rank go all at once: those of at most DECODE_MAX_ROWS rows (decode: a
row or a few per adapter) form one batch per rank tier, and prefill chunks up to BATCH_MAX_ROWS one
batch per quarter octave of length (9-10 rows, 11-12, ..., 17-20, ...) and rank tier, so padding
adds under 25% to a segment's rows. A rank tier is the power of two at or above an adapter's largest
rank, 16 at least (16, 32, 64, ...: below 16 padding costs less than another batch would; the Triton
path's tiles, kernels/segments.py rank_tile). A batch runs one batched shrink per group and one
batched expand per slice at the group's largest rank among its adapters, ranks above a segment's own
masked off, so a rank-8 adapter's rows never pay for a rank-64 one's beside them (at most twice
their own rank, or 16). That is a handful of ops per group instead of two matmuls per segment and
projection: what keeps a CPU step over 64 adapters near one over a single adapter (a prefill of 64
chunks of 8-24 rows was ~1.8k small matmul pairs: its LoRA time fell by a quarter). Longer segments,
and every segment with `exact=True` (the reference the batches are tested against), get one shrink
and one expand matmul each at their exact rank.

A batch reads its adapters' A and B stacked side by side ([S, ...]: executor/lora/stack.py).
Decode steps run nearly the same adapters step after step, so one stack per rank tier is kept and
updated in place: a new adapter of the step is appended, a slot rewritten since is copied again,
the rest is not touched. A batch whose adapters, once appended, are at least STACK_REUSE_FRACTION
of its tier's kept stack runs over all of it, the absent slots' rows masked off; otherwise it gets
a stack of its own for the step, and the tier's largest decode batch's replaces the kept one (a
batch of prefill chunks never does: its stack serves one step; but where the tier has none yet,
any batch's stack is kept). A tier's kept stack has room for the pool's slots of that tier (or a
step's segments, if more; a stack that fills is built again, larger): in all about one more copy
of the pool's rows, each padded at most to twice its rank.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch

from executor.lora.experts import ExpertRuns, ExpertWeights, apply_torch
from executor.lora.segments import LoraSegments
from executor.lora.slot_pool import LoraSlotPool, SliceGroup
from executor.lora.stack import AdapterStack, SlotCache
from kernels.segments import rank_tile

# Segments of at most this many rows share one batch (decode); longer ones are batched by length
# up to BATCH_MAX_ROWS. Longer still, a segment's own matmuls cost more than their Python (and a
# batch would copy its adapters into a stack): they run on their own, like the exact path.
DECODE_MAX_ROWS = 8
BATCH_MAX_ROWS = 32
# A batch reuses the kept stack when its segments' slots, the missing ones appended, are at least
# this fraction of it. The batch then reads every slot of the stack; a new stack would read and
# write its own slots once more before the batch reads them, so reuse costs less down to about a
# third. (At 0.75, the decode rows of a prefill step over 64 adapters, ~46 of them, built a stack
# of their own, and the next decode step built the 64 again: two copies of ~60-80 MB per prefill.)
STACK_REUSE_FRACTION = 0.5


@dataclass(frozen=True)
class _SegmentBatch:
    """Segments the torch backend handles together, one row of [S, Lmax] per position it reads
    of `stack` (padded to the longest segment; a position without a segment is all padding):
    the stack's first S positions, or the S positions `positions` gathers."""

    size: int  # S
    rows: torch.Tensor  # [S * Lmax] long: each segment's row indices, padding repeats a row
    # [N] long: the positions in `rows` that are not padding (None: there is none, e.g. decode
    # with a row per adapter, and `rows` is `flat_rows`)
    valid: torch.Tensor | None
    flat_rows: torch.Tensor  # [N] long: rows[valid], the rows to update, in that order
    stack: AdapterStack
    # (start, end) when flat_rows is start..end-1 in order (decode over distinct adapters in the
    # stack's order; a single segment): x and out are read and written in place, no gather
    span: tuple[int, int] | None
    # [S] long: the stack positions the batch reads, one per segment (None: the first S)
    positions: torch.Tensor | None = None

    @classmethod
    def build(cls, segments: list[tuple[int, int, int]], stack: AdapterStack,
              device: torch.device, gather: bool = False) -> _SegmentBatch:
        """`gather`: read only the segments' positions of the stack, not its first S."""
        longest = max(end - start for start, end, _ in segments)
        taken = collections.Counter()
        at = []  # each segment's position in the stack
        for _, _, slot in segments:
            at.append(stack.index[slot][taken[slot]])
            taken[slot] += 1
        size = len(segments) if gather else len(stack)
        starts, lens = [0] * size, [0] * size
        for i, (start, end, _) in enumerate(segments):
            starts[i if gather else at[i]], lens[i if gather else at[i]] = start, end - start
        offsets = torch.arange(longest)
        starts_t = torch.tensor(starts).unsqueeze(1)
        valid = offsets < torch.tensor(lens).unsqueeze(1)
        rows = torch.where(valid, starts_t + offsets, starts_t)
        dense = bool(valid.all())
        flat = rows.flatten()
        first = int(flat[0])
        span = (first, first + len(flat)) if dense and torch.equal(
            flat, torch.arange(first, first + len(flat))) else None
        picks = None if dense else valid.flatten().nonzero().flatten().to(device)
        positions = torch.tensor(at, device=device) if gather else None
        return cls(size, flat.to(device), picks, rows[valid].to(device), stack, span, positions)


@dataclass(frozen=True)
class TorchBatchMeta:
    """The torch backend's per-step metadata, built once and read by every layer and group."""

    alone: tuple[tuple[int, int, int], ...]  # (start_row, end_row, slot): one matmul pair each
    batches: tuple[_SegmentBatch, ...]  # segments of similar length, each batch all at once


def _length_class(rows: int) -> int:
    """0 for decode segments (<= DECODE_MAX_ROWS); else one class per quarter of an octave (9-10,
    11-12, 13-14, 15-16, 17-20, ...): padding a segment to its class's longest adds < 25%."""
    if rows <= DECODE_MAX_ROWS:
        return 0
    octave = (rows - 1).bit_length()
    return 4 * octave + ((rows - 1) >> (octave - 3))


class TorchLoraBackend:
    """Pure torch (see the module docstring). `exact=True` runs every segment on its own (the
    reference)."""

    def __init__(self, pool: LoraSlotPool, *, exact: bool = False) -> None:
        self.pool, self.exact = pool, exact
        self._stacks: dict[int, AdapterStack] = {}  # rank tier -> its kept stack (stack.py)
        self._experts = ExpertWeights(pool)  # each slot's expert weights (experts.py)
        self._rows = SlotCache(pool)  # each slot's rows, as long segments read them

    def prepare(self, row_slots: torch.Tensor) -> TorchBatchMeta:
        segments = LoraSegments.from_row_slots(row_slots).segments
        if self.exact:
            return TorchBatchMeta(segments, ())
        # (each slot's tier; those outside the step only size the kept stacks: a load may be
        # rewriting one, and a wrong count there costs a rebuild, never a wrong row)
        tiers = [rank_tile(r) for r in self.pool.rank_table.amax(dim=(0, 2)).tolist()]
        # Per tier, the step's slots of that tier: the only ones its stacks may read now (a slot
        # the pool rewrote at another tier's rank goes dormant in this tier's kept stack rather
        # than growing every group of it to that rank)
        readable: dict[int, frozenset[int]] = collections.defaultdict(frozenset)
        for _, _, slot in segments:
            readable[tiers[slot]] |= {slot}
        by_class: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        alone = []
        for seg in segments:
            rows = seg[1] - seg[0]
            if rows > BATCH_MAX_ROWS:
                alone.append(seg)
            else:
                by_class.setdefault((_length_class(rows), tiers[seg[2]]), []).append(seg)
        # rank tier -> its largest decode batch (the one that keeps its stack): a prefill
        # chunk's batch is gone next step, and replacing the decode rows' kept stack with it
        # had the next decode step copy every adapter again (each round of bench/serving.py)
        largest = {}
        for (length, tier), segs in by_class.items():
            if length == 0 and len(segs) > len(largest.get(tier, ())):
                largest[tier] = segs
        per_tier = collections.Counter(tiers)
        batches = []
        for (_, tier), segs in sorted(by_class.items()):
            stack, gather = self._stack_for(segs, tier, per_tier[tier], readable[tier],
                                            keep=segs is largest.get(tier))
            batches.append(_SegmentBatch.build(segs, stack, self.pool.device, gather))
        return TorchBatchMeta(tuple(alone), tuple(batches))

    def _stack_for(self, segments: list[tuple[int, int, int]], tier: int, tier_slots: int,
                   readable: frozenset[int], keep: bool) -> tuple[AdapterStack, bool]:
        """The stack the segments' batch reads, and whether it gathers its positions from it
        (else it reads the stack's first positions). The tier's kept stack, brought up to date
        for these segments' slots (the missing ones appended), if they fit in it: read whole
        when they are at least STACK_REUSE_FRACTION of it, else their positions gathered. Else
        a new stack, kept from now on if `keep` or the tier has none yet (decode rows of one
        adapter, 9-32 of them, make a batch of their length class, never the decode class:
        a stack built each step for them made a decode step over 16 rows of one adapter of
        the tiny LLaMA take 13-15 ms instead of 7-9 ms), with
        room for the `tier_slots` slots of the pool in the tier. `readable`: the step's slots,
        the only ones whose weights may be read now (stack.py)."""
        slots = [slot for _, _, slot in segments]
        kept = self._stacks.get(tier)
        if kept is not None:
            size = len(kept) + len(kept.missing(slots))
            if size <= kept.capacity:
                kept.update(slots, readable)
                return kept, len(slots) < STACK_REUSE_FRACTION * size
        if not keep and kept is not None:
            return AdapterStack(self.pool, slots, capacity=len(slots), readable=readable), False
        self._stacks[tier] = AdapterStack(self.pool, slots, capacity=max(tier_slots, len(slots)),
                                          readable=readable)
        return self._stacks[tier], False

    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor,
              meta: TorchBatchMeta) -> None:
        """out [T, sum of the group's out_features] += the group's adapter contributions to
        x [T, in], in place."""
        g = self.pool.groups[group]
        if meta.alone:
            for module, out_m in zip(g.modules, out.split(g.out_sizes, dim=-1)):
                self._apply_module(layer, module, x, out_m, meta.alone)
        for batch in meta.batches:
            self._apply_batch(layer, group, g, x, out, batch)

    def prepare_experts(self, pair_slots: torch.Tensor, pair_experts: torch.Tensor,
                        expert_runs: tuple[tuple[int, int, int], ...]) -> ExpertRuns:
        """One MoE layer's metadata (executor/lora/experts.py), from its sorted pairs."""
        return ExpertRuns.build(pair_slots, expert_runs)

    def apply_experts(self, layer: int, projection: str, x: torch.Tensor, out: torch.Tensor,
                      runs: ExpertRuns) -> None:
        """out [P, out] += the pairs' adapters' LoRA of their experts' `projection`."""
        apply_torch(self._experts, layer, projection, x, out, runs)

    def _apply_module(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor,
                      segments: tuple[tuple[int, int, int], ...]) -> None:
        for start, end, slot in segments:
            target = self.pool.contents(slot).targets.get((layer, module))
            if target is None:
                continue
            _, scale = target
            # [r, in], [out, r]: gathered from its pages once, not every step (decode over one
            # adapter's 64 rows read them 28 times a step)
            a, b = self._rows.get(slot, (layer, module),
                                  lambda: self.pool.rows(layer, slot, module))
            # Same operation order as PEFT: (B(A(x))) * scale, then added to the base output.
            out[start:end] += (x[start:end] @ a.T) @ b.T * scale

    @staticmethod
    def _apply_batch(layer: int, name: str, g: SliceGroup, x: torch.Tensor, out: torch.Tensor,
                     segs: _SegmentBatch) -> None:
        stacked = segs.stack.group(layer, name, x.device, x.dtype)
        if stacked is None:
            return  # no adapter of the batch targets this group here
        num, n = segs.size, len(g.modules)
        if segs.span is not None:
            xs = x[segs.span[0]:segs.span[1]].reshape(num, -1, x.shape[-1])  # [S, Lmax, in]
        else:
            xs = x.index_select(0, segs.rows).view(num, -1, x.shape[-1])
        at = segs.positions
        a, bs, scales, drop = ((stacked.a[:num], [b[:num] for b in stacked.b],
                                stacked.scales[:num], stacked.drop) if at is None else
                               (stacked.a.index_select(0, at),
                                [b.index_select(0, at) for b in stacked.b],
                                stacked.scales.index_select(0, at),
                                None if stacked.drop is None
                                else stacked.drop.index_select(0, at)))
        # A [S, nR, in] and B [S, out, R] as PEFT holds them: the shrink runs as A times x's
        # rows (a dot product along A's contiguous rows), the expand as t times B transposed.
        # Decode step of the tiny LLaMA over 64 adapters (a row each) on this CPU: LoRA 5.5-5.8
        # ms against 7.6-8.8 ms for x @ A^T and t @ B^T stored transposed; over 16 adapters (4
        # rows each) 3.3-3.9 ms against 3.6-4.8 ms.
        t = torch.bmm(a, xs.mT).mT  # [S, Lmax, nR]
        t = t.reshape(num, -1, n, stacked.rank)  # [S, Lmax, n, R]
        if drop is not None:
            t = t.masked_fill(drop[:num], 0.0)
        pieces = [(t[:, :, s] @ b.mT).mul_(scales[:, s])  # [S, Lmax, out] each
                  for s, b in enumerate(bs)]
        if segs.span is not None:
            start, end = segs.span
            for y, out_s in zip(pieces, out.split(g.out_sizes, dim=-1)):
                out_s[start:end].add_(y.view(end - start, -1))
            return
        # (index_add_ into a column slice of `out` was ~10x slower than into all of it)
        y = (torch.cat(pieces, dim=-1) if len(pieces) > 1 else pieces[0]).view(-1, out.shape[-1])
        out.index_add_(0, segs.flat_rows,
                       y if segs.valid is None else y.index_select(0, segs.valid))
