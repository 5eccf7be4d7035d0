"""The scheduler's connection to one executor: its Info, its step stream (a step's message, its
answer's samples) and its adapter RPCs, every call with a deadline (timeouts.py) and presenting
the service key. I/O only: what the scheduler knows of the executor, the core builds from its
Info (core.py: add_executor)."""

import asyncio
import itertools
import operator
import time
import uuid

import grpc

from common import wire
from common.credentials import metadata
from common.errors import Unavailable
from common.server import insecure_channel
from protos import executor_pb2, executor_pb2_grpc
from scheduler.steps.sequence import NO_EXTRAS, SampleExtras, Samples, StepPlan
from scheduler.timeouts import Timeouts


class ExecutorLink:
    """The connection to one executor: its Info, its step stream and its adapter RPCs."""

    def __init__(self, address: str, key: str = "", timeouts: Timeouts = Timeouts()):
        self.address = address
        self.timeouts = timeouts
        self.channel = insecure_channel(address, key)
        self._auth = metadata(key)  # the step stream presents it itself (insecure_channel)
        self.stub = executor_pb2_grpc.ExecutorStub(self.channel)
        self.info: executor_pb2.InfoResponse | None = None
        self._call = None
        self.stream_id = ""  # of the step stream now open (connect)
        self.woken = asyncio.Event()
        self.answered_at = 0.0  # monotonic time of its last answered step (probes included)

    async def connect(self) -> executor_pb2.InfoResponse:
        """Fetch Info, open a fresh step stream and probe it; the Info. (What the executor holds
        from an earlier stream is not ours to trust: the core makes a fresh view of it, every
        slot empty, and an executor empties its slots when a stream ends.)"""
        self.info = await self.stub.Info(executor_pb2.InfoRequest(), timeout=self.timeouts.rpc_s)
        # A fresh id per stream: the loads and unloads of this view of the executor are bound to
        # it, so none of them lands once the stream has ended (executor.proto).
        self.stream_id = uuid.uuid4().hex
        self._call = self.stub.Step(metadata=(*self._auth, (wire.STEP_STREAM, self.stream_id)))
        await self.probe()
        return self.info

    async def probe(self) -> None:
        """An empty step, answered within rpc_s: the executor's step loop is alive."""
        await self._round_trip(executor_pb2.StepRequest(), self.timeouts.rpc_s)

    async def send(self, plan: StepPlan, seconds: float) -> None:
        """Write a step to the step stream (UNAVAILABLE past `seconds`: the stream does not take
        it, its executor is not reading)."""
        await self._write(step_request(plan, len(self.info.kv_kinds) or 1), seconds)

    async def receive(self, plan: StepPlan, seconds: float) -> tuple[Samples, float]:
        """The answer to the oldest step sent, `plan` (UNAVAILABLE past `seconds`, or when it
        does not bring a sample for each row that ends its sequence's known tokens)."""
        resp = await self._read(seconds)
        due = plan.num_samples
        if not due == len(resp.sample_seq_ids) == len(resp.sample_token_ids) == len(
                resp.sample_logprobs):
            raise Unavailable(f"executor {self.address} answered a step due {due} samples with "
                              f"{len(resp.sample_seq_ids)} seq ids, {len(resp.sample_token_ids)} "
                              f"tokens and {len(resp.sample_logprobs)} logprobs")
        extras = (sample_extras(resp, self.address)
                  if resp.sample_num_top or resp.prompt_logprobs else NO_EXTRAS)
        return Samples(resp.sample_seq_ids, resp.sample_token_ids, resp.sample_logprobs,
                       extras), resp.step_seconds

    async def _round_trip(self, req: executor_pb2.StepRequest,
                          seconds: float) -> executor_pb2.StepResponse:
        """One request and its answer on the step stream, or UNAVAILABLE past `seconds`."""
        deadline = time.monotonic() + seconds
        await self._write(req, seconds)
        return await self._read(max(deadline - time.monotonic(), 0.0))

    async def _write(self, req: executor_pb2.StepRequest, seconds: float) -> None:
        try:
            async with asyncio.timeout(seconds):
                await self._call.write(req)
        except TimeoutError:
            raise Unavailable(f"executor {self.address} took no step within {seconds:.1f}s: "
                              "suspect, its work moves elsewhere") from None

    async def _read(self, seconds: float) -> executor_pb2.StepResponse:
        try:
            async with asyncio.timeout(seconds):
                resp = await self._call.read()
        except TimeoutError:
            raise Unavailable(f"executor {self.address} did not answer a step within "
                              f"{seconds:.1f}s: suspect, its work moves elsewhere") from None
        if resp is grpc.aio.EOF:
            raise Unavailable(f"executor {self.address} closed its step stream")
        self.answered_at = time.monotonic()
        return resp

    def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None


def step_request(plan: StepPlan, num_kinds: int = 1) -> executor_pb2.StepRequest:
    """The step stream's message for `plan` (its columns made by map in C: a row each), to an
    executor whose KV has `num_kinds` kinds of layers (several: each row's blocks per kind)."""
    rows = plan.rows
    new_blocks = list(map(_new_block_ids, rows))
    if num_kinds == 1:
        counts = list(map(len, new_blocks))
    else:  # (a row's KindBlocks, or () when it takes none)
        counts = [len(kind) for new in new_blocks
                  for kind in (new or itertools.repeat((), num_kinds))]
        new_blocks = [block_ids for new in new_blocks for block_ids in new]
    return executor_pb2.StepRequest(
        freed_seq_ids=plan.freed,
        new_sequences=[executor_pb2.NewSequence(
            seq_id=seq.seq_id, token_ids=seq.token_ids, slot=seq.slot_index,
            sampling=seq.request.ask.sampling.to_pb(),
            num_generated=len(seq.request.output_token_ids), num_cached=seq.num_cached,
            request_id=seq.request.ask.request_id, lora_from=seq.request.ask.lora_from,
            first_blocks=seq.first_blocks)
            for seq in plan.new],
        row_seq_ids=list(map(_seq_id, rows)),
        row_num_tokens=list(map(_num_tokens, rows)),
        row_num_new_blocks=counts,
        new_block_ids=list(itertools.chain.from_iterable(new_blocks)),
        merge_slot=plan.merge_slot, unmerge=plan.unmerge)


def sample_extras(resp: executor_pb2.StepResponse, address: str) -> dict[int, SampleExtras]:
    """The alternatives and prompt logprobs an answer brings, by sequence id (UNAVAILABLE
    when its columns do not add up)."""
    counts = resp.sample_num_top
    if counts and (len(counts) != len(resp.sample_seq_ids) or not sum(counts) == len(
            resp.top_token_ids) == len(resp.top_logprobs)):
        raise Unavailable(f"executor {address} answered a step with {len(counts)} "
                          f"alternative counts (sum {sum(counts)}) for "
                          f"{len(resp.sample_seq_ids)} samples, "
                          f"{len(resp.top_token_ids)} alternatives and "
                          f"{len(resp.top_logprobs)} of their logprobs")
    prompts = {p.seq_id: p.tokens for p in resp.prompt_logprobs}
    extras, at = {}, 0
    for seq_id, n in zip(resp.sample_seq_ids, counts or itertools.repeat(0)):
        if n or seq_id in prompts:
            extras[seq_id] = SampleExtras(resp.top_token_ids[at:at + n],
                                          resp.top_logprobs[at:at + n], prompts.get(seq_id))
        at += n
    return extras


_seq_id = operator.attrgetter("seq_id")
_num_tokens = operator.attrgetter("num_tokens")
_new_block_ids = operator.attrgetter("new_block_ids")
