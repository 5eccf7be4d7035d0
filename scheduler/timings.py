"""The serving side of the cost-model fit: the log of measured step and load times.

    loraplex serve scheduler ... --timings-out timings.jsonl   (a JSON line per step and per load)
    loraplex fit-cost timings.jsonl                             (prints a [cost] section)

Lines: {"step": executor, "tokens": T, "adapters": D, "seconds": s} for every step (the executor's
own compute time), {"load": executor, "bytes": B, "seconds": s} for every adapter load. The fit
itself is offline, in scheduler/sim/cost_fit.py: serving code never imports the simulator.
"""

import json
from typing import IO


class TimingLog:
    """Appends timing lines to a file (line-buffered: a killed scheduler loses at most one)."""

    def __init__(self, path: str):
        # Open for the process's life, closed by close().
        self._file: IO[str] = open(path, "a", buffering=1)  # noqa: SIM115

    def step(self, executor: str, tokens: int, adapters: int, seconds: float) -> None:
        self._write({"step": executor, "tokens": tokens, "adapters": adapters,
                     "seconds": seconds})

    def load(self, executor: str, num_bytes: int, seconds: float) -> None:
        self._write({"load": executor, "bytes": num_bytes, "seconds": seconds})

    def close(self) -> None:
        self._file.close()

    def _write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
