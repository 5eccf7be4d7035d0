"""Per-request sampling: greedy, temperature, top-k, top-p, seeded.

Every sequence draws from its own torch.Generator, so a request's tokens depend only on its own
logits and seed, never on what else is in its batch. The returned logprob is the token's
log-probability under the model's unmodified distribution (log_softmax of the raw logits).
"""

from __future__ import annotations

import math

import torch

from common.sampling import SamplingParams


def make_generator(seed: int | None, device: str | torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()  # non-deterministic, still private to this sequence
    else:
        gen.manual_seed(seed)
    return gen


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
           generators: list[torch.Generator]) -> tuple[list[int], list[float]]:
    """logits [S, V] fp32, one row per sequence -> (token ids, logprobs), one per row.

    Greedy rows (temperature 0) are taken with one batched argmax; sampled rows each draw from
    their own generator.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [S, V]
    tokens = torch.argmax(logits, dim=-1)  # [S]
    for i, p in enumerate(params):
        if p.temperature > 0:
            probs = filtered_probs(logits[i], p.temperature, p.top_k, p.top_p)  # [V]
            tokens[i] = torch.multinomial(probs, 1, generator=generators[i])[0]
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]  # [S]
    return tokens.tolist(), chosen.tolist()
