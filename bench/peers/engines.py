"""The engines bench/peers/run.py times, behind one call: `await engine.round(n)` ->
(seconds, greedy token ids per request), request i on adapter a{i mod n} (n = 0: base model).

- WorkerEngine: a peer in a process of its own, spoken to by bench/peers/worker_loop.py's lines.
- Loraplex: the services bench/serving.py starts, through the scheduler's Generate stream.
"""

from __future__ import annotations

import json
import os
import pathlib
import select
import subprocess
import time

import serving

# How long a peer may take to build its engine and warm up (vLLM's imports alone take ~40 s on a
# quiet machine), and one round at most: past either the benchmark stops with the log's tail.
START_TIMEOUT_S = 900.0
ROUND_TIMEOUT_S = 300.0
STOP_GRACE_S = 30.0


class WorkerEngine:
    def __init__(self, name: str, process: subprocess.Popen, log_path: pathlib.Path):
        self.name, self.process, self.log_path = name, process, log_path
        self.description = name

    @classmethod
    def start(cls, name: str, argv: list[str], log_dir: pathlib.Path,
              env: dict[str, str]) -> WorkerEngine:
        """Start the worker and wait for its ready line; RuntimeError with its log's tail when
        it ends or stays silent first."""
        log_path = log_dir / f"{name.replace(' ', '-').lower()}.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=log, env={**os.environ, **env}, text=True)
        engine = cls(name, process, log_path)
        ready = engine._answer(START_TIMEOUT_S)
        engine.description = f"{ready['engine']} ({ready['threads']} torch thread(s))"
        return engine

    def _answer(self, timeout_s: float) -> dict:
        readable, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        line = self.process.stdout.readline() if readable else ""
        if not line:
            self.stop()
            why = "ended" if readable else f"said nothing for {timeout_s:.0f} s"
            raise RuntimeError(f"{self.name} worker {why} (exit code {self.process.returncode});"
                               f" the end of its log:\n{self.log_tail()}")
        return json.loads(line)

    def log_tail(self, num_lines: int = 25) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(line for line in lines[-num_lines:] if line.strip())

    async def round(self, num_adapters: int) -> tuple[float, list[list[int]]]:
        self.process.stdin.write(json.dumps({"op": "round", "adapters": num_adapters}) + "\n")
        self.process.stdin.flush()
        answer = self._answer(ROUND_TIMEOUT_S)
        return answer["seconds"], answer["tokens"]

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.process.stdin.close()
            except (BrokenPipeError, OSError):
                pass
            try:
                self.process.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class Loraplex:
    def __init__(self, stub, prompts: list[list[int]]):
        self.stub, self.prompts = stub, prompts

    def names(self, num_adapters: int) -> list[str]:
        if num_adapters == 0:
            return [""] * len(self.prompts)  # no adapter: the base model
        return serving.adapter_names(len(self.prompts), num_adapters)

    async def warm_up(self, num_adapters: int) -> float:
        """One 1-token request per adapter (each loads it) and one on the base; seconds."""
        start = time.perf_counter()
        await serving.one_token_ttfts(self.stub, ["", *self.names(num_adapters)[:num_adapters]],
                                      self.prompts[0])
        return time.perf_counter() - start

    async def round(self, num_adapters: int) -> tuple[float, list[list[int]]]:
        seconds, gens = await serving.loraplex_round(self.stub, self.prompts,
                                                     self.names(num_adapters))
        return seconds, [g.token_ids for g in gens]
