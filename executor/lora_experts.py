"""LoRA on a mixture-of-experts layer's experts (executor/moe.py), for both backends: each pair of
a step's routing (row, expert, adapter slot), sorted by expert then slot, gets its adapter's LoRA
of that expert's projection, read from the pool's expert modules (common.peft.modules
.expert_module; how adapters' tensors become them: common/peft/experts.py):

    out[pairs_s] += scale * (x[pairs_s] @ A_{slot, e}^T) @ B_{slot, e}^T     per run s = (e, slot)

Each (expert, adapter) pair's weights are read once per step and layer, whatever its number of
rows. The torch path gathers the weights of every short run (decode: a row or a few per run) at
once, [U, R, in] and [U, R, out] at their largest rank with the rows above each run's rank zeroed,
and runs one batched shrink and expand over their rows; a longer run (a prefill chunk's) gets a
shrink and an expand of its own. The Triton path runs the SGMV kernels over all runs at once, a
run's "slot" being its (slot, module) row of the pool's offset tables viewed flat, so the kernels
need nothing new (kernels/sgmv_*.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.peft.modules import expert_module
from executor.slot_pool import LoraSlotPool
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


def apply_torch(pool: LoraSlotPool, layer: int, projection: str, x: torch.Tensor,
                out: torch.Tensor, runs: ExpertRuns) -> None:
    """out [P, out] += each run's LoRA of its expert's `projection` on x [P, in], in place."""
    short = [run for run in runs.runs if run[1] - run[0] <= BATCH_MAX_ROWS]
    for start, end, slot, expert in runs.runs:
        if end - start <= BATCH_MAX_ROWS:
            continue
        module = expert_module(expert, projection)
        target = pool.contents(slot).targets.get((layer, module))
        if target is not None:
            a, b = pool.rows(layer, slot, module)  # [r, in], [out, r] (from its pages)
            out[start:end] += (x[start:end] @ a.T) @ b.T * target[1]
    if short:
        _apply_batched(pool, layer, projection, x, out, short)


def _apply_batched(pool: LoraSlotPool, layer: int, projection: str, x: torch.Tensor,
                   out: torch.Tensor, runs: list[tuple[int, int, int, int]]) -> None:
    """The short runs at once: their weights gathered [U, R, in] / [U, R, out], each pair's row
    shrunk and expanded by its run's (a batched matmul over the pairs)."""
    slots = torch.tensor([slot for _, _, slot, _ in runs])  # [U]
    modules = torch.tensor([pool.module_index(expert_module(e, projection))
                            for _, _, _, e in runs])  # [U]
    ranks = pool.rank_table[layer, slots, modules]  # [U]
    rank = int(ranks.max())
    if rank == 0:
        return
    keep = torch.arange(rank) < ranks[:, None]  # [U, R]: rows within each run's rank
    base, chunk, flat = pool.layer_base(layer), pool.chunk, pool.kv.flat
    device = x.device
    gathered = []
    for offsets, length in ((pool.a_offsets, x.shape[1]), (pool.b_offsets, out.shape[1])):
        at = offsets[slots.to(device), modules.to(device), :rank]  # [U, R, chunks]
        rows = flat[row_index(at.flatten(0, 1), length, chunk) + base].view(len(runs), rank, -1)
        gathered.append(rows.masked_fill(~keep.to(device)[..., None], 0.0))  # [U, R, length]
    a, bt = gathered
    lengths = torch.tensor([end - start for start, end, _, _ in runs])
    of_row = torch.repeat_interleave(torch.arange(len(runs)), lengths).to(device)  # [N]
    rows = torch.cat([torch.arange(start, end) for start, end, _, _ in runs]).to(device)  # [N]
    scale = pool.scale_table[layer, slots, modules].to(device, x.dtype)  # [U]
    t = torch.bmm(x.index_select(0, rows)[:, None, :], a[of_row].transpose(1, 2))  # [N, 1, R]
    y = torch.bmm(t, bt[of_row])[:, 0] * scale[of_row, None]  # [N, out]
    out.index_add_(0, rows, y)


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
