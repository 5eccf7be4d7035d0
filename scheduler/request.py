"""A client request as the scheduler sees it, and the events it streams back."""

import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from common.adapter_ref import AdapterRef
from common.detokenizer import Finish, OutputProcessor
from common.errors import LoraplexError
from common.sampling import SamplingParams
from common.token_logprobs import top_logprobs_pb
from protos import common_pb2, scheduler_pb2


@dataclass(slots=True)  # (one per token: slots make it twice as fast to build as a NamedTuple)
class TokenEvent:
    token_id: int
    logprob: float
    text: str  # to stream now (stop strings may hold some back)
    token_text: str  # its own (GenerateResponse.token_text)
    # Its alternatives, with their texts, when its request asks for them.
    top_logprobs: Sequence[scheduler_pb2.TopLogprob] = ()


class SampleExtras(NamedTuple):
    """What a sample brings beside its token, for a request that asks for it: its alternatives
    (SamplingParams.top_logprobs), and with a first sample the prompt's logprobs."""

    top_token_ids: Sequence[int] = ()
    top_logprobs: Sequence[float] = ()
    prompt: common_pb2.TokenLogprobs | None = None


class TokenSink(Protocol):
    """Where the tokens of many requests go as columns, without an event per token (a Stream
    connection's next message): each request is known there by its sink_id."""

    def add(self, ids: Iterable[int], token_ids: Iterable[int],
            logprobs: Iterable[float]) -> None: ...

    def add_with_top(self, sink_id: int, token_id: int, logprob: float,
                     top_token_ids: Sequence[int], top_logprobs: Sequence[float]) -> None:
        """One token with its alternatives."""


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


@dataclass(frozen=True, slots=True)
class Ask:
    """What the client asked for, checked at intake and never changed: the request as it came."""

    tenant: str
    adapter: AdapterRef | None  # None: the base model
    adapter_bytes: int  # size of the adapter's weights (charged to the tenant when it loads)
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    request_id: str = ""  # the client's id: its name in every service's logs (request_ids.py)
    # Its adapter's largest rank per module (common/adapter_pages.py: the pages it takes on an
    # executor); None: unknown, planned as its rank on every module the executor has.
    adapter_ranks: Mapping[str, int] | None = None
    deadline: float | None = None  # the client's, on the scheduler's clock (None: none given)
    cache_salt: str = ""  # keeps its cached KV blocks apart from requests with another salt
    # An activated LoRA's activation point in the prompt (common/alora.py): its adapter applies
    # from this position on, the KV before it is the base model's; 0: every position
    lora_from: int = 0
    # It named an activated LoRA whose invocation its prompt does not hold: the base model
    # serves it (adapter None), as PEFT does, and the client is told
    adapter_inactive: bool = False


@dataclass(slots=True)
class Charges:
    """What a request was charged (fairness.py's virtual counters). Admission (admission.py)
    makes the charges and is the only writer."""

    is_input_charged: bool = False  # its prompt tokens, at its first admission only
    # Of its prompt, the tokens whose KV its first admission found in the prefix cache (free).
    cached_prompt_tokens: int = 0
    caused_load: bool = False  # it caused its adapter's fetch onto an executor, and paid for it


@dataclass(eq=False)
class Request:
    """One Generate call: the client's ask, where its output goes, and the core's progress with
    it. `emit` receives its events; the core never blocks on it. Where `sink` is set, its tokens
    go there instead, as `sink_id`'s (token id, logprob) and with no event built per token: a
    Stream connection appends them to its next message's columns.

    Who writes its progress: the core (core.py) its status and times; Placement its executor;
    the prefix cache (steps/prefix_cache.py, steps/longrope.py) the names of its blocks;
    Admission its charges; itself (on_sample) its first token's time and prompt logprobs."""

    serial: int  # its number in this scheduler (the client's id is ask.request_id)
    ask: Ask
    output: OutputProcessor
    emit: Callable[[Event], None]
    sink: TokenSink | None = None
    sink_id: int = 0
    # ---- progress ----
    status: Status = Status.QUEUED
    arrival: float = 0.0  # set by the scheduler's clock at submit
    queued_since: float = 0.0  # when it began to wait (arrival, or its last preemption)
    admitted_at: float | None = None  # first admission
    first_token_at: float | None = None
    finish_reason: Finish | None = None
    executor_failures: int = 0  # executors lost while it ran there (their step failed or they left)
    executor: Any = None  # the ExecutorState it is queued or running on (Placement's)
    cache_key: bytes = b""  # whose cached KV blocks it may reuse (prefix_cache.py); b"": none
    # An activated LoRA's blocks before its activation point are named under this, the base
    # model's key (prefix_cache.py); b"": every block under cache_key
    base_cache_key: bytes = b""
    # Its runs compute with longrope's long factors (longrope.py): its cache_key is the long one.
    runs_long: bool = False
    # Chained hashes of its full blocks, per block size (executors may differ): prefix_cache.py.
    block_hashes: dict[int, list[bytes]] = field(default_factory=dict)
    charges: Charges = field(default_factory=Charges)
    # Its prompt's logprobs, once its first sample brought them (SamplingParams.prompt_logprobs).
    prompt_logprobs: common_pb2.TokenLogprobs | None = None

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Its next run must compute its whole prompt: it asks for the prompt's logprobs and has
        no token yet (they come with the first)."""
        return self.ask.sampling.prompt_logprobs is not None and not self.output.num_tokens

    @property
    def max_tokens(self) -> int:
        """Its tokens once done: the prompt and max_new_tokens outputs (the work it brings)."""
        return len(self.ask.prompt_ids) + self.output.max_new_tokens

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt and every token sampled so far: what a preempted request recomputes."""
        return [*self.ask.prompt_ids, *self.output.token_ids]

    @property
    def output_token_ids(self) -> list[int]:
        """Its tokens so far, but a final stop token (a request that has one is not run again)."""
        return self.output.token_ids

    def on_sample(self, token_id: int, logprob: float, now: float,
                  extras: SampleExtras | None = None) -> Finish | None:
        """Record a sampled token, stream what it adds (with its alternatives, and the prompt's
        logprobs, where `extras` brings them); returns the finish reason, if any."""
        if self.first_token_at is None:
            self.first_token_at = now
        if extras is not None and extras.prompt is not None:
            self.prompt_logprobs = extras.prompt
        top = extras.top_token_ids if extras is not None else ()
        if self.sink is None:
            tops = top_logprobs_pb(self.output, top, extras.top_logprobs) if top else ()
            text, finish = self.output.append(token_id)  # (after the alternatives' texts)
            self.emit(TokenEvent(token_id, logprob, text, self.output.token_text, tops))
            return finish
        text, finish = self.output.append(token_id)
        if top:
            self.sink.add_with_top(self.sink_id, token_id, logprob, top, extras.top_logprobs)
        else:
            self.sink.add((self.sink_id,), (token_id,), (logprob,))
        return finish
