"""No extra steps (issue 47): a batch whose prompts fit one step's token budget is computed in one
step, so N requests of M new tokens each take M steps, as one generate() call over the batch
does. In the core (the prompts queued before the first plan) and through the engine's step loop,
where a burst's requests reach the scheduler one by one (engine.py: an idle executor's first
step gathers them, GATHER_QUIET_S)."""

import asyncio
import random
import time

from common.detokenizer import OutputProcessor
from common.sampling import SamplingParams
from scheduler.engine import Engine
from scheduler.executor_state import ExecutorShape
from scheduler.fairness import FairnessWeights
from scheduler.limits import Limits
from scheduler.request import Ask, FinishEvent, Request
from scheduler.steps.sequence import Sample, Samples
from tests.scheduler.sched_world import World

NUM_REQUESTS, MAX_NEW = 64, 32
LIMITS = Limits(max_num_seqs=NUM_REQUESTS, max_batched_tokens=2048)


def prompts(seed: int = 0) -> list[int]:
    """Prompt lengths of 8 to 24 tokens (bench/serving.py's): 64 of them fit 2,048 tokens."""
    rng = random.Random(seed)
    return [rng.randint(8, 24) for _ in range(NUM_REQUESTS)]


def test_a_batch_that_fits_the_budget_takes_as_many_steps_as_tokens_it_generates():
    w = World(num_blocks=1024, block_size=16, limits=LIMITS)
    reqs = [w.request(prompt_len=n, max_new=MAX_NEW) for n in prompts()]
    w.run()
    assert all(w.finished(r) for r in reqs)
    assert w.core.steps_run(w.executors[0].address) == MAX_NEW


def test_prompts_past_the_budget_take_a_step_more_per_budget_they_fill():
    w = World(num_blocks=1024, block_size=16, limits=Limits(max_num_seqs=64,
                                                           max_batched_tokens=256))
    lengths = prompts()
    reqs = [w.request(prompt_len=n, max_new=MAX_NEW) for n in lengths]
    w.run()
    assert all(w.finished(r) for r in reqs)
    # (each step takes its running sequences' decode tokens first, then prompts, chunked)
    assert MAX_NEW < w.core.steps_run(w.executors[0].address) <= MAX_NEW + sum(lengths) // 200


class AnsweringLink:
    """An executor link whose every step is answered at once: one token per row that samples."""

    address = "fake:1"

    def __init__(self) -> None:
        self.woken, self.answered_at = asyncio.Event(), 0.0
        self.plans = []
        self._answers: list[Samples] = []

    async def send(self, plan, seconds: float) -> None:
        self.plans.append(plan)
        self._answers.append(Samples.of(Sample(row.seq.seq_id, 7, -0.1)
                                        for row in plan.rows if row.samples))

    async def receive(self, plan, seconds: float) -> tuple[Samples, float]:
        await asyncio.sleep(0)  # (the executor's step: others run meanwhile)
        self.answered_at = time.monotonic()
        return self._answers.pop(0), 0.001

    async def probe(self) -> None:
        self.answered_at = time.monotonic()  # (else the idle loop probes again at once)


async def test_a_burst_arriving_one_by_one_at_an_idle_executor_starts_in_one_step():
    """The requests reach the core one by one, other tasks running in between (as gRPC calls
    do): the executor's first step holds every prompt, and the burst takes MAX_NEW steps
    (started as they came, the last would end steps after the first)."""
    engine = Engine((), FairnessWeights(), LIMITS)
    link = AnsweringLink()
    engine.links[link.address] = link
    ex = engine.core.add_executor(link.address, ExecutorShape(1024, 16, 1))
    loop = asyncio.create_task(engine._step_loop(link, ex))
    done = asyncio.Event()
    finished = []

    def emit(event) -> None:
        if isinstance(event, FinishEvent):
            finished.append(event)
            if len(finished) == NUM_REQUESTS:
                done.set()
    try:
        for i, n in enumerate(prompts()):
            ask = Ask("t", None, 0, tuple(range(1, n + 1)), SamplingParams())
            engine.core.submit(Request(i, ask, OutputProcessor(None, max_new_tokens=MAX_NEW),
                                       emit))
            await asyncio.sleep(0)
        await asyncio.wait_for(done.wait(), 30)
    finally:
        loop.cancel()
    computing = [plan for plan in link.plans if plan.rows]
    assert len(computing[0].rows) == NUM_REQUESTS
    assert len(computing) == MAX_NEW
