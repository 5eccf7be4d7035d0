"""Logprobs beyond the sampled token's: the most likely alternatives of a sample
(SamplingParams.top_logprobs), and the logprobs of a prompt's tokens (prompt_logprobs). Both are
of the model's own distribution (log_softmax of the raw logits), as the sampled token's is.

A prompt's logprobs come from the logits at every prompt position but the last: the logits at
position j give the logprob of token j + 1. A prefill chunk computing positions [a, b) gives
those of tokens a + 1 .. min(b, L - 1) of a prompt of L tokens (position L - 1's logits are the
first sample's). They are made in slices of PROMPT_SLICE rows, so a long chunk never holds its
[rows, vocab] logits at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

PROMPT_SLICE = 256  # prompt positions whose logits are made at once


@dataclass(frozen=True)
class TopLogprobs:
    """The most likely tokens at one position, most likely first."""

    token_ids: list[int]
    logprobs: list[float]


def top_logprobs(logprobs: torch.Tensor, counts: list[int]) -> list[TopLogprobs | None]:
    """logprobs [S, V] -> for row i its counts[i] most likely tokens (None where 0): one topk
    over the rows that ask, at the largest count among them."""
    rows = [i for i, n in enumerate(counts) if n]
    tops: list[TopLogprobs | None] = [None] * len(counts)
    if not rows:
        return tops
    k = max(counts[i] for i in rows)
    values, ids = torch.topk(logprobs[rows], k, dim=-1)  # [R, k] each
    for i, row_values, row_ids in zip(rows, values.tolist(), ids.tolist()):
        tops[i] = TopLogprobs(row_ids[:counts[i]], row_values[:counts[i]])
    return tops


@dataclass
class PromptLogprobs:
    """The logprobs of a prompt's tokens (all but the first), as its prefill chunks make them."""

    num_top: int  # alternatives per token
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)

    @torch.inference_mode()
    def extend(self, logits_of, hidden: torch.Tensor, targets: list[int]) -> None:
        """Add the logprobs of `targets` (the next prompt tokens), predicted by the hidden states
        hidden [N, hidden] of the positions before each; logits_of: hidden -> logits (fp32)."""
        target = torch.tensor(targets, device=hidden.device)  # [N]
        for start in range(0, len(targets), PROMPT_SLICE):
            end = start + PROMPT_SLICE
            logits = logits_of(hidden[start:end])  # [n, V]
            if logits is None:  # (a rank but the first of a tensor-parallel group: it met the
                continue        # gather; rank 0 keeps the logprobs)
            logprobs = torch.log_softmax(logits, dim=-1)  # [n, V]
            self.logprobs += logprobs.gather(1, target[start:end, None])[:, 0].tolist()
            if self.num_top:
                values, ids = torch.topk(logprobs, self.num_top, dim=-1)  # [n, num_top]
                self.top_token_ids += ids.flatten().tolist()
                self.top_logprobs += values.flatten().tolist()
        self.token_ids += targets
