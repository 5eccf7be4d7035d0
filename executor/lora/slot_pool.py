"""The adapter slot pool: which adapter each of `num_slots` slots holds, and where its weights are.

A slot is a handle: its adapter's weights live in pages, KV blocks the scheduler gives it (the
LoadAdapter's `pages`), laid out by common/adapter_pages.py in the KV cache's storage. So an
adapter takes memory in proportion to the rank rows it really has, and nothing in the pool is
sized for `max_rank` but the offset tables (max_rank is the largest rank a slot takes).

What a slot holds (SlotContents, read with `contents(slot)`): its adapter's rank and scale per
layer and module (`targets`), its pages and their layout, whether it is loaded (steps may read
it), and the AdapterRef it was loaded as. The runner, the backends and the adapter loader all ask
the pool; none keeps a copy.

    load(slot, weights, pages)  written: targets recorded, weights copied into the pages
    give_up(blocks)             the slots whose pages the scheduler gave out (to a load or to KV)
                                emptied
    mark_loaded(slot, adapter)  loaded: the copy completed; steps may read the slot
    mark_unloaded(slot)         written again: about to be overwritten, not to be read or reported
    clear(slot)                 empty: nothing recorded (its pages are left as they are: they are
                                the scheduler's blocks again, and may hold KV by now)

Offsets. Per layer group (one but with window blocks, common/kv_layout.py), slot and module,
`a_offsets` / `b_offsets` [layer groups, num_slots, modules, max_rank, chunks] int64 (the model's
modules: the LLaMA layout's 7, or the fused layout's 4, config.lora_modules), on the pool's
device, give the element offset in the KV storage (the group's slot 0) of each chunk of each row
of A, and of B^T (a column of B); layer l reads its group's (`offsets(l)`) and adds
`layer_base(l)` (executor/lora/page_tables.py defines both). The Triton kernels read rows through
them; the torch backend and merging gather rows with `rows`.

A slot counts as loaded only once whoever waited for the copy says so: ModelRunner.load_adapter at
once (the copy is on the step's stream), the AdapterLoader once SlotCopier waited for its side
stream and the load was not cancelled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch

from common.adapter_pages import PageGeometry, PageLayout, plan_pages
from common.kv_layout import KVLayout, single_layout
from executor.lora.page_tables import layer_base, slot_tables
from executor.model.config import ModelConfig
from executor.model.kv_cache import PagedKVCache
from kernels.page_rows import row_index

if TYPE_CHECKING:  # (only stored and compared: the GPU check imports the pool without protos)
    from common.adapter_ref import AdapterRef

# Group name -> its projections, in the column order of the model's fused base output: the
# LLaMA layout's, and the fused layout's (a fused module is its group's one slice: an adapter's
# B of qkv_proj spans q | k | v as the base weight does).
LORA_GROUPS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)})
FUSED_GROUPS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "qkv": ("qkv_proj",), "o": ("o_proj",), "gate_up": ("gate_up_proj",), "down": ("down_proj",)})


def lora_groups(config: ModelConfig) -> Mapping[str, tuple[str, ...]]:
    """The model's groups (a mixture-of-experts model without a dense MLP layer has none of the
    MLP's: its experts' LoRA is applied by executor/lora/experts.py)."""
    groups = FUSED_GROUPS if config.fused_projections else LORA_GROUPS
    if config.has_dense_mlp:
        return groups
    return MappingProxyType({name: modules for name, modules in groups.items()
                             if name in ("qkv", "o")})


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

    def module_ranks(self) -> dict[str, int]:
        """Each targeted module's largest rank over layers (what its pages are laid out by)."""
        out: dict[str, int] = {}
        for (_, module), w in self.modules.items():
            out[module] = max(out.get(module, 0), w.a.shape[0])
        return out


@dataclass(frozen=True)
class SliceGroup:
    """The projections that share an input (e.g. q, k, v): applied by one backend call."""

    modules: tuple[str, ...]
    first_module: int  # index of modules[0] in the model's modules (slices are consecutive)
    in_features: int
    out_sizes: tuple[int, ...]  # out_features of each slice (q and kv differ under GQA)

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
    pages: tuple[int, ...] = ()  # the KV blocks its weights are in


EMPTY_SLOT = SlotContents(targets=MappingProxyType({}))


def page_geometry(config: ModelConfig, block_size: int,
                  layout: KVLayout | None = None) -> PageGeometry:
    """How adapters' pages lie in a KV cache of `block_size`-token blocks of `config`, laid out
    by `layout` (None: every layer in every block)."""
    layout = layout or single_layout(config.num_hidden_layers)
    return PageGeometry(layout.layers_per_block,
                        block_size * config.num_key_value_heads * config.head_dim,
                        MappingProxyType(config.projection_shapes()), layout.layer_groups)


class LoraSlotPool:
    """`num_slots` adapters of rank <= `max_rank`, their weights in pages of `kv`'s blocks.

    Host tables `rank_table`, `scale_table` [L, num_slots, modules] give each slot's rank (0 =
    not targeted) and fp32 scale per layer and module (`modules`, the model's, in order); a step
    gathers its segments' rows from them.
    """

    def __init__(self, config: ModelConfig, *, num_slots: int, max_rank: int,
                 kv: PagedKVCache, layout: KVLayout | None = None) -> None:
        """`layout`: the KV cache's (its blocks' layer slots); None: every layer in a block."""
        if num_slots < 0 or max_rank <= 0:
            raise ValueError(f"adapter pool needs num_slots >= 0 and max_rank > 0, "
                             f"got {num_slots} and {max_rank}")
        self.config, self.num_slots, self.max_rank, self.kv = config, num_slots, max_rank, kv
        self.device, self.dtype = kv.storage.device, kv.storage.dtype
        num_layers = config.num_hidden_layers
        self.geometry = page_geometry(config, kv.block_size, layout)
        if self.geometry.num_layers != kv.num_layers:
            raise ValueError(f"the KV cache's blocks hold {kv.num_layers} layers, the layout "
                             f"{self.geometry.num_layers}")
        shapes = self.geometry.module_shapes
        self.chunk = self.geometry.chunk_elems
        self.modules = tuple(shapes)  # the model's, in the tables' order
        self._index = {m: i for i, m in enumerate(self.modules)}
        self.groups = {name: SliceGroup(modules, self._index[modules[0]],
                                        shapes[modules[0]][0],
                                        tuple(shapes[m][1] for m in modules))
                       for name, modules in lora_groups(config).items()}
        self.num_chunks = max(-(-n // self.chunk) for shape in shapes.values() for n in shape)
        table = (self.geometry.layer_groups, num_slots, len(self.modules), max_rank,
                 self.num_chunks)
        self.a_offsets = torch.zeros(table, dtype=torch.int64, device=self.device)  # slot 0
        self.b_offsets = torch.zeros(table, dtype=torch.int64, device=self.device)
        self.rank_table = torch.zeros(num_layers, num_slots, len(self.modules), dtype=torch.int32)
        self.scale_table = torch.zeros(num_layers, num_slots, len(self.modules))
        # Written only by the methods below (each assignment whole: the step thread reads them).
        self._slots: list[SlotContents] = [EMPTY_SLOT] * num_slots
        # Per slot, how its weights were written: the count moves when a write (a load or a
        # clear) begins and again once it has completed (finish_write). A copy of a slot's weights
        # made at count c is current while the count is still c: one made while a write ran (a
        # step's stack, on the step thread, beside a load's copy on a worker thread) carries the
        # count the write began with, and is made again.
        self._writes: list[int] = [0] * num_slots
        self._owner: dict[int, int] = {}  # block -> the slot whose weights are in it

    @property
    def page_bytes(self) -> int:
        return self.geometry.page_elems * self.kv.storage.element_size()

    def num_bytes(self) -> int:
        """Bytes the pool adds beside the KV cache: its offset tables (the weights are in pages)."""
        return sum(t.numel() * t.element_size() for t in (
            self.a_offsets, self.b_offsets, self.rank_table, self.scale_table))

    def pages_for(self, weights: LoraWeights) -> PageLayout:
        return plan_pages(weights.module_ranks(), self.geometry)

    def module_index(self, module: str) -> int:
        """The module's column in the pool's per-module tables."""
        return self._index[module]

    def layer_base(self, layer: int) -> int:
        """Elements from a place in slot 0 of `layer`'s group to the same place in `layer`."""
        return layer_base(layer, self.kv.num_blocks, self.geometry)

    def offsets(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The offset tables of `layer`'s group: a, b [num_slots, modules, max_rank, chunks]."""
        group = layer // self.geometry.num_layers
        return self.a_offsets[group], self.b_offsets[group]

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

    def page_blocks(self) -> set[int]:
        """The blocks every slot's weights are in (loaded or being written)."""
        return set(self._owner)

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
        it); its record stays until then."""
        self._slots[slot] = dataclasses.replace(self.contents(slot), is_loaded=False, adapter=None)

    # ----- reading rows -----

    def rows(self, layer: int, slot: int, module: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The slot's A [r, in] and B [out, r] of `module` at `layer`, gathered from its pages
        (copies), at that layer's rank; None where it does not target the module there."""
        m = self._index[module]
        rank = int(self.rank_table[layer, slot, m])
        if rank == 0:
            return None
        in_f, out_f = self.geometry.module_shapes[module]
        base = self.layer_base(layer)
        a_offsets, b_offsets = self.offsets(layer)
        a = self.kv.flat[row_index(a_offsets[slot, m, :rank], in_f, self.chunk) + base]
        bt = self.kv.flat[row_index(b_offsets[slot, m, :rank], out_f, self.chunk) + base]
        return a, bt.T  # [r, in], [out, r]

    # ----- writing -----

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"adapter slot {slot} out of range [0, {self.num_slots})")

    def load(self, slot: int, weights: LoraWeights, pages: tuple[int, ...] | list[int]) -> None:
        """Copy an adapter into `slot`, its weights into `pages` (blocks no sequence's table
        holds; another slot that holds any of them is emptied first: `give_up`); the slot is not
        yet loaded (see `mark_loaded`). The weights may be of another dtype or device: converted
        while copied. On CUDA the copies are queued on the current stream without a wait each: a
        pinned source must stay untouched until that stream has passed them (SlotCopier waits
        for it)."""
        self._check_slot(slot)
        if weights.rank > self.max_rank:
            raise ValueError(f"adapter rank {weights.rank} exceeds the pool's max rank "
                             f"{self.max_rank}")
        for (layer, module), w in weights.modules.items():
            if module not in self._index:
                raise ValueError(f"adapter targets {module}; the model's projections are "
                                 f"{', '.join(self.modules)}")
            in_f, out_f = self.config.module_shape(module)
            r = w.a.shape[0]
            if not 0 <= layer < self.config.num_hidden_layers:
                raise ValueError(f"adapter targets layer {layer}, the model has "
                                 f"{self.config.num_hidden_layers}")
            if w.a.shape != (r, in_f) or w.b.shape != (out_f, r):
                raise ValueError(f"layer {layer} {module}: A {tuple(w.a.shape)} / B "
                                 f"{tuple(w.b.shape)} do not fit [r, {in_f}] / [{out_f}, r]")
        layout = self.pages_for(weights)
        pages = tuple(pages)
        self._check_pages(pages, layout.num_pages)
        self.give_up(set(pages), keep=slot)
        self._forget(slot)
        # Recorded before the copy: a failed copy leaves a slot that is not loaded.
        self._slots[slot] = SlotContents(MappingProxyType(
            {key: (w.a.shape[0], w.scale) for key, w in weights.modules.items()}), pages=pages)
        self._owner.update(dict.fromkeys(pages, slot))
        a, b = slot_tables(layout, pages, self.kv.num_blocks, self.geometry,
                           max_rank=self.max_rank, num_chunks=self.num_chunks)
        self.a_offsets[:, slot], self.b_offsets[:, slot] = a, b  # (host -> device)
        flat, per_group = self.kv.flat, self.geometry.num_layers
        for (layer, module), w in weights.modules.items():
            m, r, group = self._index[module], w.a.shape[0], layer // per_group
            in_f, out_f = self.config.module_shape(module)
            base = self.layer_base(layer)
            a_at = row_index(a[group, m, :r], in_f, self.chunk).to(self.device) + base
            b_at = row_index(b[group, m, :r], out_f, self.chunk).to(self.device) + base
            flat.index_copy_(0, a_at.flatten(), w.a.to(self.device, self.dtype).flatten())
            flat.index_copy_(0, b_at.flatten(),
                             w.b.T.to(self.device, self.dtype).contiguous().flatten())
            self.rank_table[layer, slot, m] = r
            self.scale_table[layer, slot, m] = w.scale

    def _check_pages(self, pages: tuple[int, ...], needed: int) -> None:
        if len(pages) != needed:
            raise ValueError(f"the adapter's weights take {needed} pages, {len(pages)} given")
        bad = [b for b in pages if not 0 <= b < self.kv.num_blocks]
        if bad:
            raise ValueError(f"page {bad[0]} is no KV block (the cache has {self.kv.num_blocks})")
        if len(set(pages)) != len(pages):
            raise ValueError("a page is given twice")

    def holders(self, blocks: Iterable[int]) -> set[int]:
        """The slots whose weights are in any of `blocks`."""
        return {self._owner[b] for b in blocks if b in self._owner}

    def give_up(self, blocks: set[int], keep: int | None = None) -> list[int]:
        """Empty every slot but `keep` whose pages are among `blocks`, and return them: the
        blocks are the scheduler's to give, and it gave them out (to another slot's load, or to
        KV), having evicted those slots' adapters; its UnloadAdapter of them may come later."""
        emptied = sorted(self.holders(blocks) - {keep})
        for slot in emptied:
            self._forget(slot)
        return emptied

    def clear(self, slot: int) -> None:
        """Empty `slot`: forget the adapter (its pages are not touched: they may hold KV now)."""
        self._check_slot(slot)
        self._forget(slot)

    def _forget(self, slot: int) -> None:
        for block in self._slots[slot].pages:
            if self._owner.get(block) == slot:
                del self._owner[block]
        self._slots[slot] = dataclasses.replace(self._slots[slot], is_loaded=False, adapter=None)
        self._writes[slot] += 1
        self.rank_table[:, slot] = 0
        self.scale_table[:, slot] = 0.0
        self.a_offsets[:, slot] = 0
        self.b_offsets[:, slot] = 0
        self._slots[slot] = EMPTY_SLOT
