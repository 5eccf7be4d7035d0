"""docs/cli.md shows `loraplex budget`'s output, not figures typed by hand: each ```text block
that starts with `$ loraplex budget ...` holds exactly what that command prints now (issue 46: the
figures in the prose had gone stale). `python -m tests.e2e.test_docs_budget` writes them again."""

import pathlib
import re
import shlex
import subprocess
import sys

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "cli.md"
BLOCK = re.compile(r"^```text\n\$ (loraplex budget [^\n]*)\n(.*?)^```$", re.M | re.S)


def budget_output(command: str) -> str:
    """What `command` (loraplex budget ...) prints, run as a user runs it."""
    done = subprocess.run([sys.executable, "-m", "loraplex.cli", *shlex.split(command)[1:]],
                          capture_output=True, text=True, timeout=120)
    assert not done.stderr, done.stderr
    return done.stdout


def rendered(text: str) -> str:
    """The doc with every budget block holding its command's output."""
    return BLOCK.sub(lambda m: f"```text\n$ {m[1]}\n{budget_output(m[1])}```", text)


def test_the_budget_blocks_are_the_commands_output():
    text = DOC.read_text()
    assert len(BLOCK.findall(text)) >= 3
    assert rendered(text) == text, ("docs/cli.md's budget output is stale: write it again with "
                                    "`.venv/bin/python -m tests.e2e.test_docs_budget`")


def test_weights_above_one_gpu_lead_with_tensor_parallel():
    """Llama 3.1 70B in bf16 (141 GB) on one 80 GiB GPU: the advice is the number of GPUs."""
    out = budget_output("loraplex budget --model random:llama-3-70b --gpu-gib 80")
    (line,) = [line for line in out.splitlines() if "does not fit" in line]
    assert "weights alone are more than one GPU holds" in line
    assert re.search(r"--tensor-parallel (\d+)", line)[1] == "2"


if __name__ == "__main__":
    DOC.write_text(rendered(DOC.read_text()))
