"""One rank process of a tensor-parallel executor, as executor/tp/rank_group.py starts it:

    python -m executor.tp.rank RANK STORE_FILE FD[,FD...] -- <the executor's flags>

It joins the group at STORE_FILE (torch.distributed: NCCL on CUDA, gloo on CPU; rank r on
cuda:r), loads its part of the weights, and then rank 0 serves the Executor service (its FDs: the
sockets to ranks 1, 2, ...), any other rank follows rank 0's commands (its FD: the socket from
rank 0) until rank 0 is gone. A broken collective, rank 0 gone, or the supervisor gone ends the
process: the supervisor restarts the group as one.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import NoReturn

from common.allocator import keep_freed_memory
from common.server import configure_logging, run
from executor.config import ExecutorConfig
from executor.service import build_runner, serve
from executor.tp.collectives import TensorParallel, rank_device
from executor.tp.follower import follow

log = logging.getLogger(__name__)

EXIT_GROUP_BROKEN = 3  # a collective failed or timed out, or a rank went silent
PARENT_POLL_S = 1.0  # how often a rank looks whether its supervisor is still there


def _group_broken(err: Exception) -> NoReturn:
    """Another rank died or froze: this one ends too, and the group is started anew."""
    log.error("the tensor-parallel group broke (%s): this rank exits", err)
    logging.shutdown()
    os._exit(EXIT_GROUP_BROKEN)


def _exit_with_parent() -> None:
    """A rank outlives no supervisor (one SIGKILLed leaves no one to stop the group)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(EXIT_GROUP_BROKEN)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv or argv.index("--") != 3:
        sys.exit("usage: python -m executor.tp.rank RANK STORE_FILE FD[,FD...] -- <executor flags>")
    rank, store_file, fds = int(argv[0]), argv[1], [int(fd) for fd in argv[2].split(",")]
    configure_logging(f"executor-rank{rank}")
    _exit_with_parent()
    config = ExecutorConfig.from_args(argv[4:])
    device = rank_device(config.device, rank, config.tensor_parallel)
    if device.type == "cuda":
        import torch

        torch.cuda.set_device(device)
    tp = TensorParallel.join(rank, config.tensor_parallel, store_file, device=device,
                             timeout_s=config.rank_timeout_s, on_broken=_group_broken)
    channels = [Connection(fd) for fd in fds]
    if rank == 0:
        keep_freed_memory()
        run(lambda: serve(config, tp, channels))
        return
    for sig in (signal.SIGTERM, signal.SIGINT):  # (rank 0 drains; this rank ends after it)
        signal.signal(sig, signal.SIG_IGN)
    runner, _ = build_runner(config, tp)
    log.info("rank %d of %d: ready", rank, tp.world)
    follow(runner, channels[0], config.rank_timeout_s, _group_broken)


if __name__ == "__main__":
    main()
