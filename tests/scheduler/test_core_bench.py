"""bench/scheduler_core.py still drives the scheduler as the service does (it breaks with the
core's API otherwise): a few steps at a few rows (no tokens sampled would divide by 0)."""

import asyncio
import math
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import scheduler_core  # noqa: E402


def test_the_core_benchmark_runs_against_the_current_core():
    us = asyncio.run(scheduler_core.us_per_token(rows=8, steps=5))
    assert math.isfinite(us) and us > 0
