"""The README's five-minute tour, run as written (only the ports and the state folder moved, so
the test needs no fixed free port): `loraplex up` on the demo model, an adapter push, the CLI
against the store and the scheduler, curl against the gateway's OpenAI API, the openai client
snippet; then `loraplex up` stops every service it started."""

import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

from tests.s3server import is_free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = pathlib.Path(sys.executable).parent


def section_blocks() -> tuple[list[str], str]:
    """(the bash block's commands, continuation lines joined; the python block)."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## A five-minute tour"):]
    section = section[:section.index("\n## ", 1)]
    bash = re.search(r"```bash\n(.*?)```", section, re.S)[1].replace("\\\n", " ")
    python = re.search(r"```python\n(.*?)```", section, re.S)[1]
    return [line.strip() for line in bash.splitlines() if line.strip()], python


def free_base_port() -> int:
    """p with p - 1 .. p + 2 free (gateway, scheduler, store, executor)."""
    for _ in range(200):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            base = sock.getsockname()[1]
        if base < 60000 and all(is_free_port(base + i) for i in (-1, 1, 2)):
            return base
    raise RuntimeError("no free ports")


def wait_serving(server: subprocess.Popen, timeout_s: float = 180) -> None:
    """Until `loraplex up` says it is serving (or timeout_s passed); it must still run."""
    deadline = time.monotonic() + timeout_s
    for line in server.stdout:
        if line.startswith("serving") or time.monotonic() > deadline:
            break
    assert server.poll() is None, "loraplex up exited"


def test_the_readme_tour_works(tmp_path):
    commands, snippet = section_blocks()
    base, http = free_base_port(), free_base_port() + 1

    def localize(command: str) -> str:
        return (command.replace(".venv/bin/", f"{BIN}/")
                .replace("~/.local/state/loraplex", str(tmp_path))
                .replace("127.0.0.1:8000", f"127.0.0.1:{http}"))

    up, *rest = commands
    assert " up " in up and up.endswith(" &")
    server = subprocess.Popen(
        [*localize(up.removesuffix(" &")).split(), "--state-dir", str(tmp_path),
         "--base-port", str(base), "--http-port", str(http)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        start_new_session=True)
    try:
        wait_serving(server)
        env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
        outputs = []
        for command in rest:
            if "loraplex adapters" in command:
                command += f" --store 127.0.0.1:{base + 1}"
            elif "loraplex generate" in command or "loraplex admin" in command:
                command += f" --scheduler 127.0.0.1:{base}"
            done = subprocess.run(localize(command), shell=True, capture_output=True, text=True,
                                  timeout=120, cwd=ROOT, env=env)
            assert done.returncode == 0, (command, done.stdout, done.stderr)
            outputs.append((command, done.stdout))
        by_adapter = [out for command, out in outputs if "generate --adapter" in command]
        assert by_adapter and all(out.strip() == "stone river quiet" for out in by_adapter)
        completions = [out for command, out in outputs if "/v1/completions" in command]
        assert completions and all('"text_completion"' in out and '"finish_reason"' in out
                                   for out in completions)
        models = [out for command, out in outputs if "/v1/models" in command]
        assert models and all('"reverse-words"' in out for out in models)
        done = subprocess.run([sys.executable, "-c", localize(snippet)], capture_output=True,
                              text=True, timeout=120, cwd=ROOT)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "stone river quiet"
    finally:
        server.send_signal(signal.SIGTERM)
        server.send_signal(signal.SIGTERM)  # a second one must not leave services behind
        server.wait(60)
    leftover = [pid for pattern in (f"127.0.0.1:{base}", str(tmp_path))  # scheduler and gateway;
                for pid in subprocess.run(["pgrep", "-f", pattern],  # store and executor
                                          capture_output=True, text=True).stdout.split()]
    assert not leftover, f"services left running: {leftover}"
