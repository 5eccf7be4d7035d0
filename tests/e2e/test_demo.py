"""`make demo`'s main job, as a newcomer runs it from the README's first block (`make demo`, with
fewer requests): every service as a process, the workload over gRPC and through the gateway's
OpenAI API, and every adapter answering its task. The block's `make test` is this suite itself:
what it would run is checked, not run."""

import os
import pathlib
import re
import subprocess
import sys

from tests.e2e.test_readme_gateway import ROOT, readme_blocks

VENV = pathlib.Path(sys.executable).parent.parent


def make_targets() -> list[str]:
    """The targets of the README's `make ...` lines."""
    (block,) = [text for section, _, text in readme_blocks() if section == "## The two commands"]
    lines = [line.split("#")[0].split() for line in block.splitlines() if line.strip()]
    assert all(words[0] == "make" and len(words) == 2 for words in lines), block
    return [words[1] for words in lines]


def make(target: str, *flags: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`make TARGET` with this test's virtual environment (installed already: its stamp is taken
    as up to date, so nothing is installed). Run as a newcomer runs it: under CI's `make test` this
    suite is itself inside a make, whose level and flags would make this one a sub-make (printing
    "Entering directory" lines); they are left out."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    return subprocess.run(["make", "-o", f"{VENV}/.installed", f"VENV={VENV}", target, *flags],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def test_the_readmes_make_lines_are_demo_and_test():
    assert make_targets() == ["demo", "test"]
    dry = make("test", "-n")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.split("\n")[:2] == [f"{VENV}/bin/ruff check .", f"{VENV}/bin/python -m "
                                          "pytest -q"], dry.stdout


def test_the_demo_runs_and_its_adapters_answer_through_both_faces():
    done = make("demo", "DEMO_ARGS=--requests 32", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "all services stopped." in out
    faces = dict(re.findall(r"through (gRPC|the gateway's OpenAI)\D*(\d+) requests", out))
    assert int(faces["gRPC"]) > 0 and int(faces["the gateway's OpenAI"]) > 0
    exact = re.findall(r"(\d+) of (\d+) adapter answers exact", out)
    assert all(int(got) >= 0.8 * int(of) for got, of in exact), out[-2000:]
    # Every answer that was not exact is shown, with what it should have been (trip 17).
    table = re.findall(r"^(\S+(?: \S+)*?) +(\d+) +(\d+) \( *\d+%\)$", out, re.M)
    wrong = sum(int(requests) - int(got) for _, requests, got in table)
    assert table, out
    shown = re.findall(r"^  .* -> .*, expected .* \[(grpc|openai)\]$", out, re.M)
    assert len(shown) == wrong, out[-3000:]
    assert (f"answers that were not exact ({wrong}):" in out) if wrong else \
        ("every answer was exact." in out)
