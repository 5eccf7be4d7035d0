"""Rank 0's side of a tensor-parallel executor's group: it tells ranks 1..N-1
(executor/tp/follower.py) what the executor was asked to do, in order, each over its own socket
(protos/rank_group.proto), so every rank holds the same sequences, slots and pages, each on its
part of the model:

    step(request)            every step of the Step stream, before rank 0 runs it (no answer:
                             the forward passes meet in collectives)
    load(slot, weights, ..)  an adapter copied into a slot: each rank gets only its part
                             (executor/tp/shards.py), answered once copied
    clear(slot)              a slot emptied, answered once done
    end_stream()             the Step stream ended: sequences forgotten, weights unmerged
    heartbeat                every timeout_s / 4 from a thread of its own (`start_heartbeats`):
                             a follower that hears nothing for timeout_s takes rank 0 for frozen

Rank 0 writes its own slot first (the loader's checks run there) and tells the others after,
outside the lock a step takes for pages it gives to KV: a follower may be running the step before
this command, whose collectives need rank 0's step. Every wait is bounded by `timeout_s`; a
follower gone (its socket closed), silent past it, or failing a copy rank 0 made calls
`on_broken` (the rank process exits, and the group restarts as one: executor/tp/rank_group.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from types import MappingProxyType
from typing import NoReturn

import safetensors.torch

from executor.lora.slot_pool import LoraModuleWeights, LoraWeights
from executor.tp.shards import Shard
from protos import executor_pb2, rank_group_pb2

log = logging.getLogger(__name__)

HEARTBEATS_PER_TIMEOUT = 4  # rank 0's heartbeats within one rank timeout


def load_command(slot: int, pages: tuple[int, ...],
                 part: LoraWeights) -> rank_group_pb2.RankCommand:
    """A rank's LoadShard: its part of an adapter, as a safetensors file and scales."""
    tensors, scales = {}, []
    for (layer, module), w in part.modules.items():
        tensors[f"{layer}.{module}.lora_A"] = w.a.contiguous()
        tensors[f"{layer}.{module}.lora_B"] = w.b.contiguous()
        scales.append(rank_group_pb2.ModuleScale(layer=layer, module=module, scale=w.scale))
    return rank_group_pb2.RankCommand(load=rank_group_pb2.LoadShard(
        slot=slot, pages=pages, weights=safetensors.torch.save(tensors), scales=scales))


def shard_weights(load: rank_group_pb2.LoadShard) -> LoraWeights:
    """The part of an adapter a LoadShard carries (what `load_command` made)."""
    tensors = safetensors.torch.load(load.weights)
    return LoraWeights(modules=MappingProxyType({
        (s.layer, s.module): LoraModuleWeights(a=tensors[f"{s.layer}.{s.module}.lora_A"],
                                               b=tensors[f"{s.layer}.{s.module}.lora_B"],
                                               scale=s.scale)
        for s in load.scales}))


class Followers:
    """Rank 0's sockets to ranks 1..N-1 (channels[r - 1] to rank r), whose parts are `shards`."""

    def __init__(self, channels: list[Connection], shards: list[Shard], timeout_s: float,
                 on_broken: Callable[[Exception], NoReturn]) -> None:
        self._channels, self._shards = channels, shards
        self._timeout_s, self._on_broken = timeout_s, on_broken
        self._sending = threading.Lock()  # one command's bytes at a time on the sockets
        self._closed = threading.Event()  # (heartbeats stop)
        self._beating: threading.Thread | None = None
        self._asking = threading.Lock()  # one answered command at a time: its answers are next

    def start_heartbeats(self) -> None:
        """Tell the followers every timeout_s / 4 that rank 0 is alive, from a daemon thread: a
        frozen rank 0 (SIGSTOP, a hung host) stops it, and they end (executor/tp/follower.py)."""
        beat = [rank_group_pb2.RankCommand(heartbeat=rank_group_pb2.Heartbeat())] * len(
            self._channels)

        def beats() -> None:
            while not self._closed.is_set():
                self._send(beat)
                self._closed.wait(self._timeout_s / HEARTBEATS_PER_TIMEOUT)

        self._beating = threading.Thread(target=beats, name="rank-heartbeats", daemon=True)
        self._beating.start()

    def close(self) -> None:
        """No more heartbeats (the followers will take rank 0 for frozen)."""
        self._closed.set()
        if self._beating is not None:
            self._beating.join()

    def step(self, req: executor_pb2.StepRequest) -> None:
        self._send([rank_group_pb2.RankCommand(step=req)] * len(self._channels))

    def end_stream(self) -> None:
        command = rank_group_pb2.RankCommand(end_stream=rank_group_pb2.EndStream())
        self._send([command] * len(self._channels))

    def load(self, slot: int, weights: LoraWeights, pages: tuple[int, ...]) -> None:
        """Each follower copies its part of `weights` (the whole adapter) into `slot`."""
        self._ask([load_command(slot, pages, shard.lora(weights)) for shard in self._shards])

    def clear(self, slot: int) -> None:
        command = rank_group_pb2.RankCommand(clear=rank_group_pb2.ClearSlot(slot=slot))
        self._ask([command] * len(self._channels))

    def _send(self, commands: list[rank_group_pb2.RankCommand]) -> None:
        data = [c.SerializeToString() for c in commands]
        with self._sending:
            for rank, (channel, payload) in enumerate(zip(self._channels, data), start=1):
                try:
                    channel.send_bytes(payload)
                except OSError as err:
                    self._broken(f"rank {rank} is gone ({err})")

    def _ask(self, commands: list[rank_group_pb2.RankCommand]) -> None:
        """Send, then wait for every follower's RankAck (each within timeout_s)."""
        with self._asking:
            self._send(commands)
            for rank, channel in enumerate(self._channels, start=1):
                try:
                    if not channel.poll(self._timeout_s):
                        self._broken(f"rank {rank} did not answer within {self._timeout_s:.0f}s")
                    ack = rank_group_pb2.RankAck.FromString(channel.recv_bytes())
                except (OSError, EOFError) as err:
                    self._broken(f"rank {rank} is gone ({err!r})")
                if ack.error:
                    self._broken(f"rank {rank} failed what rank 0 did: {ack.error}")

    def _broken(self, why: str) -> NoReturn:
        log.error("the tensor-parallel group broke: %s", why)
        self._on_broken(RuntimeError(why))
