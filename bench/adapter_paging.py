"""Adapter paging against slots padded to the largest rank (issue 31), on CPU:

1. memory: at one adapter-memory budget, how many adapters of a rank mix are resident when each
   takes pages by its ranks, against slots padded to the mix's largest rank (vLLM, LoRAX), for
   Llama-3-8B shapes (common/adapter_pages.py, the executor's own page plan);
2. time: a decode step of a batch whose rows each have their own adapter of the mix, with the
   adapters in pages at their ranks, and the same adapters padded with zero rows to the largest
   rank (what a padded pool stores and multiplies); the two runners interleaved, round by round,
   on one random-weight model; the torch LoRA backend (the CPU's). The tokens are checked equal.

    .venv/bin/python bench/adapter_paging.py --out bench/results/adapter-paging-cpu.md

The simulator's hit rate, paged vs padded at equal bytes, is `loraplex simulate
bench/sim/paging1000.toml --compare-memory` (quoted in the results file).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import random
import statistics
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from common.adapter_pages import padded_pages, plan_pages  # noqa: E402
from common.peft.modules import LORA_MODULES  # noqa: E402
from common.sampling import SamplingParams  # noqa: E402
from executor.lora.slot_pool import LoraModuleWeights, LoraWeights, page_geometry  # noqa: E402
from executor.model.config import ModelConfig  # noqa: E402
from executor.runner import ModelRunner, Row  # noqa: E402

MIX = {8: 0.7, 16: 0.2, 64: 0.1}  # rank -> share of adapters
BLOCK = 16
# A model whose LoRA work shows on a CPU step: 8 layers of 1024 (Llama-shaped, GQA 4:1).
MODEL = ModelConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                    num_attention_heads=16, num_key_value_heads=4, vocab_size=2048,
                    model_id="bench-paging")


def mix_ranks(n: int, seed: int = 0) -> list[int]:
    return random.Random(seed).choices(list(MIX), list(MIX.values()), k=n)


def memory_table(budget_gib: float = 8.0) -> str:
    config = ModelConfig.named("llama-3-8b")
    geometry = page_geometry(config, BLOCK)
    page_bytes = geometry.page_elems * 2  # bf16
    budget_pages = int(budget_gib * 2**30 // page_bytes)
    rows = []
    for rank in MIX:
        pages = plan_pages(dict.fromkeys(LORA_MODULES, rank), geometry).num_pages
        rows.append(f"| rank {rank} ({MIX[rank]:.0%} of adapters) | {pages} | "
                    f"{pages * page_bytes / 1e6:.1f} MB |")
    ranks = mix_ranks(100_000)
    mean_pages = statistics.fmean(
        plan_pages(dict.fromkeys(LORA_MODULES, r), geometry).num_pages for r in ranks)
    padded = padded_pages(max(MIX), geometry)
    paged_fit, padded_fit = int(budget_pages / mean_pages), budget_pages // padded
    return "\n".join([
        f"Llama-3-8B in bf16, all 7 projections, blocks of {BLOCK} tokens "
        f"({page_bytes / 2**20:.2f} MiB a page); budget {budget_gib:g} GiB of blocks = "
        f"{budget_pages:,} pages.\n",
        "| adapter | pages | bytes |", "|---|---:|---:|", *rows,
        f"| padded slot (rank {max(MIX)}, any adapter) | {padded} | "
        f"{padded * page_bytes / 1e6:.1f} MB |", "",
        f"Resident in {budget_gib:g} GiB: **{paged_fit} adapters of the mix in pages** "
        f"({mean_pages:.1f} pages each on average) against **{padded_fit} in padded slots**: "
        f"{paged_fit / padded_fit:.2f}x.\n"])


def padded_to(weights: LoraWeights, rank: int) -> LoraWeights:
    """The same adapter with zero rows and columns up to `rank` (the same outputs)."""
    out = {}
    for key, w in weights.modules.items():
        r = w.a.shape[0]
        a = torch.cat([w.a, w.a.new_zeros(rank - r, w.a.shape[1])])
        b = torch.cat([w.b, w.b.new_zeros(w.b.shape[0], rank - r)], dim=1)
        out[key] = LoraModuleWeights(a, b, w.scale)
    return LoraWeights(out)


def random_adapter(rank: int, seed: int) -> LoraWeights:
    g = torch.Generator().manual_seed(seed)
    mods = {}
    for layer in range(MODEL.num_hidden_layers):
        for m in LORA_MODULES:
            in_f, out_f = MODEL.module_shape(m)
            mods[(layer, m)] = LoraModuleWeights(torch.randn(rank, in_f, generator=g) * 0.02,
                                                 torch.randn(out_f, rank, generator=g) * 0.02,
                                                 2.0)
    return LoraWeights(mods)


def make_runner(adapters: list[LoraWeights], seq_blocks: int) -> ModelRunner:
    pages = sum(plan_pages(w.module_ranks(), page_geometry(MODEL, BLOCK)).num_pages
                for w in adapters)
    runner = ModelRunner.random(MODEL, seed=0, num_kv_blocks=seq_blocks + pages,
                                block_size=BLOCK, num_slots=len(adapters), max_rank=max(MIX),
                                lora_backend="torch")
    for slot, weights in enumerate(adapters):
        runner.load_adapter(slot, weights)  # (the highest blocks: sequences take the lowest)
    return runner


def decode_ms(runner: ModelRunner, prompts: list[list[int]], steps: int, blocks_each: int,
              slots: bool = True) -> tuple[float, list[list[int]]]:
    """Median decode step ms of one row per prompt (row i on slot i; on none without `slots`),
    after its prefill; and the tokens."""
    runner.free_all()
    for sid, prompt in enumerate(prompts):
        runner.add_sequence(sid, prompt, SamplingParams(), sid if slots else -1)
    tokens = [[s.token_id] for s in runner.step([
        Row(sid, len(p), tuple(range(sid * blocks_each, (sid + 1) * blocks_each)))
        for sid, p in enumerate(prompts)])]
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        sampled = runner.step([Row(sid, 1) for sid in range(len(prompts))])
        times.append((time.perf_counter() - start) * 1e3)
        for s in sampled:
            tokens[s.seq_id].append(s.token_id)
    return statistics.median(times), tokens


def time_table(num_rows: int, rounds: int, steps: int) -> str:
    # The mix's shares of the rows, each row its own adapter, sorted by adapter (as scheduled).
    ranks = [r for r, share in MIX.items() for _ in range(round(share * num_rows))]
    num_rows = len(ranks)
    paged = [random_adapter(r, seed=i) for i, r in enumerate(ranks)]
    padded = [padded_to(w, max(MIX)) for w in paged]
    rng = random.Random(2)
    prompts = [[rng.randrange(2, MODEL.vocab_size) for _ in range(32)] for _ in range(num_rows)]
    blocks_each = -(-(32 + steps + 1) // BLOCK)
    runners = {"pages (by rank)": make_runner(paged, blocks_each * num_rows),
               f"padded slots (rank {max(MIX)})": make_runner(padded, blocks_each * num_rows)}
    base = ModelRunner.random(MODEL, seed=0, num_kv_blocks=blocks_each * num_rows,
                              block_size=BLOCK, num_slots=0, max_rank=max(MIX),
                              lora_backend="torch")
    times: dict[str, list[float]] = {name: [] for name in runners}
    base_times, tokens = [], {}
    for i in range(rounds + 1):  # round 0: warm-up; then interleaved, the order rotating
        names = list(runners)[i % 2:] + list(runners)[:i % 2]
        for name in names:
            ms, tokens[name] = decode_ms(runners[name], prompts, steps, blocks_each)
            if i:
                times[name].append(ms)
        ms, _ = decode_ms(base, prompts, steps, blocks_each, slots=False)
        if i:
            base_times.append(ms)
    first, second = tokens.values()
    same = sum(a == b for a, b in zip(first, second))
    base_ms = statistics.median(base_times)
    paged_ms, padded_ms = (statistics.median(t) for t in times.values())
    rank_rows = {r: ranks.count(r) for r in MIX}
    lines = [
        f"{num_rows} decode rows, each its own adapter on all 7 projections, ranks "
        + ", ".join(f"{n} x rank {r}" for r, n in rank_rows.items())
        + f" ({sum(ranks)} rank rows per module against {num_rows * max(MIX)} padded); model "
        f"{MODEL.num_hidden_layers} layers x {MODEL.hidden_size} (random weights, fp32), "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads. Median over {rounds} "
        f"interleaved rounds of the median of {steps} decode steps.\n",
        "| adapters in | decode step ms | LoRA ms (step - base) | x pages |",
        "|---|---:|---:|---:|",
        f"| base model alone | {base_ms:.2f} | 0 | |"]
    for name, ms in zip(times, (paged_ms, padded_ms)):
        lines.append(f"| {name} | {ms:.2f} | {ms - base_ms:.2f} | {ms / paged_ms:.2f} |")
    lora_ratio = (padded_ms - base_ms) / (paged_ms - base_ms)
    lines += ["", f"LoRA time padded / pages: **{lora_ratio:.2f}x**; greedy tokens equal for "
              f"{same}/{num_rows} sequences.\n"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rows", type=int, default=20, help="decode rows (mix shares of them)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    report = "\n".join([
        "# Adapter paging vs slots padded to the largest rank (CPU)\n",
        f"Rank mix: {', '.join(f'{s:.0%} rank {r}' for r, s in MIX.items())}. "
        f"Command: `.venv/bin/python bench/adapter_paging.py --rounds {args.rounds} --steps "
        f"{args.steps} --rows {args.rows}`; {time.strftime('%Y-%m-%d')}, nproc "
        f"{os.cpu_count()}.\n",
        "## Adapters resident at one memory budget\n", memory_table(),
        "## Decode step, mixed-rank batch\n", time_table(args.rows, args.rounds, args.steps)])
    print(report)
    if args.out:
        pathlib.Path(args.out).write_text(report + "\n")


if __name__ == "__main__":
    main()
