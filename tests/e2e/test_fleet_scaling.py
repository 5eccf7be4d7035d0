"""A local fleet scales while traffic flows: 1 scheduler, 2 executors, 2 stores; a third executor
joins (and receives work), one leaves by graceful drain on SIGTERM (its requests finish, none is
lost), and a store killed outright is routed around. New requests complete after each event."""

import asyncio
import signal

from common.server import insecure_channel
from loraplex import client
from loraplex.launch import start_service
from protos import scheduler_pb2, scheduler_pb2_grpc

MAX_NEW = 24


async def stats(stub) -> dict[str, scheduler_pb2.ExecutorStats]:
    return {ex.address: ex for ex in (await stub.Stats(scheduler_pb2.StatsRequest())).executors}


async def wait_for(predicate, what: str, timeout: float = 30.0) -> None:
    for _ in range(int(timeout / 0.05)):
        if await predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not reached in {timeout} s: {what}")


async def test_executor_joins_one_drains_and_a_dead_store_is_routed_around(tiny, tmp_path, log_dir):
    logs, services = log_dir / "scaling", []

    def start(name, module, args):
        services.append(start_service(name, module, args, logs))
        return services[-1]

    try:
        store_url = (tmp_path / "store").as_uri()
        stores = [start(f"store-{i}", "adapter_store.service", ["--url", store_url])
                  for i in range(2)]
        store_flags = [f for s in stores for f in ("--store", s.address)]
        executor_args = ["--model", tiny["model_dir"], "--threads", "1", *store_flags]
        executors = [start(f"executor-{i}", "executor.service", executor_args) for i in range(2)]
        roster = tmp_path / "executors.txt"
        roster.write_text("".join(f"{e.address}\n" for e in executors))
        scheduler = start("scheduler", "scheduler.service",
                          ["--executor", roster.as_uri(), "--discovery-interval-s", "0.2",
                           *store_flags])
        for name in ("r4_attn", "r8_mlp", "r16_all"):
            await client.push_adapter(stores[0].address, tiny["adapters"][name]["path"], name)

        async with insecure_channel(scheduler.address) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            # Each stage of the scenario, named for the event that began it -> the requests
            # submitted during that stage, once they completed.
            done: dict[str, list[client.Generation]] = {}
            stage = "two executors"
            stop = asyncio.Event()

            async def worker(w: int, adapters=("r4_attn", "r8_mlp", "r16_all", "")) -> None:
                i = 0
                while not stop.is_set():  # keeps requests in flight until told to stop
                    submitted_in = stage
                    request = client.generate_request(adapters[(w + i) % len(adapters)],
                                                      f"scale {w} {i}", MAX_NEW, ignore_eos=True)
                    done.setdefault(submitted_in, []).append(await client.generate(stub, request))
                    i += 1

            async def completes_in(name: str) -> None:
                """Enter stage `name`; return once a request submitted in it has completed."""
                nonlocal stage
                stage = name

                async def completed() -> bool:
                    return bool(done.get(name))

                await wait_for(completed, f"a request submitted after {name!r} completes")

            background = asyncio.gather(*(worker(w) for w in range(24)))
            await wait_for(lambda: _running(stub, 2), "work running on both executors")
            await completes_in("two executors")

            joiner = start("executor-2", "executor.service", executor_args)
            roster.write_text(roster.read_text() + f"{joiner.address}\n")
            await wait_for(lambda: _has_steps(stub, joiner.address), "the joiner receives work")
            await completes_in("joined")

            leaver = executors[0]
            leaver.process.send_signal(signal.SIGTERM)  # graceful: NOT_SERVING, drain, exit
            roster.write_text("".join(f"{a}\n" for a in (executors[1].address, joiner.address)))
            assert await asyncio.to_thread(leaver.process.wait, 60) == 0
            await completes_in("left")

            stores[0].kill()  # outright: the scheduler and executors must use the other store
            await client.push_adapter(stores[1].address, tiny["adapters"]["r32_all"]["path"],
                                      "r32_all")
            cold = await asyncio.gather(*(client.generate(stub, client.generate_request(
                "r32_all", f"cold {i}", MAX_NEW, ignore_eos=True)) for i in range(6)))
            await completes_in("store killed")
            stop.set()
            await background

            assert list(done) == ["two executors", "joined", "left", "store killed"]
            generations = [g for stage_done in done.values() for g in stage_done] + cold
            assert all(len(g.token_ids) == MAX_NEW for g in generations), "none lost or cut short"
            final = await stats(stub)
            assert leaver.address not in final, "the drained executor left the pool"
            assert final[joiner.address].steps > 0
    finally:
        for service in reversed(services):
            service.stop()


async def _running(stub, num_executors: int) -> bool:
    executors = await stats(stub)
    return len(executors) == num_executors and sum(ex.running for ex in executors.values()) > 0


async def _has_steps(stub, address: str) -> bool:
    executors = await stats(stub)
    return address in executors and executors[address].steps > 0
