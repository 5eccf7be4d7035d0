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
