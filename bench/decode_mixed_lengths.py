"""CPU decode step of the executor's Transformer over batches of mixed context lengths, before and
after decode attention stopped padding every row to the batch's longest context (issue 16).

    git worktree add --detach /tmp/pa-old f59699a~1    # the executor before the change
    python bench/decode_mixed_lengths.py --before /tmp/pa-old \
        --out bench/results/decode-mixed-lengths.md

Each side runs in its own process (PYTHONPATH = its tree, 1 torch thread), in alternating rounds:
a random-weight small Llama (the `tiny` shapes: hidden 256, 4 layers, 4 query / 2 KV heads,
head_dim 64; max_position_embeddings 4096), one prefill step of every prompt, a warm-up decode
step, then `--steps` decode steps of all rows, each timed; attention = time inside KV gathers and
SDPA calls (the CPU path's attention). The table gives medians over all rounds' steps.
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
from random import Random

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 16
WORKLOADS = {  # name -> prompt lengths of the 64 rows
    "64 x 32 (all short)": [32] * 64,
    "63 x 32 + 1 x 2048": [32] * 63 + [2048],
    "64 x uniform 32..1024": (lambda rng: [rng.randint(32, 1024) for _ in range(64)])(Random(0)),
}


def worker(steps: int) -> None:
    """Run in a side's tree: print one JSON line per workload."""
    import torch
    import torch.nn.functional as F

    from common.sampling import SamplingParams
    from executor.runner import ModelRunner, Row

    try:  # (the executor's layout since its modules moved into executor/model/)
        from executor.model.config import ModelConfig
        from executor.model.kv_cache import PagedKVCache
    except ModuleNotFoundError:  # (a tree from before: the --before side of issue 16's change)
        from executor.kv_cache import PagedKVCache
        from executor.model_config import ModelConfig

    torch.set_num_threads(1)
    seconds = {"attention": 0.0}

    def timed(fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds["attention"] += time.perf_counter() - start
        return wrapper

    F.scaled_dot_product_attention = timed(F.scaled_dot_product_attention)
    PagedKVCache.gather = timed(PagedKVCache.gather)
    config = ModelConfig.named("tiny").replace(max_position_embeddings=4096)
    for name, lens in WORKLOADS.items():
        blocks_each = [-(-(n + steps + 2) // BLOCK) for n in lens]
        runner = ModelRunner.random(config, num_kv_blocks=sum(blocks_each), block_size=BLOCK,
                                    num_slots=1, max_rank=8, lora_backend="torch")
        g = torch.Generator().manual_seed(0)
        first = [sum(blocks_each[:i]) for i in range(len(lens))]
        for sid, n in enumerate(lens):
            runner.add_sequence(sid, torch.randint(2, config.vocab_size, (n,), generator=g)
                                .tolist(), SamplingParams(), -1)
        runner.step([Row(sid, n, tuple(range(first[sid], first[sid] + blocks_each[sid])))
                     for sid, n in enumerate(lens)])
        decode = [Row(sid, 1) for sid in range(len(lens))]
        runner.step(decode)  # warm-up
        step_ms, attn_ms = [], []
        for _ in range(steps):
            seconds["attention"] = 0.0
            start = time.perf_counter()
            runner.step(decode)
            step_ms.append((time.perf_counter() - start) * 1e3)
            attn_ms.append(seconds["attention"] * 1e3)
        print(json.dumps({"workload": name, "step_ms": step_ms, "attn_ms": attn_ms,
                          "executor": str(Path(sys.modules["executor"].__file__).parent)}),
              flush=True)


def run_side(tree: Path, steps: int) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, __file__, "--worker", "--steps", str(steps)],
                         env=env, cwd=tree, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"the side in {tree} failed:\n{out.stderr[-3000:]}")
    results = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    for r in results:
        if Path(r["executor"]) != tree / "executor":
            raise SystemExit(f"side {tree} imported the executor of {r['executor']}")
    return results


def table(before: dict, after: dict) -> list[str]:
    lines = ["| workload (prompt lengths) | sum of prompts | longest | step before (ms) | "
             "step after (ms) | speed-up | attention before (ms) | attention after (ms) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, lens in WORKLOADS.items():
        b, a = before[name], after[name]
        sb, sa = statistics.median(b["step_ms"]), statistics.median(a["step_ms"])
        ab, aa = statistics.median(b["attn_ms"]), statistics.median(a["attn_ms"])
        lines.append(f"| {name} | {sum(lens)} | {max(lens)} | {sb:.1f} | "
                     f"{sa:.1f} | {sb / sa:.1f}x | {ab:.1f} | {aa:.1f} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", type=Path, help="a worktree of the executor before the change")
    p.add_argument("--after", type=Path, default=ROOT, help="the tree measured as 'after'")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed decode steps per round")
    p.add_argument("--out", type=Path, help="write the table here (markdown)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.steps)
    if args.before is None:
        p.error("--before is required (see the docstring)")
    sides = {"before": args.before.resolve(), "after": args.after.resolve()}
    merged: dict[str, dict[str, dict]] = {s: {} for s in sides}
    for i in range(args.rounds):
        for side, tree in sides.items():  # alternating rounds: both sides see the same noise
            for r in run_side(tree, args.steps):
                m = merged[side].setdefault(r["workload"], {"step_ms": [], "attn_ms": []})
                m["step_ms"] += r["step_ms"]
                m["attn_ms"] += r["attn_ms"]
            print(f"round {i + 1}/{args.rounds}: {side} done", flush=True)
    lines = table(merged["before"], merged["after"])
    commit = {s: subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=t,
                                capture_output=True, text=True).stdout.strip()
              for s, t in sides.items()}
    report = [
        "# Decode step, mixed context lengths (CPU)\n",
        f"Command: `python bench/decode_mixed_lengths.py --before {args.before} --rounds "
        f"{args.rounds} --steps {args.steps}` (before = {commit['before']}, after = "
        f"{commit['after']} + working tree); {time.strftime('%Y-%m-%d %H:%M')}; 1-minute load "
        f"average at the end {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores.\n",
        "A decode step of 64 rows of a random-weight `tiny`-shaped Llama (hidden 256, 4 layers, "
        "4 query / 2 KV heads, head_dim 64), base model only, block size 16, 1 torch thread; "
        f"medians of {args.rounds} alternating rounds x {args.steps} steps per side (contexts "
        "grow from prompt + 2 by one a step). Before: every decode row's keys gathered and "
        "padded to the longest context, one masked SDPA. After: rows bucketed by number of keys "
        "(<= 32, then powers of two), one SDPA per bucket.\n",
        *lines]
    print("\n".join(lines))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(report) + "\n")


if __name__ == "__main__":
    main()
