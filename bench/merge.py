"""A merged adapter's throughput against the base model alone and against unmerged serving.

    .venv/bin/python bench/merge.py [--quick] [--threads N]

One ModelRunner (the fixture tiny LLaMA, float32, CPU) with one rank-16 adapter on all 7
projections (seeded random PEFT weights). Each round decodes BATCH sequences for NEW_TOKENS
steps after their prefill, three ways in turn: every row on the base model (slot -1), every row
on the adapter unmerged (LoRA through the torch backend), and every row on the adapter merged
into the weights (ModelRunner.merge: no LoRA work). Decode tokens/s, the median of ROUNDS
rounds each. The merged and unmerged runs must give the same greedy tokens. The full run writes
bench/results/merge-cpu.md.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import random
import statistics
import sys
import tempfile
import time

import torch
from serving import machine_line, make_adapters

from common.adapter_pages import padded_pages
from common.sampling import SamplingParams
from executor.lora.peft_adapter import parse_peft_adapter
from executor.lora.slot_pool import page_geometry
from executor.model.config import ModelConfig
from executor.runner import ModelRunner, Row
from loraplex import fixtures

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "merge-cpu.md"
BLOCK = 16


def decode_round(runner: ModelRunner, prompts: list[list[int]], slot: int,
                 new_tokens: int) -> tuple[float, list[list[int]]]:
    """Prefill every prompt, then decode; (decode tokens/s, each sequence's tokens)."""
    per_seq = -(-(max(map(len, prompts)) + new_tokens) // BLOCK)
    rows = []
    for i, prompt in enumerate(prompts):
        runner.add_sequence(i, prompt, SamplingParams(), slot)
        rows.append(Row(i, len(prompt), tuple(range(i * per_seq, (i + 1) * per_seq))))
    out = [[s.token_id] for s in runner.step(rows)]
    start = time.perf_counter()
    for _ in range(new_tokens - 1):
        for s in runner.step([Row(i, 1) for i in range(len(prompts))]):
            out[s.seq_id].append(s.token_id)
    seconds = time.perf_counter() - start
    runner.free_all()
    return len(prompts) * (new_tokens - 1) / seconds, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 rounds, 16 rows; no file")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batch, new_tokens, rounds = (16, 16, 2) if args.quick else (64, 32, 5)
    load = os.getloadavg()[0]
    manifest = fixtures.ensure(REPO / ".fixtures")
    with tempfile.TemporaryDirectory(prefix="loraplex-merge-") as tmp:
        model = make_adapters(manifest["model_dir"], manifest["model_id"], 1,
                              pathlib.Path(tmp))
        folder = pathlib.Path(tmp) / "a0"
        config_text = (folder / "adapter_config.json").read_text()
        weights = (folder / "adapter_model.safetensors").read_bytes()
    per_seq = -(-(24 + new_tokens) // BLOCK)
    pages = padded_pages(16, page_geometry(ModelConfig.from_pretrained(manifest["model_dir"]),
                                           BLOCK))  # (above the sequences' blocks)
    runner = ModelRunner.from_pretrained(manifest["model_dir"],
                                         num_kv_blocks=batch * per_seq + pages,
                                         block_size=BLOCK, num_slots=1, max_rank=16)
    runner.load_adapter(0, parse_peft_adapter(config_text, weights, runner.config))
    rng = random.Random(0)
    prompts = [[rng.randrange(2, model.config.vocab_size) for _ in range(rng.randint(8, 24))]
               for _ in range(batch)]
    rates: dict[str, list[float]] = {"base model alone": [], "adapter unmerged": [],
                                     "adapter merged": []}
    tokens = {}
    for _ in range(rounds):
        for name in rates:
            if name == "adapter merged":
                runner.merge(0)
            rate, tokens[name] = decode_round(runner, prompts, -1 if name.startswith("base")
                                              else 0, new_tokens)
            runner.unmerge()
            rates[name].append(rate)
    median = {name: statistics.median(r) for name, r in rates.items()}
    same = sum(a == b for a, b in zip(tokens["adapter merged"], tokens["adapter unmerged"]))
    lines = ["| rows on | decode tok/s | vs base model alone | vs unmerged |",
             "|---|---:|---:|---:|"]
    lines += [f"| {name} | {rate:.0f} | {rate / median['base model alone']:.3f} | "
              f"{rate / median['adapter unmerged']:.3f} |" for name, rate in median.items()]
    command = " ".join([".venv/bin/python bench/merge.py", *sys.argv[1:]])
    text = "\n".join([
        (f"{batch} sequences decoding {new_tokens} tokens each after their prefill, median of "
         f"{rounds} rounds, the three ways in turn; tiny LLaMA (4 layers, hidden 256), float32, "
         f"CPU, {args.threads} torch thread(s); one rank-16 adapter on all 7 projections; "
         "in-process ModelRunner (torch LoRA backend)."),
        "", *lines, "",
        f"- sequences whose greedy tokens are the same merged and unmerged: {same}/{batch}",
        machine_line(load), f"- command: `{command}`", ""])
    print("\n" + text)
    if not args.quick:
        RESULTS.write_text("# A merged adapter's decode throughput on CPU\n\n" + text)
        print(f"wrote {RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
