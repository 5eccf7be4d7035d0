"""A client request as the scheduler sees it, and the events it streams back."""

import enum
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from common.adapter_ref import AdapterRef
from common.detokenizer import Finish, OutputProcessor
from common.errors import LoraplexError
from common.sampling import SamplingParams


@dataclass(slots=True)  # (one per token: slots make it twice as fast to build as a NamedTuple)
class TokenEvent:
    token_id: int
    logprob: float
    text: str


class TokenSink(Protocol):
    """Where the tokens of many requests go as columns, without an event per token (a Stream
    connection's next message): each request is known there by its own id."""

    def add(self, ids: Iterable[int], token_ids: Iterable[int],
            logprobs: Iterable[float]) -> None: ...


@dataclass(frozen=True)
class FinishEvent:
    reason: Finish


@dataclass(frozen=True)
class ErrorEvent:
    error: LoraplexError


Event = TokenEvent | FinishEvent | ErrorEvent


class Status(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One Generate call. `emit` receives its events; the core never blocks on it. Where `sink`
    is set, its tokens go there instead, as `sink_id`'s (token id, logprob) and with no event
    built per token: a Stream connection appends them to its next message's columns."""

    request_id: int
    tenant: str
    adapter: AdapterRef | None  # None: the base model
    adapter_bytes: int  # size of the adapter's weights (charged to the tenant when it loads)
    prompt_ids: list[int]
    sampling: SamplingParams
    output: OutputProcessor
    emit: Callable[[Event], None]
    status: Status = Status.QUEUED
    arrival: float = 0.0  # set by the scheduler's clock at submit
    admitted_at: float | None = None  # first admission
    deadline: float | None = None  # the client's, on the scheduler's clock (None: none given)
    queued_since: float = 0.0  # when it began to wait (arrival, or its last preemption)
    first_token_at: float | None = None
    finish_reason: Finish | None = None
    is_charged: bool = False  # input tokens charged once, not again after a preemption
    caused_load: bool = False  # it started the load of its adapter
    executor_failures: int = 0  # executors lost while it ran there (their step failed or they left)
    executor: Any = None  # the ExecutorState it is queued or running on
    cache_salt: str = ""  # keeps its cached KV blocks apart from requests with another salt
    trace_id: str = ""  # its id in every service's logs (common/request_ids.py)
    # Its adapter's largest rank per module (common/adapter_pages.py: the pages it takes on an
    # executor); None: unknown, planned as its rank on every module the executor has.
    adapter_ranks: Mapping[str, int] | None = None
    cache_key: bytes = b""  # whose cached KV blocks it may reuse (prefix_cache.py); b"": none
    # Prompt tokens whose KV its first admission found in the prefix cache (not computed).
    cached_prompt_tokens: int = 0
    # Chained hashes of its full blocks, per block size (executors may differ): prefix_cache.py.
    block_hashes: dict[int, list[bytes]] = field(default_factory=dict)
    sink: TokenSink | None = None
    sink_id: int = 0

    @property
    def max_tokens(self) -> int:
        """Its tokens once done: the prompt and max_new_tokens outputs (the work it brings)."""
        return len(self.prompt_ids) + self.output.max_new_tokens

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt and every token sampled so far: what a preempted request recomputes."""
        return self.prompt_ids + self.output_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        """Its tokens so far, but a final stop token (a request that has one is not run again)."""
        return self.output.token_ids

    def on_sample(self, token_id: int, logprob: float, now: float) -> Finish | None:
        """Record a sampled token, stream what it adds; returns the finish reason, if any."""
        if self.first_token_at is None:
            self.first_token_at = now
        text, finish = self.output.append(token_id)
        if self.sink is None:
            self.emit(TokenEvent(token_id, logprob, text))
        else:
            self.sink.add((self.sink_id,), (token_id,), (logprob,))
        return finish
