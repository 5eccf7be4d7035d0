"""An adapter evicted from a slot and loaded into it again at once: the executor answers the two
RPCs in any order, and an unload that ran after the load emptied the slot under the sequences
just admitted to it (its guard, "only while it holds this adapter", held: the same adapter). A
load into a slot is sent once the slot's unload on its way is answered (engine.py)."""

import asyncio
import types

from common.adapter_ref import AdapterRef
from scheduler.engine import Engine
from scheduler.executor_state import ExecutorShape
from scheduler.fairness import FairnessWeights
from scheduler.limits import Limits
from scheduler.timeouts import Timeouts


class SlowUnloadStub:
    """UnloadAdapter answers once `release` is set; every call is logged in order."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.release = asyncio.Event()

    async def UnloadAdapter(self, request, timeout):
        self.calls.append(f"unload {request.slot} start")
        await self.release.wait()
        self.calls.append(f"unload {request.slot} end")

    async def LoadAdapter(self, request, timeout):
        self.calls.append(f"load {request.slot}")
        return types.SimpleNamespace(was_resident=True, num_bytes=0, load_seconds=0.0)


async def test_a_load_into_a_slot_waits_for_the_slots_unload_on_its_way():
    engine = Engine((), FairnessWeights(), Limits(), timeouts=Timeouts())
    stub = SlowUnloadStub()
    link = types.SimpleNamespace(address="fake:1", stub=stub, stream_id="s1",
                                 woken=asyncio.Event(), close=lambda: None,
                                 timeouts=types.SimpleNamespace(rpc_s=5.0))
    engine.links[link.address] = link
    ex = engine.core.add_executor(link.address, ExecutorShape(64, 4, 2))
    done = []
    engine.core.on_load_done = lambda *args, **kwargs: done.append(args)
    adapter = AdapterRef("bot", 1)
    load = types.SimpleNamespace(adapter=adapter, slot=1, is_from_staged=False, pages=[3, 4],
                                 num_bytes=1000)
    engine._start_unload(ex, 1, adapter)  # (evicted) ...
    engine._start_load(ex, load)  # ... and loaded into the same slot again
    other = types.SimpleNamespace(adapter=AdapterRef("other", 1), slot=0, is_from_staged=False,
                                  pages=[5], num_bytes=1000)
    engine._start_load(ex, other)  # (another slot's load does not wait)
    for _ in range(20):
        await asyncio.sleep(0)
    assert stub.calls == ["unload 1 start", "load 0"]
    stub.release.set()
    for _ in range(20):
        await asyncio.sleep(0)
    assert stub.calls == ["unload 1 start", "load 0", "unload 1 end", "load 1"]
    assert len(done) == 2 and not engine._unloads
    await engine.stop()
