"""`loraplex up` as a user runs it, for the end-to-end tests: started as its own process on free
ports and a state folder of the test's, read until it says it serves, stopped, and the machine
checked for services it left behind."""

import contextlib
import os
import pathlib
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

from tests.s3server import is_free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = pathlib.Path(sys.executable).parent


def free_base_port() -> int:
    """p with p - 1 .. p + 2 free (gateway, scheduler, store, executor)."""
    for _ in range(200):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            base = sock.getsockname()[1]
        if base < 60000 and all(is_free_port(base + i) for i in (-1, 1, 2)):
            return base
    raise RuntimeError("no free ports")


def lines_of(server: subprocess.Popen) -> queue.Queue:
    """`server`'s stdout lines as they come (None once it closed, for every reader after), read
    by a thread of their own so that every wait on them has a deadline."""
    if not hasattr(server, "lines"):
        server.lines = queue.Queue()

        def read() -> None:
            for line in server.stdout:
                server.lines.put(line)
            server.lines.put(None)

        threading.Thread(target=read, daemon=True).start()
    return server.lines


def read_until(server: subprocess.Popen, prefix: str, timeout_s: float = 180) -> list[str]:
    """The lines `server` printed up to the first that starts with `prefix` (fewer: it ended, or
    timeout_s passed, and the caller's check on the last line fails)."""
    deadline, lines = time.monotonic() + timeout_s, []
    while True:
        try:
            line = lines_of(server).get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return lines
        if line is None:
            lines_of(server).put(None)  # (it stays closed for the next reader: no wait)
            return lines
        lines.append(line)
        if line.startswith(prefix):
            return lines


def wait_serving(server: subprocess.Popen, timeout_s: float = 180) -> list[str]:
    """Until `loraplex up` says it is serving; the lines it printed until then."""
    lines = read_until(server, "serving", timeout_s)
    assert lines and lines[-1].startswith("serving"), "loraplex up did not serve:\n" + \
        "".join(lines)
    return lines


def start_up(*args: str, state: pathlib.Path, base: int, http: int,
             env: dict | None = None) -> subprocess.Popen:
    """`loraplex up ARGS` with its state under `state`, its ports from `base`; stdout and stderr
    together on .stdout, as a terminal shows them."""
    return subprocess.Popen(
        [str(BIN / "loraplex"), "up", *args, "--state-dir", str(state), "--base-port", str(base),
         "--http-port", str(http)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        start_new_session=True, env=env)


@contextlib.contextmanager
def serving(model_dir, state: pathlib.Path):
    """`loraplex up --model DIR` (one executor thread) serving, stopped after: (its base port,
    its HTTP port)."""
    base, http = free_base_port(), free_base_port() + 1
    server = start_up("--model", str(model_dir), "--executor-args", "--threads 1", state=state,
                      base=base, http=http)
    try:
        wait_serving(server)
        yield base, http
    finally:
        stop(server)


def processes_mentioning(*texts: str) -> list[str]:
    """Command lines of the running processes that hold any of `texts`."""
    found = []
    for cmdline in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
        try:
            line = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # exited meanwhile
            continue
        if any(text in line for text in texts) and int(cmdline.parent.name) != os.getpid():
            found.append(f"{cmdline.parent.name}: {line}")
    return found


def wait_gone(*texts: str, timeout_s: float = 30) -> list[str]:
    """processes_mentioning(texts) once none is left, or at timeout_s (what is left then)."""
    deadline = time.monotonic() + timeout_s
    while (left := processes_mentioning(*texts)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def stop(server: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = 60) -> str:
    """Send `sig` to `up`, wait for it to exit; the rest of what it printed."""
    if server.poll() is None:
        server.send_signal(sig)
    server.wait(timeout_s)
    return "".join(read_until(server, "\0", timeout_s))  # (to the end: no line starts so)


def kill_leftovers(*texts: str) -> None:
    """SIGKILL the processes a failed test left (so one failure does not spill into the next)."""
    for line in processes_mentioning(*texts):
        try:
            os.kill(int(line.split(":")[0]), signal.SIGKILL)
        except ProcessLookupError:
            pass
