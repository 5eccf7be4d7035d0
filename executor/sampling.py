"""Per-request sampling: greedy, temperature, top-k, top-p, seeded.

Draws are counter-based: the draw for a sequence's i-th sampled token is seeded by (seed, i) alone
(`DrawStream`), never by what came before on this executor. So a request's tokens depend only on
its own logits, its seed and their index: the same alone, in any batch, and after a preemption or
a failover recomputes it on another executor from its tokens so far (the step says how many of
them were sampled, so the index carries on where it stopped). The returned logprob is the token's
log-probability under the model's unmodified distribution (log_softmax of the raw logits).
"""

from __future__ import annotations

import math
import secrets

import torch

from common.sampling import SamplingParams

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


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int,
                   top_p: float) -> torch.Tensor:
    """logits [V] -> probabilities [V] after temperature, top-k and top-p (nucleus) filtering."""
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
    return probs


def sample(logits: torch.Tensor, params: list[SamplingParams],
           streams: list[DrawStream]) -> tuple[list[int], list[float]]:
    """logits [S, V] fp32, one row per sequence -> (token ids, logprobs), one per row.

    Greedy rows (temperature 0) are taken with one batched argmax; sampled rows each draw from
    their own stream (every row advances its stream, so an index is a token's position).
    A row whose logits are NaN or +inf (an adapter with huge weights overflowed) has no
    distribution to draw from: it takes its argmax instead, so that one sequence's garbage never
    fails the step of every other.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [S, V]
    tokens = torch.argmax(logits, dim=-1)  # [S]
    broken = ((torch.isnan(logits) | torch.isposinf(logits)).any(dim=-1).tolist()  # [S]
              if any(p.temperature > 0 for p in params) else ())
    for i, p in enumerate(params):
        generator = streams[i].next()
        if p.temperature > 0 and not broken[i]:
            probs = filtered_probs(logits[i], p.temperature, p.top_k, p.top_p)  # [V]
            tokens[i] = torch.multinomial(probs, 1, generator=generator)[0]
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]  # [S]
    return tokens.tolist(), chosen.tolist()
