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


def test_a_tokens_own_text_is_what_it_adds_whatever_stop_strings_hold_back(tokenizer):
    text = " the model serves many adapters quickly"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    plain = OutputProcessor(tokenizer, max_new_tokens=len(ids))
    held = OutputProcessor(tokenizer, max_new_tokens=len(ids), stop=["zzz quickly!"])
    own, streamed = [], []
    for token in ids:
        plain.append(token)
        streamed.append(held.append(token)[0])
        assert held.token_text == plain.token_text
        own.append(held.token_text)
    assert "".join(own) == "".join(streamed) == text
    assert own != streamed  # (the stop string held text back: the two differ token by token)


def test_stop_token_ends_without_text(tokenizer):
    ids = tokenizer.encode(" hello there", add_special_tokens=False).ids
    deltas, finish = stream(tokenizer, ids + [1, 5, 6], stop_token_ids=[1], max_new_tokens=100)
    assert finish is Finish.STOP and "".join(deltas) == tokenizer.decode(ids)


def window_deltas(tokenizer, ids) -> list[str]:
    """The plain definition of the window rule, two decodes per token: what each token adds."""
    deltas, prefix, read = [], 0, 0
    for n in range(1, len(ids) + 1):
        before = tokenizer.decode(ids[prefix:read], skip_special_tokens=True)
        after = tokenizer.decode(ids[prefix:n], skip_special_tokens=True)
        final = n == len(ids)
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            deltas.append(after[len(before):])
            prefix, read = read, n
        else:
            deltas.append("")
    return deltas


@pytest.mark.parametrize("which", ["fixture", "demo"])
def test_each_token_adds_what_the_plain_window_rule_adds(tokenizer, which):
    """The native stream (DecodeStream) and the final-token decode give, token by token, the
    text of the plain rule: the fixture's byte-level BPE (split characters) and the demo's
    Metaspace tokenizer (a leading space that decoding a token alone drops)."""
    from loraplex import demo

    tok = tokenizer if which == "fixture" else Tokenizer.from_file(
        str(demo.MODEL_DIR / "tokenizer.json"))
    rng = random.Random(1)
    vocab = tok.get_vocab_size()
    for _ in range(60):
        ids = [rng.randrange(2, vocab) for _ in range(rng.randint(1, 30))]
        deltas, _ = stream(tok, ids)
        assert deltas == window_deltas(tok, ids)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
