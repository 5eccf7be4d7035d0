"""LoRA on a mixture-of-experts layer's experts (executor/moe.py), for both backends: each pair of
a step's routing (row, expert, adapter slot), sorted by expert then slot, gets its adapter's LoRA
of that expert's projection, read from the pool's expert modules (common.peft.modules
.expert_module; how adapters' tensors become them: common/peft/experts.py):

    out[pairs_s] += scale * (x[pairs_s] @ A_{slot, e}^T) @ B_{slot, e}^T     per run s = (e, slot)

Each (expert, adapter) pair's weights are read once per step and layer, whatever its number of
rows. The torch path runs a shrink and an expand per run; the Triton path the SGMV kernels over
all runs at once, a run's "slot" being its (slot, module) row of the pool's offset tables viewed
flat, so the kernels need nothing new (kernels/sgmv_*.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.peft.modules import expert_module
from executor.slot_pool import LoraSlotPool


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


def apply_torch(pool: LoraSlotPool, layer: int, projection: str, x: torch.Tensor,
                out: torch.Tensor, runs: ExpertRuns) -> None:
    """out [P, out] += each run's LoRA of its expert's `projection` on x [P, in], in place."""
    for start, end, slot, expert in runs.runs:
        module = expert_module(expert, projection)
        target = pool.contents(slot).targets.get((layer, module))
        if target is None:
            continue
        a, b = pool.rows(layer, slot, module)  # [r, in], [out, r] (from its pages)
        out[start:end] += (x[start:end] @ a.T) @ b.T * target[1]


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
    flat = (-1, 1, *pool.a_offsets.shape[2:])  # [slots * M, 1, R, chunks]
    rows = dict(first_module=0, layer_base=pool.layer_base(layer), chunk=pool.chunk,
                block_m=w.block_m, target_ctas=target_ctas)
    ranks, scales = w.ranks[layer], w.scales[layer]  # [1, S] each
    for tile, items in w.tiers[(0, 1)]:
        t = sgmv_shrink(x, pool.kv.flat, pool.a_offsets.view(flat), items, ranks,
                        rank_block=tile, **rows)
        sgmv_expand(t, pool.kv.flat, pool.b_offsets.view(flat), out, items, ranks, scales,
                    (out.shape[1],), **rows)
