"""The gateway's HTTP face, compatible with OpenAI's API (Starlette on uvicorn):

    POST /v1/completions        prompt(s) -> n choices each; streamed as server-sent events
    POST /v1/chat/completions   messages, rendered with the base model's chat template
    GET  /v1/models             the base models, and the adapters the caller's tenant may use
    GET  /v1/models/{model}     one of them, by any name generation takes ("name@3", "name@prod")

`model` is a base model id or an adapter reference ("name", "name@3", "name@prod"); the key is
`Authorization: Bearer <key>`. Every choice is one Generate on the pool. A streamed response
starts (HTTP 200) only once the first token came: an error before it is an HTTP error with its
own status, one after it an `error` event. A client that goes away cancels its Generate calls.
A path no route serves, or a method its route does not take, is an error in OpenAI's shape too.
"""

import asyncio
import dataclasses
import logging

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route as HttpRoute

from common.adapter_ref import AdapterRef
from common.errors import NotFound, Unavailable
from gateway.catalog import Catalog
from gateway.frontend import Frontend, Route
from gateway.guided import checked, parsed_off_loop
from gateway.http_common import SSEResponse, guarded, json_body, request_id_of, tenant_of
from gateway.http_errors import error_body, routing_error_body
from gateway.openai_requests import Conversation, Options, chat_request, completion_request
from gateway.openai_responses import DONE, Choice, EventWriter, cached_prompt_tokens, usage
from gateway.openai_responses import Response as Identity
from gateway.tool_calls import ToolFormat
from protos import scheduler_pb2

log = logging.getLogger(__name__)

# OpenAI's documented default for /v1/completions max_tokens: that API's own (equal to loraplex's
# common.wire.DEFAULT_MAX_NEW_TOKENS today, not by definition). Chat takes the rest of the context.
OPENAI_DEFAULT_MAX_TOKENS = 16


class OpenAIApi:
    def __init__(self, frontend: Frontend, catalog: Catalog, max_body_bytes: int = 32 << 20):
        self._frontend = frontend
        self._catalog = catalog
        self._max_body_bytes = max_body_bytes

    def routes(self) -> list[HttpRoute]:
        return [HttpRoute(path, guarded(self._frontend, handler, error_response), methods=[method])
                for path, handler, method in (
                    ("/v1/completions", self.completions, "POST"),
                    ("/v1/chat/completions", self.chat, "POST"),
                    ("/v1/models", self.models, "GET"),
                    ("/v1/models/{model:path}", self.model, "GET"))]

    # ----- endpoints -----

    async def completions(self, request: Request) -> Response:
        tenant, request_id = tenant_of(request, self._frontend), request_id_of(request)
        parsed = await parsed_off_loop(completion_request,
                                       await json_body(request, self._max_body_bytes))
        options = parsed.options
        route = await self._frontend.route(options.model, tenant)
        parsed.check_vocab(route.model.vocab_size)
        max_new = OPENAI_DEFAULT_MAX_TOKENS if options.max_tokens is None else max(
            options.max_tokens, 1)  # (max_tokens 0 with echo: one token, not shown)
        prompts = [await route.model.prompts.ids(
            p if isinstance(p, str) else None, None if isinstance(p, str) else list(p), max_new,
            field="max_tokens", keep_last=options.keep_last) for p in parsed.prompts]
        return await self._respond(route, tenant, options, prompts, max_new, request_id,
                                   chat=False)

    async def chat(self, request: Request) -> Response:
        tenant, request_id = tenant_of(request, self._frontend), request_id_of(request)
        parsed = await parsed_off_loop(chat_request,
                                       await json_body(request, self._max_body_bytes))
        options, tools = parsed.options, parsed.tools
        route = await self._frontend.route(options.model, tenant)
        options.check_vocab(route.model.vocab_size)
        tool_format = None
        if tools is not None and tools.are_parsed:  # (its format is the model's)
            tool_format = ToolFormat.for_template(route.model.chat.source)
            grammar = tools.grammar(tool_format)
            if grammar is not None:
                await grammar.prepare()  # (compiled off the loop; checked finds it)
                options = dataclasses.replace(options, sampling=dataclasses.replace(
                    options.sampling, grammar=checked(grammar, "tools")))
        # (without max_tokens, the reply takes the rest of the context: the prompt must leave
        # room for its first token, and an error must not name a max_tokens nobody sent)
        ids = await route.model.prompts.ids(
            chat_prompt(route, parsed.conversation), None, options.max_tokens or 1, chat=True,
            field="max_tokens" if options.max_tokens else "the reply's first token",
            keep_last=options.keep_last)
        max_new = options.max_tokens or route.model.max_model_len - len(ids)
        return await self._respond(route, tenant, options, [ids], max_new, request_id,
                                   chat=True, tool_format=tool_format, chat_echo=parsed.echo)

    async def models(self, request: Request) -> Response:
        tenant = tenant_of(request, self._frontend)
        return JSONResponse({"object": "list", "data": await self._model_cards(tenant)})

    async def model(self, request: Request) -> Response:
        """One model's card, for any name generation takes: a base model, an adapter's name, or
        one of its versions or aliases ("name@3", "name@prod": the adapter's card, with that id
        and the version it names as its root)."""
        tenant = tenant_of(request, self._frontend)
        wanted = request.path_params["model"]
        cards = await self._model_cards(tenant)
        for card in cards:
            if card["id"] == wanted:
                return JSONResponse(card)
        adapter = await self._frontend.adapter(wanted, tenant)  # (NOT_FOUND: no such adapter)
        for card in cards:
            if card["id"] == adapter.name and card["parent"] == adapter.base_model:
                return JSONResponse({**card, "id": wanted, "root": str(AdapterRef.of(adapter)),
                                     "created": int(adapter.created_unix)})
        raise NotFound(f"model {wanted[:200]!r} not found: adapter {AdapterRef.of(adapter)} "
                       f"(base model {adapter.base_model!r}) is not among the models this "
                       "gateway serves")

    # ----- the parts -----

    async def _model_cards(self, tenant: str) -> list[dict]:
        pools = self._frontend.pools
        served = set(pools.model_ids())
        cards = [{"id": model_id, "object": "model", "created": 0, "owned_by": "loraplex",
                  "root": model_id, "parent": None,
                  "max_model_len": pool.model.max_model_len if pool.model else None}
                 for model_id in sorted(served) if (pool := pools.get(model_id))]
        for entry in await self._catalog.adapters(tenant, served):
            cards.append({"id": entry.name, "object": "model", "created": int(entry.created_unix),
                          "owned_by": entry.owner or "public",
                          "root": f"{entry.name}@{entry.versions[-1]}",
                          "parent": entry.base_model, "versions": list(entry.versions),
                          "aliases": entry.aliases})
        return cards

    async def _respond(self, route: Route, tenant: str, options: Options,
                       prompts: list[list[int]], max_new: int, request_id: str,
                       chat: bool, tool_format: ToolFormat | None = None,
                       chat_echo: str | None = None) -> Response:
        many = len(prompts) * options.n > 1  # (each choice a request of its own: id-INDEX)
        upstreams = [(index, scheduler_pb2.GenerateRequest(
                        adapter_ref=route.adapter_ref, token_ids=scheduler_pb2.TokenIds(ids=ids),
                        sampling=options.choice_seed(j).to_pb(), max_new_tokens=max_new,
                        stop=options.stop, stop_token_ids=options.stop_token_ids,
                        ignore_eos=options.ignore_eos, include_stop_str=options.include_stop_str,
                        show_special_tokens=options.show_special_tokens,
                        cache_salt=options.cache_salt,
                        request_id=f"{request_id}-{index}" if many else request_id))
                     for i, ids in enumerate(prompts) for j in range(options.n)
                     for index in (i * options.n + j,)]
        self._frontend.admit(tenant, sum(len(u.token_ids.ids) + max_new for _, u in upstreams))
        prompt_tokens = sum(map(len, prompts))
        identity = Identity(chat, options.model, request_id)
        echoes = {index: _decoded(route, u.token_ids.ids) for index, u in upstreams
                  } if options.echo else {}
        if chat_echo is not None:
            echoes = {index: chat_echo for index, _ in upstreams}
        events = self._merged(route, upstreams, tenant)
        if options.max_tokens == 0:
            events = _prompt_only(events)
        if not options.stream:
            choices = {index: Choice(index, options.logprobs, echoes.get(index), tool_format)
                       for index, _ in upstreams}
            try:
                async for index, message in events:
                    choices[index].add(message)
            finally:
                await events.aclose()
            return JSONResponse(identity.body([choices[i] for i in sorted(choices)],
                                              prompt_tokens, options.n))
        first = await anext(events, None)  # an error before the first token is an HTTP error
        if first is None:
            raise Unavailable("the pool ended the stream without an answer; retry")
        writer = EventWriter(identity, options.include_usage, options.logprobs, echoes,
                             tool_format, adapter_inactive=first[1].adapter_inactive)
        return SSEResponse(self._events(writer, first, events, prompt_tokens, options))

    async def _events(self, writer: EventWriter, first, events, prompt_tokens: int,
                      options: Options):
        completion_tokens = made = 0
        cached: dict[int, int] = {}  # choice -> its prompt's tokens the prefix cache held
        try:
            index, message = first
            while True:
                made += message.HasField("token_id")
                if options.continuous_usage:
                    writer.usage_so_far = usage(prompt_tokens, made)
                yield writer.token(index, message)
                completion_tokens += message.usage.completion_tokens
                if message.HasField("usage"):  # (a choice's last message)
                    cached[index] = message.usage.cached_prompt_tokens
                if (following := await anext(events, None)) is None:
                    break
                index, message = following
        except Exception as exc:  # noqa: BLE001 - an error after the first token is an event
            yield writer.error(exc)
            return
        finally:
            await events.aclose()
        if options.include_usage:
            yield writer.usage(prompt_tokens, completion_tokens,
                               cached_prompt_tokens(cached, options.n))
        yield DONE

    async def _merged(self, route: Route, upstreams, tenant: str):
        """(choice index, message) from every choice's stream, as they come."""
        if len(upstreams) == 1:
            index, upstream = upstreams[0]
            async for message in self._frontend.generate(route, upstream, tenant):
                yield index, message
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, upstream) -> None:
            try:
                async for message in self._frontend.generate(route, upstream, tenant):
                    queue.put_nowait((index, message))
                queue.put_nowait((index, None))
            except Exception as exc:  # noqa: BLE001 - passed to the reader
                queue.put_nowait((index, exc))

        tasks = [asyncio.create_task(pump(i, u)) for i, u in upstreams]
        try:
            running = len(tasks)
            while running:
                index, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def error_response(exc: BaseException) -> JSONResponse:
    status, body, headers = error_body(exc)
    return JSONResponse(body, status_code=status, headers=headers)


async def routing_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own errors, a path no route serves (404) and a method its route does not take
    (405, with Allow), in OpenAI's error shape (the app's exception handler)."""
    headers = dict(exc.headers or {})
    body = routing_error_body(request.method, request.url.path, exc.status_code, exc.detail,
                              headers.get("Allow", ""))
    return JSONResponse(body, status_code=exc.status_code, headers=headers)


async def _prompt_only(events):
    """An echo with max_tokens 0 (scoring a prompt): each choice's one token left out, its
    prompt tokens kept, its end a `length` with no completion tokens."""
    try:
        async for index, message in events:
            if message.prompt_tokens:
                yield index, scheduler_pb2.GenerateResponse(prompt_tokens=message.prompt_tokens)
            if message.finish_reason:
                scored = scheduler_pb2.Usage()
                scored.CopyFrom(message.usage)
                scored.completion_tokens = 0
                yield index, scheduler_pb2.GenerateResponse(
                    finish_reason=scheduler_pb2.FINISH_REASON_LENGTH, usage=scored)
    finally:
        await events.aclose()


def _decoded(route: Route, ids) -> str:
    """A prompt's text as its tokens decode (what `echo` shows without prompt logprobs)."""
    tokenizer = route.model.tokenizer
    return tokenizer.decode(list(ids), skip_special_tokens=True) if tokenizer else ""


def chat_prompt(route: Route, chat: Conversation) -> str:
    """The chat's prompt text: its messages (and tools) rendered with the model's template."""
    tools = list(chat.tools.specs) if chat.tools else None
    return route.model.chat.render(list(chat.messages), chat.add_generation_prompt,
                                   chat.continue_final_message, tools, dict(chat.template_kwargs))

