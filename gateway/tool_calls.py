"""Tool calls in a model's output, in the formats the served families are trained to write, picked
by the chat template (`ToolFormat.for_template`):

    hermes    <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>   (Qwen2/2.5/3,
              Hermes, and any template that names <tool_call>; the default)
    mistral   [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
    llama3    {"name": ..., "parameters": {...}}   (Llama 3.1+: a JSON object as the whole reply,
              after <|python_tag|> or alone)

`ToolCallParser` reads an output as it grows, the same way streamed and whole: the text before
the first call is the message's content, and each call gives its name once known, then its
arguments' text as it grows (the model's own JSON text of that value). A reply whose calls are not
JSON objects with a string name is content, as vLLM treats it. A format's marker that is a special
token may be missing from the text (the detokenizer leaves special tokens out): the JSON alone is
read as calls then too.
"""

from __future__ import annotations

import dataclasses
import json
import re

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_MISTRAL_MARK, _LLAMA_MARK = "[TOOL_CALLS]", "<|python_tag|>"


@dataclasses.dataclass(frozen=True)
class ToolFormat:
    name: str  # "hermes" | "mistral" | "llama3"
    arguments_key: str  # what the format calls a call's arguments

    @classmethod
    def for_template(cls, template: str) -> ToolFormat:
        if _MISTRAL_MARK in template:
            return MISTRAL
        if _HERMES_OPEN not in template and (_LLAMA_MARK in template
                                             or "<|start_header_id|>" in template):
            return LLAMA3
        return HERMES

    def grammar(self, call_schema: dict, many: bool) -> str:
        """A Lark grammar (llguidance's, with %json) for output that is only tool calls, each a
        JSON object valid against `call_schema`; one call or, when `many`, one or more. Written
        without special-token markers, which the parser does not need."""
        schema = json.dumps(call_schema)
        if self.name == "hermes":
            call, separator, start, end = (f'"{_HERMES_OPEN}\\n" %json {schema} '
                                           f'"\\n{_HERMES_CLOSE}"'), '"\\n"', "", ""
        else:
            call = f"%json {schema}"
            separator = '", "' if self.name == "mistral" else '"; "'
            start, end = ('"[" ', ' "]"') if self.name == "mistral" else ("", "")
        more = f" ({separator} call)*" if many else ""
        return f"start: {start}call{more}{end}\ncall: {call}\n"


HERMES = ToolFormat("hermes", "arguments")
MISTRAL = ToolFormat("mistral", "arguments")
LLAMA3 = ToolFormat("llama3", "parameters")


@dataclasses.dataclass
class ToolCall:
    name: str | None = None  # None until its text has given it whole
    arguments: str = ""  # its arguments' JSON text so far
    is_complete: bool = False  # the arguments' value is closed


class ToolCallParser:
    """One choice's output, fed as it grows: `content` and `calls` always say what it holds."""

    def __init__(self, fmt: ToolFormat):
        self.format = fmt
        self.text = ""
        self.content = ""
        self.calls: list[ToolCall] = []
        self._scans: dict[object, _Scan] = {}  # (what _objects scanned of each growing text)

    def feed(self, delta: str) -> None:
        self.text += delta
        content, bodies = _split(self.format, self.text, self._scan("calls"))
        calls = [_read_call(body, self.format.arguments_key, self._scan(("arguments", i)))
                 for i, body in enumerate(bodies)]
        if any(c is None for c in calls):  # not calls after all: all of it is content
            content, calls = self.text, []
        self.content, self.calls = content, calls

    def _scan(self, text_id: object) -> _Scan:
        return self._scans.setdefault(text_id, _Scan())

    def finish(self) -> None:
        """The output is whole: calls whose JSON does not parse make it all content."""
        if not self.calls:
            self.content = self.text  # (with a tail held back as a marker's possible start)
        for call in self.calls:
            try:
                ok = call.is_complete and call.name and isinstance(json.loads(call.arguments),
                                                                   dict)
            except (ValueError, RecursionError):  # (nested past the parser: not a call either)
                ok = False
            if not ok:
                self.content, self.calls = self.text, []
                return


def _split(fmt: ToolFormat, text: str, scan: _Scan | None = None) -> tuple[str, list[str]]:
    """(content, the calls' JSON texts so far): content stops where calls begin, and holds back
    a tail that may be the start of a call's marker."""
    if fmt.name == "hermes":
        start = text.find(_HERMES_OPEN)
        if start < 0:
            return _held_back(text, (_HERMES_OPEN,)), []
        bodies = []
        for part in text[start:].split(_HERMES_OPEN)[1:]:
            bodies.append(part.split(_HERMES_CLOSE)[0])
        return text[:start], bodies
    mark = _MISTRAL_MARK if fmt.name == "mistral" else _LLAMA_MARK
    stripped = text.lstrip()
    if stripped.startswith(mark):
        stripped = stripped[len(mark):].lstrip()
    elif not stripped or mark.startswith(stripped):
        return "", []  # (may be the marker, or calls, still to come)
    opener = "[" if fmt.name == "mistral" else "{"
    if not stripped.startswith(opener):
        return text, []
    if fmt.name == "mistral":
        stripped = stripped[1:]
    return "", _objects(stripped, scan)


def _held_back(text: str, markers: tuple[str, ...]) -> str:
    """text without a tail that is the start of one of `markers`."""
    for k in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(text[-k:]) for m in markers):
            return text[:-k]
    return text


# What bracket depth depends on: a whole JSON string (skipped, brackets in it and all), a bracket,
# or a quote that opens a string not closed yet (the rest of the text is inside it)
_STRUCTURE = re.compile(r'"(?:[^"\\]|\\.)*"|[{}\[\]]|"')


@dataclasses.dataclass
class _Scan:
    """Bracket depth over a text that only grows (an output as tokens arrive), kept between feeds
    so that each scans only what is new: ToolCallParser reads the whole output on every token,
    and a step per character of it cost the gateway 435 us a token on a 1,900-token call."""

    text: str = ""  # what was scanned
    resume: int = 0  # where to go on: the end, or the quote of a string still open there
    depth: int = 0
    start: int | None = None  # where the open top-level object began
    closed: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (start, end)


def _objects(text: str, scan: _Scan | None = None) -> list[str]:
    """The top-level JSON objects in `text` (the last possibly unclosed), by bracket depth; with
    `scan` (updated), going on from where it stopped when `text` extends what it scanned."""
    if scan is None:
        scan = _Scan()
    elif not text.startswith(scan.text):  # (not a growth of what it scanned: from the start)
        scan.__init__()
    position, scan.resume = scan.resume, len(text)
    for m in _STRUCTURE.finditer(text, position):
        token = m.group()
        if token[0] == '"':
            if len(token) == 1:  # (an open string runs to the end)
                scan.resume = m.start()
                break
            continue
        if token in "{[":
            if scan.depth == 0:
                scan.start = m.start()
            scan.depth += 1
        elif scan.depth:  # (a close at depth 0: of an array the objects are in)
            scan.depth -= 1
            if scan.depth == 0:
                scan.closed.append((scan.start, m.end()))
                scan.start = None
    scan.text = text
    objects = [text[a:b] for a, b in scan.closed]
    return objects + ([text[scan.start:]] if scan.start is not None else [])


_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


def _read_call(body: str, arguments_key: str, scan: _Scan | None = None) -> ToolCall | None:
    """What a call's JSON text says so far; None when it is not a call (no object)."""
    body = body.strip()
    if not body:
        return ToolCall()
    if not body.startswith("{"):
        return None
    call = ToolCall()
    name = _NAME.search(body)
    if name:
        call.name = json.loads(f'"{name.group(1)}"')
    key = re.search(r'"' + arguments_key + r'"\s*:\s*', body)
    if key:
        value = body[key.end():]
        closed = _objects(value, scan)
        if value.startswith("{") and closed:
            call.arguments = closed[0]
            call.is_complete = closed[0].endswith("}") and _is_json(closed[0])
    return call


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True
