"""Client helpers for the CLI, the demo, benchmarks and tests: push adapters, stream generations."""

import asyncio
import contextlib
import json
import pathlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common import wire
from common.adapter_ref import AdapterRef
from common.base_fingerprint import base_fingerprint
from common.credentials import metadata
from common.server import insecure_channel
from protos import (
    adapter_store_pb2,
    adapter_store_pb2_grpc,
    common_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
)

PUSH_CHUNK_BYTES = 1 << 20
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt",
                "adapter_model.pth")


def version_metadata(training_dataset: str = "", eval_scores: dict[str, float] | None = None,
                     base_model_revision: str = "",
                     aliases: list[str] | None = None) -> adapter_store_pb2.VersionMetadata:
    return adapter_store_pb2.VersionMetadata(
        training_dataset=training_dataset, eval_scores=eval_scores or {},
        base_model_revision=base_model_revision, aliases=aliases or [])


def local_base_fingerprint(config_json: str) -> str:
    """The fingerprint (common/base_fingerprint.py) of the model in the local folder an
    adapter_config.json's base_model_name_or_path names on this machine; "" when it names no
    folder holding a config.json, or one without safetensors weights. ValueError when the
    folder's checkpoint cannot be read."""
    try:
        text = json.loads(config_json).get("base_model_name_or_path")
    except (ValueError, AttributeError, RecursionError):
        return ""  # the store names what is wrong with the config
    if not isinstance(text, str) or not text:
        return ""
    folder = pathlib.Path(text).expanduser()
    if not (folder / "config.json").is_file():
        return ""  # a hub id, or a path of another machine
    return base_fingerprint(folder) or ""


async def push_adapter(store: str, folder: str | pathlib.Path, name: str, tenant: str = "",
                       progress: Callable[[int, int], None] | None = None,
                       metadata: adapter_store_pb2.VersionMetadata | None = None,
                       key: str = "") -> common_pb2.AdapterInfo:
    """Upload a PEFT adapter folder to the store; returns the registered version. With a tenant
    `key` it belongs to that tenant; with an admin key to `tenant` ("" = public). When the
    adapter's base_model_name_or_path is a local model folder here, its fingerprint goes along,
    so the store can match the adapter to the registered base that folder holds."""
    folder = pathlib.Path(folder)
    if not folder.is_dir():
        raise NotAnAdapter(f"{folder}: no such folder: give a PEFT adapter's folder (what "
                           "save_pretrained wrote: adapter_config.json, adapter_model.safetensors)")
    if not (folder / "adapter_config.json").is_file():
        raise NotAnAdapter(f"{folder} is not a PEFT adapter folder: it has no "
                           "adapter_config.json (what save_pretrained writes beside "
                           "adapter_model.safetensors)")
    config_json = (folder / "adapter_config.json").read_text()
    weights = next((folder / f for f in WEIGHT_FILES if (folder / f).exists()), None)
    if weights is None:
        raise NotAnAdapter(f"{folder} has adapter_config.json but no weights: "
                           "adapter_model.safetensors (or a .bin) is missing")
    data = weights.read_bytes()
    header = adapter_store_pb2.PushHeader(
        name=name, owner_tenant=tenant, config_json=config_json, weights_filename=weights.name,
        num_bytes=len(data), metadata=metadata,
        base_fingerprint=await asyncio.to_thread(local_base_fingerprint, config_json))
    async with insecure_channel(store, key) as channel:
        return await push(adapter_store_pb2_grpc.AdapterStoreStub(channel), header, data,
                          progress=progress)


class NotAnAdapter(ValueError):
    """A folder given to push that holds no PEFT adapter."""


async def push(stub: adapter_store_pb2_grpc.AdapterStoreStub, header: adapter_store_pb2.PushHeader,
               data: bytes, chunk_bytes: int = PUSH_CHUNK_BYTES,
               progress: Callable[[int, int], None] | None = None) -> common_pb2.AdapterInfo:
    """One Push: the header, then (once the store accepted it) the weights in chunks.
    Waiting for the store's initial metadata before the chunks (see adapter_store.proto) means
    a refused header costs no upload, and its status arrives as the store sent it: a store that
    ends the call while a chunk is on its way makes gRPC report INTERNAL instead."""
    call = stub.Push()
    await call.write(adapter_store_pb2.PushRequest(header=header))
    accepted = wire.PUSH_ACCEPTED in tuple(await call.initial_metadata())
    with contextlib.suppress(asyncio.InvalidStateError):  # the store ended it: its status follows
        if accepted:  # (else the call ends with the store's refusal)
            for start in range(0, len(data), chunk_bytes):
                await call.write(adapter_store_pb2.PushRequest(
                    chunk=data[start:start + chunk_bytes]))
                if progress is not None:
                    progress(min(start + chunk_bytes, len(data)), len(data))
            await call.done_writing()
    return await call


async def store_call(store: str, method: str, request, key: str = "",
                     timeout_s: float = 60.0):
    """One unary AdapterStore RPC, e.g. store_call(addr, "SetAlias", SetAliasRequest(...)),
    presenting `key`, answered within `timeout_s`."""
    async with insecure_channel(store, key) as channel:
        stub = adapter_store_pb2_grpc.AdapterStoreStub(channel)
        return await getattr(stub, method)(request, timeout=timeout_s)


def ref_text(adapter: common_pb2.AdapterRef) -> str:
    """"name@version", or "" for an unset AdapterRef (the base model, an empty slot)."""
    ref = AdapterRef.from_optional_pb(adapter)
    return str(ref) if ref else ""


@dataclass
class Generation:
    """What one streamed Generate call produced, with client-side timings."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    usage: scheduler_pb2.Usage | None = None
    ttft_seconds: float = 0.0
    total_seconds: float = 0.0


def generate_request(adapter: str = "", prompt: str | list[int] = "",
                     max_new_tokens: int = wire.DEFAULT_MAX_NEW_TOKENS,
                     temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                     seed: int | None = None, stop: list[str] | None = None,
                     ignore_eos: bool = False,
                     cache_salt: str = "") -> scheduler_pb2.GenerateRequest:
    req = scheduler_pb2.GenerateRequest(
        adapter=adapter, max_new_tokens=max_new_tokens, stop=stop or [], ignore_eos=ignore_eos,
        cache_salt=cache_salt,
        sampling=common_pb2.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                           seed=seed))
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


async def stream(stub: scheduler_pb2_grpc.SchedulerStub, request: scheduler_pb2.GenerateRequest,
                 api_key: str = "") -> AsyncIterator[scheduler_pb2.GenerateResponse]:
    async for response in stub.Generate(request, metadata=metadata(api_key)):
        yield response


async def generate(stub: scheduler_pb2_grpc.SchedulerStub, request: scheduler_pb2.GenerateRequest,
                   api_key: str = "") -> Generation:
    """Run one Generate to the end and collect it."""
    out, start = Generation(), time.perf_counter()
    async for response in stream(stub, request, api_key):
        if response.HasField("token_id"):
            if not out.token_ids:
                out.ttft_seconds = time.perf_counter() - start
            out.token_ids.append(response.token_id)
            out.text += response.text
        if response.finish_reason:
            out.finish_reason = scheduler_pb2.FinishReason.Name(response.finish_reason)
            out.usage = response.usage
    out.total_seconds = time.perf_counter() - start
    return out


def token_json(response: scheduler_pb2.GenerateResponse) -> str:
    """One JSON object per streamed message, for `loraplex generate --json`."""
    obj: dict = {}
    if response.HasField("token_id"):
        obj.update(token_id=response.token_id, text=response.text,
                   logprob=round(response.logprob, 6))
    if response.finish_reason:
        u = response.usage
        obj.update(finish_reason=scheduler_pb2.FinishReason.Name(response.finish_reason).lower()
                   .removeprefix("finish_reason_"),
                   usage=dict(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                              queue_seconds=round(u.queue_seconds, 4),
                              time_to_first_token_seconds=round(u.time_to_first_token_seconds, 4),
                              adapter=ref_text(u.adapter)))
    return json.dumps(obj)


async def wait_until_serving(address: str, timeout_s: float) -> bool:
    """Whether the service at `address` reports SERVING (its health check) within `timeout_s`:
    a command run right after `loraplex up &` waits for the services to come up."""
    deadline = time.monotonic() + timeout_s
    async with insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            left = deadline - time.monotonic()
            try:
                answer = await stub.Check(health_pb2.HealthCheckRequest(),
                                          timeout=max(0.1, min(1.0, left)))
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.aio.AioRpcError:
                pass  # not listening yet, or warming up
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
