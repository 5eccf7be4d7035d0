"""The line protocol between bench/peers/run.py and a peer engine's worker process (stdlib only:
the vLLM worker runs in a virtual environment of its own, without loraplex).

The worker reads one JSON object per line on stdin and answers one per line:

    {"op": "round", "adapters": N}  ->  {"seconds": s, "tokens": [[id, ...], ...]}
    {"op": "quit"}                   ->  (the worker exits)

A round generates MAX_NEW_TOKENS greedy tokens for every prompt at once, request i on adapter
a{i mod N} (N = 0: the base model alone), and times that call alone. Before its first line the
worker prints {"ready": true, ...} once its engine is built and every adapter has been used once.
Answers go to the process's original stdout; everything else the engine prints is sent to stderr
(the run's log), so a library's print cannot break the protocol.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

MAX_NEW_TOKENS = 32


@dataclass(frozen=True)
class Setup:
    """What every engine is given, from the worker's command line."""

    model_dir: str
    adapter_dir: str  # PEFT folders adapter_dir/a0 .. a{num_adapters-1}
    prompts: list[list[int]]  # token ids, no BOS
    num_adapters: int  # the most distinct adapters a round asks for

    @classmethod
    def from_argv(cls, argv: list[str]) -> Setup:
        """argv: MODEL_DIR ADAPTER_DIR PROMPTS_JSON NUM_ADAPTERS."""
        model_dir, adapter_dir, prompts_path, num_adapters = argv
        with open(prompts_path) as f:
            prompts = json.load(f)
        return cls(model_dir, adapter_dir, prompts, int(num_adapters))

    def adapter_names(self, num_adapters: int) -> list[str | None]:
        """The adapter of each request; None for the base model."""
        if num_adapters == 0:
            return [None] * len(self.prompts)
        return [f"a{i % num_adapters}" for i in range(len(self.prompts))]


def protocol_out():
    """The process's stdout, kept for the protocol; fd 1 then points at stderr, so what the engine
    (and any child process it starts) prints goes to the log. Call it before building the engine."""
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return out


def serve(out, run_round: Callable[[list[str | None]], tuple[float, list[list[int]]]],
          setup: Setup, ready: dict) -> None:
    """Say ready, then answer round requests on stdin until quit or end of input."""
    out.write(json.dumps({"ready": True, **ready}) + "\n")
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "quit":
            return
        seconds, tokens = run_round(setup.adapter_names(request["adapters"]))
        out.write(json.dumps({"seconds": seconds, "tokens": tokens}) + "\n")
        out.flush()
