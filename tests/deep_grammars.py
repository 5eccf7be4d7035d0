"""The deepest grammars within MAX_GRAMMAR_CHARS that a client can send, by shape: the engine's
compiler recurses once per level (common/grammar.py: ENGINE_STACK_BYTES), and these need the most
stack per character of text (measured: 64-128 MiB for the Lark chain). Checked in a process of
their own, so that a stack overflow fails a test instead of killing pytest."""

import json

from common.grammar import MAX_GRAMMAR_CHARS, Grammar, GrammarKind


def _name(i: int) -> str:
    """0 -> a, 25 -> z, 26 -> aa, ...: the shortest distinct rule names."""
    out, i = "", i + 1
    while i:
        i, r = divmod(i - 1, 26)
        out = chr(97 + r) + out
    return out


def lark_chain(levels: int) -> Grammar:
    """a: b, b: c, ...: each rule names the next."""
    rules = "".join(f"{_name(i)}: {_name(i + 1)}\n" for i in range(levels))
    return Grammar(GrammarKind.LARK, f'start: a\n{rules}{_name(levels)}: "b"\n')


def schema_chain(levels: int) -> Grammar:
    """An object whose one required property is the next definition's object, via $ref."""
    defs = {_name(i): {"properties": {"a": {"$ref": f"#/$defs/{_name(i + 1)}"}},
                       "required": ["a"]} for i in range(levels)}
    defs[_name(levels)] = {"type": "string"}
    return Grammar(GrammarKind.JSON_SCHEMA, json.dumps({"$ref": "#/$defs/a", "$defs": defs},
                                                       separators=(",", ":")))


def deepest(shape) -> Grammar:
    """shape(levels) with the most levels whose text fits MAX_GRAMMAR_CHARS."""
    low, high = 1, MAX_GRAMMAR_CHARS
    while low < high:
        mid = (low + high + 1) // 2
        if len(shape(mid).value) <= MAX_GRAMMAR_CHARS:
            low = mid
        else:
            high = mid - 1
    return shape(low)


SHAPES = {"lark_chain": lark_chain, "schema_chain": schema_chain}
