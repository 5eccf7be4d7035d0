"""Whether a prompt fits the context, checked the same way wherever it is checked: the gateway
refuses what cannot fit before sending it to a pool (each HTTP API in its own error format), and
the scheduler, which knows its executors' context, is the authority for every caller. A bound on
how few tokens a text can be, known before tokenizing it, refuses a text too long without
spending the time (and the event loop) to tokenize it."""

from tokenizers import Tokenizer

from common.errors import InvalidArgument


def max_chars_per_token(tokenizer: Tokenizer) -> int:
    """An upper bound on the characters of text one token stands for: its longest vocabulary entry
    (byte-level entries have one character per byte, and a character is at least one byte). A
    normalizer may first merge characters (NFC composes a few into one): allow 4 per character."""
    longest = max(map(len, tokenizer.get_vocab(with_added_tokens=True)), default=1)
    return longest * (4 if tokenizer.normalizer is not None else 1)


def min_tokens(text: str, chars_per_token: int) -> int:
    """The fewest tokens `text` can tokenize to."""
    return -(-len(text) // chars_per_token)


def check_text_fits(text: str, max_new_tokens: int, chars_per_token: int, limit: int,
                    field: str = "max_new_tokens") -> None:
    """INVALID_ARGUMENT when `text` cannot fit `limit` tokens with `max_new_tokens` (named
    `field`) to generate, whatever it tokenizes to."""
    fewest = min_tokens(text, chars_per_token)
    if fewest + max_new_tokens > limit:
        raise InvalidArgument(f"the prompt of {len(text)} characters is at least {fewest} tokens, "
                              f"which with {field} ({max_new_tokens}) exceeds the context of "
                              f"{limit} tokens: shorten the prompt")


def check_fits(num_tokens: int, max_new_tokens: int, limit: int,
               field: str = "max_new_tokens") -> None:
    """INVALID_ARGUMENT when a prompt of `num_tokens` and `max_new_tokens` (named `field`) to
    generate exceed `limit` tokens."""
    if num_tokens + max_new_tokens > limit:
        raise InvalidArgument(f"the prompt ({num_tokens} tokens) with {field} ({max_new_tokens}) "
                              f"exceeds the context of {limit} tokens: shorten the prompt or ask "
                              f"for fewer tokens")
