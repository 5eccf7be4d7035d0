"""Which KV each layer keeps and where it lies: the KV cache's kinds of layers. Defined once:
executors place K and V by it, schedulers give out blocks by it (InfoResponse.kv_kinds).

A sliding-window layer (Mistral's, Gemma's local layers, gpt-oss's banded ones) reads only the
last `window` keys before each query; a global layer reads the whole context. With window blocks
(the executor's default), layers of one window form a kind with block tables of its own: a
window kind's tables hold blocks only for the keys its next rows can still see (the window
behind the first row position, and the rows), a global kind's the whole context. Without, every
layer is of one kind that keeps the whole context (each layer's window is applied as a mask).

A block is the unit of one pool that KV and adapters' pages share: `block_size` tokens of K and V
in `layers_per_block` layer slots. Blocks are all alike, so one a window kind lets go of can hold
another kind's KV or an adapter's page. A kind of n layers spreads one token block of KV over
`columns` = ceil(n / layers_per_block) blocks: its i-th layer (in model order) lies in column
i // layers_per_block, slot i % layers_per_block. layers_per_block is the smallest kind's count
of layers, so that kind takes one block per token block and the others a few, a window kind's
last column slack where the counts do not divide.

Running example: Gemma 3 1B, 26 layers, every 6th global (4), the others sliding over 512 keys
(22): layers_per_block 4; the global kind 1 column, the window kind 6 (24 slots for 22 layers).
At block size 16, a sequence of 8,192 tokens holds 512 global blocks and at most
6 x (ceil(511 / 16) + 1) = 198 window blocks: 710 blocks of 4 layers, against 512 blocks of 26
layers (3,328 of 4) when every layer keeps the whole context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVKind:
    window: int | None  # keys before a query its layers read (None: the whole context)
    layers: tuple[int, ...]  # its layers, in model order
    columns: int  # blocks one token block of its KV takes

    def first_needed(self, position: int, block_size: int) -> int:
        """The first token block a row from `position` on reads: blocks before it lie outside
        every window of the row's queries (0 for a global kind)."""
        if self.window is None:
            return 0
        return max(0, (position - self.window + 1) // block_size)

    def most_held(self, num_tokens: int, block_size: int) -> int:
        """Token blocks of it a sequence of `num_tokens` tokens holds at most while it decodes
        (its first row, a prefill chunk, may hold more: the chunk's own)."""
        whole = -(-num_tokens // block_size)
        if self.window is None:
            return whole
        return min(whole, -(-(self.window - 1) // block_size) + 1)


@dataclass(frozen=True)
class KVLayout:
    kinds: tuple[KVKind, ...]  # the global kind first, if any
    layers_per_block: int

    @classmethod
    def of(cls, layer_windows: Sequence[int | None], window_blocks: bool = True) -> KVLayout:
        """The layout of a model whose layer l sees the last layer_windows[l] keys (None: all).
        window_blocks False: one kind of every layer, keeping the whole context."""
        if not layer_windows:
            raise ValueError("a KV layout needs at least one layer")
        if not window_blocks:
            return cls((KVKind(None, tuple(range(len(layer_windows))), 1),), len(layer_windows))
        by_window: dict[int | None, list[int]] = {}
        for layer, window in enumerate(layer_windows):
            by_window.setdefault(window, []).append(layer)
        per_block = min(map(len, by_window.values()))
        order = sorted(by_window, key=lambda w: (w is not None, w or 0))  # (global first)
        return cls(tuple(KVKind(w, tuple(by_window[w]), -(-len(by_window[w]) // per_block))
                         for w in order), per_block)

    @property
    def num_layers(self) -> int:
        return sum(len(kind.layers) for kind in self.kinds)

    @property
    def is_single(self) -> bool:
        """One kind that keeps the whole context: block tables as without window blocks."""
        return len(self.kinds) == 1 and self.kinds[0].window is None

    @property
    def layer_groups(self) -> int:
        """Groups of layers_per_block layers an adapter's pages come in: an adapter takes its
        page layout's pages once per group (common/adapter_pages.py)."""
        return -(-self.num_layers // self.layers_per_block)

    def place(self, layer: int) -> tuple[int, int, int]:
        """Where `layer`'s K and V lie: (its kind's index, column, slot in the block)."""
        for k, kind in enumerate(self.kinds):
            if layer in kind.layers:
                i = kind.layers.index(layer)
                return k, i // self.layers_per_block, i % self.layers_per_block
        raise ValueError(f"layer {layer} is in no kind (the model has {self.num_layers})")

    def most_blocks(self, num_tokens: int, block_size: int, chunk: int = 0) -> int:
        """Blocks a sequence of `num_tokens` tokens holds at most, every kind together, computed
        in rows of up to `chunk` tokens (a window kind holds a row's blocks beside its
        window's)."""
        whole = -(-num_tokens // block_size)
        extra = -(-chunk // block_size)
        return sum(kind.columns * min(whole, kind.most_held(num_tokens, block_size) + extra)
                   for kind in self.kinds)


def single_layout(num_layers: int) -> KVLayout:
    """Every layer of one kind keeping the whole context (an executor without window blocks)."""
    return KVLayout((KVKind(None, tuple(range(num_layers)), 1),), num_layers)
