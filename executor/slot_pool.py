"""The adapter slot pool: fixed GPU-resident storage for `num_slots` LoRA adapters, and the one
record of what each slot holds.

Storage. Projections that share an input form a group (LORA_GROUPS: q/k/v, o, gate/up, down);
per group one stacked A and one stacked B^T, laid out for the SGMV kernels (kernels/), which a
LoRA backend (executor/lora.py) reads.

What a slot holds (SlotContents, read with `contents(slot)`): its adapter's rank and scale per
layer and module (`targets`), whether it is loaded (steps may read it), and the AdapterRef it was
loaded as. The runner, the backends and the adapter loader all ask the pool; none keeps a copy.

    load(slot, weights)         written: targets recorded, weights copied (or being copied)
    mark_loaded(slot, adapter)  loaded: the copy completed; steps may read the slot
    mark_unloaded(slot)         written again: about to be overwritten, not to be read or reported
    clear(slot)                 empty: zeroed, nothing recorded

`load` records the targets before it queues its copies, so whatever a failed copy wrote is zeroed
by the next clear or load. A slot counts as loaded only once whoever waited for the copy says so:
ModelRunner.load_adapter at once (the copy is on the step's stream), the AdapterLoader once
SlotCopier waited for its side stream and the load was not cancelled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch

from common.peft.modules import LORA_MODULES
from executor.model_config import ModelConfig

if TYPE_CHECKING:  # (only stored and compared: the GPU check imports the pool without protos)
    from common.adapter_ref import AdapterRef

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

    @property
    def modules_slice(self) -> slice:
        """The group's columns in the pool's per-module tables (rank_table, scale_table)."""
        return slice(self.first_module, self.first_module + len(self.modules))


@dataclass(frozen=True)
class SlotContents:
    """What one slot holds."""

    targets: Mapping[tuple[int, str], tuple[int, float]]  # (layer, module) -> (rank, scale)
    is_loaded: bool = False  # its copy completed: steps may read the slot
    adapter: AdapterRef | None = None  # the version loaded (None: loaded without a reference)


EMPTY_SLOT = SlotContents(targets=MappingProxyType({}))


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
        # Written only by the methods below (each assignment whole: the step thread reads them).
        self._slots: list[SlotContents] = [EMPTY_SLOT] * num_slots
        # Per slot, how its weights were written: the count moves when a write (a load or a
        # clear) begins and again once it has completed (finish_write). A copy of a slot's weights
        # made at count c is current while the count is still c: one made while a write ran (a
        # step's stack, on the step thread, beside a load's copy on a worker thread) carries the
        # count the write began with, and is made again.
        self._writes: list[int] = [0] * num_slots

    def num_bytes(self) -> int:
        tensors = [*self.scale.values()]
        for g in self.groups.values():
            tensors += [g.a, g.bt]
        return sum(t.numel() * t.element_size() for t in tensors)

    # ----- what each slot holds -----

    def contents(self, slot: int) -> SlotContents:
        self._check_slot(slot)
        return self._slots[slot]

    def is_loaded(self, slot: int) -> bool:
        return self.contents(slot).is_loaded

    def holds(self, slot: int, adapter: AdapterRef) -> bool:
        """Whether `slot` is loaded with exactly `adapter`."""
        held = self.contents(slot)
        return held.is_loaded and held.adapter == adapter

    def write_counts(self, slots: list[int]) -> tuple[int, ...]:
        """How many times each of `slots` was written (see copies of slot weights)."""
        return tuple(self._writes[slot] for slot in slots)

    def adapters(self) -> list[AdapterRef | None]:
        """The adapter each slot is loaded with; None where it holds none (or an unnamed one)."""
        return [s.adapter if s.is_loaded else None for s in self._slots]

    def finish_write(self, slot: int) -> None:
        """A write into `slot` (`load` or `clear`) has completed, on CUDA its stream included:
        copies of the slot made since the write began are stale from now on."""
        self._writes[slot] += 1

    def mark_loaded(self, slot: int, adapter: AdapterRef | None = None) -> None:
        """The copy into `slot` completed (as `adapter`): steps may read it."""
        self._slots[slot] = dataclasses.replace(self.contents(slot), is_loaded=True,
                                                adapter=adapter)

    def mark_unloaded(self, slot: int) -> None:
        """`slot` no longer counts as holding its adapter (a copy or clear is about to overwrite
        it); its weights stay, recorded, until then."""
        self._slots[slot] = dataclasses.replace(self.contents(slot), is_loaded=False, adapter=None)

    # ----- writing the tensors -----

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"adapter slot {slot} out of range [0, {self.num_slots})")

    def load(self, slot: int, weights: LoraWeights) -> None:
        """Copy an adapter into `slot`, replacing whatever was there; afterwards the slot holds
        exactly what it would in a fresh pool (zero above each module's rank), and is not yet
        loaded (see `mark_loaded`). The weights may be of another dtype or device: converted
        while copied. On CUDA the copies are queued on the current stream without a wait each: a
        pinned source must stay untouched until that stream has passed them (SlotCopier waits
        for it)."""
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
        self._slots[slot] = SlotContents(MappingProxyType(
            {key: (w.a.shape[0], w.scale) for key, w in weights.modules.items()}))
        for (layer, module), w in weights.modules.items():
            r = w.a.shape[0]
            self.a[module][layer, slot, :r].copy_(w.a, non_blocking=True)
            self.b[module][layer, slot, :, :r].copy_(w.b, non_blocking=True)
            self.scale[module][layer, slot] = w.scale
            self.rank_table[layer, slot, LORA_MODULES.index(module)] = r
            self.scale_table[layer, slot, LORA_MODULES.index(module)] = w.scale

    def clear(self, slot: int) -> None:
        """Empty `slot`: zero what its adapter wrote, and forget the adapter."""
        self._check_slot(slot)
        self._zero_written(slot)

    def _zero_written(self, slot: int) -> None:
        """Zero what `slot`'s adapter wrote, and its table entries; the slot is then empty. A slot
        is zero outside its adapter's ranks (as in a fresh pool), so per group only the ranks
        below the largest the adapter used there need it: a rank-8 adapter costs a rank-8 memset,
        not one of the whole slot at max_rank."""
        targets = self._slots[slot].targets
        self._slots[slot] = dataclasses.replace(self._slots[slot], is_loaded=False, adapter=None)
        self._writes[slot] += 1
        for g in self.groups.values():
            rank = max((r for (_, m), (r, _) in targets.items() if m in g.modules), default=0)
            if rank:
                g.a[:, slot, :, :rank].zero_()  # [L, n, rank, in]
                g.bt[:, slot, :rank].zero_()  # [L, rank, sum(out)]
        for module in {module for _, module in targets}:
            self.scale[module][:, slot] = 0.0
        self.rank_table[:, slot] = 0
        self.scale_table[:, slot] = 0.0
        self._slots[slot] = EMPTY_SLOT
