"""Executor discovery: static addresses, DNS names (all their addresses), rosters in files."""

import pytest

from scheduler.discovery import resolve


def test_static_dns_and_file_specs(tmp_path):
    roster = tmp_path / "executors.txt"
    roster.write_text("10.0.0.1:50053\n# drained: 10.0.0.2:50053\n\n10.0.0.3:50053  # new\n")
    found = resolve(["127.0.0.1:7000", "dns:///localhost:50053", roster.as_uri()])
    assert {"127.0.0.1:7000", "10.0.0.1:50053", "10.0.0.3:50053"} <= found
    assert "127.0.0.1:50053" in found or "[::1]:50053" in found
    assert "10.0.0.2:50053" not in found


def test_missing_roster_and_unknown_name_mean_no_executors(tmp_path):
    assert resolve([(tmp_path / "none.txt").as_uri(), "dns:///no-such-host.invalid:50053"]) == set()


def test_malformed_dns_spec_is_refused():
    with pytest.raises(ValueError, match="dns:///name:port"):
        resolve(["dns:///localhost"])
