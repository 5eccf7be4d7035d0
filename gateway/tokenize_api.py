"""vLLM's /tokenize and /detokenize: a model's tokenizer through the gateway, so that a client
counts a prompt's tokens (and sees whether it fits) the way the pool will.

    POST /tokenize     {"model", "prompt", "add_special_tokens": true, "return_token_strs"}
                       or {"model", "messages", "add_generation_prompt", "continue_final_message",
                       "tools", "chat_template_kwargs", "add_special_tokens": false,
                       "return_token_strs"} (a chat rendered as /v1/chat/completions renders it)
                       -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize   {"model", "tokens"} -> {"prompt"}

`model` is a base model or an adapter the caller's tenant may use (its base model's tokenizer);
the key is checked as for every other call. Nothing is generated and no rate limit is charged.
"""

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route as HttpRoute

from common.errors import InvalidArgument
from gateway.frontend import Frontend, Route
from gateway.guided import parsed_off_loop
from gateway.http_common import guarded, json_body, tenant_of
from gateway.http_errors import BadField
from gateway.openai_api import chat_prompt, error_response
from gateway.openai_requests import boolean, chat_conversation

_THREAD_ITEMS = 20_000  # characters or tokens past which the tokenizer runs off the event loop


class TokenizeApi:
    def __init__(self, frontend: Frontend, max_body_bytes: int):
        self._frontend = frontend
        self._max_body_bytes = max_body_bytes

    def routes(self) -> list[HttpRoute]:
        return [HttpRoute(path, guarded(self._frontend, handler, error_response),
                          methods=["POST"])
                for path, handler in (("/tokenize", self.tokenize),
                                      ("/detokenize", self.detokenize))]

    async def tokenize(self, request: Request) -> JSONResponse:
        body, route = await self._body_and_route(request)
        tokenizer = route.model.tokenizer
        chat = "messages" in body
        if chat:
            text = chat_prompt(route, await parsed_off_loop(chat_conversation, body))
        else:
            text = body.get("prompt")
            if not isinstance(text, str):
                raise BadField("prompt", "must be a string (or send messages)")
        special = boolean(body, "add_special_tokens", not chat)
        encoding = await _off_loop_if_long(len(text), tokenizer.encode, text,
                                           add_special_tokens=special)
        strs = encoding.tokens if boolean(body, "return_token_strs", False) else None
        return JSONResponse({"count": len(encoding.ids), "max_model_len":
                             route.model.max_model_len, "tokens": encoding.ids,
                             "token_strs": strs})

    async def detokenize(self, request: Request) -> JSONResponse:
        body, route = await self._body_and_route(request)
        tokens = body.get("tokens")
        vocab = route.model.vocab_size
        if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                for t in tokens):
            raise BadField("tokens", f"must be a list of token ids in [0, {vocab})")
        text = await _off_loop_if_long(len(tokens), route.model.tokenizer.decode, tokens,
                                       skip_special_tokens=False)
        return JSONResponse({"prompt": text})

    async def _body_and_route(self, request: Request) -> tuple[dict, Route]:
        tenant = tenant_of(request, self._frontend)
        body = await json_body(request, self._max_body_bytes)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise BadField("model", "required: a base model or an adapter")
        route = await self._frontend.route(model, tenant)
        if route.model.tokenizer is None:
            raise InvalidArgument(f"model {route.model.model_id!r} has no tokenizer")
        return body, route


async def _off_loop_if_long(size: int, fn, *args, **kwargs):
    """fn(*args, **kwargs), in a worker thread when `size` is large enough to hold up the loop."""
    if size > _THREAD_ITEMS:
        return await asyncio.to_thread(fn, *args, **kwargs)
    return fn(*args, **kwargs)
