"""A quantized base on CPU: decode throughput of an fp32, an INT8 and an INT4 base under 1, 16 and
64 distinct rank-16 adapters, and the bytes each format takes.

    .venv/bin/python bench/quantized_cpu.py [--quick] [--out [PATH]]

The model: 4 layers, hidden 1024 (16 heads of 64, 4 KV heads), intermediate 2816, vocab 2048,
random weights; its projections quantized round-to-nearest into executor/model/quant.py's layouts:
INT8 per channel, symmetric (W8A16); INT4 in groups of 128 with zero points (W4A16, GPTQ / AWQ's
shape). 64 requests, request i on adapter i mod N, prompts of 8-24 tokens, 32 greedy tokens
each: all prefilled, then one decode step over all of them per token (as bench/moe.py drives a
runner). The three bases alternate round by round, one torch thread; tokens/s is every generated
token over the wall time, the median of the rounds.

Then the choice of the CPU path (executor/model/quant.py), measured on the gate|up projection: dense
F.linear, dequantize + matmul (a million elements at a time) and torch's weight-only kernels
(_weight_int8pack_mm, _weight_int4pack_mm_for_cpu), for fp32 and bf16 activations.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from common.sampling import SamplingParams
from executor.lora.slot_pool import LoraModuleWeights, LoraWeights
from executor.model.config import ModelConfig
from executor.model.quant import IntWeight
from executor.runner import ModelRunner, Row
from kernels.quant_gemm_ref import pack_int4

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "quantized-cpu.md"
CONFIG = ModelConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                     num_attention_heads=16, num_key_value_heads=4, vocab_size=2048,
                     eos_token_ids=(), model_id="quantized-bench")
NUM_REQUESTS, MAX_NEW, BLOCK, RANK = 64, 32, 16, 16
FORMATS = ("fp32", "int8", "int4")
ATTRS = ("wqkv", "wo", "w_gate_up", "w_down")


def quantize(w: torch.Tensor, bits: int, group: int) -> IntWeight:
    """Round-to-nearest of w [out, in]: int8 per channel symmetric; int4 by groups with zeros."""
    out_f, in_f = w.shape
    if bits == 8:
        scale = (w.abs().amax(1, keepdim=True) / 127).clamp(min=1e-8)
        codes = (w / scale).round().clamp(-128, 127).to(torch.int8)
        return IntWeight(codes, scale.float(), None, None, None, bits=8, group_size=0,
                         label="int8 per channel")
    g = w.view(out_f, in_f // group, group)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    zero = (-lo / scale).round().clamp(0, 15)
    q = ((g / scale[..., None]).round() + zero[..., None]).clamp(0, 15).view(out_f, in_f)
    return IntWeight(pack_int4(q), scale.float(), (zero - 8).to(torch.int8), None, None, bits=4,
                     group_size=group, label=f"int4 group {group} zero points")


def adapter(seed: int) -> LoraWeights:
    g = torch.Generator().manual_seed(seed)
    mods = {}
    for layer in range(CONFIG.num_hidden_layers):
        for m in CONFIG.lora_modules:
            i, o = CONFIG.module_shape(m)
            mods[(layer, m)] = LoraModuleWeights(torch.randn(RANK, i, generator=g) * i ** -0.5,
                                                 torch.randn(o, RANK, generator=g) * 0.02, 2.0)
    return LoraWeights(mods)


def make_runner(fmt: str, adapters: list[LoraWeights]) -> ModelRunner:
    pages = ModelRunner.random(CONFIG, num_kv_blocks=1, block_size=BLOCK, num_slots=1,
                               max_rank=RANK).pool.pages_for(adapters[0]).num_pages
    kv = NUM_REQUESTS * -(-(24 + MAX_NEW) // BLOCK)
    runner = ModelRunner.random(CONFIG, seed=1, num_kv_blocks=kv + len(adapters) * pages,
                                block_size=BLOCK, num_slots=len(adapters), max_rank=RANK,
                                lora_backend="torch")
    if fmt != "fp32":
        for layer in runner.weights.layers:
            for attr in ATTRS:
                setattr(layer, attr, quantize(getattr(layer, attr), 8 if fmt == "int8" else 4,
                                              128))
    for slot, weights in enumerate(adapters):
        runner.load_adapter(slot, weights)
    return runner


def decode(runner: ModelRunner, reqs: list[tuple[list[int], int]]) -> float:
    """Seconds to prefill every request, then decode all to MAX_NEW tokens."""
    order = sorted(range(len(reqs)), key=lambda i: reqs[i][1])
    free = iter(runner.free_blocks())
    need = -(-(max(len(p) for p, _ in reqs) + MAX_NEW) // BLOCK)
    start = time.perf_counter()
    for i in order:
        runner.add_sequence(i, reqs[i][0], SamplingParams(), reqs[i][1])
    runner.step([Row(i, len(reqs[i][0]), tuple(next(free) for _ in range(need))) for i in order])
    for _ in range(MAX_NEW - 1):
        runner.step([Row(i, 1) for i in order])
    seconds = time.perf_counter() - start
    for i in order:
        runner.free_sequence(i)
    return seconds


def projection_bytes(runner: ModelRunner) -> int:
    return sum((t.numel() * t.element_size() if isinstance(t, torch.Tensor) else t.num_bytes())
               for layer in runner.weights.layers for t in map(layer.__getattribute__, ATTRS))


def paths_table(rounds: int) -> list[str]:
    """ms per call of the gate|up projection by path, fp32 and bf16 activations."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(2 * CONFIG.intermediate_size, CONFIG.hidden_size, generator=g) * 0.02
    lines = ["| activations | rows | dense F.linear | int8: dequantize + matmul | int8: torch "
             "kernel | int4: dequantize + matmul | int4: torch kernel |",
             "|---|---:|" + "---:|" * 5]
    for dtype in (torch.float32, torch.bfloat16):
        weights = {bits: quantize(w, bits, 128) for bits in (8, 4)}
        kernels = {bits: quantize(w, bits, 128) for bits in (8, 4)}
        for k in kernels.values():
            k.prepare(torch.bfloat16)  # (torch's kernel form; it takes bf16 activations only)
        for rows in (1, 16, 64):
            x = torch.randn(rows, CONFIG.hidden_size, generator=g).to(dtype)
            calls = [lambda: F.linear(x, w.to(dtype))]
            for bits in (8, 4):
                calls.append(lambda b=bits: weights[b].linear(x))
                calls.append((lambda b=bits: kernels[b].linear(x)) if dtype == torch.bfloat16
                             else None)
            cells = [f"{_ms(c, rounds):.2f}" if c else "-" for c in calls]
            lines.append(f"| {str(dtype).removeprefix('torch.')} | {rows} | "
                         + " | ".join(cells) + " |")
    return lines


def _ms(call, rounds: int) -> float:
    call()
    times = []
    for _ in range(max(3, rounds * 3)):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 round, counts 1 and 16")
    parser.add_argument("--out", nargs="?", const=str(RESULTS), default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    counts, rounds = ((1, 16), 1) if args.quick else ((1, 16, 64), 3)
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 2048) for _ in range(rng.randint(8, 24))]
               for _ in range(NUM_REQUESTS)]
    adapters = [adapter(100 + i) for i in range(max(counts))]
    runners = {fmt: make_runner(fmt, adapters) for fmt in FORMATS}
    load = os.getloadavg()[0]
    lines = [f"# A quantized base on CPU ({'quick' if args.quick else 'full'})", "",
             f"Model: {CONFIG.num_hidden_layers} layers, hidden {CONFIG.hidden_size}, "
             f"intermediate {CONFIG.intermediate_size}, vocab {CONFIG.vocab_size}, random "
             f"weights; rank-{RANK} adapters on every projection; {NUM_REQUESTS} requests, "
             f"{MAX_NEW} greedy tokens, one thread; medians of {rounds} rounds, the formats "
             f"alternating (`{' '.join(['bench/quantized_cpu.py', *(argv or sys.argv[1:])])}`, "
             f"load average {load:.2f} at start).", "",
             "| format | weights (MB) | projections (MB) |", "|---|---:|---:|"]
    for fmt, runner in runners.items():
        lines.append(f"| {fmt} | {runner.weights.num_bytes() / 1e6:.1f} | "
                     f"{projection_bytes(runner) / 1e6:.1f} |")
    lines += ["", "| distinct adapters | " + " | ".join(f"{f} tok/s" for f in FORMATS)
              + " | int8 / fp32 | int4 / fp32 |", "|---:|" + "---:|" * (len(FORMATS) + 2)]
    for fmt in FORMATS:  # (a warm-up round each, untimed: first-step allocations)
        decode(runners[fmt], [(p, i % max(counts)) for i, p in enumerate(prompts)])
    for n in counts:
        reqs = [(p, i % n) for i, p in enumerate(prompts)]
        seconds = {fmt: [] for fmt in FORMATS}
        for _ in range(rounds):
            for fmt in FORMATS:
                seconds[fmt].append(decode(runners[fmt], reqs))
        rate = {f: NUM_REQUESTS * MAX_NEW / statistics.median(s) for f, s in seconds.items()}
        lines.append(f"| {n} | " + " | ".join(f"{rate[f]:,.0f}" for f in FORMATS)
                     + f" | {rate['int8'] / rate['fp32']:.2f}x | "
                       f"{rate['int4'] / rate['fp32']:.2f}x |")
        print(lines[-1], flush=True)
    lines += ["", "The CPU path of one projection (gate|up, "
              f"{2 * CONFIG.intermediate_size} x {CONFIG.hidden_size}), ms per call, median:", ""]
    lines += paths_table(rounds)
    lines += ["", f"Load average at the end: {os.getloadavg()[0]:.2f}."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        pathlib.Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
