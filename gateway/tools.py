"""The tool fields of a chat request, checked: `tools` (functions, each with a JSON Schema of its
parameters), `tool_choice` ("none", "auto", "required", or {"type": "function", "function":
{"name"}}) and `parallel_tool_calls`; assistant messages' `tool_calls` and "tool" messages
before them. The tools are rendered by the model's chat template (its `tools` variable, as
transformers' apply_chat_template(tools=...) gives it); with "required" or a named function the
output is held by a grammar to tool calls in the model's own format (gateway/tool_calls.py);
with "auto" the model may call them or answer; with "none" its output is the answer."""

from __future__ import annotations

import dataclasses
import json
import re

from common.grammar import JSON_LAYOUT, Grammar, GrammarError, GrammarKind
from gateway.http_errors import BadField
from gateway.tool_calls import ToolFormat

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# A function that states no parameters is called with {} (OpenAI's), not any object
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclasses.dataclass(frozen=True)
class Tools:
    specs: tuple[dict, ...]  # {"type": "function", "function": {...}}, as the template takes them
    choice: str  # "none" | "auto" | "required" | "function" (the one named)
    function: str | None = None  # tool_choice's named function
    parallel: bool = True

    @property
    def are_parsed(self) -> bool:
        """The output is read for tool calls (not with tool_choice "none")."""
        return self.choice != "none"

    def grammar(self, fmt: ToolFormat) -> Grammar | None:
        """For "required" or a named function, the grammar of tool calls in `fmt`: calls of
        these functions with arguments valid against their parameters (one call for a named
        function or without parallel_tool_calls); None for "auto" and "none"."""
        if self.choice not in ("required", "function"):
            return None
        picked = [s["function"] for s in self.specs
                  if self.choice == "required" or s["function"]["name"] == self.function]
        calls = [{"type": "object", "additionalProperties": False,
                  "properties": {"name": {"const": f["name"]},
                                 fmt.arguments_key: f.get("parameters", _NO_PARAMETERS)},
                  "required": ["name", fmt.arguments_key]} for f in picked]
        schema = {"anyOf": calls} if len(calls) > 1 else calls[0]
        many = self.choice == "required" and self.parallel
        return Grammar(GrammarKind.LARK, fmt.grammar({**schema, "x-guidance": JSON_LAYOUT},
                                                     many))


def chat_tools(body: dict) -> Tools | None:
    """The request's tools, or None when it names none."""
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise BadField("functions", "the legacy functions API is not supported: send tools")
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise BadField("tool_choice", "needs tools")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise BadField("tools", f"must be a list of at most {MAX_TOOLS} functions")
    specs = tuple(_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools))
    names = [s["function"]["name"] for s in specs]
    if len(set(names)) != len(names):
        raise BadField("tools", "function names must be unique")
    parallel = body.get("parallel_tool_calls")
    parallel = True if parallel is None else parallel  # (null: the default, as for every field)
    if not isinstance(parallel, bool):
        raise BadField("parallel_tool_calls", "must be true or false")
    if choice is None or choice in ("none", "auto", "required"):
        return Tools(specs, choice or "auto", None, parallel)
    function = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or function not in names:
        raise BadField("tool_choice", "must be none, auto, required or {\"type\": \"function\", "
                                      "\"function\": {\"name\": ...}} naming one of the tools")
    return Tools(specs, "function", function, parallel)


def _tool(tool, param: str) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(
            tool.get("function"), dict):
        raise BadField(param, "must be {\"type\": \"function\", \"function\": {...}}")
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise BadField(f"{param}.function.name", "must be 1-64 characters of [A-Za-z0-9_.-]")
    if not isinstance(function.get("description", ""), str):
        raise BadField(f"{param}.function.description", "must be a string")
    parameters = function.get("parameters", _NO_PARAMETERS)
    if not isinstance(parameters, dict):
        raise BadField(f"{param}.function.parameters", "must be a JSON Schema (an object)")
    try:
        Grammar(GrammarKind.JSON_SCHEMA, json.dumps(parameters)).validate()
    except GrammarError as err:
        raise BadField(f"{param}.function.parameters", err.detail) from None
    return {"type": "function", "function": {**function, "parameters": parameters}}


def message_tool_calls(calls, param: str) -> list[dict]:
    """An assistant message's tool_calls as templates read them: arguments as an object (clients
    send the JSON text OpenAI gave them)."""
    if not isinstance(calls, list):
        raise BadField(param, "must be a list of tool calls")
    out = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise BadField(f"{param}[{i}]", "must be {\"id\", \"type\": \"function\", "
                                            "\"function\": {\"name\", \"arguments\"}}")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except (ValueError, RecursionError):
                raise BadField(f"{param}[{i}].function.arguments", "must be JSON (nested at "
                               "most a few hundred deep)") from None
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out
