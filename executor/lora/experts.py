"""LoRA on a mixture-of-experts layer's experts (executor/model/moe.py), for both backends: each
pair of a step's routing (row, expert, adapter slot), sorted by expert then slot, gets its adapter's
LoRA of that expert's projection, read from the pool's expert modules (common.peft.modules
.expert_module; how adapters' tensors become them: common/peft/experts.py):

    out[pairs_s] += scale * (x[pairs_s] @ A_{slot, e}^T) @ B_{slot, e}^T     per run s = (e, slot)

Each (expert, adapter) pair's weights are read once per step and layer, whatever its number of
rows. The torch path keeps, per slot, layer and projection, its experts' weights gathered from
its pages ([E, R, in] and [E, R, out], rows above each expert's rank zero: `ExpertWeights`, made
again once the pool rewrites the slot, and made only for slots the step runs: a load may be
rewriting any other, executor/lora/stack.py), and per slot runs one batched shrink and expand
over the rows of its short runs (decode: a row or a few per run), a longer run (a prefill
chunk's) a shrink and an expand of its own. The Triton path runs the SGMV kernels over all runs
at once, a run's "slot" being its (slot, module) row of the pool's offset tables viewed flat, so
the kernels need nothing new (kernels/sgmv_*.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.peft.modules import expert_module
from executor.lora.slot_pool import LoraSlotPool
from executor.lora.stack import SlotCache
from kernels.page_rows import row_index

# Runs of at most this many rows are batched together (decode); longer ones run on their own.
BATCH_MAX_ROWS = 8


@dataclass(frozen=True)
class ExpertRuns:
    """The (expert, adapter) runs of one MoE layer's sorted pairs that have an adapter."""

    runs: tuple[tuple[int, int, int, int], ...]  # (start, end, slot, expert)

    @classmethod
    def build(cls, pair_slots: torch.Tensor,
              expert_runs: tuple[tuple[int, int, int], ...]) -> ExpertRuns:
        """pair_slots [P] long (host), sorted by slot within each expert's run (start, end, e)."""
        out = []
        for start, end, expert in expert_runs:
            slots, counts = torch.unique_consecutive(pair_slots[start:end], return_counts=True)
            at = start
            for slot, n in zip(slots.tolist(), counts.tolist()):
                if slot >= 0:
                    out.append((at, at + n, slot, expert))
                at += n
        return cls(tuple(out))


class ExpertWeights:
    """The torch path's copy of each slot's expert weights (see the module docstring)."""

    def __init__(self, pool: LoraSlotPool) -> None:
        self.pool = pool
        self._kept = SlotCache(pool)

    def of(self, slot: int, layer: int, projection: str
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(A [E, R, in], B^T [E, R, out], scales [E]) of `slot`'s experts' `projection` at
        `layer`, R their largest rank there; None where none is targeted. `slot` must be one the
        current step runs."""
        return self._kept.get(slot, (layer, projection),
                              lambda: self._gather(slot, layer, projection))

    def _gather(self, slot: int, layer: int, projection: str):
        pool = self.pool
        modules = torch.tensor([pool.module_index(expert_module(e, projection))
                                for e in range(pool.config.num_experts)])  # [E]
        ranks = pool.rank_table[layer, slot, modules]  # [E]
        rank = int(ranks.max())
        if rank == 0:
            return None
        keep = (torch.arange(rank) < ranks[:, None]).to(pool.device)  # [E, R]
        in_f, out_f = pool.config.module_shape(expert_module(0, projection))
        base, out = pool.layer_base(layer), []
        for offsets, length in zip(pool.offsets(layer), (in_f, out_f)):
            at = offsets[slot, modules.to(pool.device), :rank]  # [E, R, chunks]
            rows = pool.kv.flat[row_index(at.flatten(0, 1), length, pool.chunk) + base]
            out.append(rows.view(len(modules), rank, length).masked_fill(~keep[..., None], 0.0))
        scales = pool.scale_table[layer, slot, modules].to(pool.device, pool.dtype)  # [E]
        return out[0], out[1], scales


def apply_torch(weights: ExpertWeights, layer: int, projection: str, x: torch.Tensor,
                out: torch.Tensor, runs: ExpertRuns) -> None:
    """out [P, out] += each run's LoRA of its expert's `projection` on x [P, in], in place."""
    by_slot: dict[int, list[tuple[int, int, int]]] = {}
    for start, end, slot, expert in runs.runs:
        by_slot.setdefault(slot, []).append((start, end, expert))
    for slot, mine in by_slot.items():
        kept = weights.of(slot, layer, projection)
        if kept is None:
            continue
        a, bt, scales = kept  # [E, R, in], [E, R, out], [E]
        short = [run for run in mine if run[1] - run[0] <= BATCH_MAX_ROWS]
        for start, end, e in mine:
            if end - start > BATCH_MAX_ROWS:
                out[start:end] += (x[start:end] @ a[e].T) @ bt[e] * scales[e]
        if short:
            lengths = torch.tensor([end - start for start, end, _ in short])
            experts = torch.repeat_interleave(torch.tensor([e for _, _, e in short]),
                                              lengths).to(x.device)  # [N]
            rows = torch.cat([torch.arange(start, end) for start, end, _ in short]).to(x.device)
            t = torch.bmm(x.index_select(0, rows)[:, None, :],
                          a.index_select(0, experts).transpose(1, 2))  # [N, 1, R]
            y = torch.bmm(t, bt.index_select(0, experts))[:, 0]  # [N, out]
            out.index_add_(0, rows, y * scales.index_select(0, experts)[:, None])


@dataclass(frozen=True)
class ExpertWork:
    """The Triton path's per-layer metadata: per projection, the SGMV work list over its runs
    (kernels/segments.py), each run's slot its flat (slot, module) row of the offset tables."""

    works: dict  # projection -> SegmentWork (None: no run's adapter targets it here)


def prepare_triton(pool: LoraSlotPool, runs: ExpertRuns, block_m: int) -> ExpertWork:
    from kernels.segments import SegmentWork

    num_modules = len(pool.modules)
    starts = torch.tensor([s for s, _, _, _ in runs.runs], dtype=torch.long)
    lens = torch.tensor([e - s for s, e, _, _ in runs.runs], dtype=torch.long)
    ranks = pool.rank_table.reshape(pool.rank_table.shape[0], -1, 1)  # [L, slots * M, 1]
    scales = pool.scale_table.reshape(pool.scale_table.shape[0], -1, 1)
    works = {}
    for projection in ("gate_up_proj", "down_proj"):
        flat = torch.tensor([slot * num_modules + pool.module_index(expert_module(e, projection))
                             for _, _, slot, e in runs.runs], dtype=torch.long)
        works[projection] = SegmentWork.build(starts, lens, flat, ranks, scales, block_m=block_m,
                                              device=pool.device, tiered=((0, 1),))
    return ExpertWork(works)


def apply_triton(pool: LoraSlotPool, layer: int, projection: str, x: torch.Tensor,
                 out: torch.Tensor, work: ExpertWork, target_ctas: int) -> None:
    from kernels.sgmv_expand import sgmv_expand
    from kernels.sgmv_shrink import sgmv_shrink

    w = work.works[projection]
    if w.num_items == 0 or w.rank_block(0, 1) == 0:
        return
    a_offsets, b_offsets = pool.offsets(layer)
    flat = (-1, 1, *a_offsets.shape[2:])  # [slots * M, 1, R, chunks]
    rows = dict(first_module=0, layer_base=pool.layer_base(layer), chunk=pool.chunk,
                block_m=w.block_m, target_ctas=target_ctas)
    ranks, scales = w.ranks[layer], w.scales[layer]  # [1, S] each
    for tile, items in w.tiers[(0, 1)]:
        t = sgmv_shrink(x, pool.kv.flat, a_offsets.view(flat), items, ranks,
                        rank_block=tile, **rows)
        sgmv_expand(t, pool.kv.flat, b_offsets.view(flat), out, items, ranks, scales,
                    (out.shape[1],), **rows)
