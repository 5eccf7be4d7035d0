"""bench/gpu_check.sh in its CPU smoke mode (tiny shapes, Triton interpreter): the GPU check must
not be first run, and fail, on the rare machine that has a GPU for a few minutes."""

import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)  # ~2-3 min under the interpreter on 2 busy cores: room to spare
def test_gpu_check_smoke_runs_every_section_and_every_check_passes(tmp_path):
    out = tmp_path / "smoke.md"
    env = {**os.environ, "PYTHON": sys.executable, "TRITON_INTERPRET": "1"}
    run = subprocess.run(["bash", "bench/gpu_check.sh", "--smoke", "--out", str(out)], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=540, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = out.read_text()
    for section in ("## 1. Copy bandwidth", "## 2. Kernels vs torch references",
                    "## 3. Executor decode step", "## 4. Adapter load into a slot",
                    "## 5. Paged attention kernel", "## 6. Adapters in pages",
                    "## 7. Kernel timings", "## 8. Sampling", "## 9. MoE"):
        assert section in report
    assert "**FAILED**" not in report
    loads = [line for line in report.splitlines() if line.startswith("| float32 file")]
    assert len(loads) == 1 and loads[0].rstrip().endswith("| yes |")
    assert "loads ran beside it" in report and "Slot bit-exact after them: yes" in report
    checks = [line for line in report.splitlines() if line.startswith(("| bfloat16", "| float16"))]
    assert len(checks) == 16 and all(line.rstrip().endswith("| yes |") for line in checks)
    assert "4 distinct adapters | torch" in report and "4 distinct adapters | triton" in report
    attention = [line for line in report.splitlines() if line.startswith("| paged ")]
    assert len(attention) == 8 and all(line.rstrip().endswith("| yes |") for line in attention)
    assert "| short + 1 long | 196 | 100 |" in report  # the timing table
    assert sum(line.startswith("| decode | ") for line in report.splitlines()) == 4
