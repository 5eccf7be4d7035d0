"""OpenAI response bodies through the gateway (tests/gateway/openai_world.py): logprob tokens
that line up with the text, and context overflows that name the field to change."""

import openai
import pytest
from transformers import AutoTokenizer

from tests.gateway.openai_world import MESSAGES, openai_client


async def test_logprob_tokens_concatenate_to_the_text_and_offsets_index_it(adapters):
    """The demo tokenizer decodes a token alone without its leading space (Metaspace, as
    Llama-2 and Mistral): the tokens were "stone", "river", "quiet" for "stone river quiet"."""
    api = openai_client(adapters)
    whole = await api.completions.create(model="reverse-words", prompt="quiet river stone",
                                         max_tokens=12, temperature=0, logprobs=0)
    text, lp = whole.choices[0].text, whole.choices[0].logprobs
    assert " " in text and "".join(lp.tokens) == text and len(lp.tokens) == len(lp.token_logprobs)
    assert all(text[at:at + len(token)] == token for token, at in zip(lp.tokens, lp.text_offset))
    assert any(token.startswith(" ") for token in lp.tokens)
    chunks = [c async for c in await api.completions.create(
        model="reverse-words", prompt="quiet river stone", max_tokens=12, temperature=0,
        logprobs=0, stream=True)]
    streamed = [(c.choices[0].logprobs.tokens[0], c.choices[0].logprobs.text_offset[0])
                for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for t, _ in streamed] == lp.tokens and [o for _, o in streamed] == lp.text_offset


async def test_chat_logprob_tokens_concatenate_to_the_content(adapters, tiny):
    api = openai_client(adapters)
    out = await api.chat.completions.create(model="tiny-attn", messages=MESSAGES, max_tokens=10,
                                            temperature=0, logprobs=True)
    content, tokens = out.choices[0].message.content, out.choices[0].logprobs.content
    assert "".join(t.token for t in tokens) == content
    assert all(bytes(t.bytes) == t.token.encode() for t in tokens)


async def test_a_context_overflow_names_the_field_and_the_real_counts(adapters, tiny):
    """The fixture model's context is 2048 tokens; "The little cat" is a handful of tokens: the
    error names max_tokens and counts the prompt's real tokens (it estimated "at least 2")."""
    api = openai_client(adapters)
    tokens = len(AutoTokenizer.from_pretrained(tiny["model_dir"])("The little cat").input_ids)
    with pytest.raises(openai.BadRequestError) as err:
        await api.completions.create(model="tiny-attn", prompt="The little cat", max_tokens=2047)
    assert err.value.body["param"] == "max_tokens"
    assert (f"the prompt ({tokens} tokens) with max_tokens (2047) is {tokens + 2047} tokens, "
            f"over the context of 2048 tokens: ask for at most {2048 - tokens}"
            ) in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        await api.chat.completions.create(model="tiny-attn", max_tokens=8, messages=[
            {"role": "user", "content": "cat " * 3000}])
    assert err.value.body["param"] == "messages" and "shorten the messages" in str(err.value)
