"""Per-request sampling: greedy, temperature, top-k, top-p, min-p, seeded.

Draws are counter-based: the draw for a sequence's i-th sampled token is seeded by (seed, i) alone
(`DrawStream`), never by what came before on this executor. So a request's tokens depend only on
its own logits, its seed and their index: the same alone, in any batch, and after a preemption or
a failover recomputes it on another executor from its tokens so far (the step says how many of
them were sampled, so the index carries on where it stopped).

`Sampler` is a step's sampling from end to end: the logits' processing (logit_bias, penalties:
executor/penalties.py) on the rows that have it, the draws (`sample`), the sampled tokens'
logprobs and alternatives (executor/logprobs.py), and the token counts penalties keep.
"""

from __future__ import annotations

import math
import secrets

import torch

from common.sampling import SamplingParams
from executor.grammar import GrammarRows
from executor.logprobs import TopLogprobs, top_logprobs
from executor.penalties import LogitBias, PenaltyTable, process_logits

_MASK64 = 2**64 - 1


def draw_seed(seed: int, index: int) -> int:
    """The seed of draw `index` of a stream seeded `seed`: SplitMix64 of their combination, so
    neighbouring seeds and indices give unrelated draws."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class DrawStream:
    """The random draws of one sequence; `index` is the sequence's number of sampled tokens."""

    def __init__(self, seed: int | None, index: int, device: str | torch.device):
        self.seed = secrets.randbits(64) if seed is None else seed
        self.index = index
        self._gen = torch.Generator(device=device)

    def next(self) -> torch.Generator:
        """The generator for the next draw (every sampled token takes one, greedy or not)."""
        self._gen.manual_seed(draw_seed(self.seed, self.index))
        self.index += 1
        return self._gen


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                   min_p: float = 0.0) -> torch.Tensor:
    """logits [V] -> probabilities [V] after temperature, top-k, top-p (nucleus) and min-p
    filtering, in HF transformers' order."""
    # Shifted so the largest is 0 before dividing: a tiny temperature (1e-40) then sends the others
    # to -inf instead of every logit to +-inf (inf - inf is NaN: no distribution to draw from).
    logits = logits.float()
    scaled = (logits - logits.max()) / temperature  # [V]
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, -math.inf)
    probs = torch.softmax(scaled, dim=-1)  # [V]
    if top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)  # [V]
        # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
        drop = torch.cumsum(sorted_probs, 0) - sorted_probs >= top_p
        probs = probs.scatter(0, order[drop], 0.0)
        probs = probs / probs.sum()
    if min_p > 0:  # (relative to the most likely token, which every filter above keeps)
        probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)
        probs = probs / probs.sum()
    return probs


def sample(scores: torch.Tensor, params: list[SamplingParams],
           streams: list[DrawStream]) -> torch.Tensor:
    """scores [S, V] fp32, one row per sequence -> the token ids drawn [S] (long).

    Greedy rows (temperature 0) are taken with one batched argmax; sampled rows each draw from
    their own stream (every row advances its stream, so an index is a token's position).
    A row whose scores are NaN or +inf (an adapter with huge weights overflowed) has no
    distribution to draw from: it takes its argmax instead, so that one sequence's garbage never
    fails the step of every other.
    """
    tokens = torch.argmax(scores, dim=-1)  # [S]
    broken = ((torch.isnan(scores) | torch.isposinf(scores)).any(dim=-1).tolist()  # [S]
              if any(p.temperature > 0 for p in params) else ())
    for i, p in enumerate(params):
        generator = streams[i].next()
        if p.temperature > 0 and not broken[i]:
            probs = filtered_probs(scores[i], p.temperature, p.top_k, p.top_p, p.min_p)  # [V]
            tokens[i] = torch.multinomial(probs, 1, generator=generator)[0]
    return tokens


class Sampler:
    """The sampling state of an executor's sequences (their penalties' token counts, their
    logit biases), and a step's sampling."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.penalties = PenaltyTable(vocab_size, device)
        self.bias = LogitBias(device)
        self._penalty_rows: dict[int, int] = {}  # seq id -> its row of the penalty table

    def add(self, seq_id: int, token_ids: list[int], num_generated: int,
            sampling: SamplingParams) -> None:
        """A sequence of `token_ids`, the last `num_generated` of them sampled before (a
        recompute): its counts are rebuilt from them."""
        if sampling.has_penalties:
            self._penalty_rows[seq_id] = self.penalties.add(token_ids, num_generated, sampling)
        self.bias.add(seq_id, sampling)

    def free(self, seq_id: int) -> None:
        row = self._penalty_rows.pop(seq_id, None)
        if row is not None:
            self.penalties.release(row)
        self.bias.discard(seq_id)

    def clear(self) -> None:
        self._penalty_rows.clear()
        self.penalties.clear()
        self.bias.clear()

    def sample(self, logits: torch.Tensor, seq_ids: list[int], params: list[SamplingParams],
               draws: list[DrawStream], grammars: GrammarRows | None = None
               ) -> tuple[list[int], list[float], list[TopLogprobs | None]]:
        """logits [S, V] fp32 of sequences seq_ids -> (token ids, their logprobs, their
        alternatives where asked for), one per row. `grammars`: the constrained rows' matchers
        (None: no row has one), whose masks apply after the penalties."""
        rows = [self._penalty_rows.get(s) for s in seq_ids] if self._penalty_rows else ()
        scores = process_logits(logits, seq_ids, params, rows, self.penalties,
                                self.bias)  # [S, V]
        if grammars is not None:
            if scores is logits:  # (the logits stay the model's: logprobs are of them)
                scores = logits.clone()
            grammars.constrain(scores, seq_ids)
        tokens = sample(scores, params, draws)  # [S]
        logprobs = torch.log_softmax(logits, dim=-1)  # [S, V] (the model's distribution)
        chosen = logprobs.gather(1, tokens[:, None])[:, 0]  # [S]
        if any(r is not None for r in rows):
            held = [i for i, r in enumerate(rows) if r is not None]
            index = torch.tensor(held, device=logits.device)
            self.penalties.record(torch.tensor([rows[i] for i in held], device=logits.device),
                                  tokens.index_select(0, index))
        return tokens.tolist(), chosen.tolist(), top_logprobs(logprobs,
                                                              [p.top_logprobs for p in params])
