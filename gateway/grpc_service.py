"""The gateway's gRPC face: the scheduler's Generate contract (scheduler.proto), so a client moves
from a pool's scheduler to the gateway by changing the address only. `adapter` names an adapter,
or a base model id (a pool's), or is empty for the base model of a gateway with one pool. The
admin and Stats RPCs stay with each pool's scheduler."""

import contextlib

import grpc

from common import wire
from common.adapter_ref import AdapterRef
from common.credentials import bearer
from common.errors import InvalidArgument, WriteBound, grpc_errors
from common.generate_pb import max_new_tokens
from common.request_ids import REQUEST_ID_KEY, checked_request_id
from gateway.frontend import CLIENT_WRITE_S, Frontend, Route
from protos import scheduler_pb2, scheduler_pb2_grpc


class GatewayServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, frontend: Frontend):
        self._frontend = frontend

    async def Generate(self, request, context):
        async with grpc_errors(context):
            try:
                metadata = context.invocation_metadata() or ()
                tenant = self._frontend.tenant(bearer(metadata),
                                               dict(metadata).get(wire.ON_BEHALF_OF, ""))
                route = await self._frontend.route(self._model(request), tenant)
                upstream = await self._upstream(route, request,
                                                dict(metadata).get(REQUEST_ID_KEY, ""))
                self._frontend.admit(tenant,
                                     len(upstream.token_ids.ids) + upstream.max_new_tokens)
                # (closed, its request cancelled at the pool, before the call's status is sent)
                async with contextlib.aclosing(self._frontend.generate(
                        route, upstream, tenant, context.time_remaining())) as messages:
                    with WriteBound(CLIENT_WRITE_S) as bound:
                        async for message in messages:
                            await bound.write(context, message)
            except Exception as exc:
                self._frontend.metrics.finished("grpc", exc)
                raise
            self._frontend.metrics.finished("grpc")

    def _model(self, request: scheduler_pb2.GenerateRequest) -> str | AdapterRef:
        """What the request asks for: its adapter (a reference, or the exact adapter_ref), a
        base model id, or the one base model this gateway serves."""
        if request.HasField("adapter_ref"):
            if request.adapter:
                raise InvalidArgument("set adapter or adapter_ref, not both")
            return AdapterRef.from_pb(request.adapter_ref)
        return request.adapter or self._frontend.only_model("adapter")

    async def _upstream(self, route: Route, request: scheduler_pb2.GenerateRequest,
                        metadata_id: str) -> scheduler_pb2.GenerateRequest:
        """The request as the pool's scheduler gets it: token ids, max_new_tokens, the exact
        adapter, and its id (the request's own, else its x-request-id metadata, else a new
        one)."""
        kind = request.WhichOneof("prompt")
        max_new = max_new_tokens(request)
        ids = await route.model.prompts.ids(request.text if kind == "text" else None,
                                            request.token_ids.ids if kind == "token_ids" else None,
                                            max_new)
        upstream = scheduler_pb2.GenerateRequest()
        upstream.CopyFrom(request)
        upstream.ClearField("adapter")
        upstream.ClearField("adapter_ref")
        if route.adapter_ref is not None:
            upstream.adapter_ref.CopyFrom(route.adapter_ref)
        upstream.token_ids.ids[:] = ids
        upstream.max_new_tokens = max_new
        upstream.request_id = checked_request_id(request.request_id or metadata_id)
        return upstream

    async def Stats(self, request, context):
        await _with_the_pool(context)

    async def Prewarm(self, request, context):
        await _with_the_pool(context)

    async def Evict(self, request, context):
        await _with_the_pool(context)

    async def Drain(self, request, context):
        await _with_the_pool(context)

    async def Resume(self, request, context):
        await _with_the_pool(context)

    async def Model(self, request, context):
        await _with_the_pool(context)


async def _with_the_pool(context) -> None:
    await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                        "admin RPCs, Stats and Model go to a pool's scheduler, not the gateway")
