"""Activated LoRA on CPU: an agent pipeline over one long context.

    .venv/bin/python bench/alora.py [--quick] [--out [PATH]]

One pool of the three services (the tiny model, one executor, one thread). A pipeline: the base
model reads a ~1,500-token context and drafts 16 tokens; then 4 checker adapters (rank 16 on
q, k, v, o, gate, up, down) each read that context plus its own invocation and answer 16 tokens,
the 4 at once. Run twice per round, interleaved: with the 4 as activated LoRAs (their invocation
in PEFT's alora_invocation_tokens: the context's blocks are the base request's, from the prefix
cache) and as ordinary LoRAs of the same weights (each computes the whole context again). Each
pipeline's context is new (a different random context per round and kind), so only the sharing
within a pipeline counts. Reported: the 4 checkers' time to first token (p50, max), the
pipeline's wall time, the prompt tokens served from cache, and whether the activated checkers'
tokens equal PEFT's (whole forwards with explicit alora_offsets).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import pathlib
import random
import statistics
import sys
import tempfile
import time

import torch
from serving import machine_line

from common.alora import activation_start
from common.server import insecure_channel
from loraplex import client, fixtures
from loraplex.launch import Fleet
from protos import scheduler_pb2_grpc

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "alora-cpu.md"
CONTEXT_TOKENS, NEW_TOKENS, NUM_CHECKERS = 1500, 16, 4
INVOCATIONS = [[900 + 3 * i, 901 + 3 * i, 902 + 3 * i] for i in range(NUM_CHECKERS)]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_checkers(model_dir: str, model_id: str, out: pathlib.Path):
    """Per checker the same weights saved twice: as an activated LoRA and as an ordinary one;
    and the PEFT models of the activated ones (the oracle)."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    base.name_or_path = model_id
    oracles = []
    for i, invocation in enumerate(INVOCATIONS):
        torch.manual_seed(40 + i)
        peft = get_peft_model(copy.deepcopy(base), LoraConfig(
            r=16, lora_alpha=32, target_modules=TARGETS, init_lora_weights=False,
            alora_invocation_tokens=invocation))
        peft.save_pretrained(out / f"alora{i}")
        peft.peft_config["default"].alora_invocation_tokens = None
        peft.save_pretrained(out / f"lora{i}")
        oracles.append(PeftModel.from_pretrained(copy.deepcopy(base), out / f"alora{i}").eval())
    return oracles


@torch.no_grad()
def oracle_tokens(model, prompt: list[int], invocation: list[int]) -> list[int]:
    start, seq, out = activation_start(prompt, invocation), list(prompt), []
    for _ in range(NEW_TOKENS):
        logits = model(input_ids=torch.tensor([seq]), alora_offsets=[len(seq) - start]).logits
        out.append(int(logits[0, -1].argmax()))
        seq.append(out[-1])
    return out


async def pipeline(stub, kind: str, context: list[int]) -> tuple[float, list]:
    """(seconds, the checkers' Generations) of one pipeline with `kind` adapters."""
    start = time.perf_counter()
    await client.generate(stub, client.generate_request("", context, NEW_TOKENS,
                                                        ignore_eos=True))
    checks = await asyncio.gather(*(client.generate(stub, client.generate_request(
        f"{kind}{i}", context + INVOCATIONS[i], NEW_TOKENS, ignore_eos=True))
        for i in range(NUM_CHECKERS)))
    return time.perf_counter() - start, checks


async def measure(fleet: Fleet, folder: pathlib.Path, rounds: int, vocab: int):
    results: dict[str, list] = {"alora": [], "lora": []}
    contexts = {}
    async with insecure_channel(fleet.scheduler) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        for kind in results:
            for i in range(NUM_CHECKERS):
                await client.push_adapter(fleet.stores[0], folder / f"{kind}{i}", f"{kind}{i}")
        await pipeline(stub, "lora", [5] * 64)  # warm-up: adapters loaded
        await pipeline(stub, "alora", [6] * 64)
        for r in range(rounds):
            for kind in results:
                rng = random.Random(f"{kind}-{r}")
                context = [rng.randrange(2, 900) for _ in range(CONTEXT_TOKENS)]
                contexts[kind, r] = context
                results[kind].append(await pipeline(stub, kind, context))
    return results, contexts


def report(results, contexts, oracles, rounds: int, load: float, command: str) -> str:
    lines = ["| checkers | TTFT p50 (ms) | TTFT max (ms) | pipeline wall (s) | prompt tokens "
             "from cache | tokens equal PEFT's |", "|---|---:|---:|---:|---:|---|"]
    walls = {}
    for kind, runs in results.items():
        walls[kind] = statistics.median(seconds for seconds, _ in runs)
        ttfts = [g.ttft_seconds for _, gens in runs for g in gens]
        cached = sum(g.usage.cached_prompt_tokens for _, gens in runs for g in gens) / len(runs)
        equal = "-"
        if kind == "alora":
            equal = "yes" if all(
                g.token_ids == oracle_tokens(oracles[i], contexts[kind, r] + INVOCATIONS[i],
                                             INVOCATIONS[i])
                for r, (_, gens) in enumerate(runs) for i, g in enumerate(gens)) else "NO"
        lines.append(f"| {'activated LoRA' if kind == 'alora' else 'ordinary LoRA'} | "
                     f"{statistics.median(ttfts) * 1e3:.0f} | {max(ttfts) * 1e3:.0f} | "
                     f"{walls[kind]:.2f} | {cached:.0f} | {equal} |")
    return "\n".join([
        f"# Activated LoRA on CPU: a pipeline over one {CONTEXT_TOKENS}-token context", "",
        f"A base request reads the context and drafts {NEW_TOKENS} tokens; then {NUM_CHECKERS} "
        f"checkers (rank 16, all 7 projections) each read the context + its 3-token invocation "
        f"and answer {NEW_TOKENS} tokens, the {NUM_CHECKERS} at once. Tiny LLaMA (4 layers, "
        f"hidden 256), one executor, one torch thread; median of {rounds} pipelines per kind, "
        "the kinds interleaved, each pipeline a new random context.", "", *lines, "",
        f"Pipeline wall time, ordinary / activated: {walls['lora'] / walls['alora']:.2f}x.",
        "", machine_line(load), f"- command: `{command}`", ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 round; writes no file")
    parser.add_argument("--out", nargs="?", const=str(RESULTS), default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rounds = 1 if args.quick else 3
    load = os.getloadavg()[0]
    manifest = fixtures.ensure(REPO / ".fixtures")
    with tempfile.TemporaryDirectory(prefix="loraplex-alora-") as tmp_name:
        tmp = pathlib.Path(tmp_name)
        oracles = make_checkers(manifest["model_dir"], manifest["model_id"], tmp)
        with Fleet(model=manifest["model_dir"], store_url=(tmp / "store").as_uri(),
                   log_dir=tmp / "logs", executor_args=["--threads", "1",
                                                        "--kv-blocks", "2048"]) as fleet:
            results, contexts = asyncio.run(measure(fleet, tmp, rounds, 1024))
    text = report(results, contexts, oracles, rounds, load,
                  " ".join(["bench/alora.py", *sys.argv[1:]]))
    print(text)
    if args.out and not args.quick:
        pathlib.Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
