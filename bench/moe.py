"""Mixture-of-experts decode on CPU: loraplex's runner vs HF PEFT, with expert adapters.

    .venv/bin/python bench/moe.py [--quick] [--out [PATH]]

A tiny Qwen3-MoE (4 layers, hidden 256, 16 experts of 128, top 4) made with transformers, and
rank-16 adapters on attention and on both expert weights (PEFT's target_parameters). 64 requests,
request i on adapter i mod N for N = 1, 16, 64 distinct adapters, 32 greedy tokens each:

- loraplex: one ModelRunner (as the executor builds it, torch backends, one thread) holding every
  adapter in a slot, every request prefilled, then one decode step over all of them per token.
- HF PEFT: one PeftModel per adapter (PEFT loads no two expert adapters into one model, and its
  expert wrapper refuses mixed-adapter batches): each adapter's requests one left-padded
  generate() batch, adapter after adapter.

Tokens/s is every generated token over the wall time; the two sides alternate round by round and
each reports its median. Then a decode step of loraplex's, in-process, broken down with timers
around the router, the experts' grouped matmuls, the experts' LoRA, attention and the rest.
Greedy tokens are compared between the two (they must agree).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import pathlib
import random
import statistics
import sys
import tempfile
import time

import torch
from step_breakdown import _Timers

from common.sampling import SamplingParams
from executor.lora import torch_backend
from executor.lora.peft_adapter import parse_peft_adapter
from executor.model import moe, transformer
from executor.model.config import ModelConfig
from executor.model.kv_cache import PagedKVCache
from executor.runner import ModelRunner, Row
from loraplex import fixtures

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "moe-cpu.md"
SHAPE = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
         "num_hidden_layers": 4, "num_experts": 16, "num_experts_per_tok": 4,
         "moe_intermediate_size": 128, "intermediate_size": 512, "norm_topk_prob": True}
ADAPTER = {"r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
           "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
NUM_REQUESTS, MAX_NEW, BLOCK = 64, 32, 16
PARTS = ("router", "experts", "expert LoRA", "attention", "rest")


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 1024) for _ in range(rng.randint(8, 24))] for _ in range(n)]


def make_model(out: pathlib.Path, num_adapters: int):
    from transformers import AutoModelForCausalLM

    model_dir = fixtures.save_tiny_model(out / "model", "qwen3_moe", seed=1, **SHAPE)
    base = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    for i in range(num_adapters):
        fixtures._save_adapter(base, out / f"a{i}", 100 + i, ADAPTER)
    return model_dir, base


def loraplex_runner(model_dir, out, num_adapters: int) -> ModelRunner:
    """A runner with blocks for every request's KV and every adapter's pages."""
    adapters = [parse_peft_adapter((out / f"a{slot}" / "adapter_config.json").read_text(),
                                   (out / f"a{slot}" / "adapter_model.safetensors").read_bytes(),
                                   ModelConfig.from_pretrained(model_dir),
                                   check_base_model=False) for slot in range(num_adapters)]
    probe = ModelRunner.from_pretrained(model_dir, num_kv_blocks=1, block_size=BLOCK,
                                        num_slots=1, max_rank=16, lora_backend="torch")
    pages = probe.pool.pages_for(adapters[0]).num_pages
    kv = NUM_REQUESTS * -(-(24 + MAX_NEW) // BLOCK)
    runner = ModelRunner.from_pretrained(model_dir, num_kv_blocks=kv + num_adapters * pages,
                                         block_size=BLOCK, num_slots=num_adapters, max_rank=16,
                                         lora_backend="torch")
    for slot, weights in enumerate(adapters):
        runner.load_adapter(slot, weights)
    return runner


def run_loraplex(runner: ModelRunner, reqs: list[tuple[list[int], int]], *,
                 timers: _Timers | None = None) -> tuple[float, dict[int, list[int]]]:
    """(seconds, tokens by request) of every request prefilled, then decoded to MAX_NEW."""
    order = sorted(range(len(reqs)), key=lambda i: reqs[i][1])  # rows sorted by adapter
    free = iter(runner.free_blocks())
    need = -(-(max(len(p) for p, _ in reqs) + MAX_NEW) // BLOCK)
    start = time.perf_counter()
    for i in order:
        runner.add_sequence(i, reqs[i][0], SamplingParams(), reqs[i][1])
    out = {i: [] for i in order}
    prefill = [Row(i, len(reqs[i][0]), tuple(next(free) for _ in range(need))) for i in order]
    for s in runner.step(prefill):
        out[s.seq_id].append(s.token_id)
    with contextlib.ExitStack() as stack:
        if timers is not None:  # (the decode steps only)
            _timed(stack, timers, runner)
        decode_start = time.perf_counter()
        for _ in range(MAX_NEW - 1):
            for s in runner.step([Row(i, 1) for i in order]):
                out[s.seq_id].append(s.token_id)
        end = time.perf_counter()
    for i in order:
        runner.free_sequence(i)
    if timers is not None:
        timers.seconds["decode"] = end - decode_start
    return end - start, out


def _timed(stack: contextlib.ExitStack, timers: _Timers, runner: ModelRunner) -> None:
    timers.wrap(stack, moe.Routing, "route", "router")
    timers.wrap(stack, runner.model, "moe_matmul", "experts")
    timers.wrap(stack, torch_backend.TorchLoraBackend, "apply_experts", "expert LoRA")
    timers.wrap(stack, torch_backend.TorchLoraBackend, "prepare_experts", "expert LoRA")
    timers.wrap(stack, transformer.F, "scaled_dot_product_attention", "attention")
    timers.wrap(stack, PagedKVCache, "gather", "attention")


def run_hf(models: list, reqs: list[tuple[list[int], int]]) -> tuple[float, dict[int, list[int]]]:
    start = time.perf_counter()
    out = {}
    for slot, model in enumerate(models):
        mine = [i for i, (_, s) in enumerate(reqs) if s == slot]
        if not mine:
            continue
        width = max(len(reqs[i][0]) for i in mine)
        ids = torch.tensor([[0] * (width - len(reqs[i][0])) + reqs[i][0] for i in mine])
        mask = torch.tensor([[0] * (width - len(reqs[i][0])) + [1] * len(reqs[i][0])
                             for i in mine])
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        for row, i in enumerate(mine):
            out[i] = gen[row, width:].tolist()
    return time.perf_counter() - start, out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 round, counts 1 and 16")
    parser.add_argument("--out", nargs="?", const=str(RESULTS), default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    counts, rounds = ((1, 16), 1) if args.quick else ((1, 16, 64), 3)
    from peft import PeftModel

    lines = [f"# MoE decode on CPU: loraplex vs HF PEFT ({'quick' if args.quick else 'full'})",
             "", f"Model: tiny Qwen3-MoE {SHAPE}; adapters {ADAPTER}; {NUM_REQUESTS} requests, "
             f"{MAX_NEW} greedy tokens, one thread each, medians of {rounds} alternating rounds "
             f"(`{' '.join(['bench/moe.py', *(argv or sys.argv[1:])])}`, load average "
             f"{os.getloadavg()[0]:.2f} at start).", "",
             "| distinct adapters | loraplex tok/s | HF PEFT tok/s | ratio | tokens equal |",
             "|---:|---:|---:|---:|---|"]
    breakdowns = []
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp)
        model_dir, base = make_model(out, max(counts))
        for n in counts:
            reqs = [(p, i % n) for i, p in enumerate(prompts(NUM_REQUESTS))]
            runner = loraplex_runner(model_dir, out, n)
            models = [PeftModel.from_pretrained(copy.deepcopy(base), out / f"a{i}").eval()
                      for i in range(n)]
            ours, theirs, same = [], [], True
            for _ in range(rounds):
                seconds, got = run_loraplex(runner, reqs)
                ours.append(seconds)
                seconds, want = run_hf(models, reqs)
                theirs.append(seconds)
                same &= got == want
            tokens = NUM_REQUESTS * MAX_NEW
            a, b = tokens / statistics.median(ours), tokens / statistics.median(theirs)
            lines.append(f"| {n} | {a:,.0f} | {b:,.0f} | {a / b:.2f}x | "
                         f"{'yes' if same else 'NO'} |")
            timers = _Timers()
            run_loraplex(runner, reqs, timers=timers)
            decode_ms = timers.seconds["decode"] * 1e3 / (MAX_NEW - 1)
            parts = {p: timers.seconds[p] * 1e3 / (MAX_NEW - 1) for p in PARTS[:-1]}
            parts["rest"] = decode_ms - sum(parts.values())
            breakdowns.append((n, decode_ms, parts))
            print(lines[-1], flush=True)
    lines += ["", "A decode step of loraplex's over the 64 requests (ms per step, share):", "",
              "| distinct adapters | step (ms) | " + " | ".join(PARTS) + " |",
              "|---:|---:|" + "---:|" * len(PARTS)]
    for n, step, parts in breakdowns:
        lines.append(f"| {n} | {step:.2f} | " + " | ".join(
            f"{parts[p]:.2f} ({parts[p] / step:.0%})" for p in PARTS) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        pathlib.Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
