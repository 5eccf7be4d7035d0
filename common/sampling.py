"""Sampling parameters: one type, one validator, one conversion from and to the proto.

The scheduler validates a client's parameters with it (adding the vocabulary's bound on top_k)
and sends them on; executors convert them back and validate again (a step stream is a boundary
too). top_p 0 on the wire means unset, i.e. 1.
"""

import dataclasses
import math

from common.errors import InvalidArgument
from common.grammar import Grammar, GrammarError
from protos import common_pb2

MAX_SEED = 2**64  # seeds are uint64 on the wire


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None  # None = a random stream of its own
    grammar: Grammar | None = None  # constrained decoding (common/grammar.py); None = free

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """Itself, or INVALID_ARGUMENT naming the field ("sampling.top_p ...") out of range."""
        t, k, p, seed = self.temperature, self.top_k, self.top_p, self.seed
        if not _is_real(t) or not math.isfinite(t) or t < 0:
            raise InvalidArgument(f"sampling.temperature must be a finite number >= 0, got {t!r}")
        if not _is_int(k) or k < 0:
            raise InvalidArgument(f"sampling.top_k must be an integer >= 0 (0 = off), got {k!r}")
        if vocab_size is not None and k > vocab_size:
            raise InvalidArgument(f"sampling.top_k must be <= the vocabulary size {vocab_size}, "
                                  f"got {k}")
        if not _is_real(p) or not 0 < p <= 1:  # NaN fails the comparison
            raise InvalidArgument(f"sampling.top_p must be in (0, 1] (0 = unset = 1), got {p!r}")
        if seed is not None and (not _is_int(seed) or not 0 <= seed < MAX_SEED):
            raise InvalidArgument(f"sampling.seed must be an integer in [0, 2**64) or unset, "
                                  f"got {seed!r}")
        if self.grammar is not None:
            try:
                self.grammar.validate()
            except GrammarError as err:
                raise InvalidArgument(f"sampling.grammar: {err.detail}") from None
        return self

    @classmethod
    def from_pb(cls, pb: common_pb2.SamplingParams) -> "SamplingParams":
        """The parameters a message carries (not yet validated)."""
        try:
            grammar = Grammar.from_pb(pb.grammar) if pb.HasField("grammar") else None
        except GrammarError as err:
            raise InvalidArgument(f"sampling.grammar: {err.detail}") from None
        return cls(temperature=pb.temperature, top_k=pb.top_k, top_p=pb.top_p or 1.0,
                   seed=pb.seed if pb.HasField("seed") else None, grammar=grammar)

    def to_pb(self) -> common_pb2.SamplingParams:
        return common_pb2.SamplingParams(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed,
            grammar=self.grammar.to_pb() if self.grammar else None)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
