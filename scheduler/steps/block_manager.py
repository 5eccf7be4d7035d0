"""KV block accounting for one executor, and its prefix cache. The scheduler owns block tables;
the executor mirrors them.

A full block's KV is fixed by the tokens up to its end and by who computed it (the adapter: LoRA
changes K and V at every layer). It is named by a chained hash (prefix_cache.py): the previous
block's hash, its own token ids and a cache key (adapter version, tenant or pool scope, salt).
A finished sequence's hashed blocks stay cached; a new sequence whose leading blocks hash the same
takes them into its table without a copy and computes only the rest.

Every block is in exactly one state:
  free        no hash, in no table                      (taken first by `grow`)
  cached      a hash, in no table, in LRU order         (reused by a match, or evicted by `grow`
                                                         when no free block is left)
  referenced  in `refs` tables, hashed or not           (never evicted)
  page        holding an adapter's weights              (common/adapter_pages.py; taken by
                                                         `take_pages`, back by `give_back_pages`)

KV and adapters share the blocks (residency/adapter_memory.py states the policy). Steps write KV
in the order they are sent, but an adapter's load writes its pages beside them (its own RPC): a
block that left a sequence's table stays unsettled until every step that may read it is answered
(`free` takes the sequence's last step, `settle` the last step answered), and only settled blocks
become pages.

Running example (block_size 4): seq 1 runs tokens [a b c d e f] with table [7, 2] and publishes
block 7 under h1 = H(root, abcd, key). Seq 1 ends: block 2 is free, block 7 cached. Seq 2 with
the same key and tokens [a b c d x] matches [7], takes it (refs 1) plus one free block, and
computes from position 4.
"""

import heapq
from collections import OrderedDict, deque


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` tokens of KV."""
    return -(-num_tokens // block_size)


class BlockManager:
    """Free list, prefix cache and the block table of each sequence.

    Predicates come in pairs with their actions: `can_grow`/`grow`, `can_start`/`start`.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("need num_blocks >= 1 and block_size >= 1, got "
                             f"{num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced hashed, LRU first
        self._block_of: dict[bytes, int] = {}  # hash -> block
        self._hash_of: dict[int, bytes] = {}  # block -> hash
        self._refs: dict[int, int] = {}  # block -> tables holding it (absent: 0)
        self.tables: dict[int, list[int]] = {}  # seq_id -> block ids, in position order
        self._pages: set[int] = set()  # blocks holding adapters' weights
        self._owner: dict[int, object] = {}  # hashed block -> the adapter whose KV it holds
        # Blocks that left a table in a step not answered yet: block -> that step (and a heap of
        # (step, block) to settle them in step order; an entry whose step moved is stale).
        self._unsettled: dict[int, int] = {}
        self._to_settle: list[tuple[int, int]] = []

    @property
    def num_free(self) -> int:
        """Blocks a sequence can take now: free ones and unreferenced cached ones."""
        return len(self._free) + len(self._cached)

    @property
    def num_pages(self) -> int:
        """Blocks holding adapters' weights."""
        return len(self._pages)

    @property
    def num_cached(self) -> int:
        """Blocks holding a published prefix, referenced or not."""
        return len(self._hash_of)

    def num_allocated(self) -> int:
        """Blocks in sequences' tables."""
        return self.num_blocks - self.num_free - len(self._pages)

    # ---- the prefix cache -------------------------------------------------------------------
    def match(self, hashes: list[bytes]) -> list[int]:
        """The blocks of the longest cached chain that starts `hashes`."""
        hits = []
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def publish(self, seq_id: int, index: int, block_hash: bytes, owner: object = None) -> None:
        """Block `index` of seq_id's table is full and computed: cache it under `block_hash`,
        as KV computed with adapter `owner` (None: the base model). When another block already
        holds that hash (two sequences computed the same prefix at once), this one stays
        unhashed and is freed as usual."""
        block = self.tables[seq_id][index]
        if block_hash not in self._block_of and block not in self._hash_of:
            self._block_of[block_hash] = block
            self._hash_of[block] = block_hash
            if owner is not None:
                self._owner[block] = owner

    def drop_cached_of(self, owner: object) -> int:
        """Forget the cached blocks of adapter `owner` (it left the executor: useless without
        it): they are free now, taken before any other. How many."""
        dropped = [b for b, o in self._owner.items() if o == owner and b in self._cached]
        for block in dropped:
            del self._cached[block]
            del self._block_of[self._hash_of.pop(block)]
            del self._owner[block]
            self._free.appendleft(block)
        return len(dropped)

    # ---- adapter pages ----------------------------------------------------------------------
    def num_settled(self) -> int:
        """Free and cached blocks that may become pages now."""
        return self.num_free - sum(1 for b in self._unsettled if b not in self._refs)

    def take_pages(self, num_pages: int) -> list[int] | None:
        """`num_pages` settled blocks for an adapter's weights, free ones first, then the least
        recently used cached ones (their prefixes forgotten); None (nothing taken) when fewer
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
        for block in list(self._cached):
            if len(pages) == num_pages:
                break
            if block not in self._unsettled:
                del self._cached[block]
                del self._block_of[self._hash_of.pop(block)]
                self._owner.pop(block, None)
                pages.append(block)
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

    # ---- tables -----------------------------------------------------------------------------
    def num_missing(self, seq_id: int, num_tokens: int) -> int:
        """Blocks `seq_id` still lacks to hold `num_tokens` tokens."""
        have = len(self.tables.get(seq_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)  # (blocks_for, inlined: per row)

    def can_grow(self, seq_id: int, num_tokens: int) -> bool:
        return self.num_missing(seq_id, num_tokens) <= self.num_free

    def grow(self, seq_id: int, num_tokens: int) -> list[int]:
        """Extend the table of `seq_id` to cover `num_tokens` tokens; returns the new block ids."""
        new = self.try_grow(seq_id, num_tokens)
        if new is None:
            raise RuntimeError(f"seq {seq_id}: needs {self.num_missing(seq_id, num_tokens)} "
                               f"blocks, {self.num_free} free")
        return new

    def try_grow(self, seq_id: int, num_tokens: int) -> list[int] | None:
        """`grow`, or None (nothing taken) when too few blocks are free: `can_grow` and `grow` in
        one look at the table (the scheduler asks for every row of every step)."""
        table = self.tables.get(seq_id)
        have = 0 if table is None else len(table)
        missing = -(-num_tokens // self.block_size) - have  # (blocks_for, inlined)
        if missing <= 0:  # (most decode steps)
            return []
        if missing > len(self._free) + len(self._cached):
            return None
        new = [self._take() for _ in range(missing)]
        self.tables.setdefault(seq_id, []).extend(new)
        return new

    def can_start(self, hits: list[int], num_tokens: int) -> bool:
        """A new sequence could hold `num_tokens` tokens, its first blocks being `hits`."""
        fresh = blocks_for(num_tokens, self.block_size) - len(hits)
        taken_from_cache = sum(1 for b in hits if b in self._cached)
        return fresh <= self.num_free - taken_from_cache

    def start(self, seq_id: int, hits: list[int], num_tokens: int) -> list[int]:
        """A new sequence's table: the matched blocks `hits` (shared, not copied), then fresh
        ones up to `num_tokens` tokens. Returns the whole table."""
        if seq_id in self.tables:
            raise RuntimeError(f"seq {seq_id} already has a block table")
        for block in hits:
            self._cached.pop(block, None)
            self._refs[block] = self._refs.get(block, 0) + 1
        self.tables[seq_id] = list(hits)
        self.grow(seq_id, num_tokens)
        return list(self.tables[seq_id])

    def free(self, seq_id: int, last_step: int = 0) -> None:
        """Drop `seq_id`'s table (idempotent): its blocks in no other table become free, or
        cached (most recently used) when hashed, unsettled until step `last_step` (the last with
        a row of it; 0: none was sent) is answered. Its last block goes first: eviction then
        takes a chain's tail before its head, which every longer match needs."""
        for block in reversed(self.tables.pop(seq_id, ())):
            refs = self._refs[block] - 1
            if refs:
                self._refs[block] = refs
                continue
            del self._refs[block]
            if last_step:
                self._unsettled[block] = last_step
                heapq.heappush(self._to_settle, (last_step, block))
            if block in self._hash_of:
                self._cached[block] = None
            else:
                self._free.append(block)

    def _take(self) -> int:
        """A block for a table: a free one, else the least recently used cached one."""
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._cached.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
            self._owner.pop(block, None)
        self._refs[block] = 1
        return block

    def check(self) -> None:
        """Assert the invariants (for tests): every block in exactly one state, reference counts
        equal to table membership, the hash maps inverse of each other."""
        counts: dict[int, int] = {}
        for table in self.tables.values():
            for block in table:
                counts[block] = counts.get(block, 0) + 1
        assert counts == self._refs, (counts, self._refs)
        free, cached = set(self._free), set(self._cached)
        assert len(free) == len(self._free) and not free & cached and not free & set(counts)
        assert not cached & set(counts) and cached <= set(self._hash_of)
        assert not free & set(self._hash_of)
        pages = self._pages
        assert not pages & (free | cached | set(counts) | set(self._hash_of))
        assert len(free) + len(cached) + len(counts) + len(pages) == self.num_blocks
        assert set(self._owner) <= set(self._hash_of)
        assert {b: h for h, b in self._block_of.items()} == self._hash_of
