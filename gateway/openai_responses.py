"""OpenAI response bodies and server-sent events, built from the pool's token stream.

A streamed token costs one json.dumps of its text and a few string joins: each stream's fixed
parts (id, created, model, choice prefixes) are encoded once per request.

A token's text in logprobs is the text its message added to the output (the scheduler's
incremental detokenizer: " river" after "stone", however the tokenizer decodes a token alone),
so the tokens concatenate to the text and `text_offset` indexes it, for every tokenizer. A token
whose text comes only with a later one (the rest of a UTF-8 character, or text held back while
it could begin a stop string) has "" and that text goes with the later token; what the final
message flushes goes with the last token. An alternative's text is what it would have added in
the sampled token's place (common/token_logprobs.py). Completions' top_logprobs hold the top n
and the sampled token (OpenAI: up to n + 1 entries); chat's the top n. With `echo`, a
completion's text and logprobs begin with the prompt's tokens (the first without a logprob), and
a stream's first event of each choice is the prompt; a chat's content begins with the last
message's when that is the assistant's (vLLM's chat `echo`), its first delta that text.
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


@dataclasses.dataclass(frozen=True)
class Entry:
    """A token as logprobs show it."""

    text: str
    logprob: float | None  # None: a prompt's first token
    token_id: int
    top: tuple[scheduler_pb2.TopLogprob, ...] = ()

    @classmethod
    def of(cls, token: scheduler_pb2.GenerateResponse | scheduler_pb2.PromptToken) -> "Entry":
        """A prompt token, or a sampled one (named by its own text, not what the message
        streams: stop strings may hold some back)."""
        if isinstance(token, scheduler_pb2.PromptToken):
            logprob = token.logprob if token.HasField("logprob") else None
            return cls(token.text, logprob, token.token_id, tuple(token.top_logprobs))
        return cls(token.token_text, token.logprob, token.token_id, tuple(token.top_logprobs))

    def completion_top(self) -> dict | None:
        """Its top alternatives and itself, text -> logprob (None for a prompt's first)."""
        if self.logprob is None:
            return None
        top: dict[str, float] = {}
        for alt in self.top:  # (two texts alike: the likelier one's)
            top.setdefault(alt.text, alt.logprob)
        if all(alt.token_id != self.token_id for alt in self.top):
            top.setdefault(self.text, self.logprob)
        return top

    def chat(self) -> dict:
        return {**_chat_token(self.text, self.logprob),
                "top_logprobs": [_chat_token(alt.text, alt.logprob) for alt in self.top]}


def _chat_token(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def stop_reason(message: scheduler_pb2.GenerateResponse) -> str | int | None:
    """vLLM's stop_reason of a last message: the stop string or stop token id that ended it
    (None: EOS, or the length)."""
    if message.stop_string:
        return message.stop_string
    return message.stop_token_id if message.HasField("stop_token_id") else None


def completion_logprobs(entries: list[Entry], offset: int = 0) -> dict:
    """Completions' logprobs of `entries`, their text offsets from `offset`; each token's
    top_logprobs hold it and its alternatives (it alone with logprobs 0, as vLLM answers)."""
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.text)
    return {"tokens": [e.text for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [e.completion_top() for e in entries],
            "text_offset": offsets}


class Choice:
    """One choice's tokens, as they arrive."""

    def __init__(self, index: int, with_logprobs: bool = False, echo: str | None = None,
                 tools: ToolFormat | None = None):
        self.index = index
        self.texts: list[str] = []
        # The output read for tool calls (a chat with tools), or None.
        self.tool_calls = ToolCallParser(tools) if tools else None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None  # (vLLM's: the stop string or token id)
        self.completion_tokens = 0
        self.cached_prompt_tokens = 0  # its prompt's tokens the prefix cache held
        self.adapter_inactive = False  # it named an activated LoRA that did not activate
        self.echo = echo  # the prompt's text, when it is echoed (None: not)
        self.prompt: list[Entry] = []  # the prompt's tokens, when echoed with logprobs
        self.logprobs: list[Entry] | None = [] if with_logprobs else None

    def add(self, message: scheduler_pb2.GenerateResponse) -> None:
        if message.prompt_tokens:
            self.prompt = [Entry.of(t) for t in message.prompt_tokens]
        if message.HasField("token_id"):
            self.texts.append(message.text)
            if self.logprobs is not None:
                self.logprobs.append(Entry.of(message))
        elif message.text:
            self.texts.append(message.text)
            if self.logprobs:  # (flushed at the end: the last token's)
                last = self.logprobs[-1]
                self.logprobs[-1] = dataclasses.replace(last, text=last.text + message.text)
        if self.tool_calls is not None:
            self.tool_calls.feed(message.text)
        if message.finish_reason:
            self.finish_reason = FINISH[message.finish_reason]
            self.stop_reason = stop_reason(message)
            self.completion_tokens = message.usage.completion_tokens
            self.cached_prompt_tokens = message.usage.cached_prompt_tokens
            self.adapter_inactive = message.usage.adapter_inactive
            if self.tool_calls is not None:
                self.tool_calls.finish()

    def chat_message(self) -> tuple[dict, str | None]:
        """(the assistant's message, the finish reason): with the tool calls it made, if any
        ("tool_calls" then, when it ended by itself)."""
        calls = self.tool_calls.calls if self.tool_calls is not None else []
        if not calls:
            return {"role": "assistant", "content": self.text}, self.finish_reason
        content = self.prompt_text + self.tool_calls.content
        message = {"role": "assistant", "content": content or None,
                   "tool_calls": [{"id": _call_id(), "type": "function",
                                   "function": {"name": c.name, "arguments": c.arguments}}
                                  for c in calls]}
        return message, _with_calls(self.finish_reason)

    @property
    def prompt_text(self) -> str:
        """What comes before the completion: the prompt when echoed, else nothing."""
        if self.echo is None:
            return ""
        return "".join(e.text for e in self.prompt) if self.prompt else self.echo

    @property
    def text(self) -> str:
        return self.prompt_text + "".join(self.texts)

    def completion_logprobs(self) -> dict | None:
        """Completions' logprobs: per token its text, logprob and offset (the prompt's first
        when echoed), and its alternatives."""
        if self.logprobs is None:
            return None
        prompt = self.prompt if self.echo is not None else []
        return completion_logprobs(prompt + self.logprobs)

    def chat_logprobs(self) -> dict | None:
        if self.logprobs is None:
            return None
        return {"content": [e.chat() for e in self.logprobs]}


# A response's field (and every streamed chunk's) when its model is an activated LoRA whose
# invocation the prompt does not hold: the base model answered, as PEFT would (docs/api.md).
ADAPTER_ACTIVATED = "adapter_activated"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage, with prompt_tokens_details.cached_tokens: the prompt's tokens whose KV
    came from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def cached_prompt_tokens(cached: dict[int, int], n: int) -> int:
    """usage's cached_tokens from each choice's (choice index -> its prompt's tokens the prefix
    cache held), with `n` choices per prompt (choice i * n + j is prompt i's choice j): each
    prompt counted once, as prompt_tokens counts it, so never more than prompt_tokens. A prompt's
    count is the least of its choices': what the request found cached (a choice that came after
    another of the same prompt also finds what that one had just computed)."""
    per_prompt: dict[int, int] = {}
    for index, tokens in cached.items():
        per_prompt[index // n] = min(tokens, per_prompt.get(index // n, tokens))
    return sum(per_prompt.values())


class Response:
    """The identity of one response: id, created, model, object kinds."""

    def __init__(self, chat: bool, model: str, request_id: str):
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id  # (the id in every log)
        self.created = int(time.time())
        self.model = model

    def body(self, choices: list[Choice], prompt_tokens: int, n: int = 1) -> dict:
        """The whole (not streamed) response (`n` choices per prompt)."""
        completion = sum(c.completion_tokens for c in choices)
        if self.chat:
            out = [{"index": c.index, "message": message, "logprobs": c.chat_logprobs(),
                    "finish_reason": reason, "stop_reason": c.stop_reason}
                   for c in choices for message, reason in (c.chat_message(),)]
        else:
            out = [{"index": c.index, "text": c.text, "logprobs": c.completion_logprobs(),
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                   for c in choices]
        body = {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": out,
                "usage": usage(prompt_tokens, completion, cached_prompt_tokens(
                    {c.index: c.cached_prompt_tokens for c in choices}, n))}
        if any(c.adapter_inactive for c in choices):
            body[ADAPTER_ACTIVATED] = False
        return body


class EventWriter:
    """Server-sent events of one streamed response."""

    def __init__(self, response: Response, include_usage: bool, with_logprobs: bool = False,
                 echoes: dict[int, str] | None = None,
                 tools: ToolFormat | None = None, adapter_inactive: bool = False):
        self._response = response
        self._tools = tools  # chat deltas carry the tool calls read in this format
        self._calls: dict[int, _StreamedCalls] = {}  # choice -> its calls so far
        self._with_logprobs = with_logprobs
        self._echoes = echoes or {}  # choice -> its prompt's text, when echoed
        self._offsets: dict[int, int] = {}  # choice -> its text's length so far (text_offset)
        head = {"id": response.id,
                "object": "chat.completion.chunk" if response.chat else "text_completion",
                "created": response.created, "model": response.model}
        if adapter_inactive:
            head[ADAPTER_ACTIVATED] = False
        self._head = json.dumps(head)[:-1]  # '{"id": ..., "model": "..."' (no closing brace)
        self._tail = ', "usage": null}\n\n' if include_usage else "}\n\n"
        # Set, the usage every event carries (stream_options.continuous_usage_stats)
        self.usage_so_far: dict | None = None
        self._started: set[int] = set()

    def token(self, index: int, message: scheduler_pb2.GenerateResponse) -> bytes:
        """The event of one message of choice `index`: its text, and its finish reason if it is
        the last (after the prompt's event, for the first message of an echoed choice)."""
        echo = b""
        if index in self._echoes and index not in self._started:
            echo = self._echo(index, message)
        finish = FINISH.get(message.finish_reason)
        if not (message.HasField("token_id") or message.text or finish):
            self._started.add(index)
            return echo  # (a message of the prompt alone: max_tokens 0)
        logprobs = "null"
        offset = self._offsets.get(index, 0)  # (the tokens' own texts index the output)
        self._offsets[index] = offset + len(message.token_text if message.HasField("token_id")
                                            else message.text)
        if self._with_logprobs and message.HasField("token_id"):
            entry = Entry.of(message)
            logprobs = json.dumps(
                {"content": [entry.chat()]} if self._response.chat else
                completion_logprobs([entry], offset))
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
            self._started.add(index)
            choice = f'{{"index": {index}, "text": {json.dumps(message.text)}, ' \
                     f'"logprobs": {logprobs}'
        return echo + self._event(choice, finish, stop_reason(message) if finish else None)

    def _echo(self, index: int, message: scheduler_pb2.GenerateResponse) -> bytes:
        """The prompt's event of an echoed choice (with its first message's prompt tokens); in
        a chat, the first delta: the role and the echoed content."""
        if self._response.chat:
            self._started.add(index)
            if self._tools is not None:
                self._calls.setdefault(index, _StreamedCalls(ToolCallParser(self._tools))
                                       ).started = True
            delta = json.dumps({"role": "assistant", "content": self._echoes[index]})
            return self._event(f'{{"index": {index}, "delta": {delta}, "logprobs": null', None)
        entries = [Entry.of(t) for t in message.prompt_tokens]
        text = "".join(e.text for e in entries) if entries else self._echoes[index]
        self._offsets[index] = len(text)
        logprobs = (json.dumps(completion_logprobs(entries))
                    if self._with_logprobs and entries else "null")
        return self._event(f'{{"index": {index}, "text": {json.dumps(text)}, '
                           f'"logprobs": {logprobs}', None)

    def _event(self, choice: str, finish: str | None,
               stopped_by: str | int | None = None) -> bytes:
        reason = f'"{finish}"' if finish else "null"
        tail = (self._tail if self.usage_so_far is None else
                f', "usage": {json.dumps(self.usage_so_far)}}}\n\n')
        return (f'data: {self._head}, "choices": [{choice}, "finish_reason": {reason}, '
                f'"stop_reason": {json.dumps(stopped_by)}}}]{tail}').encode()

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

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> bytes:
        """The last event when stream_options.include_usage: no choices, the usage."""
        return (f'data: {self._head}, "choices": [], "usage": '
                f'{json.dumps(usage(prompt_tokens, completion_tokens, cached_tokens))}}}'
                '\n\n').encode()

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
