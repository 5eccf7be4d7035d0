"""OpenAI response bodies and server-sent events, built from the pool's token stream.

A streamed token costs one json.dumps of its text and a few string joins: each stream's fixed
parts (id, created, model, choice prefixes) are encoded once per request.

A token's text in logprobs is the text its message added to the output (the scheduler's
incremental detokenizer: " river" after "stone", however the tokenizer decodes a token alone),
so the tokens concatenate to the text and `text_offset` indexes it, for every tokenizer. A token
whose text comes only with a later one (the rest of a UTF-8 character, or text held back while
it could begin a stop string) has "" and that text goes with the later token; what the final
message flushes goes with the last token.
"""

import dataclasses
import json
import secrets
import time

from gateway.http_errors import error_body
from gateway.tool_calls import ToolCall, ToolCallParser, ToolFormat
from protos import scheduler_pb2

FINISH = {scheduler_pb2.FINISH_REASON_LENGTH: "length", scheduler_pb2.FINISH_REASON_STOP: "stop"}
DONE = b"data: [DONE]\n\n"


class Choice:
    """One choice's tokens, as they arrive."""

    def __init__(self, index: int, with_logprobs: bool = False, tools: ToolFormat | None = None):
        self.index = index
        self.texts: list[str] = []
        # The output read for tool calls (a chat with tools), or None.
        self.tool_calls = ToolCallParser(tools) if tools else None
        self.finish_reason: str | None = None
        self.completion_tokens = 0
        # (each token's text, its logprob), when logprobs are asked for
        self.logprobs: list[tuple[str, float]] | None = [] if with_logprobs else None

    def add(self, message: scheduler_pb2.GenerateResponse) -> None:
        if message.HasField("token_id"):
            self.texts.append(message.text)
            if self.logprobs is not None:
                self.logprobs.append((message.text, message.logprob))
        elif message.text:
            self.texts.append(message.text)
            if self.logprobs:  # (flushed at the end: the last token's)
                token, logprob = self.logprobs[-1]
                self.logprobs[-1] = (token + message.text, logprob)
        if self.tool_calls is not None:
            self.tool_calls.feed(message.text)
        if message.finish_reason:
            self.finish_reason = FINISH[message.finish_reason]
            self.completion_tokens = message.usage.completion_tokens
            if self.tool_calls is not None:
                self.tool_calls.finish()

    def chat_message(self) -> tuple[dict, str | None]:
        """(the assistant's message, the finish reason): with the tool calls it made, if any
        ("tool_calls" then, when it ended by itself)."""
        calls = self.tool_calls.calls if self.tool_calls is not None else []
        if not calls:
            return {"role": "assistant", "content": self.text}, self.finish_reason
        message = {"role": "assistant", "content": self.tool_calls.content or None,
                   "tool_calls": [{"id": _call_id(), "type": "function",
                                   "function": {"name": c.name, "arguments": c.arguments}}
                                  for c in calls]}
        return message, _with_calls(self.finish_reason)

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def completion_logprobs(self) -> dict | None:
        """Completions' logprobs: per token its text, logprob and offset (no alternatives)."""
        if self.logprobs is None:
            return None
        offsets, at = [], 0
        for token, _ in self.logprobs:
            offsets.append(at)
            at += len(token)
        return {"tokens": [t for t, _ in self.logprobs],
                "token_logprobs": [lp for _, lp in self.logprobs],
                "top_logprobs": None, "text_offset": offsets}

    def chat_logprobs(self) -> dict | None:
        if self.logprobs is None:
            return None
        return {"content": [_chat_token(t, lp) for t, lp in self.logprobs]}


def _chat_token(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode()),
            "top_logprobs": []}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Response:
    """The identity of one response: id, created, model, object kinds."""

    def __init__(self, chat: bool, model: str, request_id: str):
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id  # (the id in every log)
        self.created = int(time.time())
        self.model = model

    def body(self, choices: list[Choice], prompt_tokens: int) -> dict:
        """The whole (not streamed) response."""
        completion = sum(c.completion_tokens for c in choices)
        if self.chat:
            out = [{"index": c.index, "message": message, "logprobs": c.chat_logprobs(),
                    "finish_reason": reason}
                   for c in choices for message, reason in (c.chat_message(),)]
        else:
            out = [{"index": c.index, "text": c.text, "logprobs": c.completion_logprobs(),
                    "finish_reason": c.finish_reason} for c in choices]
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": out,
                "usage": usage(prompt_tokens, completion)}


class EventWriter:
    """Server-sent events of one streamed response."""

    def __init__(self, response: Response, include_usage: bool, with_logprobs: bool = False,
                 tools: ToolFormat | None = None):
        self._response = response
        self._tools = tools  # chat deltas carry the tool calls read in this format
        self._calls: dict[int, _StreamedCalls] = {}  # choice -> its calls so far
        self._with_logprobs = with_logprobs
        self._offsets: dict[int, int] = {}  # choice -> its text's length so far (text_offset)
        head = {"id": response.id,
                "object": "chat.completion.chunk" if response.chat else "text_completion",
                "created": response.created, "model": response.model}
        self._head = json.dumps(head)[:-1]  # '{"id": ..., "model": "..."' (no closing brace)
        self._tail = ', "usage": null}\n\n' if include_usage else "}\n\n"
        self._started: set[int] = set()

    def token(self, index: int, message: scheduler_pb2.GenerateResponse) -> bytes:
        """The event of one message of choice `index`: its text, and its finish reason if it is
        the last."""
        finish = FINISH.get(message.finish_reason)
        logprobs = "null"
        offset = self._offsets.get(index, 0)
        self._offsets[index] = offset + len(message.text)
        if self._with_logprobs and message.HasField("token_id"):
            token = message.text
            logprobs = json.dumps(
                {"content": [_chat_token(token, message.logprob)]} if self._response.chat else
                {"tokens": [token], "token_logprobs": [message.logprob], "top_logprobs": None,
                 "text_offset": [offset]})
        if self._response.chat and self._tools is not None:
            delta, finish = self._tool_delta(index, message, finish)
        elif self._response.chat:
            if index not in self._started:
                self._started.add(index)
                delta = '{"role": "assistant", "content": ' + json.dumps(message.text) + "}"
            elif finish and not message.text:
                delta = "{}"
            else:
                delta = '{"content": ' + json.dumps(message.text) + "}"
        if self._response.chat:
            choice = f'{{"index": {index}, "delta": {delta}, "logprobs": {logprobs}'
        else:
            choice = f'{{"index": {index}, "text": {json.dumps(message.text)}, ' \
                     f'"logprobs": {logprobs}'
        reason = f'"{finish}"' if finish else "null"
        return (f'data: {self._head}, "choices": [{choice}, "finish_reason": {reason}}}]'
                f"{self._tail}").encode()

    def _tool_delta(self, index: int, message: scheduler_pb2.GenerateResponse,
                    finish: str | None) -> tuple[str, str | None]:
        """A chat delta of a choice read for tool calls, as OpenAI streams them: content as it
        comes; a call once its name is known (index, id, type, function name, the arguments
        so far), then its arguments' text in fragments; (delta, finish reason)."""
        streamed = self._calls.setdefault(index, _StreamedCalls(ToolCallParser(self._tools)))
        parser = streamed.parser
        parser.feed(message.text)
        if finish:
            parser.finish()
        delta: dict = {} if streamed.started else {"role": "assistant"}
        streamed.started = True
        if len(parser.content) > streamed.content_sent or "role" in delta:
            delta["content"] = parser.content[streamed.content_sent:]
            streamed.content_sent = len(parser.content)
        calls = [d for i, call in enumerate(parser.calls) if (d := streamed.delta(i, call))]
        if calls:
            delta["tool_calls"] = calls
        return json.dumps(delta), (_with_calls(finish) if parser.calls else finish)

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        """The last event when stream_options.include_usage: no choices, the usage."""
        return (f'data: {self._head}, "choices": [], '
                f'"usage": {json.dumps(usage(prompt_tokens, completion_tokens))}}}\n\n').encode()

    @staticmethod
    def error(exc: BaseException) -> bytes:
        """An error after the stream began: an `error` event (clients raise it), then [DONE]."""
        _, body, _ = error_body(exc)
        return f"data: {json.dumps(body)}\n\n".encode() + DONE


@dataclasses.dataclass
class _StreamedCalls:
    """What a streamed choice has sent of its content and tool calls."""

    parser: ToolCallParser
    started: bool = False
    content_sent: int = 0
    sent: list[int] = dataclasses.field(default_factory=list)  # per call: arguments' chars sent

    def delta(self, i: int, call: ToolCall) -> dict | None:
        """Call i's part of the next delta, if it moved (it starts once its name is known)."""
        if i == len(self.sent) and call.name is not None:
            self.sent.append(len(call.arguments))
            return {"index": i, "id": _call_id(), "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments}}
        if i < len(self.sent) and len(call.arguments) > self.sent[i]:
            fragment, self.sent[i] = call.arguments[self.sent[i]:], len(call.arguments)
            return {"index": i, "function": {"arguments": fragment}}
        return None


def _call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _with_calls(finish: str | None) -> str | None:
    """A choice that called tools and ended by itself finished for "tool_calls"."""
    return "tool_calls" if finish == "stop" else finish
