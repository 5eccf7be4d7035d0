"""A bounded map that forgets its least recently used entry: the caches of compiled grammars,
compile checks, servable adapters and registry answers.

    cache = Lru(64)
    cache.put(key, value)      # the newest; past 64 entries the least recently used goes
    cache.get(key)             # the value (now the most recently used), or None
"""

from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class Lru(Generic[K, V]):
    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"an LRU holds at least one entry, got size {size}")
        self.size = size
        self._entries: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> V:
        self._entries[key] = value
        self._entries.move_to_end(key)
        if len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries
