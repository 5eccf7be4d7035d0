"""BENCHMARK MODE (`--benchmark-step-s`): an executor without a forward pass, to measure the
control plane (scheduler, gateway, gRPC) alone. Never a default, and only on random weights.

It keeps every promise of ModelRunner but the numbers: it validates and mirrors each step
exactly as ModelRunner does (sequences, block tables, adapter slots, merges), then, instead of
computing, samples token `(31 * len(tokens) + seq_id) % (vocab - 2) + 2` for every sequence
that reached the end of its tokens (never 0 or 1, so never a tiny model's BOS or EOS), with
logprob 0, and sleeps until `step_s` has passed since the step began: steps take a steady,
chosen time, as on a GPU whose step time is known.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from executor.runner import ModelRunner, Row, Sampled
from executor.runner_checks import check_rows


def benchmark_token(num_tokens: int, seq_id: int, vocab_size: int) -> int:
    """The token a benchmark executor samples after `num_tokens` tokens of sequence seq_id."""
    return (31 * num_tokens + seq_id) % (vocab_size - 2) + 2


class BenchmarkRunner(ModelRunner):
    def __init__(self, *args, step_s: float, **kw) -> None:
        super().__init__(*args, **kw)
        if not step_s > 0:
            raise ValueError(f"benchmark step time must be > 0, got {step_s}")
        self.step_s = step_s

    def step_with_logits(self, rows: Sequence[Row]) -> tuple[list[Sampled], torch.Tensor]:
        start = time.perf_counter()
        check_rows(self, self._seqs, rows)
        sampled = []
        for r in rows:
            seq = self._seqs[r.seq_id]
            self.kv_tables.extend(seq.tables, r.new_block_ids, r.num_new_by_kind)
            seq.num_computed += r.num_tokens
            if seq.num_computed == len(seq.token_ids):
                token = benchmark_token(len(seq.token_ids), r.seq_id, self.config.vocab_size)
                seq.token_ids.append(token)
                sampled.append(Sampled(r.seq_id, token, 0.0))
        time.sleep(max(0.0, self.step_s - (time.perf_counter() - start)))
        return sampled, torch.empty(len(sampled), 0)
