"""Window blocks (issue 45, common/kv_layout.py): what sliding-window layers keeping only their
window saves, and what it costs a decode step.

    python bench/sliding_window.py --out bench/results/sliding-window-cpu.md

1. Memory, from `loraplex budget`'s plan (loraplex/budget.py) at 80 GB in bf16, its default
   adapter mix: the KV a sequence holds at 4k and 32k tokens, in blocks of every layer, and how
   many such sequences the blocks hold, with window blocks (the executor's default) and without
   (--no-window-blocks: every layer keeping the whole context, as before).
2. Decode on CPU: a random-weight Gemma-3-shaped model (12 layers, every 6th global, the others
   sliding over 512 keys; hidden 512, 8 heads / 4 KV heads, head_dim 64), 8 sequences with
   prompts of 4,096 tokens prefilled in chunks of 1,024, then 32 decode steps of all 8, timed;
   blocks reused as the stand-in scheduler gives them back (tests/runner_driver.py). Each layout
   in its own process, 1 torch thread, alternating rounds; medians of every round's steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = ("gemma-2-9b", "gemma-3-12b", "mistral-7b-v0.1")
CONTEXTS = (4096, 32768)
NUM_SEQS, PROMPT, DECODE, CHUNK, BLOCK = 8, 4096, 32, 1024, 16


def memory_rows() -> list[str]:
    import torch

    from executor.model.config import ModelConfig
    from loraplex.budget import plan

    rows = ["| model | sliding layers | context | KV per sequence, whole context (blocks) | "
            "with window blocks (blocks) | saved | sequences that fit: whole | with window "
            "blocks |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name in MODELS:
        config = ModelConfig.named(name)
        layout = config.kv_layout()
        sliding = sum(len(k.layers) for k in layout.kinds if k.window is not None)
        for context in CONTEXTS:
            args = dict(dtype=torch.bfloat16, gpu_bytes=80 * 2**30, utilization=0.9,
                        adapter_slots=64, max_rank=16, block_size=BLOCK,
                        max_batched_tokens=2048, max_num_seqs=64, context=context)
            on, off = plan(config, **args), plan(config, window_blocks=False, **args)
            held, whole = on.seq_blocks(context), off.seq_blocks(context)
            rows.append(f"| {name} | {sliding} of {config.num_hidden_layers} over "
                        f"{config.sliding_window} | {context:,} | {whole:,.0f} | {held:,.1f} | "
                        f"{100 * (1 - held / whole):.0f}% | {int(off.num_kv_blocks // whole):,} "
                        f"| {int(on.num_kv_blocks // held):,} |")
    return rows


def worker(window_blocks: bool) -> None:
    """One layout's decode steps: a JSON line."""
    import torch

    from common.sampling import SamplingParams
    from executor.model.config import ModelConfig
    from executor.runner import ModelRunner
    from tests.runner_driver import Driver

    torch.set_num_threads(1)
    config = ModelConfig.named("gemma-3-12b").replace(
        hidden_size=512, intermediate_size=1024, num_hidden_layers=12, num_attention_heads=8,
        num_key_value_heads=4, head_dim=64, vocab_size=4096, sliding_window=512,
        max_position_embeddings=8192, layer_types=tuple(
            "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(12)))
    whole_blocks = NUM_SEQS * -(-(PROMPT + DECODE + 2) // BLOCK)  # (blocks of every layer)
    layout = config.kv_layout(window_blocks)
    runner = ModelRunner.random(config, num_kv_blocks=whole_blocks * layout.num_layers
                                // layout.layers_per_block, block_size=BLOCK, num_slots=1,
                                max_rank=8, lora_backend="torch", window_blocks=window_blocks)
    driver = Driver(runner)
    g = torch.Generator().manual_seed(0)
    for sid in range(NUM_SEQS):
        driver.add(sid, torch.randint(2, config.vocab_size, (PROMPT,), generator=g).tolist(),
                   -1, SamplingParams())
    while any(st["computed"] < st["total"] - 1 for st in driver.state.values()):
        driver.step(CHUNK)  # (prefill; the first samples)
    driver.step(CHUNK)  # warm-up decode step
    step_ms = []
    for _ in range(DECODE):
        start = time.perf_counter()
        driver.step(CHUNK)
        step_ms.append((time.perf_counter() - start) * 1e3)
    held = max(driver.most_held.values())
    print(json.dumps({"step_ms": step_ms, "most_held": held,
                      "layers_per_block": layout.layers_per_block,
                      "num_blocks": runner.kv.num_blocks}), flush=True)


def run_side(window_blocks: bool) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, __file__, "--worker",
                          "--window-blocks" if window_blocks else "--whole"],
                         env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(next(line for line in out.stdout.splitlines() if line.startswith("{")))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, help="write the report here (markdown)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--window-blocks", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--whole", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.window_blocks)
    memory = memory_rows()
    print("\n".join(memory), flush=True)
    sides: dict[str, list[dict]] = {"whole context": [], "window blocks": []}
    for i in range(args.rounds):
        for side in sides:  # (alternating: both see the same noise)
            sides[side].append(run_side(side == "window blocks"))
        print(f"round {i + 1}/{args.rounds} done", flush=True)
    decode = ["| layout | decode step (ms, median) | tok/s | most blocks a sequence held "
              "(blocks of layers) | KV memory a sequence held |", "|---|---:|---:|---:|---:|"]
    medians = {}
    for side, runs in sides.items():
        ms = statistics.median(m for r in runs for m in r["step_ms"])
        medians[side] = ms
        r = runs[0]
        share = r["most_held"] * r["layers_per_block"] / 12 / -(-(PROMPT + DECODE + 2) // BLOCK)
        decode.append(f"| {side} | {ms:.1f} | {NUM_SEQS * 1e3 / ms:,.0f} | {r['most_held']:,} "
                      f"({r['layers_per_block']}) | {100 * share:.0f}% |")
    ratio = medians["whole context"] / medians["window blocks"]
    report = [
        "# Sliding-window layers keep only their window (CPU)\n",
        f"Command: `python bench/sliding_window.py --rounds {args.rounds}`; "
        f"{time.strftime('%Y-%m-%d %H:%M')}; load average at the end "
        f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores.\n",
        "## KV a sequence holds, and sequences that fit (`loraplex budget`, 80 GB, bf16)\n",
        "Blocks of every layer (16 tokens): with window blocks a window layer holds at most "
        "ceil((window - 1) / 16) + 1 token blocks while it decodes; global layers the whole "
        "context. `sequences that fit`: the plan's blocks over a sequence's.\n",
        *memory, "",
        "## Decode at a 4,096-token context, same memory\n",
        __doc__.split("2. ")[1].split("\n\"\"\"")[0].strip().replace("\n   ", " ") + "\n",
        *decode, "",
        f"Decode step whole / window blocks: {ratio:.2f}x (one run; the window layers read the "
        "same keys either way, so the step costs about the same: what window blocks buy is "
        "memory, above)."]
    print("\n".join(report))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(report) + "\n")


if __name__ == "__main__":
    main()
