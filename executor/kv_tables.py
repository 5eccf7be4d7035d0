"""A sequence's block tables on the executor: the mirror of the scheduler's (the blocks each row
brings appended, never chosen here), one per column of each kind of layers (common/kv_layout.py:
one table without window blocks).

Under window blocks a row brings each kind's new token blocks, each token block's columns
together: with Gemma 3's kinds (global: 1 column; window: 5), a row adding one token block of
each brings 6 blocks, counted (1, 5), the window's split over its 5 column tables. A window kind's
table starts at the first token block its first rows read (NewSequence.first_blocks), -1 before
it; the blocks the scheduler gives back behind a window later stay in the table, never read
again (attention reads only a window's keys: executor/model/attention.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from common.kv_layout import KVLayout


class KVTables:
    """Where a layout's kinds' columns start among a sequence's tables, and the checks and
    appends of rows (one per runner)."""

    def __init__(self, layout: KVLayout, block_size: int) -> None:
        self.layout, self.block_size = layout, block_size
        self.first_column = [sum(kind.columns for kind in layout.kinds[:k])
                             for k in range(len(layout.kinds))]

    def new(self, seq_id: int, first_blocks: Sequence[int], num_cached: int) -> list[list[int]]:
        """A new sequence's tables: -1 for each kind's token blocks before `first_blocks` (none
        where its first row, from position num_cached, reads them)."""
        kinds = self.layout.kinds
        first_blocks = tuple(first_blocks) or (0,) * len(kinds)
        if len(first_blocks) != len(kinds):
            raise ValueError(f"sequence {seq_id}: first_blocks {list(first_blocks)} needs one "
                             f"count per KV kind ({len(kinds)})")
        tables = []
        for kind, first in zip(kinds, first_blocks):
            needed = kind.first_needed(num_cached, self.block_size)
            if first > needed:
                raise ValueError(f"sequence {seq_id}: its first rows read token block {needed} "
                                 f"of its layers of window {kind.window}, but its tables start "
                                 f"at {first}")
            tables += [[-1] * first for _ in range(kind.columns)]
        return tables

    def check(self, seq_id: int, tables: list[list[int]], new_block_ids: Sequence[int],
              num_new_by_kind: Sequence[int], end: int) -> None:
        """A row's new blocks are each kind's whole token blocks, and the tables then hold
        positions up to `end`."""
        kinds = self.layout.kinds
        counts = num_new_by_kind or (len(new_block_ids),)
        if len(counts) != len(kinds) or sum(counts) != len(new_block_ids):
            raise ValueError(f"sequence {seq_id}: {len(new_block_ids)} new blocks in "
                             f"{len(counts)} kinds' counts {list(counts)}; the cache has "
                             f"{len(kinds)} kinds of layers")
        for kind, first, n in zip(kinds, self.first_column, counts):
            if n % kind.columns:
                raise ValueError(f"sequence {seq_id}: {n} new blocks for layers of window "
                                 f"{kind.window}, not whole token blocks of {kind.columns}")
            num_blocks = len(tables[first]) + n // kind.columns
            if num_blocks * self.block_size < end:
                raise ValueError(f"sequence {seq_id}: {num_blocks} blocks of "
                                 f"{self.block_size} cannot hold positions up to {end - 1}")

    def extend(self, tables: list[list[int]], new_block_ids: Sequence[int],
               num_new_by_kind: Sequence[int]) -> None:
        """Append a (checked) row's new blocks: each kind's share, split over its columns."""
        if not num_new_by_kind:
            tables[0].extend(new_block_ids)
            return
        at = 0
        for kind, first, n in zip(self.layout.kinds, self.first_column, num_new_by_kind):
            ids = new_block_ids[at:at + n]
            for column in range(kind.columns):
                tables[first + column].extend(ids[column::kind.columns])
            at += n
