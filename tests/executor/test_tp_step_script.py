"""bench/tp_step.sh in its CPU smoke mode (gloo ranks, the tiny model): the tensor-parallel step
timing must not be first run, and fail, on the rare machine that has GPUs for a few minutes."""

import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_tp_step_smoke_times_one_and_two_ranks_and_names_what_it_skipped(tmp_path):
    out = tmp_path / "tp.md"
    env = {**os.environ, "PYTHON": sys.executable}
    run = subprocess.run(["bash", "bench/tp_step.sh", "--smoke", "--ranks", "1,2,16", "--out",
                          str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [line.split(" | ") for line in out.read_text().splitlines()
            if line.startswith(("| 1 |", "| 2 |"))]
    assert [(r[0], r[1]) for r in rows] == [
        (f"| {n}", batch) for n in (1, 2)
        for batch in ("base only", "1 adapter (all rows)", "4 distinct adapters")]
    assert all(r[-1] == "4/4 |" for r in rows), "two ranks sample one rank's greedy tokens"
    assert "Not measured: 16 ranks" in out.read_text()
