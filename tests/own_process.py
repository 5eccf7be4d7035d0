"""Python code run in a process of its own, from the repository root: for what would take the
test process down with it (a stack overflow) or needs a clean interpreter (a package hidden)."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_script(script: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """`python -c script`'s exit status and output (text)."""
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=timeout_s, cwd=ROOT)
