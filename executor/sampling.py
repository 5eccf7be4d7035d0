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
NUCLEUS_CANDIDATES = 1024  # the likeliest tokens top_p looks among before sorting a whole row
CPU_ROWS_AT_ONCE = 8  # sampled rows a CPU filters and draws together


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

    def skip(self) -> None:
        """Pass the next draw by: a greedy token takes none (its generator is not seeded)."""
        self.index += 1


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits [R, V] -> probabilities [R, V] after each row's temperature, top-k, top-p (nucleus)
    and min-p filtering (`params`, one per row), in HF transformers' order. Each step is one
    batched operation over the rows that have it; on CPU a row's result does not depend on the
    others (on a GPU a batch's kernels may round a row's sums differently from one row's, as its
    logits' matmuls already do: a top_p cut within rounding of a boundary may move)."""
    device, vocab = logits.device, logits.shape[-1]
    # Shifted so the largest is 0 before dividing: a tiny temperature (1e-40) then sends the others
    # to -inf instead of every logit to +-inf (inf - inf is NaN: no distribution to draw from).
    logits = logits.float()
    temperature = torch.tensor([p.temperature for p in params], device=device)[:, None]
    scaled = (logits - logits.amax(-1, keepdim=True)) / temperature  # [R, V]
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(top_k):
        k = torch.tensor(top_k, device=device)[:, None]  # [R, 1] (0: none)
        kth = torch.topk(scaled, max(top_k)).values.gather(1, (k - 1).clamp(min=0))
        scaled = scaled.masked_fill(scaled < kth.masked_fill(k == 0, -math.inf), -math.inf)
    probs = torch.softmax(scaled, dim=-1)  # [R, V]
    rows = [i for i, p in enumerate(params) if p.top_p < 1]
    if rows:
        top_p = torch.tensor([params[i].top_p for i in rows], device=device)[:, None]
        probs[rows] = _nucleus(probs[rows], top_p)
    rows = [i for i, p in enumerate(params) if p.min_p > 0]
    if rows:  # (relative to the most likely token, which every filter above keeps)
        min_p = torch.tensor([params[i].min_p for i in rows], device=device)[:, None]
        some = probs[rows]
        some = some.masked_fill(some < min_p * some.amax(-1, keepdim=True), 0.0)
        probs[rows] = some / some.sum(-1, keepdim=True)
    return probs


def _nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """probs [R, V] kept on each row's smallest set of likeliest tokens whose mass reaches its
    top_p [R, 1] (the likeliest always), renormalized. Every token as likely as the least likely
    one kept is kept too: the set does not depend on how a sort orders tied tokens. On CPU it
    looks among each row's NUCLEUS_CANDIDATES likeliest first (a partial top-k: 1/7 to 1/15 of
    sorting rows of 32k-128k tokens) and sorts only the rows whose candidates hold less than their
    top_p: the same set either way. A GPU sorts every row (one kernel; a check would wait)."""
    if probs.is_cuda or probs.shape[-1] <= NUCLEUS_CANDIDATES:
        cut, _ = _cut(torch.sort(probs, dim=-1, descending=True).values, top_p)
    else:
        cut, mass = _cut(torch.topk(probs, NUCLEUS_CANDIDATES).values, top_p)
        past = (mass < top_p[:, 0]).nonzero()[:, 0].tolist()  # (nuclei beyond the candidates)
        if past:
            cut[past] = _cut(torch.sort(probs[past], dim=-1, descending=True).values,
                             top_p[past])[0]
    kept = probs.masked_fill(probs < cut, 0.0)
    return kept / kept.sum(-1, keepdim=True)


def _cut(top: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the least probability kept [R, 1], the mass of all of `top` [R]) for rows' likeliest
    probabilities `top` [R, k] in descending order: a token goes once the likelier ones reach
    top_p, and so does every one after it (the tokens after `top` too, when its mass does)."""
    mass = torch.cumsum(top, -1)
    drop = mass - top >= top_p
    drop[:, 0] = False  # (the likeliest stays, whatever top_p's rounding)
    return top.masked_fill(drop, math.inf).amin(-1, keepdim=True), mass[:, -1]


def sample(scores: torch.Tensor, params: list[SamplingParams],
           streams: list[DrawStream]) -> torch.Tensor:
    """scores [S, V] fp32, one row per sequence -> the token ids drawn [S] (long).

    Greedy rows (temperature 0) are taken with one batched argmax. Every row advances its own
    stream (so an index is a token's position), and the sampled rows draw from them together:
    each row's Exp(1) noise from its own generator, then argmax(probs / noise) over the batch,
    which is the token torch.multinomial(probs, 1) draws with that generator (its own method for
    one sample), in a few operations per step instead of a few per row.
    A row whose scores are NaN or +inf (an adapter with huge weights overflowed), or that
    filtering leaves no distribution (a temperature or top_p below float32's range, every score
    -inf), has none to draw from: it takes its argmax instead, so that one sequence's garbage
    never fails the step of every other.
    """
    tokens = torch.argmax(scores, dim=-1)  # [S]
    rows = [i for i, p in enumerate(params) if p.temperature > 0]  # (NaN or +inf scores leave
    # no distribution after filtering: such a row takes its argmax below, with no check first)
    generators = {i: streams[i].next() for i in rows}
    for i in set(range(len(streams))).difference(rows):
        streams[i].skip()
    # (a CPU takes them a few at a time: [rows, vocab] temporaries past its caches cost more than
    # the operations they save; 256 x 128k rows at once took 1.4x as long as one by one)
    at_once = max(len(rows), 1) if scores.is_cuda else CPU_ROWS_AT_ONCE
    for start in range(0, len(rows), at_once):
        part = rows[start:start + at_once]
        probs = filtered_probs(scores[part], [params[i] for i in part])  # [R, V]
        noise = torch.empty_like(probs)
        for j, i in enumerate(part):
            noise[j].exponential_(generator=generators[i])
        drawn = torch.argmax(probs / noise, dim=-1)
        tokens[part] = torch.where(torch.isfinite(probs.sum(-1)), drawn, tokens[part])
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
