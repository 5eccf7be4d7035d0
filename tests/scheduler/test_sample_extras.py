"""Alternatives and prompt logprobs through the scheduler (issue 33): from a step's answer to a
Stream's messages, with both step builders (the fast one takes most samples as columns: a
request that asks for alternatives must never be taken that way); prompt logprobs on the
request's StreamStart; a request that needs its prompt's logprobs computes its whole prompt;
malformed answers refused."""

import asyncio

import pytest

from common.detokenizer import OutputProcessor
from common.errors import Unavailable
from common.sampling import SamplingParams
from protos import common_pb2, executor_pb2, scheduler_pb2
from scheduler.executor_link import sample_extras
from scheduler.metrics import SchedulerMetrics
from scheduler.request import Ask, Request, SampleExtras
from scheduler.steps.fast_steps import FastSteps
from scheduler.steps.reference_steps import ReferenceSteps
from scheduler.steps.sequence import Samples
from scheduler.streams import StreamConnection
from tests.scheduler.sched_world import World

PROMPT = [1, 2, 3, 4, 5, 6]
ASKS = {1: SamplingParams(), 2: SamplingParams(top_logprobs=2),
        3: SamplingParams(prompt_logprobs=1), 4: SamplingParams(top_logprobs=1, prompt_logprobs=0)}


def answer(plan) -> Samples:
    """A step's answer as an executor gives it: token 7 + the row count, and the extras each
    row's request asks for (the prompt's logprobs with a first sample)."""
    rows = [r for r in plan.rows if r.samples]
    extras = {}
    for r in rows:
        p, first = r.seq.request.ask.sampling, not r.seq.request.output.num_tokens
        prompt = common_pb2.TokenLogprobs(token_ids=PROMPT[1:], logprobs=[-1.0] * 5) \
            if p.prompt_logprobs is not None and first else None
        if p.top_logprobs or prompt is not None:
            extras[r.seq.seq_id] = SampleExtras(list(range(p.top_logprobs)),
                                                [-0.5] * p.top_logprobs, prompt)
    return Samples([r.seq.seq_id for r in rows], [7 + len(rows)] * len(rows), [-0.1] * len(rows),
                   extras)


@pytest.mark.parametrize("steps", [FastSteps, ReferenceSteps])
async def test_every_token_of_a_request_that_asks_brings_its_alternatives(steps):
    w = World(num_blocks=64, block_size=4, steps=steps)
    sent: list[scheduler_pb2.StreamResponse] = []

    async def write(message):
        sent.append(message)

    connection = StreamConnection(w.core, SchedulerMetrics(w.core), write, write_s=10.0)
    writer = asyncio.create_task(connection.send(asyncio.get_running_loop().create_future()))
    for stream_id, sampling in ASKS.items():
        async def check(stream_id=stream_id, sampling=sampling) -> Request:
            req = Request(stream_id, Ask("t", None, 0, tuple(PROMPT), sampling),
                          OutputProcessor(None, max_new_tokens=10), connection.emitter(stream_id),
                          sink=connection.sink, sink_id=stream_id)
            w.requests.append(req)
            return req
        connection.submit(stream_id, check)
    await asyncio.sleep(0)
    ex = w.executors[0]
    for _ in range(14):  # (long enough for the steady decode shortcuts)
        plan = w.core.schedule(ex)
        w.core.on_step_done(ex, plan, answer(plan))
        await asyncio.sleep(0)
    writer.cancel()
    tops: dict[int, list] = {i: [] for i in ASKS}
    for message in sent:
        at = 0
        counts = message.token_num_top or [0] * len(message.token_ids)
        assert len(counts) == len(message.token_ids)
        for stream_id, n in zip(message.token_request_ids, counts):
            tops[stream_id].append(list(message.top_token_ids[at:at + n]))
            at += n
    assert all(len(t) == 10 for t in tops.values())
    assert tops[2] == [[0, 1]] * 10 and tops[4] == [[0]] * 10
    assert tops[1] == tops[3] == [[]] * 10
    starts = {s.id: s for m in sent for s in m.starts}
    assert not starts[1].HasField("prompt_logprobs")
    assert list(starts[3].prompt_logprobs.token_ids) == PROMPT[1:]
    assert list(starts[4].prompt_logprobs.logprobs) == [-1.0] * 5


def test_a_request_that_needs_its_prompts_logprobs_takes_no_cached_prefix():
    w = World(num_blocks=64, block_size=4)
    prompt = list(range(100, 113))

    def submit(sampling: SamplingParams) -> Request:
        rid = next(w._ids)
        w.events[rid] = []
        req = Request(rid, Ask("t", None, 0, tuple(prompt), sampling),
                      OutputProcessor(None, max_new_tokens=2), w.events[rid].append)
        w.core.submit(req)
        w.requests.append(req)
        return req

    submit(SamplingParams())
    w.run()  # (its blocks are cached now)
    ex = w.executors[0]
    cached = {}
    for name, sampling in (("plain", SamplingParams()),
                           ("prompt", SamplingParams(prompt_logprobs=0))):
        req = submit(sampling)
        plan = w.core.schedule(ex)
        cached[name] = next(s.num_cached for s in plan.new if s.request is req)
        w.core.on_step_done(ex, plan, answer(plan))
        w.run()
    assert cached == {"plain": 12, "prompt": 0}


def test_an_answer_whose_alternatives_do_not_add_up_is_refused():
    good = executor_pb2.StepResponse(sample_seq_ids=[1, 2], sample_token_ids=[5, 6],
                                     sample_logprobs=[-1, -2], sample_num_top=[0, 2],
                                     top_token_ids=[3, 4], top_logprobs=[-1, -2])
    good.prompt_logprobs.add(seq_id=1, tokens=common_pb2.TokenLogprobs(logprobs=[-3]))
    extras = sample_extras(good, "ex")
    assert list(extras[2].top_token_ids) == [3, 4] and not extras[2].prompt
    assert list(extras[1].top_token_ids) == [] and list(extras[1].prompt.logprobs) == [-3]
    for changes in ({"sample_num_top": [2]}, {"top_token_ids": [3]}, {"top_logprobs": [1, 2, 3]}):
        bad = executor_pb2.StepResponse()
        bad.CopyFrom(good)
        for field, value in changes.items():
            del getattr(bad, field)[:]
            getattr(bad, field).extend(value)
        with pytest.raises(Unavailable, match="alternative"):
            sample_extras(bad, "ex")
