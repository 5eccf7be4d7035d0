"""Tool calls read from a model's output (gateway/tool_calls.py), whole and as it streams, in
each family's format; and the grammars that hold an output to them (gateway/tools.py)."""

import json
import random

import llguidance
import pytest

from gateway.http_errors import BadField
from gateway.tool_calls import HERMES, LLAMA3, MISTRAL, ToolCallParser, ToolFormat
from gateway.tools import chat_tools, message_tool_calls

WEATHER = {"city": "Paris", "note": "a {brace} and \"quotes\""}
OUTPUTS = {
    HERMES: ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": '
             + json.dumps(WEATHER) + '}\n</tool_call>\n<tool_call>\n{"arguments": {"n": 2}, '
             '"name": "add"}\n</tool_call>'),
    MISTRAL: ('[TOOL_CALLS][{"name": "get_weather", "arguments": ' + json.dumps(WEATHER)
              + '}, {"name": "add", "arguments": {"n": 2}}]'),
    LLAMA3: ('<|python_tag|>{"name": "get_weather", "parameters": ' + json.dumps(WEATHER)
             + '}; {"name": "add", "parameters": {"n": 2}}'),
}


def fed(fmt, text: str, step: int) -> ToolCallParser:
    parser = ToolCallParser(fmt)
    for at in range(0, len(text), step):
        parser.feed(text[at:at + step])
    parser.finish()
    return parser


@pytest.mark.parametrize("fmt", list(OUTPUTS), ids=lambda f: f.name)
@pytest.mark.parametrize("step", [1, 3, 10_000])
def test_calls_are_read_whole_and_piece_by_piece(fmt, step):
    parser = fed(fmt, OUTPUTS[fmt], step)
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [
        ("get_weather", WEATHER), ("add", {"n": 2})]
    assert parser.content == ("Let me look. " if fmt is HERMES else "")


@pytest.mark.parametrize("fmt", list(OUTPUTS), ids=lambda f: f.name)
def test_arguments_grow_as_prefixes_of_the_final_text(fmt):
    """What streaming sends of a call's arguments is never taken back."""
    parser, seen = ToolCallParser(fmt), {}
    for ch in OUTPUTS[fmt]:
        parser.feed(ch)
        for i, call in enumerate(parser.calls):
            assert call.arguments.startswith(seen.get(i, ""))
            seen[i] = call.arguments
            assert call.name is None or call.name in ("get_weather", "add")
    assert json.loads(seen[0]) == WEATHER


@pytest.mark.parametrize("fmt,text", [
    (HERMES, "No tools needed: 4."),
    (HERMES, "Half a marker <tool_ca"),
    (HERMES, "<tool_call>\nnot json\n</tool_call>"),
    (MISTRAL, "Paris is sunny."),
    (LLAMA3, "{not a call"),
    (HERMES, '<tool_call>\n{"name": "add", "arguments": ' + '{"a": ' * 1200 + "1" + "}" * 1200
     + "}\n</tool_call>"),  # (nested past Python's JSON parser)
])
def test_text_that_is_no_call_is_content(fmt, text):
    for step in (1, len(text)):
        parser = fed(fmt, text, step)
        assert parser.calls == [] and parser.content == text


def test_the_format_follows_the_template():
    assert ToolFormat.for_template("... <tool_call> ...") is HERMES
    assert ToolFormat.for_template("{{ '[TOOL_CALLS]' }}") is MISTRAL
    assert ToolFormat.for_template("<|start_header_id|>ipython<|end_header_id|>") is LLAMA3
    assert ToolFormat.for_template("{{ messages }}") is HERMES  # (the default)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
             "required": ["city"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"n": {"type": "integer"}},
             "required": ["n"], "additionalProperties": False}}}]


@pytest.mark.parametrize("fmt", list(OUTPUTS), ids=lambda f: f.name)
def test_required_and_named_grammars_take_their_calls_only(fmt, tiny):
    tokenizer = llguidance.LLTokenizer(
        open(f"{tiny['model_dir']}/tokenizer.json").read(), eos_token=1)
    one = {HERMES: '<tool_call>\n{"name": "add", "arguments": {"n": 2}}\n</tool_call>',
           MISTRAL: '[{"name": "add", "arguments": {"n": 2}}]',
           LLAMA3: '{"name": "add", "parameters": {"n": 2}}'}[fmt]
    bad = one.replace('"n": 2', '"n": "two"')

    def accepts(choice, text, parallel=True):
        tools = chat_tools({"tools": TOOLS, "tool_choice": choice,
                            "parallel_tool_calls": parallel})
        matcher = llguidance.LLMatcher(tokenizer, tools.grammar(fmt).engine_text(), log_level=0)
        return matcher.consume_tokens(tokenizer.tokenize_str(text)) and matcher.is_accepting()

    named = {"type": "function", "function": {"name": "add"}}
    assert accepts("required", one) and accepts(named, one)
    assert not accepts("required", bad) and not accepts(named, one.replace("add", "get_weather"))
    assert fed(fmt, one, 1).calls[0].name == "add"


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "objectx"}}}]}, "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"tools": TOOLS, "parallel_tool_calls": "x"}, "parallel_tool_calls"),
])
def test_bad_tool_fields_name_the_field(body, param):
    with pytest.raises(BadField) as err:
        chat_tools(body)
    assert err.value.param == param


def test_parallel_tool_calls_null_is_the_default():
    """null is the default (true), as for every other field; false holds "required" to one
    call."""
    assert chat_tools({"tools": TOOLS, "parallel_tool_calls": None}).parallel is True
    assert chat_tools({"tools": TOOLS}).parallel is True
    assert chat_tools({"tools": TOOLS, "parallel_tool_calls": False}).parallel is False


def streamed_deltas(fmt, pieces: list[str]) -> tuple[list[dict], str]:
    """The chat deltas an EventWriter streams for an output arriving in `pieces`, and the last
    finish reason."""
    from gateway.openai_responses import EventWriter, Response
    from protos import scheduler_pb2

    writer = EventWriter(Response(True, "m", "r"), False, tools=fmt)
    deltas, reason = [], None
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        message = scheduler_pb2.GenerateResponse(
            text=piece, finish_reason=scheduler_pb2.FINISH_REASON_STOP if last else 0)
        if not last:
            message.token_id = 5
        event = json.loads(writer.token(0, message).decode().removeprefix("data: "))
        deltas.append(event["choices"][0]["delta"])
        reason = event["choices"][0]["finish_reason"]
    return deltas, reason


def test_auto_streams_content_and_then_calls():
    text = OUTPUTS[HERMES]
    deltas, reason = streamed_deltas(HERMES, [text[i:i + 4] for i in range(0, len(text), 4)])
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("content") or "" for d in deltas) == "Let me look. "
    calls = {}
    for delta in deltas:
        for part in delta.get("tool_calls", ()):
            if part["index"] not in calls:
                assert part["id"].startswith("call_") and part["type"] == "function"
                calls[part["index"]] = [part["function"]["name"], ""]
            calls[part["index"]][1] += part["function"]["arguments"]
    assert [(n, json.loads(a)) for n, a in calls.values()] == [("get_weather", WEATHER),
                                                               ("add", {"n": 2})]
    assert reason == "tool_calls"
    plain = "Paris is <b>sunny</b> today."
    deltas, reason = streamed_deltas(HERMES, list(plain) + [""])
    assert "".join(d.get("content") or "" for d in deltas) == plain and reason == "stop"
    assert not any("tool_calls" in d for d in deltas)


def test_a_message_tool_call_nested_past_the_parser_is_a_400_naming_it():
    calls = [{"id": "1", "type": "function",
              "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}]
    with pytest.raises(BadField) as err:
        message_tool_calls(calls, "messages[1].tool_calls")
    assert err.value.param == "messages[1].tool_calls[0].function.arguments"


PIECES = ("<tool_call>\n", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>",
          '{"name": "add", "arguments": ', '{"parameters": ', '{"a": [1, "x}"]}', '"\\"', "}",
          "]", "[", "{", ", ", " ", "text ", '"', "\\", "\n", '"name": "f"')


@pytest.mark.parametrize("fmt", [HERMES, MISTRAL, LLAMA3])
def test_a_parser_fed_piece_by_piece_says_what_one_fed_it_whole_says(fmt):
    """The parser keeps what it scanned between feeds (gateway/tool_calls.py _Scan): after every
    feed it says what a fresh parser given the same text at once says, over random outputs made
    of the formats' markers, brackets, quotes and escapes."""
    rng = random.Random(7)

    def said(parser: ToolCallParser) -> tuple:
        return parser.content, [(c.name, c.arguments, c.is_complete) for c in parser.calls]

    for _ in range(1500):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 14)))
        parser, fed_so_far = ToolCallParser(fmt), 0
        while fed_so_far < len(text):
            step = rng.randint(1, 6)
            parser.feed(text[fed_so_far:fed_so_far + step])
            fed_so_far += step
            whole = ToolCallParser(fmt)
            whole.feed(text[:fed_so_far])
            assert said(parser) == said(whole), text[:fed_so_far]
