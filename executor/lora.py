"""The adapter slot pool and the LoRA backends that add adapter contributions to a step.

Rows of a step come sorted by slot, so each adapter's rows form a segment. For every one of the
7 projections the dense base matmul runs over all rows first; then, per segment s with slot j:

    out[rows_s] += scale_j * (x[rows_s] @ A_j^T) @ B_j^T      (shrink to rank r, expand back)

Slot -1 means "base model only" and costs nothing. Running example, 6 rows with slots
[3, 3, -1, 0, 0, 0] -> segments (start, end, slot) = (0, 2, 3), (3, 6, 0).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

import torch

from executor.model_config import ModelConfig

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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


class LoraSlotPool:
    """Fixed GPU-resident storage for `num_slots` adapters of rank <= `max_rank`.

    Per module: A [L, num_slots, max_rank, in], B [L, num_slots, out, max_rank] (zero-padded above
    the adapter's rank), scale [L, num_slots] (0 where the adapter does not target the module).
    """

    def __init__(self, config: ModelConfig, *, num_slots: int, max_rank: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        if num_slots < 0 or max_rank <= 0:
            raise ValueError(f"adapter pool needs num_slots >= 0 and max_rank > 0, "
                             f"got {num_slots} and {max_rank}")
        self.config, self.num_slots, self.max_rank = config, num_slots, max_rank
        self.device = torch.device(device)
        num_layers = config.num_hidden_layers
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        self.scale: dict[str, torch.Tensor] = {}
        for m in LORA_MODULES:
            in_f, out_f = config.module_shape(m)
            a_shape = (num_layers, num_slots, max_rank, in_f)
            b_shape = (num_layers, num_slots, out_f, max_rank)
            self.a[m] = torch.zeros(a_shape, dtype=dtype, device=device)
            self.b[m] = torch.zeros(b_shape, dtype=dtype, device=device)
            self.scale[m] = torch.zeros(num_layers, num_slots, dtype=dtype, device=device)
        # Host-side mirror of what each slot targets: (layer, module) -> (rank, scale).
        self.targets: list[dict[tuple[int, str], tuple[int, float]]] = [
            {} for _ in range(num_slots)]

    def num_bytes(self) -> int:
        tensors = [*self.a.values(), *self.b.values(), *self.scale.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"adapter slot {slot} out of range [0, {self.num_slots})")

    def load(self, slot: int, weights: LoraWeights) -> None:
        """Copy an adapter into `slot`, replacing whatever was there."""
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
        self.clear(slot)
        for (layer, module), w in weights.modules.items():
            r = w.a.shape[0]
            self.a[module][layer, slot, :r].copy_(w.a)
            self.b[module][layer, slot, :, :r].copy_(w.b)
            self.scale[module][layer, slot] = w.scale
            self.targets[slot][(layer, module)] = (r, w.scale)

    def clear(self, slot: int) -> None:
        self._check_slot(slot)
        for m in LORA_MODULES:
            self.a[m][:, slot].zero_()
            self.b[m][:, slot].zero_()
            self.scale[m][:, slot] = 0.0
        self.targets[slot] = {}


@dataclass(frozen=True)
class LoraBatchMeta:
    """Per-step segment metadata, built once and reused by every layer and module.

    Only segments with an adapter (slot >= 0) are kept. The tensors are for kernels (a Triton
    shrink/expand grid over segments); `segments` is the same on the host for Python loops.
    """

    segments: tuple[tuple[int, int, int], ...]  # (start_row, end_row, slot)
    seg_starts: torch.Tensor  # [S] long
    seg_lens: torch.Tensor  # [S] long
    seg_slots: torch.Tensor  # [S] long
    max_seg_len: int

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

    def apply(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor,
              meta: LoraBatchMeta) -> None:
        """out [T, out_features] += the adapter contribution of x [T, in_features], in place."""
        ...


class TorchLoraBackend:
    """Pure-torch reference: one shrink and one expand matmul per segment, at the exact rank."""

    def __init__(self, pool: LoraSlotPool) -> None:
        self.pool = pool

    def prepare(self, row_slots: torch.Tensor) -> LoraBatchMeta:
        return LoraBatchMeta.from_row_slots(row_slots, self.pool.device)

    def apply(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor,
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


LORA_BACKENDS: Mapping[str, type[LoraBackend]] = MappingProxyType({"torch": TorchLoraBackend})


def make_lora_backend(name: str, pool: LoraSlotPool) -> LoraBackend:
    if name not in LORA_BACKENDS:
        raise ValueError(f"unknown LoRA backend {name!r} (known: {', '.join(LORA_BACKENDS)})")
    return LORA_BACKENDS[name](pool)
