"""A rank other than 0 of a tensor-parallel executor: it does what rank 0 tells it
(executor/tp/followers.py, protos/rank_group.proto), in order, on its part of the model, until rank
0's socket closes, or until rank 0 has sent nothing, not even its heartbeat, for the group's
timeout (it froze: the rank ends through `on_broken`, and the group restarts). Its runner holds
the same sequences, slots and pages as rank 0's; its forward passes meet rank 0's in the group's
collectives, and its sampled tokens are rank 0's.

A step rank 0 refused (a bad sequence, a merge it may not do) is refused here the same way, by the
same code on the same state: logged, and the next command is done. A collective that fails ends
the rank (TensorParallel.on_broken): the group restarts as one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import NoReturn

from common.errors import LoraplexError
from executor.lora.slot_copy import SlotCopier
from executor.runner import ModelRunner
from executor.step_request import run_step, step_rows
from executor.tp.followers import HEARTBEATS_PER_TIMEOUT, shard_weights
from protos import rank_group_pb2

log = logging.getLogger(__name__)


def follow(runner: ModelRunner, channel: Connection, silence_s: float,
           on_broken: Callable[[Exception], NoReturn]) -> None:
    """Do rank 0's commands until its socket closes (rank 0 is gone: so is the group). Once rank
    0 has spoken, a silence of `silence_s` calls `on_broken` (rank 0 froze)."""
    copier = SlotCopier(runner.pool)
    heard = False  # (rank 0 may load its weights for longer than this rank: no bound before)
    while True:
        try:
            # (a poll that timed out is tried once more for a heartbeat's interval: a whole group
            # frozen and resumed wakes with every wait expired, rank 0's heartbeats included)
            if heard and not channel.poll(silence_s) and not channel.poll(
                    silence_s / HEARTBEATS_PER_TIMEOUT):
                on_broken(RuntimeError(f"rank 0 sent nothing for {silence_s:g}s, not even its "
                                       "heartbeat: it froze"))
            data = channel.recv_bytes()
        except (EOFError, OSError):
            log.info("rank %d: rank 0 is gone; this rank ends", runner.tp.rank)
            return
        heard = True
        command = rank_group_pb2.RankCommand.FromString(data)
        kind = command.WhichOneof("command")
        if kind == "heartbeat":
            continue
        if kind == "step":
            try:
                kinds = len(runner.kv_layout.kinds)
                run_step(runner, command.step, step_rows(command.step, kinds))
            except (ValueError, LoraplexError) as err:
                log.debug("a step refused, as on rank 0: %s", err)
        elif kind == "end_stream":
            runner.free_all()
            runner.unmerge()
        else:
            channel.send_bytes(_write(runner, copier, command).SerializeToString())


def _write(runner: ModelRunner, copier: SlotCopier,
           command: rank_group_pb2.RankCommand) -> rank_group_pb2.RankAck:
    """Copy a part of an adapter into its slot (LoadShard), or empty one (ClearSlot)."""
    load = command.load if command.HasField("load") else None
    slot = load.slot if load else command.clear.slot
    try:
        with runner.slot_writes:
            runner.pool.mark_unloaded(slot)
            if load is None:
                copier.clear(slot)
            else:
                copier.copy(slot, shard_weights(load), tuple(load.pages))
                runner.pool.mark_loaded(slot)
    except ValueError as err:
        return rank_group_pb2.RankAck(error=str(err))
    return rank_group_pb2.RankAck()
