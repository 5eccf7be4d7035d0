"""The executor's step thread (executor/step_worker.py): answers in order, the next step starts
without waiting for the event loop, a failing step ends the stream and nothing after it runs,
and a stopped worker drops the steps it has not started."""

import asyncio
import threading
import time

import pytest

from executor.step_worker import StepWorker


async def test_steps_run_in_order_back_to_back_on_one_thread():
    ran, threads, last_ran = [], set(), threading.Event()

    def run(n):
        threads.add(threading.get_ident())
        ran.append(n)
        time.sleep(0.01)
        if n == 4:
            last_ran.set()
        return n * 10

    worker = StepWorker(run, asyncio.get_running_loop())
    for n in range(5):
        worker.submit(n)
    worker.finish()
    # The event loop stays blocked while they run: the steps must not need it to follow each other.
    assert last_ran.wait(30)
    assert ran == [0, 1, 2, 3, 4]
    assert [await worker.result() for _ in range(6)] == [0, 10, 20, 30, 40, None]
    await worker.done
    assert len(threads) == 1 and threading.get_ident() not in threads


async def test_a_failing_step_is_raised_and_nothing_after_it_runs():
    ran = []

    def run(n):
        ran.append(n)
        if n == 1:
            raise ValueError("bad step")
        return n

    worker = StepWorker(run, asyncio.get_running_loop())
    for n in range(4):
        worker.submit(n)
    assert await worker.result() == 0
    with pytest.raises(ValueError, match="bad step"):
        await worker.result()
    await worker.done
    assert ran == [0, 1]


async def test_a_stopped_worker_drops_what_it_has_not_started():
    started = threading.Event()
    release = threading.Event()
    ran = []

    def run(n):
        ran.append(n)
        started.set()
        release.wait(5)
        return n

    worker = StepWorker(run, asyncio.get_running_loop())
    worker.submit(0)
    worker.submit(1)
    started.wait(5)
    worker.stop()
    release.set()
    await asyncio.wait_for(worker.done, 5)
    assert ran == [0], "the step under way finished; the next never started"
