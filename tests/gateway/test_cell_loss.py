"""A cell's scheduler killed or frozen under load, behind the gateway: requests that had
streamed nothing complete on the other cell with the tokens they would have had; those cut
mid-stream end UNAVAILABLE (retryable) saying how many tokens the client got, in the message and
in the trailer loraplex-tokens-delivered; nothing hangs."""

import asyncio
from collections.abc import Callable

import grpc
import pytest

from common import wire
from common.server import insecure_channel
from gateway.pools import _weight
from loraplex import client
from loraplex.fixtures import MODEL_ID
from loraplex.launch import Fleet, start_gateway
from protos import scheduler_pb2, scheduler_pb2_grpc

ADAPTERS = ("r4_attn", "r8_mlp", "r16_all", "r2_q", "r12_vo", "r24_k_up")
REQUESTS = 24
NEW_TOKENS = 40


@pytest.fixture
def cells(tiny, tmp_path_factory, log_dir):
    logs = log_dir / "cell-loss"
    # The cell to be killed runs 3 sequences at a time, so most of the load waits in its queue
    # when it dies.
    doomed = Fleet(model=tiny["model_dir"], log_dir=logs / "a",
                   store_url=tmp_path_factory.mktemp("cell-loss-store").as_uri(),
                   executor_args=["--adapter-slots", "6", "--threads", "1"],
                   scheduler_args=["--max-num-seqs", "3"])
    other = gateway = None
    try:
        doomed.start()
        other = Fleet(model=tiny["model_dir"], store_url="", log_dir=logs / "b",
                      store_addresses=doomed.stores,
                      executor_args=["--adapter-slots", "6", "--threads", "1"]).start()
        gateway = start_gateway({MODEL_ID: [doomed.scheduler, other.scheduler]}, doomed.stores,
                                logs, args=["--refresh-s", "0.5", "--rpc-s", "3"])
        yield doomed, other, gateway
    finally:
        for part in (gateway, other, doomed):
            if part is not None:
                part.stop()


async def run(address: str, adapter: str, got: list[int],
              first_token: Callable[[], None] = lambda: None):
    """One request through the gateway, its tokens appended to `got` as they come (calling
    `first_token` at its first); its error, or None once finished."""
    async with insecure_channel(address) as channel:
        request = client.generate_request(adapter, "The little cat", NEW_TOKENS, ignore_eos=True)
        try:
            async for m in scheduler_pb2_grpc.SchedulerStub(channel).Generate(request, timeout=120):
                if m.HasField("token_id"):
                    got.append(m.token_id)
                    if len(got) == 1:
                        first_token()
        except grpc.aio.AioRpcError as err:
            return err
    return None


@pytest.mark.parametrize("fault", ["kill", "freeze", "stop"])
async def test_a_lost_cell_moves_what_it_had_not_started_and_cuts_the_rest_retryably(
        cells, tiny, fault):
    """Killed: its streams break at once. Frozen: the gateway's probe finds it down (requests
    without a token move on) and the channel's keepalive breaks the streaming ones (15 s).
    Stopped (SIGTERM, 30 s grace): the ones without a token move on, the streaming ones finish
    there: nothing is cut."""
    doomed, other, gateway = cells
    # Names the gateway's hashing gives the doomed cell (its port is a free one: any names could
    # all go to the other), each pushed with the weights of a fixture adapter.
    fixture_of = {f"{n}-{i}": n for i, n in enumerate(ADAPTERS * 4)}
    mine = [name for name in fixture_of
            if _weight(name, doomed.scheduler) > _weight(name, other.scheduler)][:len(ADAPTERS)]
    assert mine  # 24 candidates: all on the other cell has odds 2**-24
    for name in mine:
        await client.push_adapter(doomed.stores[0], tiny["adapters"][fixture_of[name]]["path"],
                                  name)
    expected = {}
    for name in mine:
        got: list[int] = []
        assert await run(gateway.address, name, got) is None
        expected[name] = got

    # The fault strikes once two requests are streaming: their cell's executor is frozen at the
    # second one's first token, so both are still mid-stream when it strikes, however fast this
    # machine runs them (thawed once it struck).
    (scheduler,), (executor,) = doomed.by_name("scheduler"), doomed.by_name("executor")
    streaming = asyncio.Event()

    def first_token() -> None:
        if not streaming.is_set() and sum(map(bool, tokens)) >= 2:
            executor.freeze()
            streaming.set()

    adapters = [mine[i % len(mine)] for i in range(REQUESTS)]
    tokens: list[list[int]] = [[] for _ in adapters]
    tasks = [asyncio.create_task(run(gateway.address, a, t, first_token))
             for a, t in zip(adapters, tokens)]
    try:
        await asyncio.wait_for(streaming.wait(), 60)
        if fault == "kill":
            scheduler.kill()
        elif fault == "freeze":
            scheduler.freeze()
        else:
            scheduler.terminate()
    finally:
        executor.thaw()
    try:  # frozen: 10 s to the keepalive ping, 5 s for its answer (common/server.py)
        errors = await asyncio.wait_for(asyncio.gather(*tasks), 40 if fault == "freeze" else 180)
    finally:
        if fault == "freeze":
            scheduler.thaw()
        if fault == "stop":
            await asyncio.to_thread(scheduler.wait_stopped, 60)

    moved = cut = 0
    for adapter, got, error in zip(adapters, tokens, errors):
        if error is None:
            assert got == expected[adapter]
            moved += 1
            continue
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
        assert got and got == expected[adapter][:len(got)] and len(got) < NEW_TOKENS
        assert dict(error.trailing_metadata())[wire.TOKENS_DELIVERED] == str(len(got))
        assert f"after {len(got)} tokens were delivered" in error.details()
        cut += 1
    assert moved >= 1 and (cut == 0 if fault == "stop" else cut >= 1), (cut, moved)
    async with insecure_channel(other.scheduler) as channel:  # the moved ones ran there
        stats = await scheduler_pb2_grpc.SchedulerStub(channel).Stats(
            scheduler_pb2.StatsRequest(), timeout=10)
    assert sum(t.requests for t in stats.tenants) >= 1
