"""KV block accounting for one executor, and its prefix cache. The scheduler owns block tables;
the executor mirrors them.

A full block's KV is fixed by the tokens up to its end and by who computed it (the adapter: LoRA
changes K and V at every layer). It is named by a chained hash (prefix_cache.py): the previous
block's hash, its own token ids and a cache key (adapter version, tenant or pool scope, salt).
A finished sequence's hashed blocks stay cached; a new sequence whose leading blocks hash the same
takes them into its table without a copy and computes only the rest.

The blocks' states (free, cached, referenced, page) and when a block that left a table may
become an adapter's page are the BlockPool's (block_pool.py), which this class extends with the
tables.

Window blocks (the executor's KV layout, common/kv_layout.py): a sequence has a table per kind of
layers. A token block of a kind takes `columns` blocks together (an entry: named by its first
block, cached, shared and evicted as one). A window kind's table holds entries only from the
first token block its next row reads: `grow` gives back the ones behind (to the cache when
hashed, as `free` does), and a new sequence's window table starts past the prefix's blocks that
lie behind its first row's window (-1 there; the executor's NewSequence.first_blocks). A prefix
matches where every global kind holds its whole chain and every window kind the blocks its
window reads.

Running example (block_size 4): seq 1 runs tokens [a b c d e f] with table [7, 2] and publishes
block 7 under h1 = H(root, abcd, key). Seq 1 ends: block 2 is free, block 7 cached. Seq 2 with
the same key and tokens [a b c d x] matches [7], takes it (refs 1) plus one free block, and
computes from position 4.
"""

from dataclasses import dataclass

from common.kv_layout import KVLayout, single_layout
from scheduler.steps.block_pool import BlockPool


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` tokens of KV."""
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class Hits:
    """A prefix found in the cache under window blocks: each kind's entries (-1 where a window
    kind needs none)."""

    tables: tuple[list[int], ...]

    def __len__(self) -> int:
        """Token blocks of the prefix."""
        return len(self.tables[0])


class KindBlocks(tuple):
    """A row's new blocks under several kinds: each kind's, every entry's blocks together (the
    step message counts them per kind)."""


class BlockManager(BlockPool):
    """The block tables of each sequence (per kind of layers) and the prefix cache, over the
    pool's blocks.

    Predicates come in pairs with their actions: `can_grow`/`grow`, `can_start`/`start`.
    """

    def __init__(self, num_blocks: int, block_size: int, layout: KVLayout | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("need num_blocks >= 1 and block_size >= 1, got "
                             f"{num_blocks}, {block_size}")
        super().__init__(num_blocks)
        self.block_size = block_size
        self.layout = layout or single_layout(1)
        self._kinds = self.layout.kinds
        self._columns = tuple(kind.columns for kind in self._kinds)
        # per kind: seq_id -> entries in position order (-1: none there); and for a window
        # kind, seq_id -> its first entry that is not -1
        self._tables: tuple[dict[int, list[int]], ...] = tuple({} for _ in self._kinds)
        self._live_from: tuple[dict[int, int], ...] = tuple({} for _ in self._kinds)
        self.tables = self._tables[0]  # (the only kind's, without window blocks)

    def capacity(self, seq_id: int) -> int:
        """Tokens seq_id's tables hold (every kind's)."""
        if len(self._tables) == 1:
            return len(self.tables[seq_id]) * self.block_size
        return min(len(t[seq_id]) for t in self._tables) * self.block_size

    def most_blocks(self, num_tokens: int, chunk: int = 0) -> int:
        """Blocks a sequence of `num_tokens` tokens holds at most, computed in rows of up to
        `chunk` tokens (KVLayout.most_blocks)."""
        return self.layout.most_blocks(num_tokens, self.block_size, chunk)

    def held(self, seq_id: int) -> list[int]:
        """The blocks seq_id's tables hold, every kind's."""
        return [b for tables in self._tables for entry in tables.get(seq_id, ()) if entry >= 0
                for b in self._blocks_of(entry)]

    def num_behind_windows(self) -> int:
        """Blocks the sequences' window kinds do not hold where every layer would keep the whole
        context: their entries behind the window, given back or never taken (a prefix's)."""
        return sum(kind.columns * sum(entry < 0 for entry in table)
                   for kind, tables in zip(self._kinds, self._tables) if kind.window is not None
                   for table in tables.values())

    def first_blocks(self, seq_id: int) -> tuple[int, ...]:
        """Each kind's first entry of seq_id's tables that is not -1."""
        return tuple(live.get(seq_id, 0) for live in self._live_from)

    # ---- the prefix cache -------------------------------------------------------------------
    def match(self, hashes: list[bytes]) -> list[int] | Hits:
        """The entries of the longest cached prefix that starts `hashes`: a list without window
        blocks, else Hits."""
        if self.layout.is_single:
            return self._chain(hashes, 0)
        num = len(hashes)
        for k, kind in enumerate(self._kinds):  # every global kind's whole chain
            if kind.window is None:
                num = len(self._chain(hashes[:num], k))
        for k, kind in enumerate(self._kinds):  # every window kind's blocks behind its end
            if kind.window is not None:
                num = self._window_match(k, hashes[:num])
        return Hits(tuple(
            [-1] * kind.first_needed(num * self.block_size, self.block_size)
            + [self._block_of[self._key(h, k)]
               for h in hashes[kind.first_needed(num * self.block_size, self.block_size):num]]
            for k, kind in enumerate(self._kinds)))

    def _key(self, block_hash: bytes, kind: int) -> bytes:
        return block_hash + bytes((kind,)) if kind else block_hash

    def _chain(self, hashes: list[bytes], kind: int) -> list[int]:
        hits = []
        for h in hashes:
            entry = self._block_of.get(self._key(h, kind))
            if entry is None:
                break
            hits.append(entry)
        return hits

    def _window_match(self, kind: int, hashes: list[bytes]) -> int:
        """The longest prefix of `hashes` whose blocks a row after it reads are cached in
        window kind `kind`."""
        run, runs = 0, []  # cached entries ending at each block
        for h in hashes:
            run = run + 1 if self._key(h, kind) in self._block_of else 0
            runs.append(run)
        window = self._kinds[kind]
        for num in range(len(hashes), 0, -1):
            if runs[num - 1] >= num - window.first_needed(num * self.block_size,
                                                          self.block_size):
                return num
        return 0

    def publish(self, seq_id: int, index: int, block_hash: bytes, owner: object = None) -> None:
        """Block `index` of seq_id's table is full and computed: cache it under `block_hash`,
        as KV computed with adapter `owner` (None: the base model); every kind's that seq_id
        still holds. When another entry already holds that hash (two sequences computed the
        same prefix at once), this one stays unhashed and is freed as usual."""
        for kind, tables in enumerate(self._tables):
            table = tables[seq_id]
            if index >= len(table) or table[index] < 0:
                continue
            self._cache_as(table[index], self._key(block_hash, kind), owner)

    # ---- tables -----------------------------------------------------------------------------
    def num_missing(self, seq_id: int, num_tokens: int) -> int:
        """Blocks `seq_id` still lacks to hold `num_tokens` tokens."""
        need = -(-num_tokens // self.block_size)  # (blocks_for, inlined: per row)
        if len(self._tables) == 1:
            return max(0, need - len(self.tables.get(seq_id, ())))
        return sum(columns * max(0, need - len(tables.get(seq_id, ())))
                   for columns, tables in zip(self._columns, self._tables))

    def can_grow(self, seq_id: int, num_tokens: int) -> bool:
        return self.num_missing(seq_id, num_tokens) <= self.num_free

    def grow(self, seq_id: int, num_tokens: int, start: int = 0,
             last_step: int = 0) -> list[int] | KindBlocks:
        """Extend the tables of `seq_id` to cover `num_tokens` tokens for a row from position
        `start` (its last row in plan `last_step`); returns the new blocks."""
        new = self.try_grow(seq_id, num_tokens, start, last_step)
        if new is None:
            raise RuntimeError(f"seq {seq_id}: needs {self.num_missing(seq_id, num_tokens)} "
                               f"blocks, {self.num_free} free")
        return new

    def try_grow(self, seq_id: int, num_tokens: int, start: int = 0,
                 last_step: int = 0) -> list[int] | KindBlocks | None:
        """`grow`, or None (nothing taken) when too few blocks are free: `can_grow` and `grow` in
        one look at the table (the scheduler asks for every row of every step). Under window
        blocks, a window kind first gives back the entries behind the window of a row from
        `start` (its last row in plan `last_step`): they are what may be taken."""
        if self.layout.is_single:
            table = self.tables.get(seq_id)
            have = 0 if table is None else len(table)
            missing = -(-num_tokens // self.block_size) - have  # (blocks_for, inlined)
            if missing <= 0:  # (most decode steps)
                return []
            if missing > len(self._free) + self._cached_blocks:
                return None
            new = [self._take(0) for _ in range(missing)]
            self.tables.setdefault(seq_id, []).extend(new)
            return new
        self._leave_behind(seq_id, start, last_step)
        if self.num_missing(seq_id, num_tokens) > self.num_free:
            return None
        need = -(-num_tokens // self.block_size)
        grown = []
        for kind, tables in enumerate(self._tables):
            table = tables.setdefault(seq_id, [])
            new = [self._take(kind) for _ in range(need - len(table))]
            table.extend(new)
            grown.append([b for entry in new for b in self._blocks_of(entry)])
        return grown[0] if len(grown) == 1 else KindBlocks(grown)

    def _leave_behind(self, seq_id: int, start: int, last_step: int) -> None:
        """Each window kind's entries of seq_id behind the window of a row from `start` go."""
        for kind, tables, live in zip(self._kinds, self._tables, self._live_from):
            first = kind.first_needed(start, self.block_size)
            table = tables.get(seq_id)
            if table is None or first <= live.get(seq_id, 0):
                continue
            for index in range(live.get(seq_id, 0), min(first, len(table))):
                self._drop(table[index], last_step)
                table[index] = -1
            live[seq_id] = first

    def can_start(self, hits: list[int] | Hits, num_tokens: int, first_end: int | None = None,
                  max_tokens: int = 0, reserved: int = 0) -> bool:
        """A new sequence could hold `num_tokens` tokens, its first blocks being `hits`, its
        window kinds' only up to `first_end` (its first row's end; None: num_tokens); given
        `max_tokens`, and grow to that many (a window kind's up to KVKind.most_held, as
        `to_grow` counts), with `reserved` blocks left free beside it."""
        fresh = taken_from_cache = 0
        for kind, columns, entries in zip(self._kinds, self._columns, self._per_kind(hits)):
            end = num_tokens if kind.window is None or first_end is None else first_end
            num = blocks_for(end, self.block_size)
            fresh += columns * (num - len(entries))
            if max_tokens:  # (then it holds num entries, but those behind its window)
                held = num - entries.count(-1)
                fresh += columns * max(0, kind.most_held(max_tokens, self.block_size) - held)
            taken_from_cache += sum(len(self._blocks_of(b)) for b in entries
                                    if b in self._cached)
        return fresh + reserved <= self.num_free - taken_from_cache

    def _per_kind(self, hits: list[int] | Hits) -> tuple[list[int], ...]:
        """Each kind's hits (a list: the one kind's; empty: none of any kind)."""
        if isinstance(hits, Hits):
            return hits.tables
        return (hits,) if hits else tuple([] for _ in self._kinds)

    def start(self, seq_id: int, hits: list[int] | Hits, num_tokens: int,
              first_end: int | None = None) -> list[int] | KindBlocks:
        """A new sequence's tables: the matched entries `hits` (shared, not copied), then fresh
        ones up to `num_tokens` tokens (a window kind's up to `first_end`, None: num_tokens).
        Returns its blocks as its first row brings them (a window kind's from its first block,
        `first_blocks`)."""
        if seq_id in self.tables:
            raise RuntimeError(f"seq {seq_id} already has a block table")
        for kind, (tables, entries) in enumerate(zip(self._tables, self._per_kind(hits))):
            for entry in entries:
                if entry >= 0:
                    self._hold(entry)
            tables[seq_id] = list(entries)
            if self._kinds[kind].window is not None:
                self._live_from[kind][seq_id] = entries.count(-1)
        if self.layout.is_single:
            self.grow(seq_id, num_tokens)
            return list(self.tables[seq_id])
        for kind, tables in enumerate(self._tables):
            end = num_tokens if self._kinds[kind].window is None or first_end is None \
                else first_end
            table = tables[seq_id]
            table.extend(self._take(kind) for _ in range(blocks_for(end, self.block_size)
                                                          - len(table)))
        out = [[b for entry in tables[seq_id] if entry >= 0 for b in self._blocks_of(entry)]
               for tables in self._tables]
        return out[0] if len(out) == 1 else KindBlocks(out)

    def free(self, seq_id: int, last_step: int = 0) -> None:
        """Drop `seq_id`'s tables (idempotent): their entries in no other table become free, or
        cached (most recently used) when hashed, unsettled until step `last_step` (the last with
        a row of it; 0: none was sent) is answered. A table's last entry goes first: eviction
        then takes a chain's tail before its head, which every longer match needs."""
        for tables, live in zip(self._tables, self._live_from):
            for entry in reversed(tables.pop(seq_id, ())):
                if entry >= 0:
                    self._drop(entry, last_step)
            live.pop(seq_id, None)

    def _take(self, kind: int) -> int:
        """An entry of `kind` for a table (BlockPool._take_entry)."""
        return self._take_entry(self._columns[kind])

    def to_grow(self, seq_id: int, max_tokens: int) -> int:
        """Blocks seq_id will still take to reach `max_tokens` tokens, at most (a window kind's
        held up to KVKind.most_held)."""
        out = 0
        for kind, tables, live in zip(self._kinds, self._tables, self._live_from):
            table = tables.get(seq_id, ())
            held = len(table) - live.get(seq_id, 0)
            out += kind.columns * max(0, kind.most_held(max_tokens, self.block_size) - held)
        return out

    def check(self) -> None:
        """Assert the invariants (for tests): window tables -1 just before their first live
        entry, and the pool's (BlockPool._check_states) with the tables' entries."""
        counts: dict[int, int] = {}
        for tables, live in zip(self._tables, self._live_from):
            for seq_id, table in tables.items():
                first = live.get(seq_id, 0)
                assert all(e == -1 for e in table[:first]) and -1 not in table[first:], table
                for entry in table[first:]:
                    counts[entry] = counts.get(entry, 0) + 1
        self._check_states(counts)
