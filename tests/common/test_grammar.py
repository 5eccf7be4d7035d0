"""The grammar of a constrained request (common/grammar.py): bounds, compile errors that say what
is wrong, and the round trip through the proto inside SamplingParams."""

import json

import pytest

from common.errors import InvalidArgument
from common.grammar import MAX_CHOICES, MAX_GRAMMAR_CHARS, Grammar, GrammarError, GrammarKind
from common.sampling import SamplingParams
from protos import common_pb2
from tests.own_process import run_script

SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                     "required": ["a"]})


@pytest.mark.parametrize("grammar", [
    Grammar(GrammarKind.JSON_OBJECT),
    Grammar(GrammarKind.JSON_SCHEMA, SCHEMA),
    Grammar(GrammarKind.REGEX, r"\d{3}-[a-z]+"),
    Grammar(GrammarKind.CHOICE, choices=("yes", "no", "it \"depends\"")),
    Grammar(GrammarKind.CHOICE, choices=("yes", "")),  # (vLLM's: "" is a choice too)
    Grammar(GrammarKind.LARK, 'start: "a" b\nb: /[0-9]+/'),
    Grammar(GrammarKind.LARK, 'root ::= "yes" | "no"'),  # GBNF
])
def test_valid_grammars_pass_and_round_trip(grammar):
    assert grammar.validate() is grammar
    params = SamplingParams(temperature=1.0, grammar=grammar)
    assert SamplingParams.from_pb(params.to_pb()) == params
    assert SamplingParams.from_pb(SamplingParams().to_pb()).grammar is None


@pytest.mark.parametrize("grammar,words", [
    (Grammar(GrammarKind.JSON_SCHEMA, "{not json"), "not JSON"),
    (Grammar(GrammarKind.JSON_SCHEMA, "[1, 2]"), "JSON object"),
    (Grammar(GrammarKind.JSON_SCHEMA, json.dumps({"type": "objectx"})), "objectx"),
    (Grammar(GrammarKind.JSON_SCHEMA, json.dumps({"$ref": "#/defs/missing"})), "missing"),
    (Grammar(GrammarKind.REGEX, "a(b"), "unclosed group"),
    (Grammar(GrammarKind.LARK, "start: foo"), "unknown name"),
    (Grammar(GrammarKind.REGEX, ""), "needs text"),
    (Grammar(GrammarKind.JSON_OBJECT, "{}"), "takes no text"),
    (Grammar(GrammarKind.CHOICE), "at least one"),
    (Grammar(GrammarKind.REGEX, r"a[^\x00-\x{10FFFF}]"), "matches no string"),
    (Grammar(GrammarKind.CHOICE, choices=tuple(map(str, range(MAX_CHOICES + 1)))),
     "at most 1024 choices"),
    (Grammar(GrammarKind.REGEX, "a" * (MAX_GRAMMAR_CHARS + 1)), "at most"),
])
def test_bad_grammars_say_why(grammar, words):
    with pytest.raises(GrammarError, match=words):
        grammar.validate()
    with pytest.raises(InvalidArgument, match=f"(?s)^sampling.grammar: .*{words}"):
        SamplingParams(grammar=grammar).validate()


def test_an_unknown_kind_on_the_wire_names_the_field():
    pb = common_pb2.SamplingParams(grammar=common_pb2.Grammar(kind=99, value="x"))
    with pytest.raises(InvalidArgument, match="^sampling.grammar: unknown grammar kind 99"):
        SamplingParams.from_pb(pb)
    pb = common_pb2.SamplingParams(grammar=common_pb2.Grammar())
    with pytest.raises(InvalidArgument, match="sampling.grammar: unknown grammar kind 0"):
        SamplingParams.from_pb(pb)


def test_json_is_compact_unless_the_schema_says_otherwise():
    text = Grammar(GrammarKind.JSON_SCHEMA, SCHEMA).engine_text()
    assert '"whitespace_flexible": false' in text and '"item_separator": ", "' in text
    own = json.dumps({"type": "object", "x-guidance": {"whitespace_flexible": True}})
    assert '"item_separator"' not in Grammar(GrammarKind.JSON_SCHEMA, own).engine_text()


@pytest.mark.parametrize("shape", ["lark_chain", "schema_chain"])
def test_the_deepest_grammars_within_bounds_compile_without_killing_the_process(shape):
    """On the calling thread's 8 MiB these overflowed the stack from 3,000 rules or 1,000
    nested objects (SIGSEGV: a gateway or scheduler gone on one request)."""
    script = ("from tests.deep_grammars import SHAPES, deepest\n"
              f"grammar = deepest(SHAPES[{shape!r}])\n"
              "assert len(grammar.value) > 200_000\n"
              "print('levels ok', grammar.validate() is grammar)\n")
    done = run_script(script)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "levels ok True"


def test_a_schema_nested_past_the_json_parser_is_a_grammar_error():
    text = '{"type":"array","items":' * 5000 + '{"type":"string"}' + "}" * 5000
    with pytest.raises(GrammarError, match="nests too deeply"):
        Grammar(GrammarKind.JSON_SCHEMA, text).validate()


async def test_prepare_compiles_off_the_loop_and_validate_then_finds_it(monkeypatch):
    """A service's event loop awaits prepare() (the engine's thread compiles); validate() then
    answers from the check it made, as for a schema sent again, errors included."""
    compiled = []
    real = Grammar._compile_error
    monkeypatch.setattr(Grammar, "_compile_error",
                        lambda self: compiled.append(self) or real(self))
    good = Grammar(GrammarKind.REGEX, r"prepared-[0-9]{4}")
    bad = Grammar(GrammarKind.REGEX, r"prepared-(")
    for g in (good, bad):
        await g.prepare()
    assert compiled == [good, bad]
    assert good.validate() is good
    with pytest.raises(GrammarError, match="does not compile"):
        bad.validate()
    assert compiled == [good, bad], "validate() compiled nothing again"
