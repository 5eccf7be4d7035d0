"""The adapter slot pool and the LoRA backends that add adapter contributions to a step.

Rows of a step come sorted by slot, so each adapter's rows form a segment. For every one of the
7 projections the dense base matmul runs over all rows first; then, per segment s with slot j:

    out[rows_s] += scale_j * (x[rows_s] @ A_j^T) @ B_j^T      (shrink to rank r, expand back)

Slot -1 means "base model only" and costs nothing. Running example, 6 rows with slots
[3, 3, -1, 0, 0, 0] -> segments (start, end, slot) = (0, 2, 3), (3, 6, 0).

Projections that share an input form a group (q/k/v, gate/up) and are applied by one backend
call on the group's fused base output, so a kernel reads x once for all of the group's slices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

import torch

from common.peft.modules import LORA_MODULES
from executor.model_config import ModelConfig
from kernels.segments import SegmentWork

# Group name -> its projections, in the column order of the model's fused base output.
LORA_GROUPS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)})


@dataclass(frozen=True)
class LoraModuleWeights:
    a: torch.Tensor  # [r, in_features]
    b: torch.Tensor  # [out_features, r]
    scale: float


@dataclass(frozen=True)
class LoraWeights:
    """One adapter, ready for the pool: (layer, module) -> weights for each targeted projection."""

    modules: Mapping[tuple[int, str], LoraModuleWeights]

    @property
    def rank(self) -> int:
        return max((m.a.shape[0] for m in self.modules.values()), default=0)


@dataclass(frozen=True)
class SliceGroup:
    """Stacked storage of one group's slices (e.g. q, k, v), laid out for the SGMV kernels."""

    modules: tuple[str, ...]
    first_module: int  # index of modules[0] in LORA_MODULES (the slices are consecutive)
    out_sizes: tuple[int, ...]  # out_features of each slice (q and kv differ under GQA)
    a: torch.Tensor  # [L, num_slots, num_slices, max_rank, in]
    bt: torch.Tensor  # [L, num_slots, max_rank, sum(out_sizes)]: B transposed, rank-major


class LoraSlotPool:
    """Fixed GPU-resident storage for `num_slots` adapters of rank <= `max_rank`.

    Per module: A [L, num_slots, max_rank, in], B [L, num_slots, out, max_rank] (zero-padded above
    the adapter's rank), scale [L, num_slots] (0 where the adapter does not target the module).
    A and B are views into each group's stacked tensors (`groups`), which the kernels read.
    Host tables `rank_table`, `scale_table` [L, num_slots, 7] give each slot's rank (0 = not
    targeted) and fp32 scale per layer and module; a step gathers its segments' rows from them.
    """

    def __init__(self, config: ModelConfig, *, num_slots: int, max_rank: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        if num_slots < 0 or max_rank <= 0:
            raise ValueError(f"adapter pool needs num_slots >= 0 and max_rank > 0, "
                             f"got {num_slots} and {max_rank}")
        self.config, self.num_slots, self.max_rank = config, num_slots, max_rank
        self.device = torch.device(device)
        num_layers = config.num_hidden_layers
        self.groups: dict[str, SliceGroup] = {}
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        self.scale: dict[str, torch.Tensor] = {}
        for name, modules in LORA_GROUPS.items():
            in_f = config.module_shape(modules[0])[0]
            out_sizes = tuple(config.module_shape(m)[1] for m in modules)
            a = torch.zeros(num_layers, num_slots, len(modules), max_rank, in_f, dtype=dtype,
                            device=device)
            bt = torch.zeros(num_layers, num_slots, max_rank, sum(out_sizes), dtype=dtype,
                             device=device)
            self.groups[name] = SliceGroup(modules, LORA_MODULES.index(modules[0]), out_sizes,
                                           a, bt)
            offset = 0
            for i, (m, out_f) in enumerate(zip(modules, out_sizes)):
                self.a[m] = a[:, :, i]  # [L, num_slots, max_rank, in]
                self.b[m] = bt[..., offset: offset + out_f].transpose(-1, -2)  # [L, slots, out, R]
                offset += out_f
                self.scale[m] = torch.zeros(num_layers, num_slots, dtype=dtype, device=device)
        self.rank_table = torch.zeros(num_layers, num_slots, len(LORA_MODULES), dtype=torch.int32)
        self.scale_table = torch.zeros(num_layers, num_slots, len(LORA_MODULES))
        # Host-side mirror of what each slot targets: (layer, module) -> (rank, scale).
        self.targets: list[dict[tuple[int, str], tuple[int, float]]] = [
            {} for _ in range(num_slots)]

    def num_bytes(self) -> int:
        tensors = [*self.scale.values()]
        for g in self.groups.values():
            tensors += [g.a, g.bt]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"adapter slot {slot} out of range [0, {self.num_slots})")

    def load(self, slot: int, weights: LoraWeights) -> None:
        """Copy an adapter into `slot`, replacing whatever was there; afterwards the slot holds
        exactly what it would in a fresh pool (zero above each module's rank). The weights may
        be of another dtype or device: converted while copied. On CUDA the copies are queued on
        the current stream without a wait each: a pinned source must stay untouched until that
        stream has passed them (SlotCopier waits for it)."""
        self._check_slot(slot)
        if weights.rank > self.max_rank:
            raise ValueError(f"adapter rank {weights.rank} exceeds the pool's max rank "
                             f"{self.max_rank}")
        for (layer, module), w in weights.modules.items():
            in_f, out_f = self.config.module_shape(module)
            r = w.a.shape[0]
            if not 0 <= layer < self.config.num_hidden_layers:
                raise ValueError(f"adapter targets layer {layer}, the model has "
                                 f"{self.config.num_hidden_layers}")
            if w.a.shape != (r, in_f) or w.b.shape != (out_f, r):
                raise ValueError(f"layer {layer} {module}: A {tuple(w.a.shape)} / B "
                                 f"{tuple(w.b.shape)} do not fit [r, {in_f}] / [{out_f}, r]")
        self._zero_written(slot)
        # Recorded before the copy: whatever a failed copy wrote is zeroed by the next clear.
        self.targets[slot] = {key: (w.a.shape[0], w.scale) for key, w in weights.modules.items()}
        for (layer, module), w in weights.modules.items():
            r = w.a.shape[0]
            self.a[module][layer, slot, :r].copy_(w.a, non_blocking=True)
            self.b[module][layer, slot, :, :r].copy_(w.b, non_blocking=True)
            self.scale[module][layer, slot] = w.scale
            self.rank_table[layer, slot, LORA_MODULES.index(module)] = r
            self.scale_table[layer, slot, LORA_MODULES.index(module)] = w.scale

    def clear(self, slot: int) -> None:
        self._check_slot(slot)
        self._zero_written(slot)

    def _zero_written(self, slot: int) -> None:
        """Zero what `slot`'s adapter wrote, and its table entries. A slot is zero outside its
        adapter's ranks (as in a fresh pool), so per group only the ranks below the largest the
        adapter used there need it: a rank-8 adapter costs a rank-8 memset, not one of the whole
        slot at max_rank."""
        targets = self.targets[slot]
        for g in self.groups.values():
            rank = max((r for (_, m), (r, _) in targets.items() if m in g.modules), default=0)
            if rank:
                g.a[:, slot, :, :rank].zero_()  # [L, n, rank, in]
                g.bt[:, slot, :rank].zero_()  # [L, rank, sum(out)]
        for module in {module for _, module in targets}:
            self.scale[module][:, slot] = 0.0
        self.rank_table[:, slot] = 0
        self.scale_table[:, slot] = 0.0
        self.targets[slot] = {}


@dataclass(frozen=True)
class _ShortSegments:
    """Segments the torch backend handles together, padded to the longest: [S, Lmax] rows."""

    rows: torch.Tensor  # [S, Lmax] long: each segment's row indices, padded with its first row
    valid: torch.Tensor  # [S, Lmax] bool: False on padding
    flat_rows: torch.Tensor  # [N] long: rows[valid], the rows to update, in that order
    slots: torch.Tensor  # [S] long
    ranks: torch.Tensor  # [L, S, 7] int32: rank per layer and module (0 = not targeted)
    scales: torch.Tensor  # [L, S, 7] fp32

    @classmethod
    def build(cls, segments: list[tuple[int, int, int]], pool: LoraSlotPool) -> _ShortSegments:
        longest = max(end - start for start, end, _ in segments)
        offsets = torch.arange(longest)
        starts = torch.tensor([start for start, _, _ in segments]).unsqueeze(1)
        lens = torch.tensor([end - start for start, end, _ in segments]).unsqueeze(1)
        valid = offsets < lens
        rows = torch.where(valid, starts + offsets, starts)
        slots = torch.tensor([slot for _, _, slot in segments])
        device = pool.device
        return cls(rows.to(device), valid.to(device), rows[valid].to(device), slots.to(device),
                   pool.rank_table[:, slots], pool.scale_table[:, slots])


@dataclass(frozen=True)
class LoraBatchMeta:
    """Per-step segment metadata, built once and reused by every layer and module.

    Only segments with an adapter (slot >= 0) are kept. `segments` is the host view for Python
    loops; `work` (Triton backend only) is the kernels' device-side work list, ranks and scales.
    """

    segments: tuple[tuple[int, int, int], ...]  # (start_row, end_row, slot)
    seg_starts: torch.Tensor  # [S] long
    seg_lens: torch.Tensor  # [S] long
    seg_slots: torch.Tensor  # [S] long
    max_seg_len: int
    work: SegmentWork | None = None
    short: _ShortSegments | None = None  # (torch backend) short segments, done all at once

    @classmethod
    def from_row_slots(cls, row_slots: torch.Tensor,
                       device: str | torch.device = "cpu") -> LoraBatchMeta:
        """row_slots: [T] long on the host, the adapter slot of every row (-1 = none)."""
        slots, lens = torch.unique_consecutive(row_slots, return_counts=True)  # [S'], [S']
        starts = torch.cumsum(lens, 0) - lens
        keep = slots >= 0
        slots, lens, starts = slots[keep], lens[keep], starts[keep]
        segments = tuple(zip(starts.tolist(), (starts + lens).tolist(), slots.tolist()))
        return cls(segments=segments, seg_starts=starts.to(device), seg_lens=lens.to(device),
                   seg_slots=slots.to(device),
                   max_seg_len=max((e - s for s, e, _ in segments), default=0))


class LoraBackend(Protocol):
    def __init__(self, pool: LoraSlotPool) -> None: ...

    def prepare(self, row_slots: torch.Tensor) -> LoraBatchMeta:
        """Build the step's metadata from host row_slots [T] (once per step)."""
        ...

    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor,
              meta: LoraBatchMeta) -> None:
        """out [T, sum of the group's out_features] += the adapter contributions of the group's
        projections (LORA_GROUPS[group], side by side in out's columns) to x [T, in], in place."""
        ...


class TorchLoraBackend:
    """Pure torch. Segments longer than `gather_max_rows` (prefill chunks) get one shrink and one
    expand matmul each, at the exact rank, in PEFT's order: (x A^T) B^T * scale. The shorter ones
    (decode: a row or a few per adapter) go all at once, padded to the longest of them: their
    adapters' A and B gathered per segment, one batched shrink per group and one batched expand
    per slice at the group's largest rank in the step, ranks above a segment's own masked off.
    That is a handful of ops per group instead of two matmuls per segment and projection: what
    keeps a CPU decode step over 64 adapters near one over a single adapter.
    `gather_max_rows=0` keeps every segment on the exact per-segment path (the reference).
    """

    def __init__(self, pool: LoraSlotPool, *, gather_max_rows: int = 8) -> None:
        self.pool, self.gather_max_rows = pool, gather_max_rows

    def prepare(self, row_slots: torch.Tensor) -> LoraBatchMeta:
        meta = LoraBatchMeta.from_row_slots(row_slots, self.pool.device)
        short = [seg for seg in meta.segments if seg[1] - seg[0] <= self.gather_max_rows]
        if not short:
            return meta
        return dataclasses.replace(meta, short=_ShortSegments.build(short, self.pool), segments=tuple(
            seg for seg in meta.segments if seg[1] - seg[0] > self.gather_max_rows))

    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor,
              meta: LoraBatchMeta) -> None:
        g = self.pool.groups[group]
        for module, out_m in zip(g.modules, out.split(g.out_sizes, dim=-1)):
            self._apply_module(layer, module, x, out_m, meta)
        if meta.short is not None:
            self._apply_short(layer, g, x, out, meta.short)

    def _apply_module(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor,
                      meta: LoraBatchMeta) -> None:
        for start, end, slot in meta.segments:
            target = self.pool.targets[slot].get((layer, module))
            if target is None:
                continue
            rank, scale = target
            a = self.pool.a[module][layer, slot, :rank]  # [r, in]
            b = self.pool.b[module][layer, slot, :, :rank]  # [out, r]
            # Same operation order as PEFT: (B(A(x))) * scale, then added to the base output.
            out[start:end] += (x[start:end] @ a.T) @ b.T * scale

    @staticmethod
    def _apply_short(layer: int, g: SliceGroup, x: torch.Tensor, out: torch.Tensor,
                     segs: _ShortSegments) -> None:
        n = len(g.modules)
        m = slice(g.first_module, g.first_module + n)
        ranks = segs.ranks[layer, :, m]  # [S, n]
        max_rank = int(ranks.max())
        if max_rank == 0:
            return  # no short segment's adapter targets this group here
        num = len(segs.slots)
        a = g.a[layer, :, :, :max_rank].index_select(0, segs.slots)  # [S, n, R, in]
        t = x[segs.rows] @ a.reshape(num, n * max_rank, -1).transpose(1, 2)  # [S, Lmax, n*R]
        keep = torch.arange(max_rank, device=x.device) < ranks.to(x.device).unsqueeze(-1)  # [S, n, R]
        t = t.view(num, -1, n, max_rank).masked_fill(~keep.unsqueeze(1), 0.0)
        bt = g.bt[layer, :, :max_rank].index_select(0, segs.slots)  # [S, R, sum(out)]
        scales = segs.scales[layer, :, m].to(x.device, x.dtype)  # [S, n]
        pieces, offset = [], 0
        for s, out_f in enumerate(g.out_sizes):
            y = t[:, :, s] @ bt[:, :, offset:offset + out_f]  # [S, Lmax, out]
            pieces.append(y * scales[:, s, None, None])
            offset += out_f
        out.index_add_(0, segs.flat_rows, torch.cat(pieces, dim=-1)[segs.valid])


class TritonLoraBackend:
    """SGMV kernels (kernels/): per step one work list of (segment, M-tile) items; per group one
    fused shrink+expand launch for decode-shaped steps (every segment <= `fused_max_rows` rows),
    else a shrink launch (x read once for all slices) and an expand launch.

    On CPU it runs through the Triton interpreter (TRITON_INTERPRET=1 before triton is imported).
    """

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

    def prepare(self, row_slots: torch.Tensor) -> LoraBatchMeta:
        meta = LoraBatchMeta.from_row_slots(row_slots)
        block_m = 16 if meta.max_seg_len <= self.fused_max_rows else 64
        work = SegmentWork.build(meta.seg_starts, meta.seg_lens, meta.seg_slots,
                                 self.pool.rank_table, self.pool.scale_table, block_m=block_m,
                                 device=self.pool.device)
        return dataclasses.replace(meta, work=work)

    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor,
              meta: LoraBatchMeta) -> None:
        work, g = meta.work, self.pool.groups[group]
        if work is None:
            raise ValueError("TritonLoraBackend.apply needs metadata from its own prepare()")
        rank_block = work.rank_block(g.first_module, len(g.modules))
        if work.num_items == 0 or rank_block == 0:
            return  # no segment's adapter targets this group in any layer
        m = slice(g.first_module, g.first_module + len(g.modules))
        ranks, scales = work.ranks[layer, m], work.scales[layer, m]  # [n, S] each
        if meta.max_seg_len <= self.fused_max_rows:
            self._fused(x, g.a[layer], g.bt[layer], out, work.items, ranks, scales, g.out_sizes,
                        block_m=work.block_m, rank_block=rank_block, target_ctas=self.target_ctas)
        else:
            t = self._shrink(x, g.a[layer], work.items, ranks, block_m=work.block_m,
                             rank_block=rank_block, target_ctas=self.target_ctas)
            self._expand(t, g.bt[layer], out, work.items, ranks, scales, g.out_sizes,
                         block_m=work.block_m, target_ctas=self.target_ctas)


LORA_BACKENDS: Mapping[str, type[LoraBackend]] = MappingProxyType(
    {"torch": TorchLoraBackend, "triton": TritonLoraBackend})


def resolve_lora_backend(name: str, device: str | torch.device) -> str:
    """'auto' -> 'triton' on CUDA, 'torch' elsewhere; other names pass through."""
    if name == "auto":
        return "triton" if torch.device(device).type == "cuda" else "torch"
    return name


def make_lora_backend(name: str, pool: LoraSlotPool) -> LoraBackend:
    name = resolve_lora_backend(name, pool.device)
    if name not in LORA_BACKENDS:
        raise ValueError(f"unknown LoRA backend {name!r} (known: auto, {', '.join(LORA_BACKENDS)})")
    return LORA_BACKENDS[name](pool)
