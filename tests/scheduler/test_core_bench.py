"""bench/scheduler_core.py still drives the scheduler as the service does (it breaks with the
core's API otherwise): a few steps at a few rows, as a user runs it."""

import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_the_core_benchmark_runs_against_the_current_core():
    out = subprocess.run([sys.executable, "bench/scheduler_core.py", "--steps", "5", "--rows", "8"],
                         cwd=REPO, capture_output=True, text=True, timeout=120, check=True).stdout
    row = out.splitlines()[-1].strip("|").split("|")
    assert int(row[0]) == 8 and float(row[1]) > 0 and float(row[2]) > 0, out


def test_the_grpc_floor_benchmark_runs():
    out = subprocess.run([sys.executable, "bench/grpc_floor.py", "--round-trips", "5",
                          "--idle-ms", "0", "1"],
                         cwd=REPO, capture_output=True, text=True, timeout=120, check=True).stdout
    rows = [line.strip("|").split("|") for line in out.splitlines()[-2:]]
    assert [float(row[0]) for row in rows] == [0, 1] and all(float(row[1]) > 0 for row in rows), out
