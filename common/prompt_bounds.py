"""A prompt as token ids, and whether it fits the context, made and checked the same way wherever
it is (ModelPrompts): the gateway refuses what cannot fit before sending it to a pool (each HTTP
API in its own error format), and the scheduler, which knows its executors' context, is the
authority for every caller. A bound on how few tokens a text can be, known before tokenizing it,
refuses a text too long without spending the time (and the event loop) to tokenize it."""

import asyncio
from collections.abc import Sequence

from tokenizers import Tokenizer

from common.errors import InvalidArgument

THREAD_TOKENIZE_CHARS = 20_000  # longer texts are tokenized off the event loop


def max_chars_per_token(tokenizer: Tokenizer) -> int:
    """An upper bound on the characters of text one token stands for: its longest vocabulary entry
    (byte-level entries have one character per byte, and a character is at least one byte). A
    normalizer may first merge characters (NFC composes a few into one): allow 4 per character."""
    longest = max(map(len, tokenizer.get_vocab(with_added_tokens=True)), default=1)
    return longest * (4 if tokenizer.normalizer is not None else 1)


def min_tokens(text: str, chars_per_token: int) -> int:
    """The fewest tokens `text` can tokenize to."""
    return -(-len(text) // chars_per_token)


class BadPrompt(InvalidArgument):
    """INVALID_ARGUMENT about a prompt; `param` names the request field to change (an HTTP API's
    error says it)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class ContextExceeded(BadPrompt):
    """The prompt and the tokens asked for exceed the context: `param` is the tokens asked for
    when the prompt alone fits, else the prompt."""


def check_text_fits(text: str, max_new_tokens: int, chars_per_token: int, limit: int,
                    field: str = "max_new_tokens", prompt_field: str = "prompt") -> None:
    """ContextExceeded when `text` cannot fit `limit` tokens with `max_new_tokens` (named
    `field`) to generate, whatever it tokenizes to: for texts too long to be worth tokenizing
    (a prompt that may fit is tokenized and checked with `check_fits`, real counts and all)."""
    fewest = min_tokens(text, chars_per_token)
    if fewest + max_new_tokens > limit:
        param = prompt_field if fewest >= limit else field
        raise ContextExceeded(
            f"the {prompt_field} of {len(text)} characters is at least {fewest} tokens, which "
            f"with {field} ({max_new_tokens}) exceeds the context of {limit} tokens: shorten "
            f"the {prompt_field}", param)


def check_fits(num_tokens: int, max_new_tokens: int, limit: int,
               field: str = "max_new_tokens", prompt_field: str = "prompt") -> None:
    """ContextExceeded when a prompt of `num_tokens` and `max_new_tokens` (named `field`) to
    generate exceed `limit` tokens."""
    if num_tokens + max_new_tokens > limit:
        param = prompt_field if num_tokens >= limit else field
        raise ContextExceeded(
            f"the {prompt_field} ({num_tokens} tokens) with {field} ({max_new_tokens}) is "
            f"{num_tokens + max_new_tokens} tokens, over the context of {limit} tokens: "
            + (f"shorten the {prompt_field}" if param == prompt_field else
               f"ask for at most {limit - num_tokens} tokens or shorten the {prompt_field}"),
            param)


class ModelPrompts:
    """One model's prompts as token ids, refused when they cannot fit its context of `limit`
    tokens: a gateway's for each pool, a scheduler's for its own."""

    def __init__(self, model_id: str, tokenizer: Tokenizer | None, limit: int):
        self.model_id = model_id
        self.tokenizer = tokenizer
        self.limit = limit
        self.chars_per_token = max_chars_per_token(tokenizer) if tokenizer else 1

    async def ids(self, text: str | None, ids: Sequence[int] | None, max_new_tokens: int,
                  chat: bool = False, field: str = "max_new_tokens",
                  keep_last: int | None = None) -> Sequence[int]:
        """The prompt, `text` tokenized (a chat's, whose template placed the special tokens,
        without adding any) or `ids` as given, its last `keep_last` tokens only when set
        (vLLM's truncate_prompt_tokens), checked to be non-empty and to fit the context with
        `max_new_tokens` (named `field` in the request's API) to generate."""
        prompt_field = "messages" if chat else "prompt"
        if text is not None:
            if self.tokenizer is None:
                raise InvalidArgument(f"model {self.model_id!r} has no tokenizer: send the "
                                      "prompt as token ids")
            encode = self.tokenizer.encode
            if len(text) > THREAD_TOKENIZE_CHARS:  # (shorter ones: the real count, below)
                if keep_last is None:
                    check_text_fits(text, max_new_tokens, self.chars_per_token, self.limit,
                                    field, prompt_field)
                ids = (await asyncio.to_thread(encode, text, add_special_tokens=not chat)).ids
            else:
                ids = encode(text, add_special_tokens=not chat).ids
        if keep_last is not None:
            ids = ids[-keep_last:]
        if not ids:
            raise BadPrompt("the prompt is empty: give text or at least one token id",
                            prompt_field)
        check_fits(len(ids), max_new_tokens, self.limit, field, prompt_field)
        return ids
