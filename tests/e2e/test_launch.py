"""The launcher's failure path: a fleet whose executors cannot start raises the error their logs
give, having stopped every service it started (tiers start at once: loraplex/launch.py)."""

import pathlib

import pytest

from loraplex.launch import Fleet


def processes_mentioning(text: str) -> list[int]:
    pids = []
    for cmdline in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text.encode() in cmdline.read_bytes():
                pids.append(int(cmdline.parent.name))
        except OSError:  # exited meanwhile
            continue
    return pids


def test_a_fleet_whose_executors_fail_raises_and_leaves_nothing_running(tmp_path):
    store_url = (tmp_path / "store-of-this-test").as_uri()
    fleet = Fleet(model=str(tmp_path / "no-such-model"), store_url=store_url,
                  log_dir=tmp_path / "logs", num_executors=2, num_stores=2)
    with pytest.raises(RuntimeError, match="executor-[01] exited with .* before listening"):
        fleet.start()
    assert fleet.services == []
    assert processes_mentioning(store_url) == []  # both stores were started, and stopped
