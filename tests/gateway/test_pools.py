"""The gateway's view of its pools, without schedulers: configuration, the roster file read again
when it changes, names resolved to addresses, and rendezvous hashing of adapters onto cells."""

import collections
import os

import pytest

from gateway.cell_stream import Cell
from gateway.pools import Pool, Pools, parse_pool, read_roster


def test_pool_flags_and_roster_lines(tmp_path):
    assert parse_pool("org/base-7b=a:1, b:2") == ("org/base-7b", ["a:1", "b:2"])
    for bad in ("org/base", "=a:1", "base="):
        with pytest.raises(ValueError, match="--pool"):
            parse_pool(bad)
    roster = tmp_path / "roster"
    roster.write_text("# pools\nbase a:1 b:2  # two cells\n\nother c:3\nbase d:4\n")
    assert read_roster(str(roster)) == {"base": ["a:1", "b:2", "d:4"], "other": ["c:3"]}
    roster.write_text("lonely\n")
    with pytest.raises(ValueError, match="roster:1"):
        read_roster(str(roster))


async def test_the_roster_is_read_again_when_it_changes_and_a_bad_one_is_ignored(tmp_path):
    roster = tmp_path / "roster"
    roster.write_text("base 127.0.0.1:9 localhost:9\n")
    pools = Pools({"fixed": ["127.0.0.1:9"]}, str(roster), rpc_s=0.2)
    try:
        await pools.refresh()
        assert pools.model_ids() == ["base", "fixed"]
        # localhost resolves to an address: one cell, not two
        assert sorted(pools.get("base").cells) == ["127.0.0.1:9"]
        assert not any(c.is_up for c in pools.get("base").cells.values())  # nothing listens
        roster.write_text("other 127.0.0.2:9\n")
        os.utime(roster, ns=(1, 2_000_000_000_000_000_000))  # a new mtime, whatever the clock
        await pools.refresh()
        assert pools.model_ids() == ["fixed", "other"]
        roster.write_text("broken\n")
        os.utime(roster, ns=(1, 3_000_000_000_000_000_000))
        await pools.refresh()
        assert pools.model_ids() == ["fixed", "other"]  # the last good roster still holds
    finally:
        await pools.close()


def up_pool(addresses) -> Pool:
    pool = Pool("base")
    for address in addresses:
        pool.cells[address] = Cell(address, channel=None, stub=None, is_up=True)
    return pool


def test_rendezvous_keeps_adapters_in_place_when_a_cell_comes_or_goes():
    names = [f"adapter-{i}" for i in range(2000)]
    four = up_pool([f"10.0.0.{i}:50051" for i in range(4)])
    before = {n: four.cells_for(n)[0].address for n in names}
    assert set(collections.Counter(before.values()).values()) <= set(range(400, 601))  # ~500 each
    assert all(four.cells_for(n)[0].address == before[n] for n in names[:50])  # stable
    five = up_pool([*four.cells, "10.0.0.9:50051"])
    after = {n: five.cells_for(n)[0].address for n in names}
    moved = [n for n in names if after[n] != before[n]]
    assert all(after[n] == "10.0.0.9:50051" for n in moved)  # only onto the new cell
    assert 300 <= len(moved) <= 500  # about a fifth
    four.cells["10.0.0.0:50051"].is_up = False  # a cell down: only its adapters move
    for n in names:
        if before[n] != "10.0.0.0:50051":
            assert four.cells_for(n)[0].address == before[n]
