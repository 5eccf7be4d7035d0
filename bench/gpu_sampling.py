"""Section 8 of the GPU check: a step's sampling (executor/sampling.py Sampler.sample) with the
per-row processing of issue 33 on every row against none, at Llama-3's vocabulary (128,256) and
256 decode rows: penalties (repetition, frequency, presence, each row's token counts kept on the
device), a 16-token logit_bias, everything (with min_p sampling and 5 alternatives), and plain
temperature + top_p sampling for scale (bench/sampling_penalties.py, its CPU twin, makes the
cases).
"""

from __future__ import annotations

from gpu_harness import DEVICE, OPTS, REPORT, bench_ms, section, table  # first

import torch
from sampling_penalties import cases, sampler_for


@section("8. Sampling: penalties, logit_bias, alternatives on every row vs none")
def sampling_check() -> None:
    rows, vocab = (8, 1000) if OPTS.smoke else (256, 128_256)
    params = cases(vocab)
    logits = torch.randn(rows, vocab, device=DEVICE) * 3  # [S, V]
    ms = {}
    for name, p in params.items():
        sampler, draws = sampler_for(p, rows, vocab, DEVICE)
        ids = list(range(rows))
        ms[name] = bench_ms(lambda: sampler.sample(logits, ids, [p] * rows, draws))
        print(name, ms[name], flush=True)
    REPORT.append(f"{rows} rows x {vocab} vocabulary, each row's sequence 768 tokens; ms = "
                  "do_bench median of one Sampler.sample call (tokens back on the host).\n\n")
    REPORT.append(table(["case", "ms", "x none"], [[n, v, v / ms["none"]] for n, v in ms.items()]))
