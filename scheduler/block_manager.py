"""KV block accounting for one executor. The scheduler owns block tables; the executor mirrors
them."""

from collections import deque


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` tokens of KV."""
    return -(-num_tokens // block_size)


class BlockManager:
    """Free list of physical KV block ids and the block table of each sequence.

    Predicates come in pairs with their actions: `can_grow`/`grow`.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("need num_blocks >= 1 and block_size >= 1, got "
                             f"{num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self.tables: dict[int, list[int]] = {}  # seq_id -> block ids, in position order

    @property
    def num_free(self) -> int:
        return len(self._free)

    def num_missing(self, seq_id: int, num_tokens: int) -> int:
        """Blocks `seq_id` still lacks to hold `num_tokens` tokens."""
        have = len(self.tables.get(seq_id, ()))
        return max(0, blocks_for(num_tokens, self.block_size) - have)

    def can_grow(self, seq_id: int, num_tokens: int) -> bool:
        return self.num_missing(seq_id, num_tokens) <= len(self._free)

    def grow(self, seq_id: int, num_tokens: int) -> list[int]:
        """Extend the table of `seq_id` to cover `num_tokens` tokens; returns the new block ids."""
        missing = self.num_missing(seq_id, num_tokens)
        if missing > len(self._free):
            raise RuntimeError(f"seq {seq_id}: needs {missing} blocks, {len(self._free)} free")
        new = [self._free.popleft() for _ in range(missing)]
        self.tables.setdefault(seq_id, []).extend(new)
        return new

    def free(self, seq_id: int) -> None:
        """Return every block of `seq_id` (idempotent)."""
        self._free.extend(self.tables.pop(seq_id, ()))

    def num_allocated(self) -> int:
        return self.num_blocks - len(self._free)
