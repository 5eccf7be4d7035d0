"""Logits processing before a draw, for the rows that ask for it: logit_bias, then the
repetition, frequency and presence penalties (protos/common.proto SamplingParams), each batched
over the rows that have it. A step whose sequences ask for none of them is not touched.

Penalties need to know which tokens a sequence holds. `PenaltyTable` keeps, for each sequence
that has a penalty (and only those), a row of per-token state on the device, updated in place
with each step's samples (one scatter for the batch, no Python per token):

    output_counts [capacity, V] int32: how often each token is in the sequence's output
    subtracted    [capacity, V] fp32:  frequency x count + presence x (count > 0), what the
                                       frequency and presence penalties take off each logit
    seen          [capacity, V] bool:  the token is in its prompt or output (repetition)

A sequence's row is built from its tokens when it is added, so a sequence recomputed after a
preemption or a failover (prompt + the tokens sampled so far, NewSequence.num_generated of them
being output) gets the same counts it had, and so the same penalties and the same draws. Each
penalty works on the rows that have it: a row with only a repetition penalty costs one pass over
its logits less than one with all three.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from common.sampling import SamplingParams


class PenaltyTable:
    """Token counts of the sequences that have a penalty, a row each."""

    def __init__(self, vocab_size: int, device: torch.device, capacity: int = 0):
        """Its tables hold `capacity` rows at first (none: an executor whose sequences never ask
        for a penalty holds no memory for them) and grow by doubling."""
        self.vocab_size, self.device = vocab_size, device
        self.output_counts = torch.zeros(capacity, vocab_size, dtype=torch.int32, device=device)
        self.subtracted = torch.zeros(capacity, vocab_size, device=device)
        self.seen = torch.zeros(capacity, vocab_size, dtype=torch.bool, device=device)
        # Per row: repetition, frequency and presence penalty. [capacity, 3] fp32
        self.params = torch.zeros(capacity, 3, device=device)
        self._free = list(range(capacity - 1, -1, -1))

    @property
    def capacity(self) -> int:
        return self.output_counts.shape[0]

    @property
    def num_rows(self) -> int:
        return self.capacity - len(self._free)

    def add(self, token_ids: Sequence[int], num_output: int, sampling: SamplingParams) -> int:
        """A row for a sequence of `token_ids`, its last `num_output` of them sampled: its
        index."""
        if not self._free:
            self._grow()
        row = self._free.pop()
        tokens = torch.tensor(token_ids, dtype=torch.long, device=self.device)  # [N]
        output = tokens[len(token_ids) - num_output:]  # [num_output]
        counts = torch.bincount(output, minlength=self.vocab_size)  # [V]
        self.output_counts[row] = counts
        self.subtracted[row] = (sampling.frequency_penalty * counts
                                + sampling.presence_penalty * (counts > 0))
        self.seen[row] = False
        self.seen[row, tokens] = True
        self.params[row] = torch.tensor([sampling.repetition_penalty, sampling.frequency_penalty,
                                         sampling.presence_penalty])
        return row

    def release(self, row: int) -> None:
        self._free.append(row)

    def clear(self) -> None:
        self._free = list(range(self.capacity - 1, -1, -1))

    def repeat(self, scores: torch.Tensor, score_rows: torch.Tensor,
               table_rows: torch.Tensor) -> None:
        """HF transformers' repetition penalty on scores[score_rows[i]] by table row
        table_rows[i], in place: a held token's logit divided by the penalty when positive,
        multiplied when negative."""
        sub = scores.index_select(0, score_rows)  # [P, V]
        seen = self.seen.index_select(0, table_rows)  # [P, V]
        penalty = self.params.index_select(0, table_rows)[:, 0:1].contiguous()  # [P, 1]
        # x / p where x > 0, x * p where x < 0, with each as HF computes it (the other term is
        # 0): no select on the sign, whose random mask is several times slower on CPU.
        held = sub.clamp(min=0).div_(penalty).add_(sub.clamp(max=0).mul_(penalty))  # [P, V]
        scores.index_copy_(0, score_rows, torch.where(seen, held, sub))

    def subtract(self, scores: torch.Tensor, score_rows: torch.Tensor,
                 table_rows: torch.Tensor) -> None:
        """OpenAI's frequency and presence penalties on scores[score_rows[i]] by table row
        table_rows[i], in place."""
        scores.index_add_(0, score_rows, self.subtracted.index_select(0, table_rows), alpha=-1)

    def record(self, table_rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Row table_rows[i] sampled token_ids[i] (rows distinct)."""
        self.output_counts[table_rows, token_ids] += 1
        params = self.params.index_select(0, table_rows)  # [P, 3]
        self.subtracted[table_rows, token_ids] = (
            params[:, 1] * self.output_counts[table_rows, token_ids] + params[:, 2])
        self.seen[table_rows, token_ids] = True

    def _grow(self) -> None:
        """Twice the rows, at least 8 (the old ones copied): a step's batch of penalised
        sequences only grows the table a few times over a stream's life."""
        old = self.capacity
        more = max(old, 8)
        grown = [torch.cat([t, t.new_zeros(more, *t.shape[1:])])
                 for t in (self.output_counts, self.subtracted, self.seen, self.params)]
        self.output_counts, self.subtracted, self.seen, self.params = grown
        self._free = list(range(old + more - 1, old - 1, -1)) + self._free


class LogitBias:
    """The logit_bias of each sequence that has one, as tensors made once, when it is added."""

    def __init__(self, device: torch.device):
        self.device = device
        self._of: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # seq id -> (ids, biases)

    def add(self, seq_id: int, sampling: SamplingParams) -> None:
        if sampling.logit_bias:
            ids, values = zip(*sampling.logit_bias)
            self._of[seq_id] = (torch.tensor(ids, dtype=torch.long, device=self.device),
                                torch.tensor(values, dtype=torch.float32, device=self.device))

    def discard(self, seq_id: int) -> None:
        self._of.pop(seq_id, None)

    def clear(self) -> None:
        self._of.clear()

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._of

    def __len__(self) -> int:
        return len(self._of)

    def apply(self, scores: torch.Tensor, rows: list[int], seq_ids: list[int]) -> None:
        """Add the biases of sequence seq_ids[i] to scores[rows[i]], in place (one scatter)."""
        parts = [self._of[s] for s in seq_ids]
        ids = torch.cat([p[0] for p in parts])  # [B] token ids
        values = torch.cat([p[1] for p in parts])  # [B]
        counts = torch.tensor([len(p[0]) for p in parts], device=self.device)
        row_of = torch.repeat_interleave(torch.tensor(rows, device=self.device), counts)  # [B]
        scores.index_put_((row_of, ids), values, accumulate=True)


def process_logits(logits: torch.Tensor, seq_ids: list[int], params: Sequence[SamplingParams],
                   penalty_rows: Sequence[int | None], table: PenaltyTable,
                   bias: LogitBias) -> torch.Tensor:
    """logits [S, V] fp32 of sequences seq_ids -> the scores to draw from: logit_bias added, then
    the repetition, frequency and presence penalties, each on the rows that have it
    (penalty_rows[i]: row i's row of the table, None for none; empty when no row has one).
    `logits` itself when no row has any (no copy); else a copy (the logits stay the model's:
    logprobs are of them)."""
    biased = [i for i, s in enumerate(seq_ids) if s in bias] if bias else []
    penalised = [i for i, r in enumerate(penalty_rows) if r is not None]
    if not biased and not penalised:
        return logits
    scores = logits.clone()
    if biased:
        bias.apply(scores, biased, [seq_ids[i] for i in biased])
    device = logits.device
    for rows, penalise in (
            ([i for i in penalised if params[i].repetition_penalty != 1], table.repeat),
            ([i for i in penalised if params[i].frequency_penalty or params[i].presence_penalty],
             table.subtract)):
        if rows:
            penalise(scores, torch.tensor(rows, device=device),
                     torch.tensor([penalty_rows[i] for i in rows], device=device))
    return scores
