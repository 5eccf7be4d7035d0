"""Incremental detokenization and stop conditions on the fixture's byte-level BPE tokenizer."""

import random

import pytest
from tokenizers import Tokenizer

from common.detokenizer import Finish, OutputProcessor


@pytest.fixture(scope="module")
def tokenizer(tiny) -> Tokenizer:
    return Tokenizer.from_file(f"{tiny['model_dir']}/tokenizer.json")


def stream(tokenizer, ids, **kw) -> tuple[list[str], Finish | None]:
    out = OutputProcessor(tokenizer, max_new_tokens=kw.pop("max_new_tokens", len(ids)), **kw)
    deltas, finish = [], None
    for token in ids:
        delta, finish = out.append(token)
        deltas.append(delta)
        if finish:
            break
    return deltas, finish


def test_streamed_text_equals_full_decode_even_for_broken_utf8(tokenizer):
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(2, 1024) for _ in range(rng.randint(1, 40))]
        deltas, finish = stream(tokenizer, ids)
        assert "".join(deltas) == tokenizer.decode(ids)
        assert finish is Finish.LENGTH


def test_multibyte_characters_are_never_split(tokenizer):
    text = " héllo wörld — naïve café 日本語 ok"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    deltas, _ = stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert not any("\ufffd" in d for d in deltas)


def test_stop_string_is_cut_and_never_streamed(tokenizer):
    text = " the model serves many adapters quickly"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    deltas, finish = stream(tokenizer, ids, stop=["many ad", "zzz"])
    assert finish is Finish.STOP
    assert "".join(deltas) == text[: text.index("many ad")]


def test_stop_token_ends_without_text(tokenizer):
    ids = tokenizer.encode(" hello there", add_special_tokens=False).ids
    deltas, finish = stream(tokenizer, ids + [1, 5, 6], stop_token_ids=[1], max_new_tokens=100)
    assert finish is Finish.STOP and "".join(deltas) == tokenizer.decode(ids)
