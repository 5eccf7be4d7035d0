"""loraplex's decode step against a bare forward loop of the same weights, on a model where the
matmuls dominate: a random-weight LLaMA of about 100M parameters (8 layers x 1024, intermediate
2816, 16 heads / 4 KV heads, vocabulary 8192), float32, CPU.

    python bench/compute_bound_step.py [--quick] [--threads 1] [--out FILE]

For each batch size, B sequences with prompts of 64 random tokens are prefilled, then decode
steps of all B are timed one by one:
- loraplex: ModelRunner.step as the executor runs it (paged KV cache, StepMetadata, the torch
  attention path, greedy sampling), no adapter;
- bare: transformers' LlamaForCausalLM forward over the same checkpoint with its own contiguous
  KV cache (DynamicCache), one token per sequence, then an argmax: no scheduler, no paging.
Rounds alternate between the two; a round is STEPS decode steps after the prefill (its first
steps not timed). ms per step: the median over every timed step of every round. Both must pick
the same greedy tokens at every step (the table says so).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import serving  # noqa: E402

from common.sampling import SamplingParams  # noqa: E402
from executor.runner import ModelRunner, Row  # noqa: E402

LAYERS, HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, VOCAB = 8, 1024, 2816, 16, 4, 8192
PROMPT, BLOCK, WARM = 64, 16, 2


def save_model(folder: Path) -> int:
    """A random LLaMA checkpoint in `folder`; its number of parameters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
                         max_position_embeddings=2048, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def loraplex_round(runner: ModelRunner, prompts: list[list[int]], steps: int,
                   first_id: int) -> tuple[list[float], list[list[int]]]:
    """Prefill, then `steps` timed decode steps: (seconds per step, tokens per sequence)."""
    blocks = -(-(PROMPT + steps + WARM + 1) // BLOCK)
    ids = [first_id + i for i in range(len(prompts))]
    for seq_id, prompt in zip(ids, prompts):
        runner.add_sequence(seq_id, prompt, SamplingParams(), -1)
    runner.step([Row(s, PROMPT, tuple(range(i * blocks, (i + 1) * blocks)))
                 for i, s in enumerate(ids)])
    decode = [Row(s, 1) for s in ids]
    times = []
    for step in range(WARM + steps):
        start = time.perf_counter()
        runner.step(decode)
        if step >= WARM:
            times.append(time.perf_counter() - start)
    tokens = [runner.tokens(s)[PROMPT:] for s in ids]
    for s in ids:
        runner.free_sequence(s)
    return times, tokens


@torch.inference_mode()
def bare_round(model, prompts: list[list[int]], steps: int) -> tuple[list[float],
                                                                   list[list[int]]]:
    from transformers import DynamicCache

    cache = DynamicCache()
    out = model(input_ids=torch.tensor(prompts), past_key_values=cache, use_cache=True)
    token = out.logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
    tokens, times = [token], []
    for step in range(WARM + steps):
        start = time.perf_counter()
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        if step >= WARM:
            times.append(time.perf_counter() - start)
        tokens.append(token)
    return times, torch.cat(tokens, dim=1).tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="batch 4 only, 2 rounds of 4 steps")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batches, rounds, steps = ((4,), 2, 4) if args.quick else ((1, 16, 64), args.rounds, args.steps)
    load = os.getloadavg()[0]
    from transformers import LlamaForCausalLM

    with tempfile.TemporaryDirectory(prefix="loraplex-compute-bound-") as folder:
        num_params = save_model(Path(folder))
        bare = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        blocks = max(batches) * -(-(PROMPT + steps + WARM + 1) // BLOCK)
        runner = ModelRunner.from_pretrained(folder, num_kv_blocks=blocks, block_size=BLOCK,
                                             num_slots=1, max_rank=16)
        rows = []
        for batch in batches:
            prompts = serving.make_prompts(batch, VOCAB, seed=batch)
            prompts = [(p * (PROMPT // len(p) + 1))[:PROMPT] for p in prompts]  # PROMPT each
            ours, theirs, equal = [], [], True
            for r in range(rounds):
                for name in (("loraplex", "bare") if r % 2 == 0 else ("bare", "loraplex")):
                    if name == "loraplex":
                        times, ours_tokens = loraplex_round(runner, prompts, steps, 1000 * r)
                        ours += times
                    else:
                        times, bare_tokens = bare_round(bare, prompts, steps)
                        theirs += times
                equal &= ours_tokens == bare_tokens
            a, b = statistics.median(ours) * 1e3, statistics.median(theirs) * 1e3
            rows.append(f"| {batch} | {a:.2f} | {b:.2f} | {a / b:.2f} | "
                        f"{'yes' if equal else 'no'} |")
            print(rows[-1], flush=True)
    text = "\n".join([
        "# Decode step on a compute-bound model: loraplex vs a bare forward loop (CPU)", "",
        (f"Random LLaMA, {num_params / 1e6:.0f}M parameters ({LAYERS} layers x {HIDDEN}, "
         f"intermediate {INTERMEDIATE}, {HEADS} heads / {KV_HEADS} KV heads, vocabulary "
         f"{VOCAB}), float32; prompts of {PROMPT} tokens, then decode steps of every sequence "
         f"(ms per step: median of {rounds} alternating rounds x {steps} steps; bare: "
         "transformers' forward with its DynamicCache and an argmax, no adapter either side)."),
        "", "| sequences | loraplex step (ms) | bare forward (ms) | loraplex / bare | "
            "greedy tokens equal |", "|---:|---:|---:|---:|:---|", *rows, "",
        f"- torch threads: {args.threads}", serving.machine_line(load),
        "- command: `.venv/bin/python bench/compute_bound_step.py"
        + "".join(f" {a}" for a in sys.argv[1:]) + "`", ""])
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
