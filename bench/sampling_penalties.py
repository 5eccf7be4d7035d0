"""What a step's sampling costs with the per-row processing of issue 33 on every row, against
none (executor/sampling.py Sampler.sample: the logits of a decode step in, tokens, logprobs and
alternatives out), at a real model's vocabulary:

    none       greedy rows, no processing (the plain path: argmax, log-softmax, gather)
    penalties  every row with repetition, frequency and presence penalties (its token counts
               kept in the executor's table: gathered, applied, updated with the samples)
    bias       every row with a logit_bias of 16 tokens
    all        every row with penalties, logit_bias, min_p sampling and 5 alternatives
    sampled    sampled rows (temperature, top_p) without the new processing, for scale

Each row's sequence holds a 512-token prompt and 256 sampled tokens. The cases are interleaved
round by round (a shared machine's noise falls on each alike); medians are reported, with the
1-minute load average. One torch thread, glibc malloc set as the executor sets it.

    .venv/bin/python bench/sampling_penalties.py --out bench/results/sampling-penalties-cpu.md
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

from common.allocator import keep_freed_memory  # noqa: E402
from common.sampling import SamplingParams  # noqa: E402
from executor.sampling import DrawStream, Sampler  # noqa: E402

PROMPT, OUTPUT = 512, 256


def cases(vocab: int) -> dict[str, SamplingParams]:
    rng = random.Random(0)
    bias = tuple((t, rng.uniform(-5, 5)) for t in rng.sample(range(vocab), 16))
    penalties = {"repetition_penalty": 1.1, "frequency_penalty": 0.3, "presence_penalty": 0.2}
    return {
        "none": SamplingParams(),
        "penalties": SamplingParams(**penalties),
        "bias": SamplingParams(logit_bias=bias),
        "all": SamplingParams(temperature=0.8, top_p=0.95, min_p=0.05, seed=1, logit_bias=bias,
                              top_logprobs=5, **penalties),
        "sampled": SamplingParams(temperature=0.8, top_p=0.95, seed=1),
    }


def sampler_for(params: SamplingParams, rows: int, vocab: int, device: str):
    """A Sampler holding `rows` sequences of this sampling, and their draw streams."""
    sampler, rng = Sampler(vocab, torch.device(device)), random.Random(1)
    for seq_id in range(rows):
        tokens = [rng.randrange(vocab) for _ in range(PROMPT + OUTPUT)]
        sampler.add(seq_id, tokens, OUTPUT, params)
    return sampler, [DrawStream(params.seed, OUTPUT, device) for _ in range(rows)]


def nucleus_size(logits: torch.Tensor, params: SamplingParams) -> int:
    """The median number of tokens in the rows' top_p nucleus at this temperature (what the
    nucleus search looks through: executor/sampling.py NUCLEUS_CANDIDATES)."""
    probs = torch.softmax(logits.float() / params.temperature, -1)
    top = torch.sort(probs, -1, descending=True).values
    return int(((torch.cumsum(top, -1) - top) < params.top_p).sum(-1).median())


def time_call(sampler, logits, params, draws, device: str) -> float:
    rows = logits.shape[0]
    start = time.perf_counter()
    sampler.sample(logits, list(range(rows)), [params] * rows, draws)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32_000, 128_256])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--logit-std", type=float, default=3.0,
                        help="the logits are N(0, std^2): larger, peakier rows, smaller nuclei")
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    keep_freed_memory()  # (as the executor does: its [rows, vocab] temporaries reuse the heap)
    names = list(cases(1000))
    lines = [f"device {args.device}, torch threads 1, rows x vocab, logits N(0, "
             f"{args.logit_std:g}^2); median ms per sampling call over {args.rounds} rounds (x "
             "none in brackets); nucleus: the median row's top_p nucleus in tokens", "",
             "| rows | vocab | " + " | ".join(names) + " | nucleus |",
             "|---:|---:|" + "---:|" * len(names) + "---:|"]
    for vocab in args.vocab:
        for rows in args.rows:
            params = cases(vocab)
            made = {n: sampler_for(p, rows, vocab, args.device) for n, p in params.items()}
            logits = torch.randn(rows, vocab, device=args.device) * args.logit_std  # [S, V]
            times = {n: [] for n in names}
            for _ in range(args.rounds):
                for n in names:
                    sampler, draws = made[n]
                    times[n].append(time_call(sampler, logits, params[n], draws, args.device))
            med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
            cells = [f"{med[n]:.2f} ({med[n] / med['none']:.2f}x)" for n in names]
            lines.append(f"| {rows} | {vocab:,} | " + " | ".join(cells)
                         + f" | {nucleus_size(logits, params['sampled']):,} |")
            print(lines[-1], flush=True)
    lines += ["", f"load average (1 min) at the end: {os.getloadavg()[0]:.2f}"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(f"# Sampling with per-row processing against none\n\n"
                            f"`.venv/bin/python bench/sampling_penalties.py --out {args.out}`\n\n"
                            f"{text}\n")


if __name__ == "__main__":
    main()
