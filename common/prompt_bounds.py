"""A bound on how few tokens a text can be, known before tokenizing it: a text too long for the
context is refused without spending the time (and the event loop) to tokenize it."""

from tokenizers import Tokenizer


def max_chars_per_token(tokenizer: Tokenizer) -> int:
    """An upper bound on the characters of text one token stands for: its longest vocabulary entry
    (byte-level entries have one character per byte, and a character is at least one byte). A
    normalizer may first merge characters (NFC composes a few into one): allow 4 per character."""
    longest = max(map(len, tokenizer.get_vocab(with_added_tokens=True)), default=1)
    return longest * (4 if tokenizer.normalizer is not None else 1)


def min_tokens(text: str, chars_per_token: int) -> int:
    """The fewest tokens `text` can tokenize to."""
    return -(-len(text) // chars_per_token)
