"""common/lru.py: the least recently used entry goes first, a read counts as a use."""

import pytest

from common.lru import Lru


def test_the_least_recently_used_goes_and_a_read_is_a_use():
    cache = Lru(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # now b is the least recently used
    cache.put("c", 3)
    assert "b" not in cache and cache.get("a") == 1 and cache.get("c") == 3 and len(cache) == 2
    assert cache.put("a", 4) == 4 and cache.get("a") == 4  # (a new value, the newest again)
    cache.put("d", 5)
    assert "c" not in cache and "a" in cache
    assert cache.get("missing") is None


def test_an_lru_holds_at_least_one_entry():
    with pytest.raises(ValueError, match="at least one"):
        Lru(0)
