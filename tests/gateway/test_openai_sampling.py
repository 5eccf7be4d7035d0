"""Sampling and logprobs through the gateway, as clients use them (issue 33): the official
`openai` client's logprobs as an integer / top_logprobs, echo with the prompt's logprobs,
logit_bias, presence/frequency/repetition penalties and min_p; TGI's and LoRAX's fields; the
gRPC Generate fields; chat echo, and vLLM's /tokenize and /detokenize. One pool of the fixture
model and a gateway, as real processes. Values are checked against HF transformers + PEFT (the
executor's own oracle tests check the sampler) and the model's transformers tokenizer."""

import asyncio
import json
import secrets
import urllib.error
import urllib.request

import grpc
import openai
import pytest
import torch
from transformers import AutoTokenizer

from common.sampling import SamplingParams
from common.server import insecure_channel
from gateway.openai_requests import UNSUPPORTED_EXTRAS
from loraplex import client
from loraplex.launch import Fleet, FleetKeys, start_gateway
from protos import scheduler_pb2, scheduler_pb2_grpc

KEY = secrets.token_hex(16)
PROMPT = "The little cat"


@pytest.fixture(scope="module")
def world(tiny, tmp_path_factory, log_dir):
    keys = FleetKeys(tenants={KEY: "acme"})
    logs = log_dir / "gateway-sampling"
    fleet = Fleet(model=tiny["model_dir"], store_url=tmp_path_factory.mktemp("store").as_uri(),
                  log_dir=logs / "pool", keys=keys, executor_args=["--adapter-slots", "2",
                                                                   "--threads", "1"])
    gateway = None
    try:
        fleet.start()
        gateway = start_gateway({tiny["model_id"]: [fleet.scheduler]}, fleet.stores, logs, keys)
        yield {"fleet": fleet, "gateway": gateway, "keys": keys, "acme": KEY}
    finally:
        for part in (gateway, fleet):
            if part is not None:
                part.stop()


@pytest.fixture(scope="module")
async def served(world, tiny):
    await client.push_adapter(world["fleet"].stores[0], tiny["adapters"]["r4_attn"]["path"],
                              "tiny-attn", key=KEY)
    return world


def api(world) -> openai.AsyncOpenAI:
    http = world["gateway"].announced["gateway-http"]
    return openai.AsyncOpenAI(base_url=f"http://{http}/v1", api_key=KEY, max_retries=0,
                              timeout=120)


async def direct(world, sampling: SamplingParams, max_new: int = 8,
                 prompt: str = PROMPT) -> list[scheduler_pb2.GenerateResponse]:
    """The pool's own scheduler's Generate messages for tiny-attn (its own detokenizer)."""
    request = client.generate_request("tiny-attn", prompt, max_new)
    request.sampling.CopyFrom(sampling.to_pb())
    async with insecure_channel(world["fleet"].scheduler) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        return [m async for m in client.stream(stub, request, KEY)]


def post(world, path: str, body: dict) -> tuple[int, bytes]:
    """A raw HTTP POST to the gateway (TGI's endpoints; bodies the openai client would not
    send)."""
    url = f"http://{world['gateway'].announced['gateway-http']}{path}"
    request = urllib.request.Request(url, json.dumps(body).encode(), method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def prompt_ids(tiny) -> list[int]:
    return AutoTokenizer.from_pretrained(tiny["model_dir"])(PROMPT)["input_ids"]


async def test_completions_top_logprobs_streamed_and_not_equal_the_pools(served):
    whole = await api(served).completions.create(model="tiny-attn", prompt=PROMPT,
                                                 max_tokens=8, temperature=0, logprobs=3)
    lp = whole.choices[0].logprobs
    pool = [m for m in await direct(served, SamplingParams(top_logprobs=3)) if m.HasField(
        "token_id")]
    assert len(lp.top_logprobs) == len(lp.tokens) == len(pool) == 8
    for token, logprob, top, message in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, pool):
        expected: dict[str, float] = {}
        for t in message.top_logprobs:
            expected.setdefault(t.text, t.logprob)
        if message.token_id not in [t.token_id for t in message.top_logprobs]:
            expected.setdefault(message.text, message.logprob)
        assert top == pytest.approx(expected) and 1 <= len(top) <= 4  # (texts may coincide)
        assert logprob == pytest.approx(message.logprob) == pytest.approx(max(top.values()))
        assert top[token] == pytest.approx(logprob)  # (greedy: the sampled token is the top)
    chunks = [c async for c in await api(served).completions.create(
        model="tiny-attn", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3, stream=True)]
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [s.top_logprobs[0] for s in streamed] == lp.top_logprobs
    assert [s.tokens[0] for s in streamed] == lp.tokens


async def test_logprobs_name_each_token_by_its_own_text_whatever_the_stop_strings(served):
    """A stop string holds back text that could begin it, and a match cuts the output; logprobs
    still name each sampled token by its own text, the key of its top_logprobs entry (they
    named what the stream released with it: 'a', 'na', 'na', 'nan' for 'an' x 4, and a key no
    token has). With logprobs 0 top_logprobs holds the sampled token alone, as vLLM answers.
    A token forced by logit_bias."""
    forced = {"model": "tiny-attn", "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
              "logit_bias": {"271": 100}}
    plain = await api(served).completions.create(**forced, logprobs=0)
    lp = plain.choices[0].logprobs
    token = lp.tokens[0]
    assert len(token) > 1 and lp.tokens == [token] * 4 and plain.choices[0].text == token * 4
    assert lp.top_logprobs == [{token: p} for p in lp.token_logprobs]
    for stop, text, num in (("X" + token, token * 4, 4), (token[1:] + token, token[0], 2)):
        out = await api(served).completions.create(**forced, logprobs=1, stop=["zz", stop])
        lp = out.choices[0].logprobs
        assert out.choices[0].text == text and lp.tokens == [token] * num, stop
        assert out.choices[0].stop_reason == (stop if num == 2 else None)  # (vLLM's)
        assert [top[token] for top in lp.top_logprobs] == lp.token_logprobs
        chunks = [c async for c in await api(served).completions.create(
            **forced, logprobs=1, stop=[stop], stream=True)]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text
        assert [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.tokens] == [token] * num
        chat = await api(served).chat.completions.create(
            model="tiny-attn", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            temperature=0, logit_bias={"271": 100}, logprobs=True, top_logprobs=1, stop=[stop])
        content = chat.choices[0].logprobs.content
        assert [(t.token, bytes(t.bytes)) for t in content] == [(token, token.encode())] * num
        assert chat.choices[0].stop_reason == (stop if num == 2 else None)


async def test_include_stop_str_in_output_and_skip_special_tokens(served):
    """vLLM's include_stop_str_in_output keeps the stop string that ended the output at its end;
    skip_special_tokens false shows special tokens (BOS here, forced by logit_bias) in the
    text. Streamed and not."""
    completions = api(served).completions
    forced = {"model": "tiny-attn", "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
              "logit_bias": {"271": 100}}
    token = (await completions.create(**forced)).choices[0].text[:2]  # (token 271 alone)
    stop = token[1:] + token
    for extra, text in (({}, token[0]), ({"include_stop_str_in_output": True}, token[0] + stop)):
        whole = await completions.create(**forced, stop=[stop], extra_body=extra)
        assert (whole.choices[0].text, whole.choices[0].stop_reason) == (text, stop), extra
        chunks = [c async for c in await completions.create(**forced, stop=[stop], stream=True,
                                                            extra_body=extra)]
        assert "".join(c.choices[0].text for c in chunks) == text, extra
    bos = {**forced, "logit_bias": {"0": 100}, "max_tokens": 3}
    shown = await completions.create(**bos, extra_body={"skip_special_tokens": False,
                                                        "ignore_eos": True})
    hidden = await completions.create(**bos, extra_body={"ignore_eos": True})
    assert (shown.choices[0].text, hidden.choices[0].text) == ("<s>" * 3, "")


async def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(served):
    """vLLM's truncate_prompt_tokens: only the last k prompt tokens are used, also of a prompt
    longer than the context."""
    completions = api(served).completions
    short = await completions.create(model="tiny-attn", prompt=[8, 9, 10], max_tokens=4,
                                     temperature=0)
    for prompt in ([5, 6, 7, 8, 9, 10], [5] * 5000 + [8, 9, 10]):
        cut = await completions.create(model="tiny-attn", prompt=prompt, max_tokens=4,
                                       temperature=0, extra_body={"truncate_prompt_tokens": 3})
        assert cut.choices[0].text == short.choices[0].text and cut.usage.prompt_tokens == 3
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        await completions.create(model="tiny-attn", prompt=[5], max_tokens=2,
                                 extra_body={"truncate_prompt_tokens": 0})


async def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(served):
    """vLLM's stream_options.continuous_usage_stats: each chunk's usage counts the tokens
    streamed so far; the last, with include_usage, all of them."""
    chunks = [c async for c in await api(served).completions.create(
        model="tiny-attn", prompt=PROMPT, max_tokens=6, temperature=0, stream=True, n=2,
        extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True})]
    *tokens, last = chunks
    counts = [c.usage.completion_tokens for c in tokens]  # (a choice's end: a chunk of its own)
    assert counts == sorted(counts) and sorted(set(counts)) == list(range(1, 13))
    assert {c.usage.prompt_tokens for c in chunks} == {last.usage.prompt_tokens}
    assert last.usage.completion_tokens == 12 and not last.choices


async def test_echo_returns_the_prompt_and_its_logprobs(served, tiny, hf_peft):
    ids = prompt_ids(tiny)
    whole = await api(served).completions.create(model="tiny-attn", prompt=PROMPT,
                                                 max_tokens=4, temperature=0, logprobs=2,
                                                 echo=True)
    choice, lp = whole.choices[0], whole.choices[0].logprobs
    plain = await api(served).completions.create(model="tiny-attn", prompt=PROMPT,
                                                 max_tokens=4, temperature=0)
    assert choice.text == PROMPT + plain.choices[0].text
    assert "".join(lp.tokens) == choice.text and len(lp.tokens) == len(ids) + 4
    assert all(choice.text[at:at + len(t)] == t for t, at in zip(lp.tokens, lp.text_offset))
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    with torch.no_grad():
        logits = hf_peft(input_ids=torch.tensor([ids]), adapter_names=["r4_attn"]).logits[0]
    hf = torch.log_softmax(logits.float(), -1)[:-1]  # [L - 1, V]: of prompt tokens 1..L-1
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(
        hf.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist(), abs=2e-4)
    assert [max(top.values()) for top in lp.top_logprobs[1:len(ids)]] == pytest.approx(
        hf.max(-1).values.tolist(), abs=2e-4)
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs[1:])  # (texts may coincide)
    chunks = [c async for c in await api(served).completions.create(
        model="tiny-attn", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2, echo=True,
        stream=True)]
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert texts[0] == PROMPT and "".join(texts) == choice.text
    assert chunks[0].choices[0].logprobs.token_logprobs == lp.token_logprobs[:len(ids)]
    echoed = await api(served).completions.create(model="tiny-attn", prompt=PROMPT,
                                                  max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == choice.text and echoed.choices[0].logprobs is None


async def test_echo_with_max_tokens_0_scores_the_prompt_alone(served, tiny):
    """What evaluation harnesses send to score a text: its logprobs, no completion."""
    ids = prompt_ids(tiny)
    whole = await api(served).completions.create(model="tiny-attn", prompt=PROMPT, max_tokens=0,
                                                 logprobs=1, echo=True)
    echoed = await api(served).completions.create(model="tiny-attn", prompt=PROMPT, max_tokens=1,
                                                  temperature=0, logprobs=1, echo=True)
    choice, lp = whole.choices[0], whole.choices[0].logprobs
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    assert lp.token_logprobs == echoed.choices[0].logprobs.token_logprobs[:len(ids)]
    assert whole.usage.completion_tokens == 0 and whole.usage.prompt_tokens == len(ids)
    chunks = [c async for c in await api(served).completions.create(
        model="tiny-attn", prompt=PROMPT, max_tokens=0, logprobs=1, echo=True, stream=True)]
    assert "".join(c.choices[0].text for c in chunks) == PROMPT
    assert chunks[0].choices[0].logprobs.token_logprobs == lp.token_logprobs
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_chat_echo_begins_with_the_assistants_last_message(served):
    """vLLM's chat `echo`: a reply that goes on from the assistant's last message begins with
    that message's text, streamed (the first delta) and not; after a user's message, nothing."""
    prefill = [{"role": "user", "content": "Name a river."},
               {"role": "assistant", "content": "The river"}]
    go_on = {"add_generation_prompt": False, "continue_final_message": True}
    chat = api(served).chat.completions
    plain = await chat.create(model="tiny-attn", messages=prefill, max_tokens=5, temperature=0,
                              extra_body=go_on)
    echoed = await chat.create(model="tiny-attn", messages=prefill, max_tokens=5, temperature=0,
                               extra_body={**go_on, "echo": True})
    assert echoed.choices[0].message.content == "The river" + plain.choices[0].message.content
    # (the same tokens; the second found the first's prompt in the prefix cache)
    assert echoed.usage.prompt_tokens == plain.usage.prompt_tokens
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens
    chunks = [c async for c in await chat.create(
        model="tiny-attn", messages=prefill, max_tokens=5, temperature=0, stream=True,
        extra_body={**go_on, "echo": True})]
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.content == "The river"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
        echoed.choices[0].message.content
    question = prefill[:1]
    asked = await chat.create(model="tiny-attn", messages=question, max_tokens=5, temperature=0)
    echoed = await chat.create(model="tiny-attn", messages=question, max_tokens=5, temperature=0,
                               extra_body={"echo": True})
    assert echoed.choices[0].message.content == asked.choices[0].message.content


async def test_chat_top_logprobs_streamed_and_not(served):
    messages = [{"role": "user", "content": "Name a river."}]
    out = await api(served).chat.completions.create(
        model="tiny-attn", messages=messages, max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=4)
    content = out.choices[0].logprobs.content
    assert "".join(t.token for t in content) == out.choices[0].message.content
    for token in content:
        tops = token.top_logprobs
        assert len(tops) == 4 and [t.logprob for t in tops] == sorted(
            (t.logprob for t in tops), reverse=True)
        assert tops[0].logprob == pytest.approx(token.logprob)  # (greedy)
        assert all(bytes(t.bytes) == t.token.encode() for t in tops)
    chunks = [c async for c in await api(served).chat.completions.create(
        model="tiny-attn", messages=messages, max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=4, stream=True)]
    streamed = [c.choices[0].logprobs.content[0] for c in chunks
                if c.choices and c.choices[0].logprobs]
    assert [[t.token for t in s.top_logprobs] for s in streamed] == [
        [t.token for t in c.top_logprobs] for c in content]


async def test_logit_bias_and_penalties_give_the_pools_answer(served, tiny):
    plain = await api(served).completions.create(model="tiny-attn", prompt=PROMPT, max_tokens=8,
                                                 temperature=0)
    first = [m for m in await direct(served, SamplingParams()) if m.HasField("token_id")][0]
    cases = [  # (OpenAI fields, the same as SamplingParams)
        ({"logit_bias": {str(first.token_id): -100}},
         SamplingParams(logit_bias=((first.token_id, -100.0),))),
        ({"presence_penalty": 1.5, "frequency_penalty": 2.0},
         SamplingParams(presence_penalty=1.5, frequency_penalty=2.0)),
        ({"extra_body": {"repetition_penalty": 1.8}}, SamplingParams(repetition_penalty=1.8)),
    ]
    for fields, sampling in cases:
        out = await api(served).completions.create(model="tiny-attn", prompt=PROMPT,
                                                   max_tokens=8, temperature=0, **fields)
        pool = "".join(m.text for m in await direct(served, sampling))
        assert out.choices[0].text == pool, fields
        assert out.choices[0].text != plain.choices[0].text, f"{fields} changed nothing"
    forced = await api(served).completions.create(model="tiny-attn", prompt=PROMPT, max_tokens=3,
                                                  temperature=1.0, seed=3,
                                                  logit_bias={"300": 100},
                                                  extra_body={"min_p": 0.5})
    pool = await direct(served, SamplingParams(temperature=1.0, seed=3, min_p=0.5,
                                               logit_bias=((300, 100.0),)), 3)
    assert [m.token_id for m in pool if m.HasField("token_id")] == [300] * 3
    assert forced.choices[0].text == "".join(m.text for m in pool)


@pytest.mark.parametrize("path,fields,param", [
    ("/v1/completions", {"logit_bias": {"5000": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": 150}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": [1]}, "logit_bias"),
    ("/v1/completions", {"presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": "1"}, "frequency_penalty"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"min_p": 2}, "min_p"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": -1, "echo": True}, "logprobs"),
    ("/v1/completions", {"echo": "yes"}, "echo"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),  # (0 only with echo)
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ("/v1/chat/completions", {"stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage"),
    ("/v1/completions", {"prompt": [1, 99_999]}, "prompt"),  # (outside the vocabulary)
    ("/v1/completions", {"prompt": [[1, 2], [1, 99_999]]}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": ["a"] * 17}, "prompt"),  # (more than 16 choices)
    ("/v1/completions", {"prompt": ["a"] * 2, "n": 9}, "n"),
    ("/v1/completions", {"top_p": 0}, "top_p"),
])
async def test_bad_sampling_fields_are_400_naming_them(served, path, fields, param):
    body = {"model": "tiny-attn", "max_tokens": 2,
            **({"prompt": PROMPT} if path == "/v1/completions" else
               {"messages": [{"role": "user", "content": "hi"}]}), **fields}
    status, text = await asyncio.to_thread(post, served, path, body)
    assert status == 400 and json.loads(text)["error"]["param"] == param, text


async def test_tgi_and_lorax_fields(served, tiny):
    ids = prompt_ids(tiny)
    params = {"adapter_id": "tiny-attn", "max_new_tokens": 4, "details": True,
              "decoder_input_details": True, "top_n_tokens": 3, "repetition_penalty": 1.8}
    status, body = await asyncio.to_thread(post, served, "/generate", {
        "inputs": PROMPT, "parameters": params})
    assert status == 200, body
    details = json.loads(body)["details"]
    pool = [m for m in await direct(served, SamplingParams(repetition_penalty=1.8,
                                                           top_logprobs=3), 4)
            if m.HasField("token_id")]
    assert [t["id"] for t in details["tokens"]] == [m.token_id for m in pool]
    assert [[t["id"] for t in top] for top in details["top_tokens"]] == [
        [t.token_id for t in m.top_logprobs] for m in pool]
    prefill = details["prefill"]
    assert [t["id"] for t in prefill] == ids and prefill[0]["logprob"] is None
    assert "".join(t["text"] for t in prefill) == PROMPT
    assert all(isinstance(t["logprob"], float) for t in prefill[1:])
    status, body = await asyncio.to_thread(post, served, "/generate_stream", {
        "inputs": PROMPT, "parameters": params})
    events = [json.loads(line[5:]) for line in body.decode().splitlines()
              if line.startswith("data:")]
    assert [[t["id"] for t in e["top_tokens"]] for e in events if "top_tokens" in e] == [
        [t["id"] for t in top] for top in details["top_tokens"]]
    status, body = await asyncio.to_thread(post, served, "/generate", {
        "inputs": PROMPT, "parameters": {**params, "repetition_penalty": 0}})
    assert status == 422 and "repetition_penalty" in json.loads(body)["error"]


async def test_lorax_client_alternatives_and_prefill(served, tiny):
    import lorax

    url = f"http://{served['gateway'].announced['gateway-http']}"
    lx = lorax.AsyncClient(url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    answer = await lx.generate(PROMPT, adapter_id="tiny-attn", max_new_tokens=4, details=True,
                               decoder_input_details=True, return_k_alternatives=2)
    assert [t.id for t in answer.details.prefill] == prompt_ids(tiny)
    assert all(len(t.alternative_tokens) == 2 for t in answer.details.tokens)
    assert all(t.alternative_tokens[0].logprob == pytest.approx(t.logprob)
               for t in answer.details.tokens)  # (greedy)


async def test_grpc_generate_through_the_gateway_carries_alternatives_and_prompt(served, tiny):
    sampling = SamplingParams(top_logprobs=2, prompt_logprobs=1)
    request = client.generate_request("tiny-attn", PROMPT, 3)
    request.sampling.CopyFrom(sampling.to_pb())
    async with insecure_channel(served["gateway"].address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        messages = [m async for m in client.stream(stub, request, KEY)]
    pool = await direct(served, sampling, 3)
    tokens = [m for m in messages if m.HasField("token_id")]
    assert [list(m.top_logprobs) for m in tokens] == [
        list(m.top_logprobs) for m in pool if m.HasField("token_id")]  # (texts made alike)
    assert list(tokens[0].prompt_tokens) == list(pool[0].prompt_tokens)
    assert [t.token_id for t in tokens[0].prompt_tokens] == prompt_ids(tiny)
    assert not tokens[0].prompt_tokens[0].HasField("logprob")
    assert all(len(t.top_logprobs) == 1 for t in tokens[0].prompt_tokens[1:])
    assert not any(m.prompt_tokens for m in tokens[1:])


@pytest.mark.parametrize("sampling,field", [
    (SamplingParams(logit_bias=((5000, 1.0),)), "logit_bias"),
    (SamplingParams(top_logprobs=21), "top_logprobs"),
    (SamplingParams(presence_penalty=-2.5), "presence_penalty"),
    (SamplingParams(prompt_logprobs=30), "prompt_logprobs"),
])
async def test_grpc_bad_sampling_is_invalid_argument_naming_the_field(served, sampling, field):
    request = client.generate_request("tiny-attn", PROMPT, 2)
    request.sampling.CopyFrom(sampling.to_pb())
    for address in (served["gateway"].address, served["fleet"].scheduler):
        async with insecure_channel(address) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [m async for m in client.stream(stub, request, KEY)]
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"sampling.{field}" in err.value.details()


async def test_tokenize_and_detokenize_are_the_models_tokenizers(served, tiny):
    """vLLM's /tokenize (a prompt, or a chat as /v1/chat/completions renders it) and /detokenize,
    for a base model or an adapter: transformers' tokenizer's ids, text and token strings."""
    hf = AutoTokenizer.from_pretrained(tiny["model_dir"])
    messages = [{"role": "user", "content": "Name a river."}]
    for model in (tiny["model_id"], "tiny-attn"):
        status, text = await asyncio.to_thread(post, served, "/tokenize", {
            "model": model, "prompt": PROMPT, "return_token_strs": True})
        answer = json.loads(text)
        assert status == 200 and answer["tokens"] == hf(PROMPT)["input_ids"]
        assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] > 0
        assert answer["token_strs"] == hf.convert_ids_to_tokens(answer["tokens"])
        status, text = await asyncio.to_thread(post, served, "/tokenize", {
            "model": model, "messages": messages})
        chat = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        answer = json.loads(text)
        assert answer["tokens"] == hf(chat, add_special_tokens=False)["input_ids"]
        assert answer["token_strs"] is None
        reply = await api(served).chat.completions.create(model=model, messages=messages,
                                                          max_tokens=1)
        assert reply.usage.prompt_tokens == answer["count"]
        status, text = await asyncio.to_thread(post, served, "/detokenize", {
            "model": model, "tokens": answer["tokens"]})
        assert status == 200 and json.loads(text)["prompt"] == hf.decode(answer["tokens"])
    kwargs = {"bos_token": "quiet river "}  # (vLLM's chat_template_kwargs reach the template)
    status, text = await asyncio.to_thread(post, served, "/tokenize", {
        "model": "tiny-attn", "messages": messages, "chat_template_kwargs": kwargs})
    chat = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    assert json.loads(text)["tokens"] == hf(chat, add_special_tokens=False)["input_ids"]
    assert chat.startswith("quiet river ")
    for path, body, param in [
            ("/tokenize", {"model": "tiny-attn"}, "prompt"),
            ("/tokenize", {"model": "tiny-attn", "prompt": "x", "add_special_tokens": 1},
             "add_special_tokens"),
            ("/detokenize", {"model": "tiny-attn", "tokens": [1, 10**9]}, "tokens"),
            ("/detokenize", {"model": "nobody", "tokens": [1]}, None),
            ("/tokenize", {"model": "tiny-attn", "messages": messages, "chat_template": "x"},
             "chat_template"),
            ("/tokenize", {"model": "tiny-attn", "messages": messages,
                           "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs")]:
        status, text = await asyncio.to_thread(post, served, path, body)
        assert status == (400 if param else 404), text
        assert json.loads(text)["error"]["param"] == param


async def test_stop_token_ids_end_the_output_as_eos_does(served):
    """vLLM's stop_token_ids: the output ends at the first of them, which is not shown
    (finish_reason stop); an id past the vocabulary is a 400."""
    messages = [m for m in await direct(served, SamplingParams()) if m.HasField("token_id")]
    stop_id = messages[2].token_id
    first = next(i for i, m in enumerate(messages) if m.token_id == stop_id)
    completions = api(served).completions
    stopped = await completions.create(model="tiny-attn", prompt=PROMPT, max_tokens=8,
                                       temperature=0, extra_body={"stop_token_ids": [stop_id]})
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop" and stopped.usage.completion_tokens == first + 1
    assert choice.text == "".join(m.text for m in messages[:first])
    assert choice.stop_reason == stop_id  # (vLLM's: the id that ended it)
    chunks = [c async for c in await completions.create(
        model="tiny-attn", prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
        extra_body={"stop_token_ids": [stop_id]})]
    assert [c.choices[0].stop_reason for c in chunks] == [None] * (len(chunks) - 1) + [stop_id]
    plain = await completions.create(model="tiny-attn", prompt=PROMPT, max_tokens=2)
    assert plain.choices[0].finish_reason == "length" and plain.choices[0].stop_reason is None
    with pytest.raises(openai.BadRequestError, match="stop_token_ids"):
        await completions.create(model="tiny-attn", prompt=PROMPT, max_tokens=2,
                                 extra_body={"stop_token_ids": [10**7]})


async def test_vllm_extras_loraplex_does_not_do_are_refused_unless_they_change_nothing(served):
    """(never silently ignored: an output the client did not ask for is worse than a 400)"""
    completions = api(served).completions
    for field, default in UNSUPPORTED_EXTRAS.items():
        changed = {bool: lambda d: not d, int: lambda d: d + 3, float: lambda d: d + 0.5,
                   list: lambda d: ["no"]}.get(type(default), lambda d: 7)(default)
        with pytest.raises(openai.BadRequestError, match=field):
            await completions.create(model="tiny-attn", prompt=PROMPT, max_tokens=1,
                                     extra_body={field: changed})
    neutral = {field: default for field, default in UNSUPPORTED_EXTRAS.items()}
    plain = await completions.create(model="tiny-attn", prompt=PROMPT, max_tokens=3,
                                     temperature=0)
    same = await completions.create(model="tiny-attn", prompt=PROMPT, max_tokens=3,
                                    temperature=0, extra_body=neutral)
    assert same.choices[0].text == plain.choices[0].text
    chat = await api(served).chat.completions.create(
        model="tiny-attn", messages=[{"role": "user", "content": "hi"}], max_tokens=1,
        extra_body=neutral)
    assert chat.choices[0].finish_reason
