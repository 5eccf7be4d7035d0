"""Section 11 of the GPU check: decode steps replayed from CUDA graphs (executor/decode_graphs.py)
against the same steps run eagerly, on an 8B-shaped random-weight model in bf16: the start-up
check (every bucket's graph equal to the eager forward of its probe batch), then the decode step
time of B sequences both ways, base only and one rank-16 adapter per row, with the greedy tokens
compared. Run alone: python bench/gpu_graphs.py [--smoke] (smoke: the tiny model on CPU, the
Triton interpreter, and a stand-in capture that replays the recorded forward).
"""

from __future__ import annotations

from gpu_harness import (BLOCK_SIZE, CFG, DEVICE, MODEL, OPTS, REPORT, pages_of,  # first
                         random_adapter, section, sync, table)

import time

import torch
from common.peft.modules import LORA_MODULES
from executor.decode_graphs import DecodeGraphs, cuda_capture
from gpu_step import time_decode

BATCHES = (4,) if OPTS.smoke else (1, 8, 32, 64)
STEPS = 1 if OPTS.smoke else 20


def tokens_of(runner) -> list[list[int]]:
    return [runner.tokens(s) for s in sorted(runner._seqs)]


@section("11. Decode steps from CUDA graphs vs eager (8B-shaped random weights, bf16)")
def graphs_check() -> None:
    from executor.runner import ModelRunner
    rank = 8 if OPTS.smoke else 16
    dtype = torch.float32 if OPTS.smoke else torch.bfloat16
    ranks = dict.fromkeys(LORA_MODULES, rank)
    rows_max = max(BATCHES)
    t0 = time.perf_counter()
    runner = ModelRunner.random(MODEL, dtype=dtype, device=DEVICE,
                                num_kv_blocks=(rows_max + 2) * pages_of(CFG, ranks)
                                + 1024, block_size=BLOCK_SIZE, num_slots=rows_max + 1,
                                max_rank=rank, lora_backend="triton",
                                attention_backend="triton", scratch_block=True)
    capture = (lambda run: run) if OPTS.smoke else cuda_capture
    graphs, why = DecodeGraphs.check(runner, buckets=BATCHES, capture=capture)
    check_s = time.perf_counter() - t0
    print(f"model ready and graphs checked in {check_s:.0f} s: "
          f"{'on' if graphs else 'OFF'}", flush=True)
    if graphs is None:
        REPORT.append(f"**The start-up check turned the graphs off**: {why}. Nothing timed.\n")
        return
    for s in range(rows_max):
        runner.load_adapter(s, random_adapter(runner.config, ranks, 2000 + s))
    sync()
    rows = []
    for batch in BATCHES:
        for name, slots in (("base only", [-1] * batch),
                            ("an adapter per row", list(range(batch)))):
            runner.graphs = None
            _, eager_ms = time_decode(runner, slots, STEPS)
            eager_tokens = tokens_of(runner)
            runner.graphs = graphs
            _, graph_ms = time_decode(runner, slots, STEPS)
            same = tokens_of(runner) == eager_tokens
            rows.append([batch, name, eager_ms, graph_ms, eager_ms / graph_ms,
                         "yes" if same else "no"])
            print(rows[-1], flush=True)
    REPORT.append(
        f"Start-up check (capture of buckets {list(BATCHES)} and the probe comparison, with the "
        f"model's random init): {check_s:.0f} s; every bucket's graph equal to the eager "
        f"forward. Median wall time of {STEPS} decode steps per batch (after a prefill of the "
        "prompts, eager in both), sampling included; greedy tokens compared (the graph's "
        "matmuls have the bucket's rows, so a row may round otherwise than eagerly: "
        "'no' is a difference to look at, not by itself a failure).\n\n")
    REPORT.append(table(["rows", "adapters", "eager step ms", "graph step ms",
                         "eager / graph", "greedy tokens equal"], rows))
    del runner, graphs
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


if __name__ == "__main__":
    graphs_check()
