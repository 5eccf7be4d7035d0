"""Serving throughput on the tiny model: loraplex (three services) vs HF PEFT mixed-adapter batches.

    .venv/bin/python bench/serving.py [--quick] [--pipeline-depth N]

The same prompts (token ids), the same adapters and the same greedy 32-token budget go to both:
- loraplex: an adapter store (temp files), one CPU executor with a slot for every adapter, and a
  scheduler, as separate processes. Every adapter is loaded once before timing; then all requests
  are sent at once and streamed back; tokens/s is all generated tokens over the wall time.
- HF PEFT: one PeftModel holding every adapter; `generate(..., adapter_names=[...])` on all
  requests as one left-padded batch.
Request i uses adapter i mod N for N distinct adapters. The two sides run in turn, round by
round, and each reports its median round by wall time (these CPUs are shared: a burst of other
work should hit both sides and not set the number). Then, per adapter count, where the wall time
of loraplex's rounds went (the scheduler's --timings-out lines: executor compute and busy share,
scheduler planning, waiting, streaming) and an in-process breakdown of a decode step
(bench/step_breakdown.py). The full run at the default --pipeline-depth writes
bench/results/serving-cpu.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import grpc
import torch
from step_breakdown import breakdown_table, decode_breakdown

from common.server import insecure_channel, run
from loraplex import client, fixtures
from loraplex.launch import Fleet
from protos import scheduler_pb2, scheduler_pb2_grpc

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "serving-cpu.md"
MAX_NEW_TOKENS = 32
ADAPTER_COUNTS = (1, 16, 64)
ROUNDS = 5
STREAM_ROUND_TIMEOUT_S = 300.0  # (a round takes ~1 s here)
LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_prompts(num_requests: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Random token ids (no BOS/EOS), 8 to 24 tokens each."""
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab_size) for _ in range(rng.randint(8, 24))]
            for _ in range(num_requests)]


def make_adapters(model_dir: str, model_id: str, num_adapters: int, out_dir: pathlib.Path):
    """One PeftModel with adapters a0..a{N-1} (rank 16, all 7 projections, seeded random weights),
    each also saved as a PEFT folder out_dir/a{i}. Returns the PeftModel, ready for generate."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir)
    base.name_or_path = model_id  # becomes base_model_name_or_path in each adapter_config.json
    config = LoraConfig(r=16, lora_alpha=32, target_modules=LORA_MODULES, init_lora_weights=False)
    torch.manual_seed(1000)
    model = get_peft_model(base, config, adapter_name="a0")
    for i in range(1, num_adapters):
        torch.manual_seed(1000 + i)
        model.add_adapter(f"a{i}", config)
    # A non-"default" adapter goes to out_dir/<adapter name>; embeddings are untouched, not saved.
    model.save_pretrained(out_dir, save_embedding_layers=False)
    return model.eval()


def adapter_names(num_requests: int, num_adapters: int) -> list[str]:
    return [f"a{i % num_adapters}" for i in range(num_requests)]


def pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def median_round(rounds: list[tuple]) -> tuple:
    """The round with the median wall time; rounds are (seconds, ...) tuples."""
    return sorted(rounds, key=lambda r: r[0])[len(rounds) // 2]


def left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # [B, width]
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return input_ids, attention_mask


def peft_round(model, batch: tuple[torch.Tensor, torch.Tensor],
               names: list[str]) -> tuple[float, list[list[int]]]:
    """One mixed-adapter generate over the whole batch; (seconds, new token ids per row)."""
    input_ids, attention_mask = batch
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                             adapter_names=names, max_new_tokens=MAX_NEW_TOKENS,
                             min_new_tokens=MAX_NEW_TOKENS, do_sample=False, pad_token_id=0)
    return time.perf_counter() - start, out[:, input_ids.shape[1]:].tolist()


async def loraplex_round(stub, prompts: list[list[int]],
                         names: list[str]) -> tuple[float, list[client.Generation]]:
    """All requests at once; (seconds to the last token, their Generations)."""
    start = time.perf_counter()
    gens = await asyncio.gather(*(
        client.generate(stub, client.generate_request(n, p, MAX_NEW_TOKENS, ignore_eos=True))
        for p, n in zip(prompts, names)))
    return time.perf_counter() - start, gens


async def loraplex_stream_round(stub, prompts: list[list[int]],
                                names: list[str]) -> tuple[float, list[list[int]]]:
    """All requests at once on one Stream, as a gateway sends them (scheduler.proto: a message
    per step carries every request's tokens); (seconds to the last token, token ids per
    request). RuntimeError on a request that ends in an error."""
    start = time.perf_counter()
    call = stub.Stream(timeout=STREAM_ROUND_TIMEOUT_S)
    tokens: list[list[int]] = [[] for _ in prompts]
    await call.write(scheduler_pb2.StreamRequest(submits=[
        scheduler_pb2.StreamSubmit(id=i, tenant="bench", request=client.generate_request(
            name, prompt, MAX_NEW_TOKENS, ignore_eos=True))
        for i, (prompt, name) in enumerate(zip(prompts, names))]))
    left = set(range(len(prompts)))
    try:
        while left:
            message = await call.read()
            if message is grpc.aio.EOF:
                raise RuntimeError(f"the scheduler ended the Stream with {len(left)} requests "
                                   "unfinished")
            for i, token in zip(message.token_request_ids, message.token_ids):
                tokens[i].append(token)
            for end in message.ends:
                if end.error_code:
                    raise RuntimeError(f"request {end.id} failed: {end.error_message}")
                left.discard(end.id)
        seconds = time.perf_counter() - start
        await call.done_writing()
    finally:
        call.cancel()
    return seconds, tokens


async def one_token_ttfts(stub, names: list[str], prompt: list[int]) -> list[float]:
    """One single-token request per adapter, one after another; their TTFTs."""
    return [(await client.generate(stub, client.generate_request(n, prompt, 1))).ttft_seconds
            for n in names]


async def adapter_loads(stub) -> int:
    stats = await stub.Stats(scheduler_pb2.StatsRequest())
    return sum(e.adapter_loads for e in stats.executors)


def agree_until_eos(ours: list[int], theirs: list[int], eos: int) -> bool:
    """Same greedy tokens up to loraplex's first EOS: with ignore_eos it emits EOS and goes on,
    while PEFT's min_new_tokens masks EOS and takes the runner-up, so the two part ways there."""
    end = ours.index(eos) if eos in ours else len(ours)
    return ours[:end] == theirs[:end]


@dataclass
class Row:
    num_adapters: int
    loraplex_tok_s: float
    ttft_p50: float  # seconds
    ttft_p99: float
    peft_tok_s: float
    num_agree: int  # requests whose tokens agree with PEFT's up to the first EOS
    steps: StepShares  # where the scheduler's wall time went, over this count's loraplex rounds


@dataclass
class StepShares:
    """Mean per executor step over some rounds (seconds), from the scheduler's timing lines
    (scheduler/timings.py), and the executor's busy share of the rounds' wall time."""

    steps_per_round: float
    compute: float  # the executor's own forward + sampling
    plan: float  # the scheduler planning and sending the step
    wait: float  # the scheduler waiting for the step's answer
    done: float  # the scheduler taking in the samples and streaming tokens to clients
    other: float  # the rest of the scheduler's wall time: its loop on other work, or idle
    busy: float  # compute / wall

    @classmethod
    def of(cls, lines: list[dict], windows: list[tuple[float, float]]) -> StepShares:
        steps = [r for r in lines if "step" in r
                 and any(start <= r["at"] <= end for start, end in windows)]
        wall = sum(end - start for start, end in windows)
        n = max(len(steps), 1)
        total = {k: sum(r[k] for r in steps) for k in ("seconds", "plan_s", "wait_s", "done_s")}
        scheduler = total["plan_s"] + total["wait_s"] + total["done_s"]
        return cls(len(steps) / len(windows), total["seconds"] / n, total["plan_s"] / n,
                   total["wait_s"] / n, total["done_s"] / n, (wall - scheduler) / n,
                   total["seconds"] / wall)


async def measure(fleet: Fleet, model, adapter_dir: pathlib.Path, prompts: list[list[int]],
                  counts: list[int], timings: pathlib.Path) -> tuple[list[Row], str]:
    """Push and warm up every adapter; then, per count, ROUNDS rounds of loraplex and PEFT in
    turn. Returns a Row per count and a line on the warm-up."""
    names = [f"a{i}" for i in range(max(counts))]
    for name in names:
        await client.push_adapter(fleet.stores[0], adapter_dir / name, name)
    batch, eos = left_pad(prompts), model.config.eos_token_id
    peft_round(model, left_pad(prompts[:4]), adapter_names(4, 1))  # warm-up
    rows = []
    async with insecure_channel(fleet.scheduler) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        cold = await one_token_ttfts(stub, names, prompts[0])  # each loads its adapter
        warm = await one_token_ttfts(stub, names, prompts[0])  # all resident now
        loads = await adapter_loads(stub)
        for n in counts:
            per_request = adapter_names(len(prompts), n)
            ours, theirs, windows = [], [], []
            for _ in range(ROUNDS):
                start = time.time()
                ours.append(await loraplex_round(stub, prompts, per_request))
                windows.append((start, time.time()))
                theirs.append(peft_round(model, batch, per_request))
            seconds, gens = median_round(ours)
            peft_seconds, peft_tokens = median_round(theirs)
            ttfts = [g.ttft_seconds for g in gens]
            agree = sum(agree_until_eos(g.token_ids, t, eos) for g, t in zip(gens, peft_tokens))
            lines = [json.loads(line) for line in timings.read_text().splitlines()]
            rows.append(Row(n, sum(len(g.token_ids) for g in gens) / seconds, pct(ttfts, 50),
                            pct(ttfts, 99), sum(map(len, peft_tokens)) / peft_seconds, agree,
                            StepShares.of(lines, windows)))
        loads_after = await adapter_loads(stub)
    warmup = (f"warm-up, one 1-token request per adapter in turn: TTFT p50 "
              f"{statistics.median(cold) * 1e3:.0f} ms with its adapter load, "
              f"{statistics.median(warm) * 1e3:.0f} ms once resident; executor adapter loads: "
              f"{loads} during warm-up, {loads_after - loads} during the timed runs")
    return rows, warmup


def step_parts(model_dir: str, adapter_dir: pathlib.Path, prompts: list[list[int]], n: int):
    """The in-process decode-step breakdown (bench/step_breakdown.py) for n distinct adapters."""
    adapters = [((adapter_dir / f"a{i}" / "adapter_config.json").read_text(),
                 (adapter_dir / f"a{i}" / "adapter_model.safetensors").read_bytes())
                for i in range(n)]
    slot_of = [int(name[1:]) for name in adapter_names(len(prompts), n)]
    return decode_breakdown(model_dir, adapters, prompts, slot_of, MAX_NEW_TOKENS - 1)


def report(rows: list[Row], num_requests: int, threads: int, warmup: str, load: float,
           command: str, parts: list[str]) -> str:
    lines = [("| distinct adapters | loraplex tok/s | loraplex TTFT p50 / p99 (ms) | HF PEFT tok/s "
              "| loraplex/PEFT ratio |"), "|---:|---:|---:|---:|---:|"]
    lines += [f"| {r.num_adapters} | {r.loraplex_tok_s:.0f} | {r.ttft_p50 * 1e3:.0f} / "
              f"{r.ttft_p99 * 1e3:.0f} | {r.peft_tok_s:.0f} "
              f"| {r.loraplex_tok_s / r.peft_tok_s:.2f} |" for r in rows]
    shares = [("| distinct adapters | steps per round | executor compute | scheduler: plan and "
               "send | scheduler: wait for the answer | scheduler: samples to clients | scheduler: "
               "other | executor busy |"), "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    shares += [f"| {r.num_adapters} | {s.steps_per_round:.0f} | {s.compute * 1e3:.2f} | "
               f"{s.plan * 1e3:.2f} | {s.wait * 1e3:.2f} | {s.done * 1e3:.2f} | "
               f"{s.other * 1e3:.2f} | {s.busy:.0%} |" for r in rows for s in [r.steps]]
    same = ", ".join(f"{r.num_agree}/{num_requests}" for r in rows)
    return "\n".join([
        (f"{num_requests} requests sent at once, median of {ROUNDS} rounds; prompts 8-24 tokens, "
         f"{MAX_NEW_TOKENS} new tokens each (greedy, EOS ignored); adapters rank 16 on all 7 "
         f"projections; tiny LLaMA (4 layers, hidden 256), float32, CPU; {threads} torch "
         "thread(s) for the executor and for PEFT."),
        "", *lines, "",
        ("Where the wall time of loraplex's rounds went, per executor step (ms, mean over all "
         "rounds of a row; from the scheduler's --timings-out lines): the executor's compute, and "
         "the scheduler's time in the same steps. Steps are pipelined (--pipeline-depth 2): the "
         "executor runs a step while the scheduler plans the next and streams the last one's "
         "tokens, so its busy share is its compute over the wall time."),
        "", *shares, "",
        ("Inside the executor's compute: one decode step over every request, measured in-process "
         "(bench/step_breakdown.py: the same model, adapters and prompts in a ModelRunner, torch "
         "LoRA backend; ms per step and share of it)."),
        "", *parts, "",
        f"- {warmup}",
        f"- requests whose greedy tokens match HF PEFT's up to the first EOS, per row: {same}",
        machine_line(load), f"- command: `{command}`", ""])


def machine_line(load: float) -> str:
    """Where a benchmark ran: a line for its results file."""
    return (f"- machine: nproc {len(os.sched_getaffinity(0))}, torch {torch.__version__}, python "
            f"{sys.version.split()[0]}, 1-min load average at start {load:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="16 requests, 1 and 16 adapters; writes no file")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of the executor and of PEFT (1 keeps OpenMP from "
                             "stalling when other work shares the CPUs)")
    parser.add_argument("--pipeline-depth", type=int, default=2,
                        help="the scheduler's --pipeline-depth (1: one step at a time)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    num_requests = 16 if args.quick else 64
    counts = [n for n in ADAPTER_COUNTS if n <= num_requests]
    load = os.getloadavg()[0]  # other work on these CPUs skews every number below
    manifest = fixtures.ensure(REPO / ".fixtures")
    with tempfile.TemporaryDirectory(prefix="loraplex-bench-") as tmp_name:
        tmp = pathlib.Path(tmp_name)
        print(f"making {max(counts)} adapters with peft ...", flush=True)
        model = make_adapters(manifest["model_dir"], manifest["model_id"], max(counts),
                              tmp / "adapters")
        prompts = make_prompts(num_requests, model.config.vocab_size)
        # Blocks for KV and adapters' pages alike: the bytes the executor had before pages (1024
        # KV blocks, and a slot per adapter at max rank 32: 38 blocks' worth each), so every
        # adapter (rank 16: 19 pages) stays resident beside the requests' KV.
        kv_blocks = 1024 + 38 * max(counts)
        fleet = Fleet(model=manifest["model_dir"], store_url=(tmp / "store").as_uri(),
                      log_dir=tmp / "logs",
                      executor_args=["--adapter-slots", str(max(counts)), "--max-rank", "32",
                                     "--kv-blocks", str(kv_blocks), "--threads",
                                     str(args.threads)],
                      scheduler_args=["--max-num-seqs", str(num_requests),
                                      "--pipeline-depth", str(args.pipeline_depth),
                                      "--timings-out", str(tmp / "timings.jsonl")])
        print("starting the services; pushing and warming up adapters; then "
              f"{ROUNDS} rounds of loraplex and HF PEFT in turn per adapter count ...", flush=True)
        with fleet:
            rows, warmup = run(lambda: measure(fleet, model, tmp / "adapters", prompts, counts,
                                               tmp / "timings.jsonl"))
        print("timing the parts of a decode step in-process ...", flush=True)
        parts = breakdown_table([
            (n, step_parts(manifest["model_dir"], tmp / "adapters", prompts, n)) for n in counts])
    command = " ".join([".venv/bin/python bench/serving.py", *sys.argv[1:]])
    text = report(rows, num_requests, args.threads, warmup, load, command, parts)
    print("\n" + text)
    if not args.quick and args.pipeline_depth == 2:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text("# Serving throughput on CPU: loraplex vs HF PEFT\n\n" + text)
        print(f"wrote {RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
