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

Running example (block_size 4): seq 1 runs tokens [a b c d e f] with table [7, 2] and publishes
block 7 under h1 = H(root, abcd, key). Seq 1 ends: block 2 is free, block 7 cached. Seq 2 with
the same key and tokens [a b c d x] matches [7], takes it (refs 1) plus one free block, and
computes from position 4.
"""

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

    @property
    def num_free(self) -> int:
        """Blocks a sequence can take now: free ones and unreferenced cached ones."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Blocks holding a published prefix, referenced or not."""
        return len(self._hash_of)

    def num_allocated(self) -> int:
        return self.num_blocks - self.num_free

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

    def publish(self, seq_id: int, index: int, block_hash: bytes) -> None:
        """Block `index` of seq_id's table is full and computed: cache it under `block_hash`.
        When another block already holds that hash (two sequences computed the same prefix at
        once), this one stays unhashed and is freed as usual."""
        block = self.tables[seq_id][index]
        if block_hash not in self._block_of and block not in self._hash_of:
            self._block_of[block_hash] = block
            self._hash_of[block] = block_hash

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

    def free(self, seq_id: int) -> None:
        """Drop `seq_id`'s table (idempotent): its blocks in no other table become free, or
        cached (most recently used) when hashed. Its last block goes first: eviction then takes
        a chain's tail before its head, which every longer match needs."""
        for block in reversed(self.tables.pop(seq_id, ())):
            refs = self._refs[block] - 1
            if refs:
                self._refs[block] = refs
                continue
            del self._refs[block]
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
        assert len(free) + len(cached) + len(counts) == self.num_blocks
        assert {b: h for h, b in self._block_of.items()} == self._hash_of
