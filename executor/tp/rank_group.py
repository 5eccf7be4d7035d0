"""`loraplex serve executor --tensor-parallel N`: N rank processes, one per device, that serve as
one executor, and this process, their supervisor.

    supervisor (this process)
      rank 0      serves the Executor service on --address; tells the other ranks each step,
                  load and unload (executor/tp/followers.py)
      rank 1..N-1 follow rank 0 (executor/tp/follower.py)
    each rank: python -m executor.tp.rank (executor/tp/rank.py), its part of the weights, KV heads
    and adapter pages (executor/tp/shards.py); forward passes meet in torch.distributed collectives.

The group lives and dies as one. When any rank exits (it died; a collective of it failed or timed
out because another rank died or froze; rank 0 went away and its followers with it), the
supervisor kills the others and starts the group again, on the address rank 0 announced (a port
0 becomes the port first bound): the scheduler's Step stream broke with the first death, its
sequences were recomputed elsewhere, and it finds the executor there again. A group that fails
before it ever served (a wrong flag, a model it cannot load) is not restarted: the supervisor
exits with its code, as a one-process executor would. Restarts back off from RESTART_DELAY_S to
MAX_RESTART_DELAY_S while the group keeps failing.

SIGTERM or SIGINT: rank 0 drains (--grace-s) and exits, its followers after it; whatever remains
after the grace and STOP_MARGIN_S is killed. The ranks end when this process is gone (they watch
it), and a freeze of the process group (SIGSTOP) freezes them all.
"""

from __future__ import annotations

import logging
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from executor.config import ExecutorConfig

log = logging.getLogger(__name__)

RESTART_DELAY_S = 1.0
MAX_RESTART_DELAY_S = 30.0
STEADY_S = 60.0  # a group that served this long restarts at once, without back-off
STOP_MARGIN_S = 5.0
POLL_S = 0.1
_ANNOUNCE = re.compile(r"^executor listening on (\S+)$")


class _Group:
    """One start of the N rank processes."""

    def __init__(self, world: int, argv: list[str], address: str) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="loraplex-ranks-"))
        self.address: str | None = None  # what rank 0 announced
        self.started = time.monotonic()
        pairs = [socket.socketpair() for _ in range(world - 1)]  # rank 0 <-> rank r
        flags = [*argv, "--address", address]  # (the last --address wins)
        self.ranks: list[subprocess.Popen] = []
        try:
            for rank in range(world):
                ends = [a for a, _ in pairs] if rank == 0 else [pairs[rank - 1][1]]
                fds = [end.fileno() for end in ends]
                self.ranks.append(subprocess.Popen(
                    [sys.executable, "-m", "executor.tp.rank", str(rank),
                     str(self.folder / "store"), ",".join(map(str, fds)), "--", *flags],
                    pass_fds=fds, stdout=subprocess.PIPE if rank == 0 else None, text=True))
        finally:
            for end in (e for pair in pairs for e in pair):
                end.close()  # (the ranks hold their own)
        log.info("ranks started: %s", ", ".join(f"{r}: pid {p.pid}"
                                                for r, p in enumerate(self.ranks)))
        threading.Thread(target=self._relay, args=(self.ranks[0].stdout,), daemon=True).start()

    def _relay(self, stdout) -> None:
        """Rank 0's stdout is this process's: its announcement, which names the address."""
        for line in stdout:
            match = _ANNOUNCE.match(line.strip())
            if match:
                self.address = match[1]
            print(line, end="", flush=True)

    def exited(self) -> dict[int, int]:
        """rank -> exit code of the ranks that have exited."""
        return {rank: process.returncode for rank, process in enumerate(self.ranks)
                if process.poll() is not None}

    def stop(self, grace_s: float) -> None:
        """SIGTERM rank 0 (it drains; its followers end after it), then kill what remains."""
        self.ranks[0].send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for process in self.ranks:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        for process in self.ranks:
            if process.poll() is None:
                process.kill()
        for process in self.ranks:
            process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def supervise(config: ExecutorConfig, argv: list[str]) -> int:
    """Run the group of config.tensor_parallel ranks until SIGTERM/SIGINT; the exit code."""
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    address, delay, has_served = config.address, RESTART_DELAY_S, False
    while True:
        group = _Group(config.tensor_parallel, argv, address)
        while not stopping.is_set() and not (ended := group.exited()):
            time.sleep(POLL_S)
        if stopping.is_set():
            group.stop(config.grace_s + STOP_MARGIN_S)
            return 0
        time.sleep(POLL_S)  # (the ranks that end with it, to name them all)
        ended = group.exited()
        group.kill()
        which = ", ".join(f"rank {rank} exited with {code}" for rank, code in ended.items())
        has_served = has_served or group.address is not None
        if not has_served:
            log.error("%s before the group served: not restarted", which)
            return next((code for code in ended.values() if code), 1)
        address = group.address or address
        if time.monotonic() - group.started > STEADY_S:
            delay = RESTART_DELAY_S
        log.warning("%s: the group restarts in %.1fs", which, delay)
        if stopping.wait(delay):
            return 0
        delay = min(2 * delay, MAX_RESTART_DELAY_S)
