"""Texts of alternatives and prompt tokens (common/token_logprobs.py, OutputProcessor.peek), on
the demo's tokenizer (Metaspace: a token decoded alone loses its leading space) and the
fixture's byte-level BPE (tokens that end inside a character)."""

import random

from tokenizers import Tokenizer

from common.detokenizer import OutputProcessor
from common.token_logprobs import prompt_tokens_pb, top_logprobs_pb
from loraplex.demo import MODEL_DIR
from protos import common_pb2


def test_an_alternative_reads_as_the_sampled_tokens_continuation_would():
    tokenizer = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    ids = tokenizer.encode("stone river quiet", add_special_tokens=False).ids
    out = OutputProcessor(tokenizer, max_new_tokens=10)
    for i, token_id in enumerate(ids):
        alternatives = [ids[0], token_id] if i else [token_id]
        texts = [t.text for t in top_logprobs_pb(out, alternatives, [-1.0] * len(alternatives))]
        text, _ = out.append(token_id)
        assert texts[-1] == text  # (the sampled token among its alternatives reads the same)
        if i:
            assert texts[0] == " stone"  # (decoded alone: "stone")
    assert out.text == "stone river quiet"


def test_prompt_token_texts_concatenate_to_the_prompt_as_it_decodes():
    tokenizer = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    ids = tokenizer.encode("quiet river stone").ids  # (with the BOS token)
    logprobs = common_pb2.TokenLogprobs(
        token_ids=ids[1:], logprobs=[-float(i) for i in range(1, len(ids))],
        num_top=[1] * (len(ids) - 1), top_token_ids=ids[1:], top_logprobs=[-0.5] * (len(ids) - 1))
    tokens = prompt_tokens_pb(tokenizer, ids, logprobs)
    assert [t.token_id for t in tokens] == ids
    assert "".join(t.text for t in tokens) == tokenizer.decode(ids) == "quiet river stone"
    assert not tokens[0].HasField("logprob") and tokens[0].text == ""  # (BOS)
    assert [t.logprob for t in tokens[1:]] == list(logprobs.logprobs)
    assert [t.top_logprobs[0].text for t in tokens[1:]] == [t.text for t in tokens[1:]]


def test_byte_tokens_concatenate_and_an_open_character_shows_as_a_replacement(tiny):
    tokenizer = Tokenizer.from_file(f"{tiny['model_dir']}/tokenizer.json")
    rng = random.Random(1)
    for _ in range(20):
        ids = [rng.randrange(2, 1024) for _ in range(rng.randint(2, 30))]
        tokens = prompt_tokens_pb(tokenizer, ids, common_pb2.TokenLogprobs(
            logprobs=[-1.0] * (len(ids) - 1)))
        assert "".join(t.text for t in tokens) == tokenizer.decode(ids)
    euro = tokenizer.encode("€", add_special_tokens=False).ids  # (a token per byte here)
    assert len(euro) == 3
    out = OutputProcessor(tokenizer, max_new_tokens=10)
    assert out.peek(euro[:1])[0].endswith("\ufffd")
    assert out.append(euro[0])[0] == ""  # (the sampled token waits for the rest)
    assert out.append(euro[1])[0] == ""
    assert out.peek(euro[2:]) == ["€"]  # (the last byte adds the whole character)
