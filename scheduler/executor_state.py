"""What the core knows of one executor: where it is in its life, its measured rates and its KV
blocks. The Scheduler (core.py) builds one from the executor's Info (ExecutorShape) each time it
connects, and is the only writer of its fields.

Everything else about an executor belongs to the manager that keeps it, privately, per executor;
the others ask that manager (docs/architecture.md lists each one's state and questions):

    its running sequences, its plans     its step builder (steps/step_builder.py), the core's
    its queue, work ahead, popularity    Placement (placement.py)
    its slots, stagings, pages, pins,    its ExecutorResidency (residency/executor_residency.py)
      fetches, failures, load counters
    its dedication to one adapter        Merges (merging.py)

Its blocks are the elastic pool that KV and adapters' pages share (steps/block_manager.py): the
step builders grow and free tables through its methods, residency takes and gives back pages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.adapter_pages import PageGeometry
from common.kv_layout import KVLayout
from common.page_geometry_pb import geometry_from_pb, layout_from_pb
from protos import executor_pb2
from scheduler.routing import Rates
from scheduler.steps.block_manager import BlockManager


@dataclass(frozen=True)
class ExecutorShape:
    """What the scheduler plans one executor by: the facts its Info states."""

    num_blocks: int  # KV blocks (KV and adapters' pages share them)
    block_size: int  # tokens per block
    num_slots: int  # adapter slots
    # How its memory holds adapters (None: fixed slots outside the KV blocks, no pages), and the
    # bytes of one page (one KV block).
    geometry: PageGeometry | None = None
    page_bytes: int = 0
    rope_switch_len: int = 0  # its model's longrope switch (steps/longrope.py; 0: none)
    kv_layout: KVLayout | None = None  # which KV its layers keep (None: one kind, the whole)
    quantized: QuantizedBase | None = None  # (None: a 16-bit base)
    # The batch sizes its decode steps replay CUDA graphs of (() : eager), and why not on CUDA
    graph_buckets: tuple[int, ...] = ()
    graphs_off: str = ""

    @classmethod
    def from_info(cls, info: executor_pb2.InfoResponse) -> ExecutorShape:
        layout = layout_from_pb(info)
        return cls(info.num_kv_blocks, info.block_size, info.num_adapter_slots,
                   geometry_from_pb(info), info.page_geometry.page_bytes,
                   info.longrope_switch_len, layout, QuantizedBase.of(info, layout),
                   tuple(info.decode_graph_buckets), info.decode_graphs_off)


@dataclass(frozen=True)
class QuantizedBase:
    """An executor's quantized base: its quantization in words, and what its smaller weights
    free against the same model in 16 bits: bytes, and those bytes in KV tokens (of every
    layer) or blocks (each a block of KV or an adapter's page). No adapter merges into it."""

    description: str
    freed_bytes: int = 0
    freed_kv_tokens: int = 0
    freed_blocks: int = 0

    @classmethod
    def of(cls, info: executor_pb2.InfoResponse, layout: KVLayout) -> QuantizedBase | None:
        if not info.quantization:
            return None
        freed = max(0, info.dense_weight_bytes - info.weight_bytes)
        block_bytes = info.kv_cache_bytes // info.num_kv_blocks if info.num_kv_blocks else 0
        blocks = freed // block_bytes if block_bytes else 0
        tokens = blocks * info.block_size * layout.layers_per_block // layout.num_layers
        return cls(info.quantization, freed, tokens, blocks)


@dataclass(eq=False)
class ExecutorState:
    address: str
    blocks: BlockManager
    rope_switch_len: int = 0  # its model's longrope switch (steps/longrope.py; 0: none)
    rates: Rates = field(default_factory=Rates)
    is_up: bool = False  # connected and stepping: from add_executor until on_executor_lost
    is_draining: bool = False  # admits nothing new; its running sequences finish
    is_leaving: bool = False  # gone from discovery: forget it once drained
    is_stopping: bool = False  # its health said NOT_SERVING: release it once drained
    steps_since_up: int = 0  # steps answered since it came up (this connection): its warm-up
    quantized: QuantizedBase | None = None  # its base's quantization (None: 16-bit)
    graph_buckets: tuple[int, ...] = ()  # (ExecutorShape's: for Stats)
    graphs_off: str = ""

    @classmethod
    def of(cls, address: str, shape: ExecutorShape, is_leaving: bool = False) -> ExecutorState:
        """A fresh view of the executor at `address` from its Info's facts: empty blocks."""
        return cls(address, BlockManager(shape.num_blocks, shape.block_size, shape.kv_layout),
                   shape.rope_switch_len, is_leaving=is_leaving, quantized=shape.quantized,
                   graph_buckets=shape.graph_buckets, graphs_off=shape.graphs_off)

    @property
    def is_admitting(self) -> bool:
        return self.is_up and not self.is_draining

    @property
    def can_resume(self) -> bool:
        """An operator may let it admit again: it is up and neither leaving nor stopping."""
        return self.is_up and not (self.is_leaving or self.is_stopping)

    def can_hold(self, num_tokens: int, adapter_pages: int = 0, chunk: int = 0) -> bool:
        """A sequence of `num_tokens` tokens, computed in rows of up to `chunk` tokens, fits
        this executor's blocks whole, beside its adapter's `adapter_pages` pages."""
        return self.blocks.most_blocks(num_tokens, chunk) + adapter_pages \
            <= self.blocks.num_blocks
