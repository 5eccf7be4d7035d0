"""The Triton LoRA backend (the backend on CUDA), and its per-step metadata: the SGMV kernels'
work list (kernels/segments.py), built once per step on the host and copied to the device in one
transfer. `apply` reads x and writes out in place: nothing is gathered or copied per layer.

Per group and layer, decode-shaped steps (every segment <= `fused_max_rows` rows) get one fused
shrink+expand launch, its rank tile the step's largest; others a shrink launch (x read once for
all of the group's slices) and an expand launch per rank tier (kernels/segments.py), each tier's
rank tile its adapters' own. Decode is bound by the bytes of A and B, which masked rows do not
read, and one launch a group costs less than a launch a tier; prefill chunks are bound by the
multiplies, which a tile larger than the rank wastes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor.lora.experts import ExpertRuns, ExpertWork, apply_triton, prepare_triton
from executor.lora.segments import LoraSegments
from executor.lora.slot_pool import LoraSlotPool
from kernels.segments import SegmentWork


@dataclass(frozen=True)
class TritonBatchMeta:
    """The Triton backend's per-step metadata, built once and read by every layer and group."""

    work: SegmentWork  # work items (segment M-tiles), ranks and scales, on the device
    is_fused: bool  # every segment <= fused_max_rows: one fused launch per group


class TritonLoraBackend:
    """SGMV kernels (kernels/). On CPU it runs through the Triton interpreter (TRITON_INTERPRET=1
    before triton is imported)."""

    def __init__(self, pool: LoraSlotPool, *, fused_max_rows: int = 64,
                 target_ctas: int | None = None) -> None:
        from kernels.sgmv_expand import sgmv_expand  # these import triton
        from kernels.sgmv_fused import sgmv_fused
        from kernels.sgmv_shrink import sgmv_shrink
        from kernels.sgmv_tiles import is_interpreted

        if pool.device.type != "cuda" and not is_interpreted():
            raise ValueError("the triton LoRA backend needs a CUDA device, or the Triton "
                             "interpreter on CPU (TRITON_INTERPRET=1 before triton is imported)")
        self.pool, self.fused_max_rows = pool, fused_max_rows
        self._shrink, self._expand, self._fused = sgmv_shrink, sgmv_expand, sgmv_fused
        if target_ctas is None:
            is_cuda = pool.device.type == "cuda"
            target_ctas = (torch.cuda.get_device_properties(pool.device).multi_processor_count
                           if is_cuda else 4)
        self.target_ctas = target_ctas

    def prepare(self, row_slots: torch.Tensor) -> TritonBatchMeta:
        segments = LoraSegments.from_row_slots(row_slots)
        is_fused = segments.max_seg_len <= self.fused_max_rows
        groups = () if is_fused else tuple((g.first_module, len(g.modules))
                                           for g in self.pool.groups.values())
        work = SegmentWork.build(segments.seg_starts, segments.seg_lens, segments.seg_slots,
                                 self.pool.rank_table, self.pool.scale_table,
                                 block_m=16 if is_fused else 64, device=self.pool.device,
                                 tiered=groups)
        return TritonBatchMeta(work, is_fused)

    def prepare_experts(self, pair_slots: torch.Tensor, pair_experts: torch.Tensor,
                        expert_runs: tuple[tuple[int, int, int], ...]) -> ExpertWork:
        """One MoE layer's metadata (executor/lora/experts.py), from its sorted pairs."""
        runs = ExpertRuns.build(pair_slots, expert_runs)
        return prepare_triton(self.pool, runs, block_m=16)

    def apply_experts(self, layer: int, projection: str, x: torch.Tensor, out: torch.Tensor,
                      work: ExpertWork) -> None:
        """out [P, out] += the pairs' adapters' LoRA of their experts' `projection`."""
        apply_triton(self.pool, layer, projection, x, out, work, self.target_ctas)

    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor,
              meta: TritonBatchMeta) -> None:
        """out [T, sum of the group's out_features] += the group's adapter contributions to
        x [T, in], in place."""
        work, g = meta.work, self.pool.groups[group]
        rank_block = work.rank_block(g.first_module, len(g.modules))
        if work.num_items == 0 or rank_block == 0:
            return  # no segment's adapter targets this group in any layer
        pool = self.pool
        m = slice(g.first_module, g.first_module + len(g.modules))
        ranks, scales = work.ranks[layer, m], work.scales[layer, m]  # [n, S] each
        rows = dict(first_module=g.first_module, layer_base=pool.layer_base(layer),
                    chunk=pool.chunk, block_m=work.block_m, target_ctas=self.target_ctas)
        store, (a_offsets, b_offsets) = pool.kv.flat, pool.offsets(layer)
        if meta.is_fused:
            self._fused(x, store, a_offsets, b_offsets, out, work.items, ranks, scales,
                        g.out_sizes, rank_block=rank_block, **rows)
        else:
            for tile, items in work.tiers[(g.first_module, len(g.modules))]:
                t = self._shrink(x, store, a_offsets, items, ranks, rank_block=tile, **rows)
                self._expand(t, store, b_offsets, out, items, ranks, scales, g.out_sizes,
                             **rows)
