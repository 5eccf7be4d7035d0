"""The serving side of the cost-model fit: the log of measured step and load times.

    loraplex serve scheduler ... --timings-out timings.jsonl   (a JSON line per step and per load)
    loraplex fit-cost timings.jsonl                             (prints a [cost] section)

Lines: {"step": executor, "tokens": T, "adapters": D, "seconds": s, ...} for every step, and
{"load": executor, "bytes": B, "seconds": s} for every adapter load. A step's line also says where
the scheduler's time around it went (bench/serving.py reads them for the executor's idle share):

    seconds       the executor's own compute time (what the cost model fits)
    plan_s        the scheduler planning and sending it (core.schedule, the stream write)
    wait_s        the scheduler waiting for its answer (steps are pipelined: the executor may
                  have answered before the scheduler asked)
    done_s        the scheduler taking in its samples (core.on_step_done: tokens out to clients)
    at            wall clock (time.time()) when the scheduler was done with it

The fit itself is offline, in scheduler/sim/cost_fit.py: serving code never imports the simulator.
"""

import json
import time
from typing import IO


class TimingLog:
    """Appends timing lines to a file (line-buffered: a killed scheduler loses at most one)."""

    def __init__(self, path: str):
        # Open for the process's life, closed by close().
        self._file: IO[str] = open(path, "a", buffering=1)  # noqa: SIM115

    def step(self, executor: str, tokens: int, adapters: int, seconds: float, *,
             plan_s: float = 0.0, wait_s: float = 0.0, done_s: float = 0.0) -> None:
        self._write({"step": executor, "tokens": tokens, "adapters": adapters,
                     "seconds": seconds, "plan_s": plan_s, "wait_s": wait_s,
                     "done_s": done_s, "at": time.time()})

    def load(self, executor: str, num_bytes: int, seconds: float) -> None:
        self._write({"load": executor, "bytes": num_bytes, "seconds": seconds})

    def close(self) -> None:
        self._file.close()

    def _write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
