"""The KV blocks of one executor and the state each is in; the tables that hold them, per
sequence and kind of layers, are the BlockManager's (block_manager.py), built on this.

Blocks are taken and given back as entries: one block, or `columns` blocks together under window
blocks (named by the first; common/kv_layout.py). Every block is in exactly one state:
  free        no hash, in no table                      (taken first)
  cached      a hash, in no table, in LRU order         (reused by a match, or evicted when no
                                                         free block is left)
  referenced  in `refs` tables, hashed or not           (never evicted)
  page        holding an adapter's weights              (common/adapter_pages.py; taken by
                                                         `take_pages`, back by `give_back_pages`)

KV and adapters share the blocks (residency/adapter_memory.py states the policy). Steps write KV
in the order they are sent, but an adapter's load writes its pages beside them (its own RPC): a
block that left a sequence's table stays unsettled until every step that may read it is answered
(`_drop` takes the table's last step, `settle` the last step answered), and only settled blocks
become pages.
"""

import heapq
from collections import OrderedDict, deque


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced hashed, LRU first
        self._cached_blocks = 0  # blocks of the cached entries
        self._block_of: dict[bytes, int] = {}  # hash (a window kind's: + its index) -> entry
        self._hash_of: dict[int, bytes] = {}  # entry -> hash
        self._refs: dict[int, int] = {}  # entry -> tables holding it (absent: 0)
        self._rest: dict[int, tuple[int, ...]] = {}  # entry -> its other blocks (columns > 1)
        self._head_of: dict[int, int] = {}  # such a block -> its entry
        self._pages: set[int] = set()  # blocks holding adapters' weights
        self._owner: dict[int, object] = {}  # hashed entry -> the adapter whose KV it holds
        # Blocks that left a table in a step not answered yet: block -> that step (and a heap of
        # (step, block) to settle them in step order; an entry whose step moved is stale).
        self._unsettled: dict[int, int] = {}
        self._to_settle: list[tuple[int, int]] = []

    @property
    def num_free(self) -> int:
        """Blocks a sequence can take now: free ones and unreferenced cached ones."""
        return len(self._free) + self._cached_blocks

    @property
    def num_pages(self) -> int:
        """Blocks holding adapters' weights."""
        return len(self._pages)

    @property
    def num_cached(self) -> int:
        """Blocks holding a published prefix, referenced or not."""
        return sum(1 + len(self._rest.get(entry, ())) for entry in self._hash_of)

    def num_allocated(self) -> int:
        """Blocks in sequences' tables."""
        return self.num_blocks - self.num_free - len(self._pages)

    # ---- entries ----------------------------------------------------------------------------
    def _take_entry(self, columns: int) -> int:
        """An entry of `columns` blocks for a table: free blocks, else the least recently used
        cached entries' (evicted)."""
        while len(self._free) < columns:
            entry = next(iter(self._cached))
            self._free.extendleft(reversed(self._evict(entry)))
        entry = self._free.popleft()
        if columns > 1:
            rest = tuple(self._free.popleft() for _ in range(columns - 1))
            self._rest[entry] = rest
            self._head_of.update(dict.fromkeys(rest, entry))
        self._refs[entry] = 1
        return entry

    def _hold(self, entry: int) -> None:
        """One more table holds `entry` (a prefix's: out of the cache's LRU when it was there)."""
        if entry in self._cached:
            del self._cached[entry]
            self._cached_blocks -= len(self._blocks_of(entry))
        self._refs[entry] = self._refs.get(entry, 0) + 1

    def _drop(self, entry: int, last_step: int) -> None:
        """One table lets go of `entry` (read up to plan `last_step`): in no table any more, it
        is cached (most recently used) when hashed, else free."""
        refs = self._refs[entry] - 1
        if refs:
            self._refs[entry] = refs
            return
        del self._refs[entry]
        blocks = self._blocks_of(entry)
        if last_step:
            for block in blocks:
                self._unsettled[block] = last_step
                heapq.heappush(self._to_settle, (last_step, block))
        if entry in self._hash_of:
            self._cached[entry] = None
            self._cached_blocks += len(blocks)
        else:
            self._forget_rest(entry)
            self._free.extend(blocks)

    def _blocks_of(self, entry: int) -> tuple[int, ...]:
        rest = self._rest.get(entry)
        return (entry,) if rest is None else (entry, *rest)

    def _forget_rest(self, entry: int) -> None:
        for block in self._rest.pop(entry, ()):
            del self._head_of[block]

    # ---- hashes -----------------------------------------------------------------------------
    def _cache_as(self, entry: int, key: bytes, owner: object) -> None:
        """`entry` holds the KV named `key`, computed with adapter `owner` (None: the base
        model); unless another entry already holds that name, or this one another."""
        if key not in self._block_of and entry not in self._hash_of:
            self._block_of[key] = entry
            self._hash_of[entry] = key
            if owner is not None:
                self._owner[entry] = owner

    def drop_cached_of(self, owner: object) -> int:
        """Forget the cached blocks of adapter `owner` (it left the executor: useless without
        it): they are free now, taken before any other. How many."""
        dropped = [b for b, o in self._owner.items() if o == owner and b in self._cached]
        count = 0
        for entry in dropped:
            blocks = self._evict(entry)
            self._free.extendleft(reversed(blocks))
            count += len(blocks)
        return count

    def _evict(self, entry: int) -> tuple[int, ...]:
        """A cached entry forgotten: its blocks (now in no state: the caller places them)."""
        del self._cached[entry]
        del self._block_of[self._hash_of.pop(entry)]
        self._owner.pop(entry, None)
        blocks = self._blocks_of(entry)
        self._cached_blocks -= len(blocks)
        self._forget_rest(entry)
        return blocks

    # ---- adapter pages ----------------------------------------------------------------------
    def num_settled(self) -> int:
        """Free and cached blocks that may become pages now (a cached entry only whole)."""
        unsettled_free, unsettled_entries = 0, set()
        for block in self._unsettled:
            entry = self._head_of.get(block, block)
            if entry in self._refs:
                continue
            if entry in self._cached:
                unsettled_entries.add(entry)
            else:
                unsettled_free += 1
        return self.num_free - unsettled_free - sum(
            len(self._blocks_of(entry)) for entry in unsettled_entries)

    def take_pages(self, num_pages: int) -> list[int] | None:
        """`num_pages` settled blocks for an adapter's weights, free ones first, then the least
        recently used cached entries (their prefixes forgotten); None (nothing taken) when fewer
        are settled."""
        if num_pages > self.num_settled():
            return None
        pages: list[int] = []
        for block in list(self._free):
            if len(pages) == num_pages:
                break
            if block not in self._unsettled:
                pages.append(block)
        for block in pages:
            self._free.remove(block)
        for entry in list(self._cached):
            if len(pages) == num_pages:
                break
            blocks = self._blocks_of(entry)
            if not any(b in self._unsettled for b in blocks):
                self._evict(entry)
                taken = blocks[:num_pages - len(pages)]
                pages += taken
                self._free.extendleft(reversed(blocks[len(taken):]))
        self._pages.update(pages)
        return pages

    def give_back_pages(self, pages: list[int] | tuple[int, ...]) -> None:
        """An adapter's pages are free again (no step or load may touch them any more)."""
        for block in pages:
            self._pages.remove(block)
            self._free.append(block)

    def settle(self, answered: int) -> None:
        """Every step up to `answered` is answered: blocks that left tables in them may become
        pages."""
        while self._to_settle and self._to_settle[0][0] <= answered:
            step, block = heapq.heappop(self._to_settle)
            if self._unsettled.get(block) == step:
                del self._unsettled[block]

    def _check_states(self, counts: dict[int, int]) -> None:
        """Assert (for tests) that every block is in exactly one state, the reference counts are
        `counts` (the tables' entries), and the hash maps are inverse of each other."""
        assert counts == self._refs, (counts, self._refs)
        free, cached = set(self._free), set(self._cached)
        entries = set(counts) | cached
        in_entries = {b for e in entries for b in self._blocks_of(e)}
        assert len(in_entries) == sum(len(self._blocks_of(e)) for e in entries)
        assert set(self._rest) <= entries
        assert self._head_of == {b: e for e, rest in self._rest.items() for b in rest}
        assert self._cached_blocks == sum(len(self._blocks_of(e)) for e in cached)
        assert len(free) == len(self._free) and not free & in_entries
        assert not cached & set(counts) and cached <= set(self._hash_of)
        assert not free & set(self._hash_of) and set(self._hash_of) <= entries
        pages = self._pages
        assert not pages & (free | in_entries)
        assert len(free) + len(in_entries) + len(pages) == self.num_blocks
        assert set(self._owner) <= set(self._hash_of)
        assert {b: h for h, b in self._block_of.items()} == self._hash_of
