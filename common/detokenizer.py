"""Incremental detokenization with stop conditions: turns each sampled token into the text it adds.

Byte-level BPE tokens can end inside a multi-byte character, so text is emitted only once it decodes
cleanly (no trailing U+FFFD), decoding from a short window of earlier tokens for correct spacing.
Each token goes through the tokenizers library's DecodeStream (the same window rule, in one native
call: 1.1 against 4.2 us a token with two decode calls from Python); the last token, which may
release an incomplete character, and a window DecodeStream refuses are decoded here.
With stop strings, the last (longest stop - 1) characters are held back until they cannot start a
stop string, so no part of a stop string is ever streamed.
"""

import enum
from collections.abc import Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from common import wire
from common.errors import InvalidArgument
from protos import scheduler_pb2


class Finish(enum.Enum):
    LENGTH = "length"
    STOP = "stop"


FINISH_PB = {Finish.LENGTH: scheduler_pb2.FINISH_REASON_LENGTH,
             Finish.STOP: scheduler_pb2.FINISH_REASON_STOP}


def check_stops(stops: Sequence[str], max_strings: int = wire.MAX_STOP_STRINGS,
                max_chars: int = wire.MAX_STOP_CHARS) -> None:
    """Stop strings a request may carry (whoever applies them checks them)."""
    if len(stops) > max_strings:
        raise InvalidArgument(f"at most {max_strings} stop strings, got {len(stops)}")
    if any(len(s) > max_chars for s in stops):
        raise InvalidArgument(f"stop strings must be at most {max_chars} characters")
    if any(not s for s in stops):
        raise InvalidArgument("stop strings must not be empty (an empty one would end the "
                              "output before its first token)")


_MORE, _LAST = ("", None), ("", Finish.LENGTH)  # (a token id's answer without text)


class OutputProcessor:
    """Per request: decodes output tokens and decides when generation finishes."""

    def __init__(self, tokenizer: Tokenizer | None, *, max_new_tokens: int,
                 stop_token_ids: Sequence[int] = (), stop: Sequence[str] = (),
                 eos_token_ids: Sequence[int] = (), include_stop_str: bool = False,
                 skip_special_tokens: bool = True):
        """`stop_token_ids` and `eos_token_ids` alike end it (the first are the request's own:
        `stop_reason` names them, as it does a stop string, and never EOS). With
        `include_stop_str` the stop string that ends it stays in the text."""
        self._tokenizer = tokenizer
        self._include_stop = include_stop_str
        self._skip_special = skip_special_tokens
        self.max_new_tokens = max_new_tokens
        self._eos_ids = frozenset(eos_token_ids)
        self.stop_ids = frozenset(stop_token_ids) | self._eos_ids
        # What ended it, where the request named it: its stop string, or its stop token id
        self.stop_reason: str | int | None = None
        self._stops = tuple(s for s in stop if s)
        self._holdback = max((len(s) for s in self._stops), default=1) - 1
        self.token_ids: list[int] = []  # output tokens that count toward the text
        self.is_stopped = False  # it ended on a stop token (not in token_ids)
        self.text = ""
        self.token_text = ""  # what the last token appended added to `text`
        self._prefix = 0  # window start (token index) for decoding
        self._read = 0  # tokens already turned into text
        # The same window, kept natively (None: decoded here, from the indices above).
        self._stream = (DecodeStream(skip_special_tokens=skip_special_tokens)
                        if tokenizer is not None else None)
        self._emitted = 0  # characters of self.text already returned
        # No text to make (token ids only: a scheduler's Stream): only stop ids and the length.
        self.is_ids_only = tokenizer is None and not self._stops

    @property
    def num_tokens(self) -> int:
        """All sampled tokens, including a final stop token."""
        return len(self.token_ids) + self.is_stopped

    def append(self, token_id: int) -> tuple[str, Finish | None]:
        """Record a sampled token; returns (text to stream now, finish reason or None). Its
        own text, what it added to the decoded output whatever is held back for stop strings
        or cut by one, is `token_text` until the next."""
        start = len(self.text)
        answer = self._append(token_id)
        self.token_text = self.text[start:]
        return answer

    def _append(self, token_id: int) -> tuple[str, Finish | None]:
        if token_id in self.stop_ids:
            self.is_stopped = True
            if token_id not in self._eos_ids:
                self.stop_reason = token_id
            self._decode(final=True)
            return self._flush(len(self.text)), Finish.STOP
        self.token_ids.append(token_id)
        is_last = len(self.token_ids) >= self.max_new_tokens
        if self.is_ids_only:
            return _LAST if is_last else _MORE
        self._decode(final=is_last)
        if self._stops:
            start = max(0, self._emitted - self._holdback)
            hits = [(i, s) for s in self._stops if (i := self.text.find(s, start)) >= 0]
            if hits:
                at, self.stop_reason = min(hits)
                return self._flush(at + len(self.stop_reason) * self._include_stop), Finish.STOP
        if is_last:
            return self._flush(len(self.text)), Finish.LENGTH
        return self._flush(len(self.text) - self._holdback), None

    def peek(self, token_ids: Sequence[int]) -> list[str]:
        """The text each of `token_ids` would add as the next token, decoded as the continuation
        of the tokens so far the way `append` decodes, with what it adds at once: where it would
        end inside a character, the decoded text (U+FFFD for the incomplete bytes), which
        `append` would hold back for the next token. Stop strings are not applied. Nothing is
        recorded."""
        if self._tokenizer is None:
            return [""] * len(token_ids)
        window = self.token_ids[self._prefix:]
        before = self._text(self.token_ids[self._prefix:self._read])
        texts = []
        for token_id in token_ids:
            after = self._text([*window, token_id])
            texts.append(after[len(before):])
        return texts

    def close(self) -> str:
        """The text not streamed yet, for a request that ended without its last token saying so
        (ended by the side that counts its tokens)."""
        self._decode(final=True)
        return self._flush(len(self.text))

    def _decode(self, final: bool = False) -> None:
        """Append newly decodable text; `final` also releases an incomplete trailing character."""
        if self._tokenizer is None:  # a model without tokenizer streams token ids only
            return
        ids = self.token_ids
        if self._stream is not None and not final:  # (it has taken every token but the last)
            try:
                added = self._stream.step(self._tokenizer, ids[-1])
            except Exception:  # noqa: BLE001 - a window it refuses (InvalidPrefix): decoded here
                self._stream = None
            else:
                if added is not None:
                    self.text += added
                    self._prefix, self._read = self._read, len(ids)
                return
        self._stream = None  # (the window moves here from now on)
        before = self._text(ids[self._prefix:self._read])
        after = self._text(ids[self._prefix:])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(ids)

    def _text(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _flush(self, end: int) -> str:
        """Return text[emitted:end] and move the emitted mark; the text is cut at `end` on
        finish."""
        end = max(end, self._emitted)
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta
