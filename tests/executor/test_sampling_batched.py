"""executor/sampling.py draws a step's sampled rows together: each row's filtering is what the
plain per-row definition below gives (temperature, top-k, the nucleus by a whole sort, min-p),
whatever rows share its step, and each row's token is the one torch.multinomial draws from it
with its own generator; a row left without a distribution takes its argmax."""

import math

import pytest
import torch

from common.sampling import SamplingParams
from executor.sampling import NUCLEUS_CANDIDATES, DrawStream, filtered_probs, sample


def one_row(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The definition, on one row [V]: HF's order, the nucleus by sorting the whole row."""
    scaled = (logits - logits.max()) / p.temperature
    if 0 < p.top_k < len(scaled):
        scaled = scaled.masked_fill(scaled < torch.topk(scaled, p.top_k).values[-1], -math.inf)
    probs = torch.softmax(scaled, -1)
    if p.top_p < 1:  # the fewest likeliest reaching top_p, and any token tied with the last
        top = torch.sort(probs, descending=True).values
        last = top[max(int((torch.cumsum(top, 0) - top < p.top_p).sum()) - 1, 0)]
        probs = probs.masked_fill(probs < last, 0.0)
        probs = probs / probs.sum()
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        probs = probs / probs.sum()
    return probs


PARAMS = [SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.0),
          SamplingParams(temperature=0.5, top_k=40, top_p=0.8, min_p=0.05),
          SamplingParams(temperature=1.3, min_p=0.2), SamplingParams(temperature=0.9, top_k=3),
          SamplingParams(temperature=1.0, top_p=0.999)]


@pytest.mark.parametrize("vocab,spread", [(1000, 3.0), (32_000, 6.0), (32_000, 0.3)])
def test_each_row_is_filtered_as_alone_by_the_plain_definition(vocab, spread):
    """(spread 6: every nucleus within the candidates; 0.3: flat rows that go past them)"""
    logits = torch.randn(len(PARAMS), vocab, generator=torch.Generator().manual_seed(3)) * spread
    batched = filtered_probs(logits, PARAMS)
    for i, p in enumerate(PARAMS):
        alone = filtered_probs(logits[i:i + 1], [p])[0]
        assert torch.equal(batched[i], alone)
        assert torch.equal(alone.nonzero(), one_row(logits[i], p).nonzero())
        torch.testing.assert_close(alone, one_row(logits[i], p), rtol=1e-6, atol=1e-9)


def test_the_nucleus_past_the_candidates_is_the_whole_sorts():
    """A row whose nucleus holds more than NUCLEUS_CANDIDATES tokens beside one within them."""
    vocab = 4 * NUCLEUS_CANDIDATES
    flat = torch.arange(vocab, dtype=torch.float32) * 1e-5  # (no two alike)
    peaked = torch.arange(vocab, dtype=torch.float32) / 50
    params = [SamplingParams(temperature=1.0, top_p=0.95)] * 2
    probs = filtered_probs(torch.stack([flat, peaked]), params)
    assert abs(int((probs[0] > 0).sum()) - 0.95 * vocab) < 0.01 * vocab
    assert 0 < int((probs[1] > 0).sum()) < NUCLEUS_CANDIDATES
    for i, row in enumerate((flat, peaked)):
        assert torch.equal(probs[i].nonzero(), one_row(row, params[i]).nonzero())


def test_the_draws_are_torch_multinomials_with_each_rows_generator():
    logits = torch.randn(len(PARAMS) + 1, 32_000, generator=torch.Generator().manual_seed(4)) * 4
    params = [SamplingParams(), *PARAMS]  # (a greedy row first: it still takes its draw)
    for index in range(20):
        streams = [DrawStream(seed, index, "cpu") for seed in range(len(params))]
        tokens = sample(logits, params, streams).tolist()
        expected = []
        for i, p in enumerate(params):
            generator = DrawStream(i, index, "cpu").next()
            expected.append(int(logits[i].argmax()) if p.temperature == 0 else int(
                torch.multinomial(one_row(logits[i], p), 1, generator=generator)[0]))
        assert tokens == expected
        assert all(s.index == index + 1 for s in streams)


def test_tokens_tied_at_the_nucleus_cut_are_kept_together():
    """(bf16 logits make ties common: which of them a sort puts first must not matter)"""
    vocab = 4 * NUCLEUS_CANDIDATES
    probs = torch.full((vocab,), 1e-9)
    probs[:500] = 1.0  # 500 tied tokens hold nearly all the mass: top_p 0.5 cuts among them
    logits = torch.log(probs)
    for top_p in (0.5, 0.999):
        kept = filtered_probs(logits[None], [SamplingParams(temperature=1.0, top_p=top_p)])[0]
        assert set(kept.nonzero().flatten().tolist()) == set(range(500))
    wide = torch.log(torch.full((vocab,), 1.0))  # every token tied: the nucleus is all of them
    kept = filtered_probs(wide[None], [SamplingParams(temperature=1.0, top_p=0.3)])[0]
    assert int((kept > 0).sum()) == vocab


def test_a_row_left_without_a_distribution_takes_its_argmax():
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(temperature=1e-50),  # (0 in float32: no distribution)
              SamplingParams(temperature=1.0, top_p=1e-50),  # (0 in float32: the top stays)
              SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.5)]
    logits[3] = -math.inf
    streams = [DrawStream(1, 0, "cpu") for _ in params]
    tokens = sample(logits, params, streams).tolist()
    assert tokens[0] == int(logits[0].argmax()) and tokens[1] == int(logits[1].argmax())
    assert tokens[3] == int(logits[3].argmax())
    assert 0 <= tokens[2] < 1000
