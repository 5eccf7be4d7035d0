"""The engines bench/peers/run.py times, behind one call: `await engine.round(n)` ->
(seconds, greedy token ids per request), request i on adapter a{i mod n} (n = 0: the base
model); `timed` adds the CPU seconds of the engine's processes (and their children) during the
round, user + system time from /proc: on shared cores it counts the work, not the wait for a core,
and the CPU seconds the other engines' processes took meanwhile. A peer idle between its rounds
is paused (SIGSTOP) while another engine runs one: vLLM's engine core and worker poll while they
wait for work, and on these 2 cores took CPU from whichever engine was timed.

- WorkerEngine: a peer in a process of its own, spoken to by bench/peers/worker_loop.py's lines.
- Loraplex: the services bench/serving.py starts, its requests sent to the scheduler on one Stream
  (as the gateway sends them: a message per step carries every request's tokens), or each on a
  Generate stream of its own (as loraplex.client does: a message per token).
"""

from __future__ import annotations

import json
import os
import pathlib
import select
import signal
import subprocess
import time

import serving

# How long a peer may take to build its engine and warm up (vLLM's imports alone take ~40 s on a
# quiet machine), and one round at most: past either the benchmark stops with the log's tail.
START_TIMEOUT_S = 900.0
ROUND_TIMEOUT_S = 300.0
STOP_GRACE_S = 30.0


def process_tree(pid: int) -> list[int]:
    """pid and its living descendants."""
    children: dict[int, list[int]] = {}
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # ended meanwhile
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes (all their threads) so far."""
    ticks = 0
    for pid in pids:
        try:
            fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


async def timed(engine, num_adapters: int,
                others: list) -> tuple[float, list[list[int]], float, dict, float]:
    """One round of an engine, the `others` idle beside it (peers paused meanwhile): (seconds,
    tokens, CPU seconds of all its processes, CPU seconds of each of them by name, CPU seconds
    of the others' processes)."""
    pids = engine.pids()
    other_pids = [pid for other in others for pid in other.pids().values()
                  if pid not in pids.values()]  # (two ways into the same services: not others)
    before = {label: cpu_seconds([pid]) for label, pid in pids.items()}
    others_before = cpu_seconds(other_pids)
    paused = [other for other in others if isinstance(other, WorkerEngine)]
    for other in paused:
        other.signal(signal.SIGSTOP)
    try:
        seconds, tokens = await engine.round(num_adapters)
    finally:
        for other in paused:
            other.signal(signal.SIGCONT)
    cpu = {label: cpu_seconds([pid]) - before[label] for label, pid in pids.items()}
    return seconds, tokens, sum(cpu.values()), cpu, cpu_seconds(other_pids) - others_before


def process_name(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "ended"


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

    def pids(self) -> dict[str, int]:
        """The worker (the front end) and every process under it, by its name (15 characters)."""
        root, *children = process_tree(self.process.pid)
        named = {"front end": root}
        for pid in children:
            name = process_name(pid).removeprefix("VLLM::").replace("EngineCor", "engine core")
            named[name if name not in named else f"{name} {pid}"] = pid
        return named

    def signal(self, signum: int) -> None:
        """Send `signum` to the worker and every process under it."""
        for pid in process_tree(self.process.pid):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass  # ended meanwhile

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
    def __init__(self, stub, prompts: list[list[int]], pids: dict[str, int], *, stream: bool):
        self.stub, self.prompts, self.service_pids, self.stream = stub, prompts, pids, stream

    def pids(self) -> dict[str, int]:
        """The services' processes by name (store, executor, scheduler), not this client's."""
        return self.service_pids

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
        names = self.names(num_adapters)
        if self.stream:
            return await serving.loraplex_stream_round(self.stub, self.prompts, names)
        seconds, gens = await serving.loraplex_round(self.stub, self.prompts, names)
        return seconds, [g.token_ids for g in gens]
