"""What constrained decoding holds an output to (structured outputs): one type, its bounds and
compile check, its conversion from and to the proto (common.proto Grammar), and its text for the
grammar engine.

The engine is llguidance (bench/results/grammar-cpu.md says why). It is imported only when a
grammar is checked or compiled, so a service that never sees one runs without the package.
It compiles recursively, in native code, on the calling thread's stack: within MAX_GRAMMAR_CHARS a
Lark chain of 27,000 rules, or a JSON Schema whose $refs nest 4,000 objects, needs 64-128 MiB of
stack, and on a main thread's 8 MiB it killed the process (SIGSEGV) from 3,000 rules or 1,000
objects. So every call that compiles (`in_engine`) runs on one thread of ENGINE_STACK_BYTES.
Clients' fields map onto the kinds here: OpenAI's response_format json_object / json_schema,
vLLM's guided_regex / guided_choice / guided_grammar, TGI's grammar, the gateway's tool calls.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import enum
import functools
import json
import threading
from collections.abc import Callable
from typing import TypeVar

from common.errors import InvalidArgument
from common.lru import Lru
from protos import common_pb2

MAX_GRAMMAR_CHARS = 256 * 1024  # a schema, regex or grammar text
# The grammar engine thread's stack: 4x what the deepest grammar within MAX_GRAMMAR_CHARS needs
# (address space: a call takes memory only for the pages it touches)
ENGINE_STACK_BYTES = 512 << 20
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 4096
# How JSON is written unless a schema's own "x-guidance" says otherwise: compact, with OpenAI's
# separators and no free whitespace (a sampled model cannot pad an object with blanks forever).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarKind(enum.IntEnum):
    JSON_OBJECT = common_pb2.GRAMMAR_KIND_JSON_OBJECT
    JSON_SCHEMA = common_pb2.GRAMMAR_KIND_JSON_SCHEMA
    REGEX = common_pb2.GRAMMAR_KIND_REGEX
    CHOICE = common_pb2.GRAMMAR_KIND_CHOICE
    LARK = common_pb2.GRAMMAR_KIND_LARK


class GrammarError(InvalidArgument):
    """A grammar that is out of bounds or does not compile; `detail` says why, without naming a
    field (each API names its own: response_format, guided_regex, sampling.grammar, ...)."""

    def __init__(self, detail: str):
        super().__init__(detail)
        self.detail = detail


@dataclasses.dataclass(frozen=True)
class Grammar:
    kind: GrammarKind
    value: str = ""  # JSON Schema text, regex, or Lark / GBNF text, by kind
    choices: tuple[str, ...] = ()  # CHOICE only

    def validate(self) -> Grammar:
        """Itself, or GrammarError: out of bounds, or refused by the engine's compiler (a
        grammar checked before in this process is not compiled again: _CHECKED)."""
        self._check_bounds()
        error = _CHECKED.get(self)
        if error is None:
            error = _CHECKED.put(self, in_engine(self._compile_error))
        if error:
            raise GrammarError(f"does not compile: {error.strip()}")
        return self

    async def prepare(self) -> None:
        """Compile-check it on the engine's thread while the event loop goes on (a large
        grammar takes the engine up to ~0.4 s), so that validate() finds the answer cached;
        nothing for a grammar out of bounds (validate() says why)."""
        try:
            self._check_bounds()
        except GrammarError:
            return
        if _CHECKED.get(self) is None:
            error = await asyncio.wrap_future(_engine_thread().submit(self._compile_error))
            _CHECKED.put(self, error)

    def _check_bounds(self) -> None:
        if not isinstance(self.kind, GrammarKind):
            raise GrammarError(f"unknown grammar kind {self.kind!r}")
        if len(self.value) > MAX_GRAMMAR_CHARS:
            raise GrammarError(f"at most {MAX_GRAMMAR_CHARS} characters, got {len(self.value)}")
        takes_value = self.kind not in (GrammarKind.JSON_OBJECT, GrammarKind.CHOICE)
        if takes_value != bool(self.value):
            raise GrammarError(f"a {self.kind.name.lower()} grammar "
                               f"{'needs' if takes_value else 'takes no'} text")
        if (self.kind == GrammarKind.CHOICE) != bool(self.choices):
            raise GrammarError("choices go with a choice grammar, and it needs at least one")
        if len(self.choices) > MAX_CHOICES:
            raise GrammarError(f"at most {MAX_CHOICES} choices, got {len(self.choices)}")
        bad = next((c for c in self.choices if not isinstance(c, str)
                    or len(c) > MAX_CHOICE_CHARS), None)
        if bad is not None:
            raise GrammarError(f"choices must be strings of at most {MAX_CHOICE_CHARS} "
                               f"characters, got {bad!r:.80}")

    def _compile_error(self) -> str:
        """The engine compiler's complaint ("" when it compiles); on the engine's thread. A regex
        or grammar no string matches is one too (the engine takes it, and an output under it
        could only end at once, "stop"); JSON Schemas the compiler checks so itself."""
        import llguidance

        try:
            text = self.engine_text()
        except GrammarError as err:
            return err.detail
        error = llguidance.LLMatcher.validate_grammar(text, None)
        if error or self.kind not in (GrammarKind.REGEX, GrammarKind.LARK):
            return error
        matcher = llguidance.LLMatcher(_byte_tokenizer(), text, log_level=0)
        matcher.compute_bitmask()  # (its first step: a grammar that matches nothing errs here)
        return "it matches no string" if matcher.is_error() else ""

    def engine_text(self) -> str:
        """The grammar as llguidance takes it (LLMatcher); GrammarError for a JSON Schema that is
        not a JSON object, or a grammar text that is neither Lark nor GBNF."""
        import llguidance

        if self.kind == GrammarKind.JSON_OBJECT:
            return llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps({"type": "object", "x-guidance": JSON_LAYOUT}))
        if self.kind == GrammarKind.JSON_SCHEMA:
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(json_schema(
                self.value)))
        if self.kind == GrammarKind.REGEX:
            return llguidance.LLMatcher.grammar_from_regex(self.value)
        if self.kind == GrammarKind.CHOICE:
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(map(json.dumps, self.choices)))
        try:
            return llguidance.grammar_from("grammar", self.value)
        except ValueError as err:
            raise GrammarError(str(err)) from None

    @classmethod
    def from_pb(cls, pb: common_pb2.Grammar) -> Grammar:
        """The grammar a message carries (not yet validated)."""
        try:
            kind = GrammarKind(pb.kind)
        except ValueError:
            raise GrammarError(f"unknown grammar kind {pb.kind}") from None
        return cls(kind, pb.value, tuple(pb.choices))

    def to_pb(self) -> common_pb2.Grammar:
        return common_pb2.Grammar(kind=self.kind.value, value=self.value, choices=self.choices)


def json_schema(text: str) -> dict:
    """A JSON Schema's text as the engine takes it: a JSON object, written compactly unless it
    says how itself (JSON_LAYOUT)."""
    try:
        schema = json.loads(text)
    except ValueError as err:
        raise GrammarError(f"the schema is not JSON: {err}") from None
    except RecursionError:
        raise GrammarError("the schema nests too deeply for its parser") from None
    if not isinstance(schema, dict):
        raise GrammarError("the schema must be a JSON object")
    return schema if "x-guidance" in schema else {**schema, "x-guidance": JSON_LAYOUT}


T = TypeVar("T")


def in_engine(compile_: Callable[[], T]) -> T:
    """compile_() on the grammar engine's thread (ENGINE_STACK_BYTES of stack, one call at a time
    in this process): its result, or its exception."""
    return _engine_thread().submit(compile_).result()


class _CheckedGrammars:
    """The compile checks of the last MAX_CHECKED grammars this process made, by grammar: an
    extraction service sends one schema with every request, and each service checks it."""

    def __init__(self, size: int):
        self._lock = threading.Lock()  # (checked from the engine thread and event loops)
        self._errors: Lru[Grammar, str] = Lru(size)

    def get(self, grammar: Grammar) -> str | None:
        """The compiler's complaint ("" for none), or None when not checked here lately."""
        with self._lock:
            return self._errors.get(grammar)

    def put(self, grammar: Grammar, error: str) -> str:
        with self._lock:
            return self._errors.put(grammar, error)


MAX_CHECKED = 64  # grammars (each at most MAX_GRAMMAR_CHARS)
_CHECKED = _CheckedGrammars(MAX_CHECKED)
_STACK_SIZE_LOCK = threading.Lock()  # (threading.stack_size is the process's)


@functools.cache
def _byte_tokenizer():
    """A tokenizer of the 256 bytes and an end token, for the engine to walk a grammar's start
    with (whatever the model's tokenizer, a grammar either matches some string or none)."""
    import llguidance
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<end>"] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<end>"])
    return llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=len(vocab),
                                  eos_token=[len(vocab) - 1])


@functools.cache
def _engine_thread() -> concurrent.futures.ThreadPoolExecutor:
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-engine")
    with _STACK_SIZE_LOCK:
        previous = threading.stack_size(ENGINE_STACK_BYTES)
        try:
            pool.submit(lambda: None).result()  # (its one thread, started with that stack)
        finally:
            threading.stack_size(previous)
    return pool

