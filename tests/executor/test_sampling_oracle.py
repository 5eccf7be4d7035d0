"""Sampling beyond temperature/top-k/top-p against HF transformers' own logits processors:
logit_bias (SequenceBiasLogitsProcessor), repetition_penalty (RepetitionPenaltyLogitsProcessor),
min_p (MinPLogitsWarper) and OpenAI's presence/frequency penalties (a LogitsProcessor here:
transformers has none), greedy through HF's generate() and seeded through HF's processors with
our draws; logprobs and top-k alternatives against compute_transition_scores; prompt logprobs
against a full forward. Every case runs batched beside rows that use none of it."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from common.errors import InvalidArgument
from common.sampling import SamplingParams
from executor.penalties import LogitBias, PenaltyTable, process_logits
from executor.runner import ModelRunner, Row
from executor.sampling import draw_seed
from tests.runner_driver import BLOCK, make_runner, prompts, run

NUM_TOKENS = 16


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's documented penalties over the output so far: logit - frequency x count -
    presence x (count > 0)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        output = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores).scatter_add_(1, output, torch.ones_like(
            output, dtype=scores.dtype))
        return scores - (self.frequency * counts + self.presence * (counts > 0))


def processors(prompt_len: int, p: SamplingParams) -> LogitsProcessorList:
    """HF's processors for `p`, in HF generate()'s order (warpers only when sampling)."""
    procs = []
    if p.logit_bias:
        procs.append(SequenceBiasLogitsProcessor({(t,): b for t, b in p.logit_bias}))
    if p.repetition_penalty != 1:
        procs.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    if p.presence_penalty or p.frequency_penalty:
        procs.append(OpenAIPenalties(prompt_len, p.presence_penalty, p.frequency_penalty))
    if p.temperature > 0:
        procs.append(TemperatureLogitsWarper(p.temperature))
        if p.top_k:
            procs.append(TopKLogitsWarper(p.top_k))
        if p.top_p < 1:
            procs.append(TopPLogitsWarper(p.top_p))
        if p.min_p:
            procs.append(MinPLogitsWarper(p.min_p))
    return LogitsProcessorList(procs)


def hf_generate(hf, prompt: list[int], adapter: str | None, p: SamplingParams, n: int):
    """HF generate() itself (greedy, its own processors): tokens, chosen-token logprobs
    (compute_transition_scores over the raw logits), raw logits [n, V]."""
    extra = [OpenAIPenalties(len(prompt), p.presence_penalty, p.frequency_penalty)] \
        if p.presence_penalty or p.frequency_penalty else []
    out = hf.generate(
        input_ids=torch.tensor([prompt]), adapter_names=[adapter or "__base__"],
        max_new_tokens=n, min_new_tokens=0, do_sample=False, eos_token_id=None, pad_token_id=0,
        repetition_penalty=p.repetition_penalty,
        sequence_bias={(t,): b for t, b in p.logit_bias} or None,
        logits_processor=LogitsProcessorList(extra), output_logits=True,
        return_dict_in_generate=True)
    scores = hf.compute_transition_scores(out.sequences, out.logits, normalize_logits=True)
    return (out.sequences[0, len(prompt):].tolist(), scores[0].tolist(),
            torch.cat(out.logits).float())


@torch.no_grad()
def hf_sample(hf, prompt: list[int], adapter: str | None, p: SamplingParams, n: int):
    """HF's model and processors, each token drawn as our executor draws it: multinomial with
    the generator seeded draw_seed(seed, i) (argmax when greedy)."""
    procs, tokens = processors(len(prompt), p), []
    kw = {"adapter_names": [adapter or "__base__"]}
    out = hf(input_ids=torch.tensor([prompt]), use_cache=True, **kw)
    for i in range(n):
        scores = procs(torch.tensor([prompt + tokens]), out.logits[:, -1].clone())[0]
        if p.temperature == 0:
            tokens.append(int(scores.argmax()))
        else:
            gen = torch.Generator().manual_seed(draw_seed(p.seed, i))
            tokens.append(int(torch.multinomial(torch.softmax(scores, -1), 1, generator=gen)))
        out = hf(input_ids=torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values,
                 use_cache=True, **kw)
    return tokens


@pytest.fixture(scope="module")
def fx(tiny):
    return tiny


def _slot(fx, name):
    return fx["valid"].index(name) if name else -1


def test_greedy_penalties_bias_and_top_logprobs_match_hf_generate(fx, hf_peft):
    ps = prompts(6, seed=11)
    plain = {i: hf_generate(hf_peft, ps[i], adapter, SamplingParams(), NUM_TOKENS)[0]
             for i, adapter in ((1, None), (2, "r4_attn"), (3, "r8_mlp"))}
    ps[1] = ps[1] + plain[1][:6]  # (OpenAI's penalties count the output only, not these)
    banned = ((plain[2][0], -100.0), (plain[2][3], -100.0), (5, 0.3), (77, 0.2))
    cases = [  # (adapter, sampling): four with processing, two without, in one batch
        ("r16_all", SamplingParams(repetition_penalty=1.3, top_logprobs=5)),
        (None, SamplingParams(presence_penalty=0.6, frequency_penalty=0.4, top_logprobs=2)),
        ("r4_attn", SamplingParams(logit_bias=banned, top_logprobs=1)),
        ("r8_mlp", SamplingParams(repetition_penalty=0.8, presence_penalty=-0.5,
                                  frequency_penalty=1.5,
                                  logit_bias=((plain[3][1], -100.0),), top_logprobs=20)),
        (None, SamplingParams()),
        ("r16_all", SamplingParams(top_logprobs=3)),
    ]
    runner = make_runner(fx)
    requests = {i: (ps[i], _slot(fx, a), p) for i, (a, p) in enumerate(cases)}
    samples: dict = {}
    got = run(runner, requests, NUM_TOKENS, chunk=5, admit=6, samples=samples)
    for i, (adapter, p) in enumerate(cases):
        tokens, scores, raw = hf_generate(hf_peft, ps[i], adapter, p, NUM_TOKENS)
        assert got[i][0] == tokens, f"case {i}: tokens differ from HF generate()"
        ours = samples[i]
        assert [s.logprob for s in ours] == pytest.approx(scores, abs=2e-4)
        hf_logprobs = torch.log_softmax(raw, -1)  # [n, V]
        for step, s in enumerate(ours):
            if not p.top_logprobs:
                assert s.top is None
                continue
            kth = float(hf_logprobs[step].topk(p.top_logprobs).values[-1])
            assert len(s.top.token_ids) == p.top_logprobs
            assert s.top.logprobs == sorted(s.top.logprobs, reverse=True)
            assert s.top.logprobs == pytest.approx(
                hf_logprobs[step, s.top.token_ids].tolist(), abs=2e-4)
            assert s.top.logprobs[-1] == pytest.approx(kth, abs=2e-4)  # (the top k of them)
    for i in (0, 1, 2, 3):  # each case's processing changed its tokens: the test can fail
        base = hf_generate(hf_peft, ps[i], cases[i][0], SamplingParams(), NUM_TOKENS)[0]
        assert got[i][0] != base, f"case {i}: its processing changed nothing"


def test_seeded_sampling_with_min_p_and_penalties_matches_hf_processors(fx, hf_peft):
    ps = prompts(7, seed=12)
    full = SamplingParams(temperature=0.7, top_k=60, top_p=0.95, min_p=0.3, seed=5,
                          repetition_penalty=1.4, presence_penalty=0.7, frequency_penalty=0.9,
                          logit_bias=((9, 0.5), (300, 1.0)))
    cases = [
        ("r16_all", full),
        (None, SamplingParams(temperature=0.5, min_p=0.4, seed=6)),
        ("r8_mlp", SamplingParams(temperature=1.0, seed=7)),  # plain seeded
        (None, SamplingParams()),  # greedy
        ("r4_attn", SamplingParams(temperature=0.6, seed=8, repetition_penalty=1.6)),
        ("r16_all", SamplingParams(temperature=0.3, seed=9, presence_penalty=2.0)),
        ("r16_all", SamplingParams(temperature=0.1, seed=10, frequency_penalty=1.0)),
    ]
    runner = make_runner(fx)
    requests = {i: (ps[i], _slot(fx, a), p) for i, (a, p) in enumerate(cases)}
    batched = run(runner, requests, NUM_TOKENS, chunk=4, admit=7)
    for i, (adapter, p) in enumerate(cases):
        expected = hf_sample(hf_peft, ps[i], adapter, p, NUM_TOKENS)
        assert batched[i][0] == expected, f"case {i}: tokens differ from HF's processors"
        alone = run(runner, {i: requests[i]}, NUM_TOKENS, seed=i)
        assert alone[i][0] == batched[i][0], f"case {i} depends on its batch"
    # Each field matters to a case: without it HF's processors draw other tokens.
    for i, field, off in [(0, "min_p", 0.0), (0, "repetition_penalty", 1.0),
                          (5, "presence_penalty", 0.0), (6, "frequency_penalty", 0.0),
                          (0, "logit_bias", ()), (1, "min_p", 0.0)]:
        adapter, p = cases[i]
        other = hf_sample(hf_peft, ps[i], adapter, dataclasses.replace(p, **{field: off}),
                          NUM_TOKENS)
        assert other != batched[i][0], f"case {i}: {field} changed no token"


def test_prompt_logprobs_match_a_full_forward_over_chunked_prefill(fx, hf_peft):
    ps = prompts(3, seed=13)
    prompt = ps[0] + ps[1]  # (long enough for several chunks)
    runner = make_runner(fx)
    requests = {0: (prompt, _slot(fx, "r16_all"), SamplingParams(prompt_logprobs=4)),
                1: (ps[2], -1, SamplingParams()),
                2: (prompt, -1, SamplingParams(prompt_logprobs=0, top_logprobs=2))}
    samples: dict = {}
    run(runner, requests, 3, chunk=5, admit=3, samples=samples)
    assert all(s.prompt is None for s in samples[1] + samples[0][1:] + samples[2][1:])
    for i, adapter in ((0, "r16_all"), (2, None)):
        got = samples[i][0].prompt
        with torch.no_grad():
            logits = hf_peft(input_ids=torch.tensor([prompt]),
                             adapter_names=[adapter or "__base__"]).logits[0]
        logprobs = torch.log_softmax(logits.float(), -1)[:-1]  # [L - 1, V]: of tokens 1..L-1
        assert got.token_ids == prompt[1:]
        assert got.logprobs == pytest.approx(
            logprobs.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist(), abs=2e-4)
        num_top = requests[i][2].prompt_logprobs
        assert len(got.top_token_ids) == len(got.top_logprobs) == num_top * (len(prompt) - 1)
        if num_top:
            tops = torch.tensor(got.top_logprobs).view(-1, num_top)
            ids = torch.tensor(got.top_token_ids).view(-1, num_top)
            torch.testing.assert_close(tops, logprobs.gather(1, ids), atol=2e-4, rtol=0)
            torch.testing.assert_close(tops[:, -1], logprobs.topk(num_top).values[:, -1],
                                       atol=2e-4, rtol=0)


def test_a_recomputed_sequence_rebuilds_its_counts_and_draws_the_same_tokens(fx):
    """A preemption or failover re-adds the sequence with its prompt and the tokens sampled so
    far (num_generated of them): its penalties count the same output, its draws carry on."""
    prompt = prompts(1, seed=14)[0]
    slot = _slot(fx, "r16_all")
    p = SamplingParams(temperature=0.1, seed=21, presence_penalty=0.5, frequency_penalty=1.0)
    whole = run(make_runner(fx), {0: (prompt, slot, p)}, NUM_TOKENS)[0][0]
    plain = run(make_runner(fx), {0: (prompt, slot, SamplingParams(temperature=0.1, seed=21))},
                NUM_TOKENS)[0][0]
    assert whole != plain  # (the counts matter)
    first = run(make_runner(fx), {0: (prompt, slot, p)}, 6)[0][0]
    assert first == whole[:6]
    other = make_runner(fx)  # (another executor)
    other.add_sequence(0, prompt + first, p, slot, num_generated=6)
    blocks = other.free_blocks()
    total, tokens = len(prompt) + 6, []
    table = blocks[:-(-total // BLOCK)]
    sampled = other.step([Row(0, total, tuple(table))])
    tokens.append(sampled[0].token_id)
    for _ in range(NUM_TOKENS - 7):
        total += 1
        new = (blocks[len(table)],) if -(-total // BLOCK) > len(table) else ()
        table += list(new)
        tokens.append(other.step([Row(0, 1, new)])[0].token_id)
    assert first + tokens == whole


def test_defaults_take_the_plain_path():
    """A step whose rows ask for no processing draws from the logits themselves (no copy, no
    table row); rows without it beside processed rows are left exactly as they were."""
    table, bias = PenaltyTable(50, torch.device("cpu")), LogitBias(torch.device("cpu"))
    logits = torch.randn(4, 50)
    params = [SamplingParams()] * 4
    assert process_logits(logits, [1, 2, 3, 4], params, (), table, bias) is logits
    bias.add(2, SamplingParams(logit_bias=((3, 5.0),)))
    params[2] = SamplingParams(frequency_penalty=1.0)
    row = table.add([1, 2, 3, 3], 2, params[2])
    scores = process_logits(logits, [1, 2, 3, 4], params, [None, None, row, None], table, bias)
    assert torch.equal(scores[[0, 3]], logits[[0, 3]])
    assert scores[1, 3] == logits[1, 3] + 5 and scores[2, 3] == logits[2, 3] - 2.0
    runner = ModelRunner.random("tiny", num_kv_blocks=16, block_size=BLOCK, num_slots=1,
                                max_rank=8)
    runner.add_sequence(1, [5, 6, 7], SamplingParams(temperature=1.0, seed=1), -1)
    assert runner.sampler.penalties.capacity == 0  # (no memory until a sequence has a penalty)
    runner.add_sequence(2, [5, 6, 7], SamplingParams(repetition_penalty=1.2), -1)
    assert runner.sampler.penalties.num_rows == 1 and runner.sampler.penalties.capacity == 8
    runner.free_sequence(2)
    runner.free_sequence(2)
    assert runner.sampler.penalties.num_rows == 0
    # Prompt logprobs: the step looks at its rows for them only while a sequence makes them.
    runner.add_sequence(3, [5, 6, 7], SamplingParams(prompt_logprobs=0), -1)
    runner.add_sequence(4, [5, 6, 7], SamplingParams(prompt_logprobs=0), -1)
    runner.free_sequence(3)
    sampled = runner.step([Row(1, 3, (0,)), Row(4, 3, (1,))])
    assert sampled[1].prompt.logprobs and runner._num_prompt_logprobs == 0


def test_penalty_table_grows_and_reuses_rows():
    table = PenaltyTable(10, torch.device("cpu"), capacity=2)
    rows = [table.add([i, i + 1], 1, SamplingParams(presence_penalty=1.0)) for i in range(5)]
    assert len(set(rows)) == 5 and table.capacity == 2 + 8
    assert table.output_counts[rows[3]].tolist() == [0] * 4 + [1] + [0] * 5
    assert table.subtracted[rows[3]].tolist() == [0] * 4 + [1] + [0] * 5
    assert table.seen[rows[3]].nonzero().flatten().tolist() == [3, 4]
    table.release(rows[1])
    again = table.add([7], 0, SamplingParams(presence_penalty=1.0))
    assert again == rows[1] and table.output_counts[again].sum() == 0
    assert table.seen[again].nonzero().flatten().tolist() == [7]


@pytest.mark.parametrize("params,field", [
    ({"min_p": -0.1}, "min_p"), ({"min_p": 1.5}, "min_p"), ({"min_p": math.nan}, "min_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"frequency_penalty": math.inf}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": 11.0}, "repetition_penalty"),
    ({"logit_bias": ((5, 101.0),)}, "logit_bias"), ({"logit_bias": ((5, math.nan),)}, "logit_bias"),
    ({"logit_bias": ((-1, 1.0),)}, "logit_bias"), ({"logit_bias": ((2000, 1.0),)}, "logit_bias"),
    ({"logit_bias": ((5, 1.0), (5, 2.0))}, "logit_bias"),
    ({"logit_bias": tuple((i, 1.0) for i in range(1025))}, "logit_bias"),
    ({"top_logprobs": 21}, "top_logprobs"), ({"top_logprobs": -1}, "top_logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"), ({"prompt_logprobs": True}, "prompt_logprobs"),
])
def test_sampling_field_bounds(params, field):
    with pytest.raises(InvalidArgument, match=f"sampling.{field}") as raised:
        SamplingParams(**params).validate(vocab_size=1024)
    assert raised.value.field == field


def test_sampling_round_trips_the_wire_and_the_runner_refuses_bad_sequences():
    p = SamplingParams(temperature=0.5, min_p=0.25, presence_penalty=-1.5, frequency_penalty=0.5,
                       repetition_penalty=1.25, logit_bias=((3, -100.0), (9, 2.5)),
                       top_logprobs=4, prompt_logprobs=0)
    assert SamplingParams.from_pb(p.to_pb()) == p
    assert SamplingParams.from_pb(SamplingParams().to_pb()) == SamplingParams()
    runner = ModelRunner.random("tiny", num_kv_blocks=16, block_size=BLOCK, num_slots=1,
                                max_rank=8)
    with pytest.raises(ValueError, match="prompt logprobs need its whole prompt"):
        runner.add_sequence(1, [5, 6, 7, 8, 9], SamplingParams(prompt_logprobs=1), -1,
                            num_cached=4)
    runner.add_sequence(1, [5, 6, 7, 8, 9], SamplingParams(prompt_logprobs=1), -1,
                        num_generated=1, num_cached=4)  # (a recompute: none asked again)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        runner.add_sequence(2, [5], SamplingParams(logit_bias=((runner.config.vocab_size, 1.0),)),
                            -1)
