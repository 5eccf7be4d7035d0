"""Sampling parameters: one type, one validator, one conversion from and to the proto.

The scheduler validates a client's parameters with it (adding the vocabulary's bounds on top_k
and logit_bias) and sends them on; executors convert them back and validate again (a step stream
is a boundary too); the gateway validates what its HTTP APIs parsed, naming their own fields.
On the wire top_p 0 and repetition_penalty 0 mean unset, i.e. 1. What each field does, and in
which order the executor applies them, is documented in protos/common.proto.
"""

import dataclasses
import math

from common.errors import InvalidArgument
from common.grammar import Grammar, GrammarError
from protos import common_pb2

MAX_SEED = 2**64  # seeds are uint64 on the wire
MAX_TOP_LOGPROBS = 20  # alternatives per token (OpenAI's bound for top_logprobs)
MAX_LOGIT_BIAS = 1024  # logit_bias entries
MAX_ABS_BIAS = 100.0  # |a logit bias|
MAX_ABS_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| (OpenAI's bounds)
MAX_REPETITION_PENALTY = 10.0


class BadSampling(InvalidArgument):
    """INVALID_ARGUMENT about one sampling field: `field` is its SamplingParams name, so an API
    can name its own field for it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"sampling.{field} {message}")
        self.field = field
        self.detail = message


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None  # None = a random stream of its own
    min_p: float = 0.0  # 0 = off
    presence_penalty: float = 0.0  # 0 = off
    frequency_penalty: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    top_logprobs: int = 0  # alternatives per sampled token
    prompt_logprobs: int | None = None  # None = none; else alternatives per prompt token
    grammar: Grammar | None = None  # constrained decoding (common/grammar.py); None = free

    @property
    def has_penalties(self) -> bool:
        """It penalises tokens the sequence holds (its rows need token counts)."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1)

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """Itself, or BadSampling (INVALID_ARGUMENT) naming the field ("sampling.top_p ...") out
        of range."""
        t, k, p, seed = self.temperature, self.top_k, self.top_p, self.seed
        if not _is_real(t) or not math.isfinite(t) or t < 0:
            raise BadSampling("temperature", f"must be a finite number >= 0, got {t!r}")
        if not _is_int(k) or k < 0:
            raise BadSampling("top_k", f"must be an integer >= 0 (0 = off), got {k!r}")
        if vocab_size is not None and k > vocab_size:
            raise BadSampling("top_k", f"must be <= the vocabulary size {vocab_size}, got {k}")
        if not _is_real(p) or not 0 < p <= 1:  # NaN fails the comparison
            raise BadSampling("top_p", f"must be in (0, 1] (0 = unset = 1), got {p!r}")
        if seed is not None and (not _is_int(seed) or not 0 <= seed < MAX_SEED):
            raise BadSampling("seed", f"must be an integer in [0, 2**64) or unset, got {seed!r}")
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("presence_penalty", self.presence_penalty, -MAX_ABS_PENALTY,
                     MAX_ABS_PENALTY)
        _check_range("frequency_penalty", self.frequency_penalty, -MAX_ABS_PENALTY,
                     MAX_ABS_PENALTY)
        r = self.repetition_penalty
        if not _is_real(r) or not 0 < r <= MAX_REPETITION_PENALTY:
            raise BadSampling("repetition_penalty", f"must be in (0, {MAX_REPETITION_PENALTY:g}] "
                                                    f"(1 = off), got {r!r}")
        self._check_logit_bias(vocab_size)
        _check_count("top_logprobs", self.top_logprobs, vocab_size)
        if self.prompt_logprobs is not None:
            _check_count("prompt_logprobs", self.prompt_logprobs, vocab_size)
        if self.grammar is not None:
            try:
                self.grammar.validate()
            except GrammarError as err:
                raise InvalidArgument(f"sampling.grammar: {err.detail}") from None
        return self

    def _check_logit_bias(self, vocab_size: int | None) -> None:
        bias = self.logit_bias
        if not isinstance(bias, tuple) or len(bias) > MAX_LOGIT_BIAS:
            raise BadSampling("logit_bias", f"must hold at most {MAX_LOGIT_BIAS} tokens, got "
                                            f"{len(bias) if isinstance(bias, tuple) else bias!r}")
        seen: set[int] = set()
        for token_id, value in bias:
            if not _is_int(token_id) or token_id < 0 or token_id in seen:
                raise BadSampling("logit_bias", f"token ids must be distinct integers >= 0, got "
                                                f"{token_id!r}")
            if vocab_size is not None and token_id >= vocab_size:
                raise BadSampling("logit_bias", f"token id {token_id} is outside the vocabulary "
                                                f"(size {vocab_size})")
            if not _is_real(value) or not -MAX_ABS_BIAS <= value <= MAX_ABS_BIAS:
                raise BadSampling("logit_bias", f"of token {token_id} must be in "
                                                f"[-{MAX_ABS_BIAS:g}, {MAX_ABS_BIAS:g}], "
                                                f"got {value!r}")
            seen.add(token_id)

    @classmethod
    def from_pb(cls, pb: common_pb2.SamplingParams) -> "SamplingParams":
        """The parameters a message carries (not yet validated)."""
        try:
            grammar = Grammar.from_pb(pb.grammar) if pb.HasField("grammar") else None
        except GrammarError as err:
            raise InvalidArgument(f"sampling.grammar: {err.detail}") from None
        return cls(temperature=pb.temperature, top_k=pb.top_k, top_p=pb.top_p or 1.0,
                   seed=pb.seed if pb.HasField("seed") else None, min_p=pb.min_p,
                   presence_penalty=pb.presence_penalty,
                   frequency_penalty=pb.frequency_penalty,
                   repetition_penalty=pb.repetition_penalty or 1.0,
                   logit_bias=tuple(sorted(pb.logit_bias.items())),
                   top_logprobs=pb.top_logprobs,
                   prompt_logprobs=(pb.prompt_logprobs if pb.HasField("prompt_logprobs")
                                    else None),
                   grammar=grammar)

    def to_pb(self) -> common_pb2.SamplingParams:
        return common_pb2.SamplingParams(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed,
            min_p=self.min_p, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=dict(self.logit_bias),
            top_logprobs=self.top_logprobs, prompt_logprobs=self.prompt_logprobs,
            grammar=self.grammar.to_pb() if self.grammar else None)


def _check_range(field: str, value: object, low: float, high: float) -> None:
    if not _is_real(value) or not low <= value <= high:  # NaN fails the comparison
        raise BadSampling(field, f"must be in [{low:g}, {high:g}], got {value!r}")


def _check_count(field: str, value: object, vocab_size: int | None) -> None:
    high = MAX_TOP_LOGPROBS if vocab_size is None else min(MAX_TOP_LOGPROBS, vocab_size)
    if not _is_int(value) or not 0 <= value <= high:
        raise BadSampling(field, f"must be an integer in [0, {high}], got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
