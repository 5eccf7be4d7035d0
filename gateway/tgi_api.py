"""The TGI/LoRAX-style HTTP API, so clients written for LoRAX (the `lorax-client` package) or
TGI work unchanged:

    POST /generate          {"inputs", "parameters": {"adapter_id", "max_new_tokens", ...}}
                            -> {"generated_text", "details"}
    POST /generate_stream   the same as server-sent events: {"token", "generated_text",
                            "details"} per token
    POST /                  either, by the body's "stream"; not streamed it answers a list of
                            one response (what lorax-client expects)

`adapter_id` is an adapter reference the caller's tenant may use, or a base model id (a pool's);
unset means the base model of a gateway with one pool. Adapters come from the loraplex registry
only (`adapter_source` other than "hub" is refused: push adapters with `loraplex adapters push`).
The last streamed event carries generated_text and details on a special token with empty text
(the pool's final message holds no token), so clients that join non-special tokens' text get
exactly the generated text. Errors: {"error", "error_type"} (422 validation, 404, 429
overloaded, 503, ...).

Sampling beyond TGI's basics: `repetition_penalty` and `frequency_penalty`; `top_n_tokens`
(TGI: each token's most likely alternatives in details.top_tokens, and in each streamed event's
top_tokens) or `return_k_alternatives` (LoRAX: in each token's alternative_tokens);
`decoder_input_details` (details.prefill: the prompt's tokens with their logprobs, the first
without). Token texts are what each adds to the text before it (common/token_logprobs.py).
"""

import json

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route as HttpRoute

from common.errors import InvalidArgument, Unavailable
from common.grammar import Grammar, GrammarKind
from common.sampling import MAX_SEED, BadSampling, SamplingParams
from gateway.frontend import Frontend, Route
from gateway.guided import parsed_off_loop
from gateway.http_common import SSEResponse, guarded, json_body, request_id_of, tenant_of
from gateway.http_errors import error_body
from gateway.openai_requests import MAX_STOP
from protos import scheduler_pb2

# TGI's and LoRAX's documented default for parameters.max_new_tokens: that API's own, not
# loraplex's (common.wire.DEFAULT_MAX_NEW_TOKENS, what a Generate without a bound gets).
TGI_DEFAULT_MAX_NEW_TOKENS = 20
_ERROR_TYPES = {400: "validation", 404: "not_found", 429: "overloaded", 401: "authentication",
                403: "authorization", 503: "unavailable", 504: "timeout"}
_UNSUPPORTED = {"typical_p": None, "watermark": False, "merged_adapters": None,
                "response_format": None}


class TgiApi:
    def __init__(self, frontend: Frontend, max_body_bytes: int = 32 << 20):
        self._frontend = frontend
        self._max_body_bytes = max_body_bytes

    def routes(self) -> list[HttpRoute]:
        return [HttpRoute(path, guarded(self._frontend, handler, error_response), methods=["POST"])
                for path, handler in (("/generate", self.generate),
                                      ("/generate_stream", self.generate_stream),
                                      ("/", self.compat))]

    async def generate(self, request: Request) -> Response:
        return await self._serve(request, stream=False, as_list=False)

    async def generate_stream(self, request: Request) -> Response:
        return await self._serve(request, stream=True, as_list=False)

    async def compat(self, request: Request) -> Response:
        return await self._serve(request, stream=None, as_list=True)

    async def _serve(self, request: Request, stream: bool | None, as_list: bool) -> Response:
        tenant = tenant_of(request, self._frontend)
        body = await json_body(request, self._max_body_bytes)
        if stream is None:
            stream = _flag(body, "stream", False)
        inputs = body.get("inputs")
        if not isinstance(inputs, str) or not inputs:
            raise InvalidArgument("inputs: required, a non-empty string")
        params = body.get("parameters") or {}
        if not isinstance(params, dict):
            raise InvalidArgument("parameters: must be an object")
        route = await self._frontend.route(self._model(params), tenant)
        max_new = _int(params, "max_new_tokens", TGI_DEFAULT_MAX_NEW_TOKENS, 1)
        ids = await route.model.prompts.ids(inputs, None, max_new)
        truncate = params.get("truncate")
        if truncate is not None:
            ids = ids[-_int(params, "truncate", 0, 1):]
        upstream = scheduler_pb2.GenerateRequest(
            adapter_ref=route.adapter_ref, token_ids=scheduler_pb2.TokenIds(ids=ids),
            request_id=request_id_of(request),
            sampling=(await parsed_off_loop(_sampling, params)).to_pb(), max_new_tokens=max_new,
            stop=_stops(params), ignore_eos=_flag(params, "ignore_eos_token", False))
        self._frontend.admit(tenant, len(ids) + max_new)
        prefix = inputs if _flag(params, "return_full_text", False) else ""
        details = _flag(params, "details", False)
        shape = _Alternatives(params)
        events = self._frontend.generate(route, upstream, tenant)
        if not stream:
            tokens, final, prefill = [], None, []
            async for message in events:
                prefill = prefill or list(message.prompt_tokens)
                if message.HasField("token_id"):
                    tokens.append(message)
                if message.finish_reason:
                    final = message
            text = prefix + "".join(t.text for t in tokens) + (final.text if final else "")
            answer = {"generated_text": text, "details": _details(
                route, tokens, final, upstream, prefill, shape) if details else None}
            return JSONResponse([answer] if as_list else answer)
        first = await anext(events, None)  # an error before the first token is an HTTP error
        if first is None:
            raise Unavailable("the pool ended the stream without an answer; retry")
        return SSEResponse(self._events(route, upstream, first, events, prefix, shape))

    def _model(self, params: dict) -> str:
        source = params.get("adapter_source")
        if source not in (None, "hub"):
            raise InvalidArgument(f"adapter_source {source!r}: adapters come from the loraplex "
                                  "registry (push them with `loraplex adapters push`)")
        for field, allowed in _UNSUPPORTED.items():
            if params.get(field, allowed) != allowed:
                raise InvalidArgument(f"{field}: not supported")
        if params.get("best_of") not in (None, 1):
            raise InvalidArgument("best_of: not supported (unset, or 1)")
        adapter = params.get("adapter_id")
        if adapter:
            if not isinstance(adapter, str):
                raise InvalidArgument("adapter_id: must be a string")
            return adapter
        return self._frontend.only_model("adapter_id")

    async def _events(self, route: Route, upstream, first, events, prefix: str,
                      shape: "_Alternatives"):
        texts: list[str] = []
        tokens = 0
        try:
            message = first
            while message is not None:
                if message.HasField("token_id"):
                    tokens += 1
                    texts.append(message.text)
                    event = {"token": shape.token(message), "generated_text": None,
                             "details": None}
                    if shape.top_tokens:
                        event["top_tokens"] = shape.top(message)
                    yield _event(event)
                if message.finish_reason:
                    texts.append(message.text)
                    yield _event({"token": {"id": _last_id(route), "text": message.text,
                                            "logprob": 0.0, "special": not message.text},
                                  "generated_text": prefix + "".join(texts),
                                  "details": {"finish_reason": _finish(route, message, upstream,
                                                                       None),
                                              "prompt_tokens": len(upstream.token_ids.ids),
                                              "generated_tokens": tokens,
                                              "seed": _seed(upstream)}})
                message = await anext(events, None)
        except Exception as exc:  # noqa: BLE001 - an error after the first token is an event
            _, body = tgi_error(exc)
            yield _event(body)
        finally:
            await events.aclose()


def _event(payload: dict) -> bytes:
    return f"data:{json.dumps(payload)}\n\n".encode()


class _Alternatives:
    """Where a request wants each token's alternatives: TGI's top_tokens (top_n_tokens) or
    LoRAX's alternative_tokens (return_k_alternatives)."""

    def __init__(self, params: dict):
        self.top_tokens = params.get("top_n_tokens") is not None
        self.alternative_tokens = params.get("return_k_alternatives") is not None

    def token(self, message: scheduler_pb2.GenerateResponse) -> dict:
        token = {"id": message.token_id, "text": message.token_text, "logprob": message.logprob,
                 "special": False}
        if self.alternative_tokens:
            token["alternative_tokens"] = [
                {"id": t.token_id, "text": t.text, "logprob": t.logprob}
                for t in message.top_logprobs]
        return token

    @staticmethod
    def top(message: scheduler_pb2.GenerateResponse) -> list[dict]:
        return [{"id": t.token_id, "text": t.text, "logprob": t.logprob, "special": False}
                for t in message.top_logprobs]


def _last_id(route: Route) -> int:
    eos = route.model.answer.eos_token_ids
    return eos[0] if eos else 0


def _details(route: Route, tokens, final, upstream, prefill, shape: _Alternatives) -> dict:
    details = {"finish_reason": _finish(route, final, upstream, tokens[-1] if tokens else None),
               "prompt_tokens": len(upstream.token_ids.ids), "generated_tokens": len(tokens),
               "seed": _seed(upstream), "prefill": [
                   {"id": t.token_id, "text": t.text,
                    "logprob": t.logprob if t.HasField("logprob") else None} for t in prefill],
               "tokens": [shape.token(t) for t in tokens], "best_of_sequences": None}
    if shape.top_tokens:
        details["top_tokens"] = [shape.top(t) for t in tokens]
    return details


def _finish(route: Route, final, upstream, last) -> str:
    if final is None or final.finish_reason == scheduler_pb2.FINISH_REASON_LENGTH:
        return "length"
    eos = set(route.model.answer.eos_token_ids) | set(upstream.stop_token_ids)
    if last is not None and last.token_id in eos:
        return "eos_token"
    return "stop_sequence" if upstream.stop else "eos_token"


def _seed(upstream) -> int | None:
    if upstream.sampling.temperature == 0 or not upstream.sampling.HasField("seed"):
        return None
    return upstream.sampling.seed


def _sampling(params: dict) -> SamplingParams:
    """TGI's: greedy unless do_sample (or a temperature, top_k or top_p is set)."""
    sampled = _flag(params, "do_sample", False) or any(
        params.get(f) is not None for f in ("temperature", "top_k", "top_p"))
    temperature = params.get("temperature")
    if temperature is not None and (not isinstance(temperature, (int, float)) or isinstance(
            temperature, bool) or temperature <= 0):
        raise InvalidArgument(f"temperature: must be > 0, got {temperature!r}")
    seed = params.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
        raise InvalidArgument(f"seed: must be an integer >= 0, got {seed!r}")
    top_p = params.get("top_p")
    if top_p is not None and (not isinstance(top_p, (int, float)) or isinstance(top_p, bool)):
        raise InvalidArgument(f"top_p: must be a number in (0, 1], got {top_p!r}")
    top_n, k_alternatives = params.get("top_n_tokens"), params.get("return_k_alternatives")
    if top_n is not None and k_alternatives is not None:
        raise InvalidArgument("top_n_tokens: set it or return_k_alternatives, not both")
    sampling = SamplingParams(
        temperature=float(temperature or 1.0) if sampled else 0.0,
        top_k=_int(params, "top_k", 0, 1) if params.get("top_k") is not None else 0,
        top_p=1.0 if top_p is None else float(top_p),
        seed=None if seed is None else seed % MAX_SEED,
        repetition_penalty=_real(params, "repetition_penalty", 1.0),
        frequency_penalty=_real(params, "frequency_penalty", 0.0),
        top_logprobs=(top_n if k_alternatives is None else k_alternatives) or 0,
        prompt_logprobs=0 if _flag(params, "decoder_input_details", False) else None,
        grammar=_grammar(params.get("grammar")))
    try:
        return sampling.validate()
    except BadSampling as err:
        field = {"top_logprobs": "top_n_tokens" if k_alternatives is None
                 else "return_k_alternatives"}.get(err.field, err.field)
        raise InvalidArgument(f"{field}: {err.detail}") from None
    except InvalidArgument as err:  # (the grammar's: "sampling.grammar: ...")
        raise InvalidArgument(str(err).removeprefix("sampling.")) from None


def _grammar(spec) -> Grammar | None:
    """TGI's `grammar`: {"type": "json", "value": a JSON Schema (object or text)} or {"type":
    "regex", "value": a regular expression}."""
    if spec is None:
        return None
    kind = spec.get("type") if isinstance(spec, dict) else None
    value = spec.get("value") if isinstance(spec, dict) else None
    if kind == "json" and isinstance(value, (dict, str)):
        return Grammar(GrammarKind.JSON_SCHEMA,
                       value if isinstance(value, str) else json.dumps(value))
    if kind == "regex" and isinstance(value, str):
        return Grammar(GrammarKind.REGEX, value)
    raise InvalidArgument("grammar: must be {\"type\": \"json\", \"value\": a JSON Schema} or "
                          "{\"type\": \"regex\", \"value\": a regular expression}")


def _stops(params: dict) -> list[str]:
    stop = params.get("stop") or []
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise InvalidArgument("stop: must be a list of non-empty strings")
    if len(stop) > MAX_STOP:
        raise InvalidArgument(f"stop: at most {MAX_STOP} strings")
    return stop


def _real(params: dict, field: str, default: float) -> float:
    value = params.get(field)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"{field}: must be a number, got {value!r}")
    return float(value)


def _int(params: dict, field: str, default: int, low: int) -> int:
    value = params.get(field)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise InvalidArgument(f"{field}: must be an integer >= {low}, got {value!r}")
    return value


def _flag(params: dict, field: str, default: bool) -> bool:
    value = params.get(field, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidArgument(f"{field}: must be true or false, got {value!r}")
    return value


def tgi_error(exc: BaseException) -> tuple[int, dict]:
    """(HTTP status, {"error", "error_type"}): TGI's shape; validation errors are 422 as in
    TGI."""
    status, body, _ = error_body(exc)
    kind = _ERROR_TYPES.get(status, "generation")
    return (422 if status == 400 else status), {"error": body["error"]["message"],
                                                "error_type": kind}


def error_response(exc: BaseException) -> JSONResponse:
    status, body, headers = error_body(exc)
    kind = _ERROR_TYPES.get(status, "generation")
    return JSONResponse({"error": body["error"]["message"], "error_type": kind},
                        status_code=422 if status == 400 else status, headers=headers)
