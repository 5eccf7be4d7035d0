"""Section 10 of bench/gpu_check.sh (bench/gpu_quant.py) in its CPU smoke mode, alone: every
format's kernel matches its reference under the Triton interpreter, so the section is not first
run, and fail, on the rare machine that has a GPU for a few minutes."""

import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_the_quantized_gemm_section_runs_and_every_check_passes(tmp_path):
    out = tmp_path / "smoke.md"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "bench/gpu_quant.py", "--smoke", "--out", str(out)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = out.read_text()
    assert "## 10. Quantized GEMM" in report and "**FAILED**" not in report
    checks = [line for line in report.splitlines() if line.startswith("| gate_up | 4 |")]
    assert len(checks) == 6 and all(line.rstrip().endswith("| yes |") for line in checks)
