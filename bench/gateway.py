"""It must not cost (issue 14): the gateway against its pool's scheduler, on the same workload.

    .venv/bin/python bench/gateway.py [--quick] [--concurrency 1,8,32] [--cycles 5] [--round-s 2]
                                      [--profile-s 6] [--no-native] [--out [PATH]]

Real processes with keys on (FleetKeys): an adapter store on local files, one CPU executor
(`--threads 1`) with the demo model, a scheduler, and a gateway in front of that one pool
(start_gateway). One tenant streams greedy requests (held-out prompts of two demo adapters' tasks,
32 new tokens each, EOS ignored) from C closed-loop streams at once, along these paths:

    direct          gRPC Generate to the scheduler
    gateway gRPC    gRPC Generate to the gateway: the same request, the same key
    gateway SSE     POST /v1/completions with stream: true to the gateway, read as raw
                    server-sent events (aiohttp, one json.loads per event)
    gateway openai  the same through the official openai.AsyncOpenAI client (max_retries=0)

Rounds alternate: direct, a gateway path, direct, the next gateway path, ...; each gateway round
is compared with the direct round just before it, so other work on these CPUs hits both sides of
a pair. Measured per streamed token: time to first token (TTFT), inter-token latency (ITL: the gap
between a token's arrival and the previous one's in its stream), and the round's tokens/s (tokens
arriving from half a second after its start to its end, over that time; streams still open at
the end finish uncounted before the next round). CPU seconds of every process over each round
give what each path costs per token. Then py-spy (if installed) records the gateway at the
largest concurrency, per face (gRPC, SSE): Python frames live, then with native frames.

Every process, this one included, shares this machine's CPUs: the gateway's CPU is taken from the
executor's, which a separate gateway host would not do. Read the ratios of one run, not absolutes.
"""

import argparse
import asyncio
import datetime
import importlib.metadata
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import aiohttp
import gateway_profile
import openai
from gateway_records import (
    GOAL_ADDED_MS,
    GOAL_RATIO,
    Round,
    Stream,
    cpu_table,
    findings,
    latency_table,
)
from stream_measures import cpu_seconds

from common.server import insecure_channel, run
from loraplex import client, demo
from loraplex.demo_tasks import TASKS_BY_NAME, held_out
from loraplex.launch import Fleet, FleetKeys, ServiceProcess, start_gateway
from protos import scheduler_pb2_grpc

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "gateway-cpu.md"
ADAPTERS = ("reverse-words", "rotate-words")
PROMPTS_PER_ADAPTER = 8
MAX_NEW_TOKENS = 32
DEADLINE_S = 60.0  # every stream's deadline
EXECUTOR = ["--threads", "1", "--adapter-slots", str(len(ADAPTERS))]
LAYERS = ("gateway", "scheduler", "common", "protos")  # the code on the measured paths


# ----- the paths: each streams one request, appending each token's arrival time and text -----

class GrpcPath:
    def __init__(self, name: str, address: str, key: str):
        self.name = name
        self._channel = insecure_channel(address)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._metadata = client.metadata(key)

    async def stream(self, adapter: str, prompt: str, times: list[float], texts: list[str]):
        request = client.generate_request(adapter, prompt, MAX_NEW_TOKENS, ignore_eos=True)
        async for message in self._stub.Generate(request, metadata=self._metadata,
                                                 timeout=DEADLINE_S):
            if message.HasField("token_id"):
                times.append(time.perf_counter())
                texts.append(message.text)

    async def close(self) -> None:
        await self._channel.close()


class SsePath:
    """The OpenAI streaming endpoint read with as little client work as a client can do."""

    def __init__(self, name: str, http: str, key: str):
        self.name = name
        self._session = aiohttp.ClientSession(
            f"http://{http}", headers={"Authorization": f"Bearer {key}"},
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=DEADLINE_S))

    async def stream(self, adapter: str, prompt: str, times: list[float], texts: list[str]):
        body = {"model": adapter, "prompt": prompt, "max_tokens": MAX_NEW_TOKENS,
                "temperature": 0, "stream": True, "ignore_eos": True}
        async with self._session.post("/v1/completions", json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"{self.name}: HTTP {response.status}: "
                                   f"{await response.text()}")
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue  # blank separators, data: [DONE]
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"{self.name}: error event: {event['error']}")
                choice = event["choices"][0]
                if choice["finish_reason"] is None:  # the finish event carries no token
                    times.append(time.perf_counter())
                    texts.append(choice["text"])

    async def close(self) -> None:
        await self._session.close()


class OpenAIPath:
    def __init__(self, name: str, http: str, key: str):
        self.name = name
        self._api = openai.AsyncOpenAI(base_url=f"http://{http}/v1", api_key=key,
                                       max_retries=0, timeout=DEADLINE_S)

    async def stream(self, adapter: str, prompt: str, times: list[float], texts: list[str]):
        chunks = await self._api.completions.create(
            model=adapter, prompt=prompt, max_tokens=MAX_NEW_TOKENS, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        async for chunk in chunks:
            if chunk.choices and chunk.choices[0].finish_reason is None:
                times.append(time.perf_counter())
                texts.append(chunk.choices[0].text)

    async def close(self) -> None:
        await self._api.close()


async def run_round(path, concurrency: int, seconds: float, work: list[tuple[str, str]],
                    pids: dict[str, int], pair: Round | None = None) -> Round:
    """`concurrency` closed loops, each streaming request after request until `seconds`."""
    cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    client_before = time.process_time()
    start = time.perf_counter()
    end = start + seconds
    streams: list[Stream] = []

    async def loop(i: int) -> None:
        while time.perf_counter() < end:
            adapter, prompt = work[i % len(work)]
            i += concurrency
            stream = Stream(time.perf_counter())
            streams.append(stream)
            await path.stream(adapter, prompt, stream.times, [])

    await asyncio.gather(*(loop(i) for i in range(concurrency)))
    cpu = {name: cpu_seconds(pid) - cpu_before[name] for name, pid in pids.items()}
    cpu["client"] = time.process_time() - client_before
    return Round(path.name, concurrency, start, end, streams, cpu, pair)


async def same_answers(direct, paths, work: list[tuple[str, str]]) -> list[str]:
    """Greedy text of one prompt per adapter along every path; the paths that differ."""
    differ = []
    for adapter, prompt in {a: (a, p) for a, p in work}.values():
        want: list[str] = []
        await direct.stream(adapter, prompt, [], want)
        for path in paths:
            got: list[str] = []
            await path.stream(adapter, prompt, [], got)
            if "".join(got) != "".join(want) or len(got) != MAX_NEW_TOKENS:
                differ.append(f"{path.name} on {adapter}: {''.join(got)!r} ({len(got)} tokens) "
                              f"vs direct {''.join(want)!r} ({len(want)} tokens)")
    return differ


async def measure(fleet: Fleet, gateway: ServiceProcess, key: str, args) -> dict:
    for name in ADAPTERS:
        await client.push_adapter(fleet.stores[0], demo.adapter_dir(name), name, key=key)
    prompts = {a: [p for p, _ in held_out(TASKS_BY_NAME[a], PROMPTS_PER_ADAPTER)]
               for a in ADAPTERS}
    work = [(a, prompts[a][i]) for i in range(PROMPTS_PER_ADAPTER) for a in ADAPTERS]
    pids = {s.name: s.process.pid for s in [gateway, *fleet.services]}
    http = gateway.announced["gateway-http"]
    direct = GrpcPath("direct", fleet.scheduler, key)
    paths = [GrpcPath("gateway gRPC", gateway.address, key), SsePath("gateway SSE", http, key),
             OpenAIPath("gateway openai", http, key)]
    paths = [p for p in paths if p.name.split()[-1] in args.paths]
    rounds: list[Round] = []
    profiles = []
    try:
        differ = await same_answers(direct, paths, work)
        for path in [direct, *paths]:  # warm-up: connections, adapters, caches
            await run_round(path, 8, 1.0, work, pids)
        for c in args.concurrency:
            for cycle in range(args.cycles):
                for path in paths[cycle % len(paths):] + paths[:cycle % len(paths)]:
                    base = await run_round(direct, c, args.round_s, work, pids)
                    rounds += [base, await run_round(path, c, args.round_s, work, pids, base)]
            print(f"  {c} streams: done", flush=True)
        if args.profile_s:
            for path in [p for p in paths if p.name != "gateway openai"]:
                for native in (False, True)[:1 + args.native]:
                    profiles.append(await profile(path, gateway, native, work, pids, args))
    finally:
        for path in [direct, *paths]:
            await path.close()
    return dict(rounds=rounds, differ=differ, profiles=profiles, work=work,
                code=code_under_test())


async def profile(path, gateway: ServiceProcess, native: bool, work: list[tuple[str, str]],
                  pids: dict[str, int], args) -> gateway_profile.Profile:
    """py-spy on the gateway while `path` runs at the largest concurrency."""
    streams = max(args.concurrency)
    load = asyncio.create_task(run_round(path, streams, args.profile_s + 1.0, work, pids))
    await asyncio.sleep(0.5)
    kind = "native" if native else "python"
    out = args.log_dir / f"{path.name.replace(' ', '-')}-{kind}.speedscope.json"
    label = (f"{path.name}, {streams} streams, "
             + ("with native frames (process paused per sample)" if native else
                "Python frames (not paused)"))
    result = await gateway_profile.record(gateway.process.pid, args.profile_s, out, label,
                                          rate=200 if native else 400, native=native)
    await load
    return result


# ----- the report -----

def code_under_test() -> str:
    """The commit, and what the working tree measured changes under the gateway's imports
    (others edit this checkout while it runs)."""
    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], cwd=REPO, capture_output=True, text=True,
                              check=False).stdout.strip()
    dirty = [line[3:] for line in git("status", "--porcelain", "--", *LAYERS).splitlines()]
    counts = ", ".join(f"{layer}/ {sum(d.startswith(layer + '/') for d in dirty)} file(s)"
                       for layer in LAYERS)
    return f"commit {git('rev-parse', '--short', 'HEAD')}; uncommitted changes measured: {counts}"


def report(result: dict, args, load: tuple[float, float], command: str) -> str:
    rounds = result["rounds"]
    paths = ["direct", *dict.fromkeys(r.path for r in rounds if r.path != "direct")]
    services = [k for k in rounds[0].cpu if k != "client"] if rounds else []
    profiles = [line for p in result["profiles"] for line in ["", *gateway_profile.table(p)]]
    versions = ", ".join(f"{p} {importlib.metadata.version(p)}"
                         for p in ("grpcio", "uvicorn", "starlette", "uvloop", "openai",
                                   "aiohttp"))
    return "\n".join([
        (f"One pool (demo model, one executor `{' '.join(EXECUTOR)}`, a scheduler, an adapter "
         f"store on local files) and a gateway in front of it, keys on; every service and this "
         f"client are separate processes on this machine. Greedy requests over "
         f"{len(ADAPTERS)} adapters ({', '.join(ADAPTERS)}), {len(result['work'])} held-out "
         f"prompts, {MAX_NEW_TOKENS} new tokens each (EOS ignored), from N closed-loop streams "
         f"at once. Rounds of {args.round_s:g} s alternate direct and a gateway path "
         f"({args.cycles} per path and concurrency); each gateway round is compared with the "
         "direct round just before it, and the table gives the median over those pairs."),
        "", *latency_table(rounds, args.concurrency, paths), "",
        ("- ITL: the gap between consecutive tokens of a stream, pooled over a path's rounds; "
         "TTFT: from the request's start to its first token. Added ITL and TTFT are the median "
         "over pairs of (gateway round p50 - direct round p50). A relay delay the same for "
         "every token shifts arrivals but not their gaps: it shows in TTFT (together with the "
         "request's own path: key, adapter resolution, tokenizing), so added TTFT bounds "
         "what each token waits for the extra hop."),
        (f"- goal (issue 14): added ITL p50 <= {GOAL_ADDED_MS:g} ms and tokens/s >= "
         f"{GOAL_RATIO}x direct; the openai rows include that client's own CPU, which runs on "
         "the same CPUs (see below)."),
        ("- same greedy text along every path: "
         + ("yes" if not result["differ"] else "NO: " + "; ".join(result["differ"]))),
        "", "CPU per streamed token (microseconds; each process's user + system time over a "
        "path's rounds over its tokens), and CPUs busy (all of them together over the rounds' "
        "wall time; this machine has " f"{len(os.sched_getaffinity(0))}):",
        "", *cpu_table(rounds, args.concurrency, paths, services), "",
        *findings(rounds, args.concurrency, paths), "",
        "Profiles of the gateway process under load (py-spy `--function`, also `--native`; "
        "shares of the samples in which its threads ran; with native frames, samples waiting "
        "in epoll are dropped; profiles in the log folder, speedscope format):", *profiles, "",
        (f"- machine: nproc {len(os.sched_getaffinity(0))}, 1-min load average {load[0]:.1f} at "
         f"start, {load[1]:.1f} at the end; python {sys.version.split()[0]}, {versions}"),
        f"- code: {result['code']}",
        f"- date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}",
        f"- command: `{command}`", ""])


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")],
                   help="streams at once, comma-separated (1,8,32; 1,8 with --quick)")
    p.add_argument("--cycles", type=int, help="rounds per gateway path and concurrency (5)")
    p.add_argument("--round-s", type=float, help="seconds per round (2)")
    p.add_argument("--profile-s", type=float,
                   help="seconds of each py-spy profile (2 per gateway face); 0: none (6)")
    p.add_argument("--paths", default="gRPC,SSE,openai",
                   help="gateway paths, comma-separated: gRPC, SSE, openai")
    p.add_argument("--no-native", dest="native", action="store_false",
                   help="profile Python frames only (not also with the native ones: uvloop, "
                        "gRPC's Cython layer and C core, syscalls)")
    p.add_argument("--quick", action="store_true",
                   help="1 and 8 streams, 1 cycle of 2 s rounds, 3 s profiles")
    p.add_argument("--out", nargs="?", const=str(RESULTS), metavar="PATH",
                   help=f"also write the report here ({RESULTS.relative_to(REPO)})")
    args = p.parse_args()
    args.concurrency = args.concurrency or ([1, 8] if args.quick else [1, 8, 32])
    args.cycles = args.cycles or (1 if args.quick else 5)
    args.round_s = args.round_s or 2.0
    if args.profile_s is None:
        args.profile_s = 3.0 if args.quick else 6.0
    args.paths = args.paths.split(",")
    return args


def main() -> None:
    args = parse_args()
    # The services run as `python -m gateway.service` and so on: from the repository root.
    os.chdir(REPO)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # not a line per fork() of py-spy
    load_start = os.getloadavg()[0]
    args.log_dir = pathlib.Path(tempfile.mkdtemp(prefix="loraplex-gateway-bench-"))
    key = os.urandom(16).hex()
    keys = FleetKeys(tenants={key: "bench"})
    fleet = Fleet(model=str(demo.MODEL_DIR), store_url=(args.log_dir / "store").as_uri(),
                  log_dir=args.log_dir, keys=keys, executor_args=EXECUTOR)
    num_rounds = len(args.concurrency) * args.cycles * 2 * len(args.paths)
    print(f"logs and profiles: {args.log_dir}\nstarting a store, an executor, a scheduler and a "
          f"gateway; then {num_rounds} rounds of {args.round_s:g} s ...", flush=True)
    with fleet:
        gateway = start_gateway({demo.MODEL_DIR.name: [fleet.scheduler]}, fleet.stores,
                                args.log_dir, keys)
        try:
            result = run(lambda: measure(fleet, gateway, key, args))
        finally:
            gateway.stop()
    command = " ".join([".venv/bin/python bench/gateway.py", *sys.argv[1:]])
    text = report(result, args, (load_start, os.getloadavg()[0]), command)
    print(f"\n{text}")
    if args.out:
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(f"# Gateway overhead on CPU: the gateway vs the scheduler directly\n\n"
                       f"{text}")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
