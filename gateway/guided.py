"""The structured-output fields of an OpenAI request, made the request's grammar
(common/grammar.py): OpenAI's `response_format` ({"type": "json_object"}, {"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}) and vLLM's extras, sent in the body (the `openai`
client's extra_body): `guided_json` (a schema), `guided_regex`, `guided_choice` (a list of
strings), `guided_grammar` (Lark or GBNF), or the same in vLLM's newer `structured_outputs` object
({"json" | "regex" | "choice" | "grammar": ..., or "json_object": true}). At most one of them; a
grammar that does not compile is a 400 naming its field."""

import asyncio
import json
from collections.abc import Callable
from typing import TypeVar

from common.grammar import Grammar, GrammarError, GrammarKind
from gateway.http_errors import BadField

T = TypeVar("T")
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
# The fields of a body (OpenAI's, or TGI's parameters) that may carry a grammar to compile
GRAMMAR_FIELDS = ("response_format", "tools", "grammar", *GUIDED)


async def parsed_off_loop(parse: Callable[[dict], T], body: dict) -> T:
    """parse(body), in a worker thread when the body may carry a grammar: compiling one takes
    the engine up to ~0.4 s (common/grammar.py), which the event loop, serving every other
    stream, does not wait for; on the loop otherwise (most bodies: microseconds)."""
    if any(field in body for field in GRAMMAR_FIELDS):
        return await asyncio.to_thread(parse, body)
    return parse(body)


def request_grammar(body: dict) -> tuple[Grammar, str] | None:
    """(the grammar the body asks for, the field that asked), or None: free output."""
    found = [g for g in (_response_format(body.get("response_format")),
                         *(_guided(field, body.get(field)) for field in GUIDED),
                         *_structured_outputs(body.get("structured_outputs"))) if g]
    if len(found) > 1:
        raise BadField(found[1][1], f"only one of response_format, {', '.join(GUIDED)} may "
                                    f"constrain the output (and {found[0][1]} does)")
    if not found:
        return None
    grammar, field = found[0]
    checked(grammar, field)
    return grammar, field


def checked(grammar: Grammar, field: str) -> Grammar:
    """`grammar` validated; BadField naming `field` when it is out of bounds or does not
    compile."""
    try:
        return grammar.validate()
    except GrammarError as err:
        raise BadField(field, err.detail) from None


def _response_format(fmt) -> tuple[Grammar, str] | None:
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise BadField("response_format", "must be an object with a type")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar(GrammarKind.JSON_OBJECT), "response_format"
    if kind != "json_schema":
        raise BadField("response_format.type", f"must be text, json_object or json_schema, got "
                                               f"{kind!r}")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise BadField("response_format.json_schema", "must be an object with a schema")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise BadField("response_format.json_schema.schema", "must be a JSON Schema (an object)")
    if not isinstance(spec.get("strict", False), bool):
        raise BadField("response_format.json_schema.strict", "must be true or false")
    return (Grammar(GrammarKind.JSON_SCHEMA, json.dumps(schema)),
            "response_format.json_schema.schema")


# vLLM's newer structured_outputs object: its kinds, as the guided_* fields they replace
STRUCTURED_OUTPUTS = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                      "grammar": "guided_grammar"}
_STRUCTURED_HINTS = ("disable_fallback", "disable_any_whitespace")  # (change no output here)


def _structured_outputs(value) -> list[tuple[Grammar, str] | None]:
    """vLLM's `structured_outputs` ({"json" | "regex" | "choice" | "grammar": ..., or
    "json_object": true}) as the grammars it asks for; a 400 naming any other field it sets."""
    if value is None:
        return []
    if not isinstance(value, dict):
        raise BadField("structured_outputs", "must be an object")
    found = []
    for key, item in value.items():
        param = f"structured_outputs.{key}"
        if key in STRUCTURED_OUTPUTS:
            found.append(_guided(STRUCTURED_OUTPUTS[key], item, param))
        elif key == "json_object":
            if item not in (None, False, True):
                raise BadField(param, "must be true or false")
            found.append((Grammar(GrammarKind.JSON_OBJECT), param) if item else None)
        elif key not in _STRUCTURED_HINTS and item not in (None, False, "", [], {}):
            raise BadField(param, "is not supported")
    return found


def _guided(field: str, value, param: str = "") -> tuple[Grammar, str] | None:
    """A guided_* field's grammar (`param`: where the request said it, if not that field)."""
    param = param or field
    if value is None:
        return None
    if field == "guided_json":
        if isinstance(value, str):
            return Grammar(GrammarKind.JSON_SCHEMA, value), param
        if isinstance(value, dict):
            return Grammar(GrammarKind.JSON_SCHEMA, json.dumps(value)), param
        raise BadField(param, "must be a JSON Schema (an object, or its text)")
    if field == "guided_choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise BadField(param, "must be a list of strings")
        return Grammar(GrammarKind.CHOICE, choices=tuple(value)), param
    if not isinstance(value, str):
        raise BadField(param, "must be a string")
    return Grammar(GrammarKind.REGEX if field == "guided_regex" else GrammarKind.LARK,
                   value), param
