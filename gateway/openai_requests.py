"""OpenAI request bodies (/v1/completions, /v1/chat/completions), checked field by field: a bad
field is a 400 that names it (`param`), a field whose feature loraplex does not have is a 400
that says so, never silently ignored. Unknown fields are ignored, as OpenAI-compatible servers
do (clients send extensions)."""

import dataclasses
import json

from common.sampling import MAX_SEED, BadSampling, SamplingParams
from common.wire import MAX_CACHE_SALT_CHARS, MAX_STOP_STRINGS
from gateway.chat import ROLES
from gateway.guided import request_grammar
from gateway.http_errors import BadField
from gateway.tools import Tools, chat_tools, message_tool_calls

MAX_N = 16  # choices per request (n x prompts)
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "add_generation_prompt"})
MAX_STOP = MAX_STOP_STRINGS
MAX_STOP_TOKEN_IDS = 1024
# vLLM's request extras that would change the output and that loraplex does not do: a 400 naming
# the field unless it is absent, null or the value that changes nothing (given here), never
# silently ignored. (Ignored as they change nothing here: guided_decoding_backend, a hint;
# spaces_between_special_tokens, as special tokens are never shown; length_penalty, beam search's.)
UNSUPPORTED_EXTRAS = {
    "min_tokens": 0, "allowed_token_ids": None, "bad_words": [],
    "use_beam_search": False,
    "prompt_logprobs": None, "guided_whitespace_pattern": None,
    "return_tokens_as_token_ids": False, "priority": 0, "documents": None,
}


@dataclasses.dataclass(frozen=True)
class Options:
    """What both endpoints take, checked."""

    model: str
    n: int
    max_tokens: int | None  # None: the endpoint's default
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: bool
    ignore_eos: bool
    # stream_options.continuous_usage_stats (vLLM's): every chunk carries the usage so far
    continuous_usage: bool = False
    include_stop_str: bool = False  # vLLM's include_stop_str_in_output
    show_special_tokens: bool = False  # vLLM's skip_special_tokens false
    keep_last: int | None = None  # vLLM's truncate_prompt_tokens: the prompt's last tokens only
    cache_salt: str = ""  # vLLM's extension: prefix-cached KV is reused only with the same salt
    stop_token_ids: tuple[int, ...] = ()  # vLLM's: these end the output as EOS does (unshown)
    echo: bool = False  # completions: the prompt comes first in each choice
    # The endpoint's name for each SamplingParams field it sets differently (an error names it).
    params: tuple[tuple[str, str], ...] = ()

    def check_vocab(self, vocab_size: int) -> None:
        """The sampling fits the model's vocabulary (logit_bias token ids, top_k), and so do the
        stop token ids."""
        _checked(self.sampling, dict(self.params), vocab_size)
        if any(t >= vocab_size for t in self.stop_token_ids):
            raise BadField("stop_token_ids", f"token ids must be in [0, {vocab_size})")

    def choice_seed(self, choice: int) -> SamplingParams:
        """The sampling of choice `choice` of n: a seeded request gives each choice its own
        stream (seed + choice), still reproducible."""
        seed = self.sampling.seed
        if seed is None or choice == 0:
            return self.sampling
        return dataclasses.replace(self.sampling, seed=(seed + choice) % MAX_SEED)


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    options: Options
    prompts: tuple[str | tuple[int, ...], ...]  # text, or token ids

    def check_vocab(self, vocab_size: int) -> None:
        """The options fit the model's vocabulary (Options.check_vocab), and so do the prompts
        given as token ids."""
        self.options.check_vocab(vocab_size)
        for i, prompt in enumerate(self.prompts):
            bad = None if isinstance(prompt, str) else next(
                (t for t in prompt if t >= vocab_size), None)
            if bad is not None:
                which = f" (prompt {i})" if len(self.prompts) > 1 else ""
                raise BadField("prompt", f"token id {bad}{which} is outside the vocabulary: "
                                         f"token ids must be in [0, {vocab_size})")


@dataclasses.dataclass(frozen=True)
class Conversation:
    """What a chat's prompt is rendered from (the model's template: gateway/chat.py)."""

    messages: tuple[dict, ...]  # {"role", "content": str, ...} as the template takes them
    add_generation_prompt: bool
    continue_final_message: bool
    tools: Tools | None = None  # gateway/tools.py; None: the request names none
    # vLLM's chat_template_kwargs: more variables for the template (Qwen3's enable_thinking)
    template_kwargs: tuple[tuple[str, object], ...] = ()


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    options: Options
    conversation: Conversation
    # vLLM's `echo`: the reply's content begins with the last message's text when that message
    # is the assistant's own (a reply that goes on from it); None: nothing echoed.
    echo: str | None = None

    @property
    def tools(self) -> Tools | None:
        return self.conversation.tools


def completion_request(body: dict) -> CompletionRequest:
    top = _completion_logprobs(body)
    echo = boolean(body, "echo", False)
    params = (("top_logprobs", "logprobs"), ("prompt_logprobs", "logprobs"))
    options = _options(body, logprobs=top is not None, top_logprobs=top or 0,
                       prompt_logprobs=top if echo else None, echo=echo, params=params)
    if body.get("suffix"):
        raise BadField("suffix", "is not supported")
    prompts = _prompts(body.get("prompt"))
    if len(prompts) * options.n > MAX_N:
        raise BadField("prompt" if options.n == 1 else "n",
                       f"prompts x n must be at most {MAX_N}, got {len(prompts)} x {options.n}")
    return CompletionRequest(options, prompts)


def chat_request(body: dict) -> ChatRequest:
    conversation = chat_conversation(body)
    tools = conversation.tools
    if body.get("max_completion_tokens") is not None:
        body = {**body, "max_tokens": body["max_completion_tokens"]}
    logprobs = boolean(body, "logprobs", False)
    top = body.get("top_logprobs")
    if top not in (None, 0) and not logprobs:
        raise BadField("top_logprobs", "needs logprobs: true")
    options = _options(body, logprobs=logprobs, top_logprobs=0 if top is None else top)
    if tools is not None and tools.choice in ("required", "function") and options.sampling.grammar:
        raise BadField("tool_choice", "required or a named function constrains the output: it "
                                      "cannot be combined with response_format or guided_*")
    last = conversation.messages[-1]
    echo = last["content"] if boolean(body, "echo", False) and last["role"] == "assistant" \
        else None
    return ChatRequest(options, conversation, echo or None)  # (an empty one: nothing echoed)


def chat_conversation(body: dict) -> Conversation:
    """The messages, tools and template options of a chat body (/v1/chat/completions, and the
    chat form of /tokenize)."""
    tools = chat_tools(body)
    add_generation_prompt = boolean(body, "add_generation_prompt", True)
    continue_final = boolean(body, "continue_final_message", False)
    if add_generation_prompt and continue_final:
        raise BadField("continue_final_message", "needs add_generation_prompt: false")
    if body.get("chat_template") is not None:
        raise BadField("chat_template", "is not supported: the model's own template renders "
                                        "every chat")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict) or RESERVED_TEMPLATE_NAMES & kwargs.keys():
        raise BadField("chat_template_kwargs", "must be an object of template variables other "
                                               f"than {', '.join(sorted(RESERVED_TEMPLATE_NAMES))}")
    return Conversation(_messages(body.get("messages")), add_generation_prompt, continue_final,
                        tools, tuple(kwargs.items()))


def _options(body: dict, logprobs: bool, top_logprobs: int = 0,
             prompt_logprobs: int | None = None, echo: bool = False,
             params: tuple[tuple[str, str], ...] = ()) -> Options:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadField("model", "required: a base model or an adapter (name, name@VERSION, "
                                "name@ALIAS)")
    for field, default in UNSUPPORTED_EXTRAS.items():
        value = body.get(field)
        if value is not None and value != default:
            raise BadField(field, f"is not supported (vLLM's extra; unset it, or send "
                                  f"{json.dumps(default)})")
    n = _integer(body, "n", 1, 1, MAX_N)
    best_of = body.get("best_of")
    if best_of not in (None, n):
        raise BadField("best_of", "is not supported (unset it, or set it to n)")
    guided = request_grammar(body)
    max_tokens = body.get("max_tokens")
    if max_tokens is not None:  # (0: score the prompt alone, with echo)
        max_tokens = _integer(body, "max_tokens", None, 0 if echo else 1, 2**31)
    top_k = _integer(body, "top_k", 0, -1, 2**31)
    seed = body.get("seed")
    if seed is not None:
        if not _is_int(seed) or not -2**63 <= seed < 2**64:
            raise BadField("seed", f"must be a 64-bit integer, got {seed!r}")
        seed %= MAX_SEED
    sampling = SamplingParams(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True), top_k=max(top_k, 0),
        seed=seed,
        min_p=_real(body, "min_p", 0.0), presence_penalty=_real(body, "presence_penalty", 0.0),
        frequency_penalty=_real(body, "frequency_penalty", 0.0),
        repetition_penalty=_real(body, "repetition_penalty", 1.0),
        logit_bias=_logit_bias(body.get("logit_bias")), top_logprobs=top_logprobs,
        prompt_logprobs=prompt_logprobs, grammar=guided[0] if guided else None)
    _checked(sampling, dict(params))
    stream = boolean(body, "stream", False)
    stream_options = body.get("stream_options")
    if stream_options is not None and not stream:
        raise BadField("stream_options", "only with stream: true")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise BadField("stream_options", "must be an object")
    include_usage = bool(stream_options and boolean(stream_options, "include_usage", False,
                                                    "stream_options.include_usage"))
    continuous_usage = bool(stream_options and boolean(
        stream_options, "continuous_usage_stats", False, "stream_options.continuous_usage_stats"))
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise BadField("user", "must be a string")
    cache_salt = body.get("cache_salt", "")
    if not isinstance(cache_salt, str) or len(cache_salt) > MAX_CACHE_SALT_CHARS:
        raise BadField("cache_salt", f"must be a string of at most {MAX_CACHE_SALT_CHARS} "
                                     "characters")
    return Options(model=model, n=n, max_tokens=max_tokens, sampling=sampling,
                   stop=_stop(body.get("stop")), stream=stream, include_usage=include_usage,
                   continuous_usage=continuous_usage,
                   include_stop_str=boolean(body, "include_stop_str_in_output", False),
                   show_special_tokens=not boolean(body, "skip_special_tokens", True),
                   keep_last=_truncate_prompt_tokens(body.get("truncate_prompt_tokens")),
                   logprobs=logprobs, ignore_eos=boolean(body, "ignore_eos", False),
                   cache_salt=cache_salt, echo=echo, params=params,
                   stop_token_ids=_stop_token_ids(body.get("stop_token_ids")))


def _truncate_prompt_tokens(value) -> int | None:
    if value is None:
        return None
    if not _is_int(value) or not 1 <= value < 2**31:
        raise BadField("truncate_prompt_tokens", f"must be a positive integer (the prompt's last "
                                                 f"tokens kept), got {value!r}")
    return value


def _stop_token_ids(ids) -> tuple[int, ...]:
    """vLLM's stop_token_ids: token ids that end the output as EOS does (counted in usage, its
    text not shown)."""
    if ids is None:
        return ()
    if not isinstance(ids, list) or len(ids) > MAX_STOP_TOKEN_IDS or not all(
            _is_int(t) and t >= 0 for t in ids):
        raise BadField("stop_token_ids", f"must be a list of at most {MAX_STOP_TOKEN_IDS} token "
                                         "ids")
    return tuple(ids)


def _checked(sampling: SamplingParams, names: dict[str, str],
             vocab_size: int | None = None) -> SamplingParams:
    """SamplingParams.validate, its error naming the endpoint's field."""
    try:
        return sampling.validate(vocab_size)
    except BadSampling as err:
        raise BadField(names.get(err.field, err.field), err.detail) from None


def _completion_logprobs(body: dict) -> int | None:
    """Completions' `logprobs`: how many alternatives to return per token beside the sampled
    one (None: no logprobs; true is taken as 0)."""
    value = body.get("logprobs")
    if value is None or value is False:
        return None
    if value is True:
        return 0
    if not _is_int(value):
        raise BadField("logprobs", f"must be an integer in [0, 20], got {value!r}")
    return value


def _logit_bias(bias) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: {"token id": bias}, the ids as strings (JSON keys)."""
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise BadField("logit_bias", "must be an object of token id -> bias")
    pairs = []
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 10):
            raise BadField("logit_bias", f"keys must be token ids, got {key[:20]!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise BadField("logit_bias", f"of token {key} must be a number, got {value!r}")
        pairs.append((int(key), float(value)))
    return tuple(pairs)


def _prompts(prompt) -> tuple[str | tuple[int, ...], ...]:
    """A string, a list of strings, a list of token ids, or a list of lists of token ids."""
    if isinstance(prompt, str):
        return (prompt,)
    if isinstance(prompt, list) and prompt:
        if all(_is_int(t) for t in prompt):
            return (_token_ids(prompt, "prompt"),)
        if all(isinstance(p, str) for p in prompt):
            return tuple(prompt)
        if all(isinstance(p, list) for p in prompt):
            return tuple(_token_ids(p, f"prompt[{i}]") for i, p in enumerate(prompt))
    raise BadField("prompt", "must be a string, a list of strings, a list of token ids or a "
                             "list of lists of token ids, and not empty")


def _token_ids(ids: list, param: str) -> tuple[int, ...]:
    if not ids or not all(_is_int(t) and 0 <= t < 2**32 for t in ids):
        raise BadField(param, "token ids must be a non-empty list of integers >= 0")
    return tuple(ids)


def _messages(messages) -> tuple[dict, ...]:
    if not isinstance(messages, list) or not messages:
        raise BadField("messages", "must be a non-empty list of {role, content}")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise BadField(f"messages[{i}]", f"must be an object whose role is one of "
                                             f"{', '.join(ROLES)}")
        checked.append({**message, "content": _content(message.get("content"),
                                                       f"messages[{i}].content")})
        if message.get("tool_calls"):
            checked[-1]["tool_calls"] = message_tool_calls(message["tool_calls"],
                                                           f"messages[{i}].tool_calls")
    return tuple(checked)


def _content(content, param: str) -> str:
    """A string, or a list of text parts (joined with newlines)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                    part.get("text"), str):
                raise BadField(f"{param}[{j}]", "only text parts are supported "
                                                "({\"type\": \"text\", \"text\": ...})")
            texts.append(part["text"])
        return "\n".join(texts)
    raise BadField(param, "must be a string or a list of text parts")


def _stop(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadField("stop", "must be a non-empty string or a list of them")
    if len(stops) > MAX_STOP:
        raise BadField("stop", f"at most {MAX_STOP} stop strings")
    return tuple(stops)


def _number(body: dict, field: str, default: float, low: float, high: float,
            low_open: bool = False) -> float:
    """A number in [low, high] ((low, high] when `low_open`)."""
    value = body.get(field)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            low <= value <= high) or (low_open and value == low):
        raise BadField(field, f"must be a number in {'(' if low_open else '['}{low:g}, "
                              f"{high:g}], got {value!r}")
    return float(value)


def _real(body: dict, field: str, default: float) -> float:
    """A number (its range is SamplingParams.validate's to check)."""
    value = body.get(field)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadField(field, f"must be a number, got {value!r}")
    return float(value)


def _integer(body: dict, field: str, default: int | None, low: int, high: int) -> int:
    value = body.get(field)
    if value is None and default is not None:
        return default
    if not _is_int(value) or not low <= value <= high:
        raise BadField(field, f"must be an integer in [{low}, {high}], got {value!r}")
    return value


def boolean(body: dict, field: str, default: bool, param: str | None = None) -> bool:
    """body[field] as a bool: absent or null is `default`, a non-bool a 400 naming it (`param`:
    its path in the request, when `body` is an object within it)."""
    value = body.get(field)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadField(param or field, f"must be true or false, got {value!r}")
    return value


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
