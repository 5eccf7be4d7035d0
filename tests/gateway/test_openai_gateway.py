"""The gateway in front of two pools with different base models (the demo model, which has no chat
template, and the fixture model, which has one), as real processes sharing one adapter store,
driven by the official `openai` client and by gRPC. What comes back through the gateway is what
the pool's scheduler answers for the same request."""

import asyncio
import json
import os
import secrets
import urllib.error
import urllib.request

import grpc
import lorax
import openai
import pytest
from transformers import AutoTokenizer

from common.server import insecure_channel
from loraplex import client
from loraplex.demo import MODEL_DIR as DEMO_MODEL_DIR
from loraplex.fixtures import MODEL_ID as FIXTURE_MODEL
from loraplex.launch import Fleet, FleetKeys, start_gateway
from protos import adapter_store_pb2, common_pb2, scheduler_pb2, scheduler_pb2_grpc

DEMO_MODEL = "loraplex-demo-tiny"
DEMO_ADAPTERS = DEMO_MODEL_DIR.parent / "adapters"
KEYS = {"acme": secrets.token_hex(16), "globex": secrets.token_hex(16),
        "limited": secrets.token_hex(16), "metered": secrets.token_hex(16)}
EXECUTOR = ["--adapter-slots", "2", "--threads", "1"]
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a river."}]


@pytest.fixture(scope="module")
def world(tiny, tmp_path_factory, log_dir):
    """Pool "demo" (with the store), pool "fixture" (using the same store), and a gateway; their
    own loggers at DEBUG (a line per request, with its id)."""
    os.environ["LORAPLEX_LOG_LEVEL"] = "DEBUG"  # (read by the services this fixture starts)
    keys = FleetKeys(tenants={key: tenant for tenant, key in KEYS.items()})
    logs = log_dir / "gateway"
    demo = Fleet(model=str(DEMO_MODEL_DIR), log_dir=logs / "demo", keys=keys,
                 store_url=tmp_path_factory.mktemp("store").as_uri(), executor_args=EXECUTOR)
    fixture = None
    gateway = None
    try:
        demo.start()
        fixture = Fleet(model=tiny["model_dir"], store_url="", log_dir=logs / "fixture",
                        keys=keys, store_addresses=demo.stores, executor_args=EXECUTOR).start()
        gateway = start_gateway({DEMO_MODEL: [demo.scheduler],
                                 FIXTURE_MODEL: [fixture.scheduler]}, demo.stores, logs, keys,
                                ["--rate-limit", "limited=0.02:1000000",
                                 "--rate-limit", f"metered=0:{METERED_TOKENS_PER_S}"])
        yield {"demo": demo, "fixture": fixture, "gateway": gateway, "keys": keys}
    finally:
        os.environ.pop("LORAPLEX_LOG_LEVEL", None)
        for part in (gateway, fixture, demo):
            if part is not None:
                part.stop()


@pytest.fixture(scope="module")
async def adapters(world, tiny):
    store = world["demo"].stores[0]
    await client.push_adapter(store, DEMO_ADAPTERS / "reverse-words", "reverse-words",
                              key=KEYS["acme"])
    await client.push_adapter(store, tiny["adapters"]["r4_attn"]["path"], "tiny-attn",
                              key=KEYS["acme"])
    await client.push_adapter(store, tiny["adapters"]["r8_mlp"]["path"], "globex-mlp",
                              key=KEYS["globex"])
    await client.push_adapter(store, tiny["adapters"]["r2_q"]["path"], "shared-q",
                              key=world["keys"].admin)  # public
    return world


# A bucket of 300 tokens (1 s of its rate); a request of 250 new tokens at most fits it once,
# twice only with what the first did not make given back
METERED_TOKENS_PER_S, METERED_MAX_TOKENS = 300, 240


def openai_client(world, tenant: str = "acme") -> openai.AsyncOpenAI:
    http = world["gateway"].announced["gateway-http"]
    return openai.AsyncOpenAI(base_url=f"http://{http}/v1", api_key=KEYS[tenant],
                              max_retries=0, timeout=120)


async def direct(world, pool: str, adapter: str, prompt, max_new: int, tenant="acme") -> str:
    """What the pool's own scheduler answers (greedy)."""
    async with insecure_channel(world[pool].scheduler) as channel:
        out = await client.generate(scheduler_pb2_grpc.SchedulerStub(channel),
                                    client.generate_request(adapter, prompt, max_new),
                                    KEYS[tenant])
    return out.text


@pytest.mark.parametrize("pool,model,prompt", [
    ("demo", "reverse-words", "quiet river stone"),
    ("demo", DEMO_MODEL, "quiet river stone"),
    ("fixture", "tiny-attn@1", "The little cat"),
    ("fixture", "shared-q", "The little cat"),
])
async def test_completions_equal_the_pools_answer(adapters, pool, model, prompt):
    expected = await direct(adapters, pool, "" if model == DEMO_MODEL else model, prompt, 12)
    api = openai_client(adapters)
    whole = await api.completions.create(model=model, prompt=prompt, max_tokens=12,
                                         temperature=0)
    assert whole.choices[0].text == expected and whole.model == model
    assert whole.usage.completion_tokens == 12 or whole.choices[0].finish_reason == "stop"
    chunks = [c async for c in await api.completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True})]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


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


async def test_chat_uses_the_models_template(adapters, tiny):
    template_ids = AutoTokenizer.from_pretrained(tiny["model_dir"]).apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = AutoTokenizer.from_pretrained(tiny["model_dir"])(
        template_ids, add_special_tokens=False)["input_ids"]
    expected = await direct(adapters, "fixture", "tiny-attn", ids, 10)
    api = openai_client(adapters)
    whole = await api.chat.completions.create(model="tiny-attn", messages=MESSAGES,
                                              max_tokens=10, temperature=0)
    assert whole.choices[0].message.content == expected
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(ids)
    chunks = [c async for c in await api.chat.completions.create(
        model="tiny-attn", messages=MESSAGES, max_tokens=10, temperature=0, stream=True)]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


async def test_chat_without_a_template_is_400_and_completions_still_serve(adapters):
    api = openai_client(adapters)
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        await api.chat.completions.create(model="reverse-words", messages=MESSAGES)


async def test_n_choices_and_seeds(adapters):
    api = openai_client(adapters)
    kw = dict(model="tiny-attn", prompt=["The cat", "A dog"], max_tokens=8, temperature=0.9,
              seed=7, n=2)
    first = await api.completions.create(**kw)
    again = await api.completions.create(**kw)
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    streamed = {}
    async for chunk in await api.completions.create(**kw, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(4)] == [c.text for c in first.choices]


async def test_n_choices_count_each_prompts_cached_tokens_once(adapters):
    """usage counts each prompt once, its cached tokens too: with the prompt's blocks in the
    prefix cache, n choices report what one choice reports (they were summed: cached_tokens over
    prompt_tokens), whole or streamed, completions and chat."""
    api = openai_client(adapters)
    words = "The little cat sat on the warm mat by the door " * 4
    kw = dict(model="tiny-attn", max_tokens=2, temperature=0)
    messages = [{"role": "user", "content": words}]
    for create, ask in ((api.chat.completions.create, {"messages": messages}),
                        (api.completions.create, {"prompt": words})):
        for _ in range(2):  # (the second finds the first's blocks in the prefix cache)
            one = (await create(**kw, **ask)).usage
        counts = (one.prompt_tokens, one.prompt_tokens_details.cached_tokens)
        assert 0 < counts[1] <= counts[0]
        many = (await create(**kw, **ask, n=3)).usage
        assert (many.prompt_tokens, many.prompt_tokens_details.cached_tokens) == counts
        chunks = [c async for c in await create(**kw, **ask, n=3, stream=True,
                                                stream_options={"include_usage": True})]
        streamed = chunks[-1].usage
        assert (streamed.prompt_tokens, streamed.prompt_tokens_details.cached_tokens) == counts
    both = (await api.completions.create(**kw, prompt=[words, words], n=2)).usage
    assert (both.prompt_tokens, both.prompt_tokens_details.cached_tokens) == (
        2 * counts[0], 2 * counts[1])


async def test_models_lists_what_the_tenant_may_use(adapters):
    acme = {m.id for m in (await openai_client(adapters, "acme").models.list()).data}
    globex = {m.id for m in (await openai_client(adapters, "globex").models.list()).data}
    bases = {DEMO_MODEL, FIXTURE_MODEL}
    assert acme == bases | {"reverse-words", "tiny-attn", "shared-q"}
    assert globex == bases | {"globex-mlp", "shared-q"}
    card = await openai_client(adapters).models.retrieve("tiny-attn")
    assert card.model_extra["parent"] == FIXTURE_MODEL and card.model_extra["versions"] == [1]


async def test_a_model_is_retrieved_by_every_name_generation_takes(adapters):
    """GET /v1/models/{model} finds an adapter by name@version and name@alias as generation
    does (its card, with that id and the version as root); another tenant's is still a 404."""
    await client.store_call(adapters["demo"].stores[0], "SetAlias",
                            adapter_store_pb2.SetAliasRequest(name="tiny-attn", alias="stable",
                                                              version=1), key=KEYS["acme"])
    api = openai_client(adapters)
    for model in ("tiny-attn@1", "tiny-attn@stable", "tiny-attn@latest"):
        await api.completions.create(model=model, prompt="hi", max_tokens=1)  # (generation)
        card = await api.models.retrieve(model)
        assert (card.id, card.model_extra["root"], card.model_extra["parent"]) == (
            model, "tiny-attn@1", FIXTURE_MODEL)
    for model in ("tiny-attn@2", "tiny-attn@nope", "my model"):
        with pytest.raises(openai.NotFoundError):
            await api.models.retrieve(model)
    with pytest.raises(openai.NotFoundError):
        await openai_client(adapters, "globex").models.retrieve("tiny-attn@1")


async def test_unknown_and_other_tenants_models_are_the_same_404(adapters):
    api = openai_client(adapters, "globex")
    texts = []
    for model in ("tiny-attn", "no-such-adapter"):
        with pytest.raises(openai.NotFoundError) as err:
            await api.completions.create(model=model, prompt="hi", max_tokens=2)
        texts.append(err.value.message.replace(model, "NAME"))
    assert texts[0] == texts[1]


async def test_a_name_no_adapter_could_have_is_the_404_of_an_unknown_one(adapters):
    """A model that is no base model served here and not of an adapter's form (a hub id, a name
    with a space) is unknown like any other name: 404 model_not_found on every HTTP API (it was
    a 400 with param null), NOT_FOUND on the gateway's gRPC Generate, as a well-formed name nobody
    has. (A pool's own scheduler takes adapter references only: there a malformed one is
    INVALID_ARGUMENT, test_bad_input.)"""
    api = openai_client(adapters)
    for model in ("no-such-adapter", "meta-llama/Llama-3.1-8B-Instruct", "my model"):
        with pytest.raises(openai.NotFoundError) as err:
            await api.completions.create(model=model, prompt="hi", max_tokens=2)
        assert err.value.code == "model_not_found", model
        assert err.value.type == "invalid_request_error"  # (OpenAI's, for an unknown model)
        with pytest.raises(openai.NotFoundError):
            await api.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)
        status, _ = await asyncio.to_thread(post, adapters, "/generate", {
            "inputs": "hi", "parameters": {"adapter_id": model, "max_new_tokens": 2}})
        assert status == 404, model
        async with insecure_channel(adapters["gateway"].address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.generate(scheduler_pb2_grpc.SchedulerStub(channel),
                                      client.generate_request(model, "hi", 2), KEYS["acme"])
        assert err.value.code() == grpc.StatusCode.NOT_FOUND, model


async def answers(world, model: str, tenant: str = "acme") -> list:
    """Every surface's answer to a request for `model`, `model`'s name replaced by NAME: the
    gateway's /v1/completions and TGI /generate (status, body), its gRPC Generate and the pool's
    own scheduler's (code, details)."""
    name = model.split("@")[0]
    out = []
    for path, body in (("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 2}),
                       ("/generate", {"inputs": "hi", "parameters": {
                           "adapter_id": model, "max_new_tokens": 2}})):
        status, raw = await asyncio.to_thread(post, world, path, body, tenant)
        out.append((path, status, raw.decode().replace(name, "NAME")))
    for address in (world["gateway"].address, world["fixture"].scheduler):
        async with insecure_channel(address) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            try:
                await client.generate(stub, client.generate_request(model, "hi", 2),
                                      KEYS[tenant])
                out.append((address, "OK", ""))
            except grpc.aio.AioRpcError as err:
                out.append((address, err.code(), err.details().replace(name, "NAME")))
    return out


async def test_another_tenants_adapter_reads_exactly_as_one_that_does_not_exist(adapters):
    """After globex has used its adapter (so the gateway and the scheduler hold its version in
    their caches) and given it an alias, acme asking for it by name, version, a version it does
    not have, or the alias gets, on every surface, the very answer of a name nobody has."""
    store = adapters["demo"].stores[0]
    await client.store_call(store, "SetAlias", adapter_store_pb2.SetAliasRequest(
        name="globex-mlp", alias="prod", version=1), key=KEYS["globex"])
    for model in ("globex-mlp", "globex-mlp@1", "globex-mlp@prod"):  # (warm every cache)
        assert {a[1] for a in await answers(adapters, model, "globex")} <= {200, "OK"}
    for suffix in ("", "@1", "@9", "@prod"):
        theirs = await answers(adapters, "globex-mlp" + suffix)
        missing = await answers(adapters, "globex-mlq" + suffix)
        assert theirs == missing, suffix
        assert {a[1] for a in theirs} == {404, grpc.StatusCode.NOT_FOUND}


async def test_one_request_id_from_the_client_to_the_executors_log(adapters):
    """A client's x-request-id names its response and is the request's id in the gateway's, the
    scheduler's and the executor's logs; each of n choices is a request of its own (id-INDEX).
    An id that could forge a log line is refused (400, naming the header)."""
    http = adapters["gateway"].announced["gateway-http"]
    api = openai.AsyncOpenAI(base_url=f"http://{http}/v1", api_key=KEYS["acme"], max_retries=0,
                             default_headers={"x-request-id": "trace-7f3a.1"})
    answer = await api.completions.create(model="tiny-attn", prompt="The little cat",
                                          max_tokens=3, n=2)
    assert answer.id == "cmpl-trace-7f3a.1"
    fixture = adapters["fixture"]
    logs = {"gateway": adapters["gateway"].log_path,
            "scheduler": fixture.by_name("scheduler")[0].log_path,
            "executor": fixture.by_name("executor")[0].log_path}
    for name, path in logs.items():
        text = path.read_text()
        for choice in ("trace-7f3a.1-0", "trace-7f3a.1-1"):
            assert f"request {choice}" in text, f"{choice} not in the {name}'s log"
    status, body = await asyncio.to_thread(post, adapters, "/v1/completions", {
        "model": "tiny-attn", "prompt": "hi", "max_tokens": 2}, "acme",
        {"x-request-id": "bad id=forged"})
    assert status == 400 and b"x-request-id" in body


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
    with pytest.raises(openai.BadRequestError) as err:  # (no max_tokens: none is named)
        await api.chat.completions.create(model="tiny-attn", messages=[
            {"role": "user", "content": "cat " * 3000}])
    assert err.value.body["param"] == "messages" and "shorten the messages" in str(err.value)
    assert "max_tokens" not in err.value.body["message"]


async def test_bad_key_bad_field_and_rate_limit(adapters):
    http = adapters["gateway"].announced["gateway-http"]
    bad = openai.AsyncOpenAI(base_url=f"http://{http}/v1", api_key="x" * 32, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await bad.completions.create(model="tiny-attn", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as err:
        await openai_client(adapters).completions.create(model="tiny-attn", prompt="hi",
                                                         max_tokens=2, temperature=7)
    assert err.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as err:
        await openai_client(adapters).completions.create(
            model="tiny-attn", prompt="hi", max_tokens=2, extra_body={"cache_salt": 7})
    assert err.value.body["param"] == "cache_salt"
    salted = await openai_client(adapters).completions.create(
        model="tiny-attn", prompt="The little cat", max_tokens=8, temperature=0,
        extra_body={"cache_salt": "conversation-1"})
    assert salted.choices[0].text == await direct(adapters, "fixture", "tiny-attn",
                                                  "The little cat", 8)
    limited = openai_client(adapters, "limited")
    await limited.completions.create(model=DEMO_MODEL, prompt="a b", max_tokens=2)
    with pytest.raises(openai.RateLimitError) as err:
        await limited.completions.create(model=DEMO_MODEL, prompt="a b", max_tokens=2)
    assert int(err.value.response.headers["retry-after"]) >= 1


async def test_a_request_pays_for_the_new_tokens_it_made_not_its_max_tokens(adapters):
    """A request is admitted on its prompt + max_tokens and gets back what it did not make: the
    demo model echoes a short prompt and stops, far below max_tokens, so requests whose
    max_tokens is most of the bucket follow each other (without the refund the second waited
    ~0.7 s for the bucket to refill: a 429)."""
    metered = openai_client(adapters, "metered")
    for _ in range(3):
        answer = await metered.completions.create(model=DEMO_MODEL, prompt="a b", temperature=0,
                                                  max_tokens=METERED_MAX_TOKENS)
        assert answer.usage.completion_tokens < 20


async def test_grpc_generate_through_the_gateway_equals_the_pool(adapters):
    expected = await direct(adapters, "fixture", "tiny-attn", "The little cat", 8)
    async with insecure_channel(adapters["gateway"].address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        out = await client.generate(stub, client.generate_request("tiny-attn", "The little cat",
                                                                  8), KEYS["acme"])
        assert out.text == expected and out.usage.adapter.name == "tiny-attn"
        exact = client.generate_request("", "The little cat", 8)  # (an exact version, passed on)
        exact.adapter_ref.CopyFrom(common_pb2.AdapterRef(name="tiny-attn", version=1))
        out = await client.generate(stub, exact, KEYS["acme"])
        assert out.text == expected and client.ref_text(out.usage.adapter) == "tiny-attn@1"
        exact.adapter_ref.version = 2
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.generate(stub, exact, KEYS["acme"])
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.generate(stub, client.generate_request("", "hi", 2), KEYS["acme"])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # two pools: name one
        base = await client.generate(stub, client.generate_request(FIXTURE_MODEL, "hi", 4),
                                     KEYS["acme"])
        assert base.text == await direct(adapters, "fixture", "", "hi", 4)


def post(world, path: str, body: dict | bytes | None, tenant: str = "acme",
         headers: dict | None = None, method: str = "POST") -> tuple[int, bytes]:
    """A raw HTTP POST (or `method`) to the gateway, as lorax-client and TGI clients make it."""
    url = f"http://{world['gateway'].announced['gateway-http']}{path}"
    data = body if isinstance(body, bytes | None) else json.dumps(body).encode()
    request = urllib.request.Request(url, data, method=method, headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {KEYS[tenant]}",
        **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


@pytest.mark.parametrize("method,path,status", [
    ("GET", "/v1/embeddings", 404), ("POST", "/v1/embeddings", 404), ("POST", "/v2/nope", 404),
    ("GET", "/v1/completions", 405), ("GET", "/v1/chat/completions", 405),
    ("DELETE", "/v1/models/tiny-attn", 405), ("GET", "/generate", 405),
])
async def test_unknown_routes_and_methods_are_errors_in_openais_shape(adapters, method, path,
                                                                     status):
    """A path no route serves (404) and a method a route does not take (405) answer OpenAI's
    error body, which clients read, not plain text."""
    got, body = await asyncio.to_thread(post, adapters, path, None, method=method)
    error = json.loads(body)["error"]
    assert got == status and set(error) == {"message", "type", "param", "code"}
    assert f"{method} {path}" in error["message"] and error["type"] == "invalid_request_error"
    if status == 404 and path == "/v1/embeddings":
        with pytest.raises(openai.NotFoundError, match="Invalid URL"):
            await openai_client(adapters).embeddings.create(model="tiny-attn", input="hi")


async def test_lorax_and_tgi_clients_requests(adapters):
    expected = await direct(adapters, "fixture", "tiny-attn", "The little cat", 8)
    params = {"adapter_id": "tiny-attn", "max_new_tokens": 8, "details": True}
    status, body = await asyncio.to_thread(post, adapters, "/", {
        "inputs": "The little cat", "parameters": params, "stream": False})
    assert status == 200
    (answer,) = json.loads(body)  # lorax-client reads a list of one
    assert answer["generated_text"] == expected
    assert answer["details"]["generated_tokens"] == len(answer["details"]["tokens"])
    assert answer["details"]["finish_reason"] in ("length", "eos_token")
    status, body = await asyncio.to_thread(post, adapters, "/generate_stream", {
        "inputs": "The little cat", "parameters": params})
    events = [json.loads(line[5:]) for line in body.decode().splitlines()
              if line.startswith("data:")]
    assert status == 200
    assert "".join(e["token"]["text"] for e in events if not e["token"]["special"]) == expected
    assert events[-1]["generated_text"] == expected and events[-1]["details"]
    status, body = await asyncio.to_thread(post, adapters, "/generate", {
        "inputs": "hi", "parameters": {"adapter_id": "globex-mlp"}})
    assert status == 404 and json.loads(body)["error_type"] == "not_found"
    status, body = await asyncio.to_thread(post, adapters, "/generate", {
        "inputs": "hi", "parameters": {"adapter_id": "tiny-attn", "temperature": -1}})
    assert status == 422 and "temperature" in json.loads(body)["error"]
    for top_p in ([0.5], "0.5", True):  # (a list was a 500, a string was taken)
        status, body = await asyncio.to_thread(post, adapters, "/generate", {
            "inputs": "hi", "parameters": {"adapter_id": "tiny-attn", "top_p": top_p}})
        assert status == 422 and "top_p" in json.loads(body)["error"], (top_p, body)
    status, body = await asyncio.to_thread(post, adapters, "/generate", b"[" * 100_000)
    assert status == 422 and "nests too deeply" in json.loads(body)["error"]  # (was a 500)


async def test_lorax_client_unchanged(adapters):
    """LoRAX's own Python client (lorax-client), pointed at the gateway: generate and
    generate_stream with adapter_id give the pool's answer; its errors map to its exceptions."""
    expected = await direct(adapters, "fixture", "tiny-attn", "The little cat", 8)
    url = f"http://{adapters['gateway'].announced['gateway-http']}"
    lx = lorax.AsyncClient(url, headers={"Authorization": f"Bearer {KEYS['acme']}"}, timeout=60)
    answer = await lx.generate("The little cat", adapter_id="tiny-attn", max_new_tokens=8,
                               details=True)
    assert answer.generated_text == expected
    assert answer.details.generated_tokens == len(answer.details.tokens) == 8
    assert answer.details.finish_reason.value in ("length", "eos_token")
    streamed = [r async for r in lx.generate_stream("The little cat", adapter_id="tiny-attn",
                                                     max_new_tokens=8)]
    assert "".join(r.token.text for r in streamed if not r.token.special) == expected
    assert streamed[-1].generated_text == expected
    seeded = [await lx.generate("The little cat", adapter_id="shared-q", max_new_tokens=6,
                                do_sample=True, temperature=0.9, top_p=0.9, seed=7)
              for _ in range(2)]
    assert seeded[0].generated_text == seeded[1].generated_text  # a seed reproduces
    with pytest.raises(lorax.errors.NotFoundError):
        await lx.generate("hi", adapter_id="globex-mlp", max_new_tokens=2)  # another tenant's
    with pytest.raises(lorax.errors.ValidationError, match="context"):  # refused by the gateway
        await lx.generate("hi", adapter_id="tiny-attn", max_new_tokens=100_000)
    sync = lorax.Client(url, headers={"Authorization": f"Bearer {KEYS['acme']}"}, timeout=120)
    done = await asyncio.to_thread(sync.generate, "The little cat", adapter_id="tiny-attn",
                                   max_new_tokens=8)
    assert done.generated_text == expected


WEIRD = [None, True, -1, 0, 2**70, 1e309, "x", "", [], [None], {}, {"a": 1}, [[1, -5]],
         "\u2603" * 5000]
FIELDS = {
    "/v1/completions": ("model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n",
                        "seed", "stop", "logprobs", "stream", "stream_options", "best_of",
                        "echo", "suffix", "presence_penalty", "logit_bias", "user",
                        "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                        "stop_token_ids"),
    "/v1/chat/completions": ("model", "messages", "max_tokens", "max_completion_tokens",
                             "temperature", "n", "seed", "stop", "logprobs", "top_logprobs",
                             "tools", "tool_choice", "response_format", "stream",
                             "add_generation_prompt", "continue_final_message", "echo",
                             "parallel_tool_calls", "guided_json", "guided_choice",
                             "chat_template", "chat_template_kwargs", "stop_token_ids"),
    "/generate": ("inputs", "parameters"),
    "/tokenize": ("prompt", "messages", "add_special_tokens", "chat_template_kwargs"),
    "/detokenize": ("tokens",),
}
BASES = {
    "/v1/completions": {"model": "tiny-attn", "prompt": "The cat", "max_tokens": 2},
    "/v1/chat/completions": {"model": "tiny-attn", "messages": MESSAGES, "max_tokens": 2},
    "/generate": {"inputs": "The cat", "parameters": {"adapter_id": "tiny-attn",
                                                      "max_new_tokens": 2}},
    "/tokenize": {"model": "tiny-attn", "prompt": "The cat"},
    "/detokenize": {"model": "tiny-attn", "tokens": [5, 6]},
}


async def test_no_body_makes_the_gateway_fail_itself(adapters):
    """Every field of every endpoint given values of every JSON kind: an answer or a 4xx that
    says what is wrong, never a 5xx."""
    wrong = []
    for path, fields in FIELDS.items():
        for field in fields:
            for value in WEIRD:
                body = {**BASES[path], field: value}
                status, text = await asyncio.to_thread(post, adapters, path, body)
                if status >= 500 or (status >= 400 and b"error" not in text):
                    wrong.append(f"{path} {field}={str(value)[:20]}: {status} {text[:200]}")
    for raw in (b"", b"[]", b"{", b"null", b"\xff\xfe", b'{"model": "tiny-attn"}' * 2,
                b'{"model": "tiny-attn", "prompt": "a \\ud800 b"}',  # (a lone surrogate)
                b'{"model": "tiny-attn", "prompt": "ok", "stop": [{"\\udc00": 1}]}'):
        status, text = await asyncio.to_thread(post, adapters, "/v1/completions", raw)
        if status != 400:
            wrong.append(f"raw {raw[:20]!r}: {status} {text[:200]}")
    assert not wrong, "\n".join(wrong)


async def busy(world, pool: str, tenant: str = "acme") -> int:
    """The tenant's requests queued or running in the pool."""
    async with insecure_channel(world[pool].scheduler) as channel:
        stats = await scheduler_pb2_grpc.SchedulerStub(channel).Stats(
            scheduler_pb2.StatsRequest(), metadata=client.metadata(world["keys"].admin))
    return sum(t.queued + t.running for t in stats.tenants if t.tenant == tenant)


@pytest.mark.parametrize("path,stream", [("/v1/completions", False), ("/v1/completions", True),
                                         ("/generate", False), ("/generate_stream", True)])
async def test_a_client_that_leaves_before_its_answer_cancels_its_request(adapters, path,
                                                                         stream):
    """Not streamed, or streamed but before its first token: the pool's executor is frozen, so
    the request can only leave the pool by being cancelled (it would run its 1000 tokens)."""
    (executor,) = adapters["fixture"].by_name("executor")
    host, port = adapters["gateway"].announced["gateway-http"].rsplit(":", 1)
    body = json.dumps({"model": "tiny-attn", "prompt": "The little cat", "max_tokens": 1000,
                       "ignore_eos": True, "stream": stream} if path.startswith("/v1") else
                      {"inputs": "The little cat", "parameters": {
                          "adapter_id": "tiny-attn", "max_new_tokens": 1000,
                          "ignore_eos_token": True}}).encode()
    assert await busy_within(adapters, 0), "earlier requests still run"
    executor.freeze()
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
                     f"\r\nAuthorization: Bearer {KEYS['acme']}\r\nContent-Length: {len(body)}"
                     f"\r\n\r\n".encode() + body)
        await writer.drain()
        assert await busy_within(adapters, 1), "the request never reached the pool"
        writer.close()  # the client leaves
        assert await busy_within(adapters, 0), "the request outlived its client"
    finally:
        executor.thaw()


async def busy_within(world, count: int, seconds: float = 30) -> bool:
    """Whether acme's requests in the fixture pool come to `count` within `seconds`."""
    try:
        async with asyncio.timeout(seconds):
            while await busy(world, "fixture") != count:
                await asyncio.sleep(0.05)
    except TimeoutError:
        return False
    return True


async def test_a_pool_down_is_503_for_its_models_while_the_other_serves(adapters):
    adapters["demo"].by_name("scheduler")[0].kill()
    api = openai_client(adapters)
    with pytest.raises(openai.InternalServerError) as err:
        await api.completions.create(model="reverse-words", prompt="a b", max_tokens=2)
    assert err.value.status_code == 503
    assert err.value.response.headers["retry-after"] == "1"  # (a client's backoff, bounded)
    done = await api.completions.create(model="tiny-attn", prompt="The cat", max_tokens=4)
    assert done.choices[0].finish_reason in ("length", "stop")
    url = f"http://{adapters['gateway'].announced['gateway-http']}/health"
    with await asyncio.to_thread(urllib.request.urlopen, url, timeout=10) as health:
        assert health.status == 200
