"""Receiving a Push stream: its header, checked before any byte is invited, then its chunks,
every wait bounded (the gap between two messages, and the whole upload at a minimum rate)."""

import asyncio
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from adapter_store.messages import meta_from_pb
from adapter_store.records import VersionMeta
from common.adapter_ref import check_name
from common.base_fingerprint import check_fingerprint
from common.errors import InvalidArgument, Unavailable
from common.peft.config import parse_config
from common.peft.safetensors_header import WEIGHTS_FILE, check_weights_file
from protos import adapter_store_pb2 as pb


async def receive_push(
    requests: AsyncIterator[pb.PushRequest], accepted: Callable[[pb.PushHeader], Awaitable[None]],
    max_bytes: int, idle_s: float, min_bytes_per_s: float,
) -> tuple[pb.PushHeader, VersionMeta, list[str], bytes]:
    """The header, its checked metadata (and the aliases to set) and the weights of a Push
    stream, checked against the header's num_bytes. `accepted(header)` is awaited once the header
    passed its checks, before any chunk is read (it may still refuse the push by raising).
    UNAVAILABLE when `idle_s` pass without a message, or the upload takes longer than `idle_s`
    plus its bytes at `min_bytes_per_s`."""
    header, meta, aliases, data = None, VersionMeta(), [], bytearray()
    deadline = math.inf
    async for request in _with_idle_limit(requests, idle_s):
        if time.monotonic() > deadline:
            raise Unavailable(f"the Push stream is slower than {min_bytes_per_s:g} bytes/s "
                              f"({len(data)} of {header.num_bytes} bytes in the time that "
                              "allows); the upload was dropped, push again")
        kind = request.WhichOneof("payload")
        if header is None:
            if kind != "header":
                raise InvalidArgument("the first Push message must carry the header")
            header = request.header
            # Refuse what would fail anyway before receiving the bytes.
            check_name(header.name)
            check_fingerprint(header.base_fingerprint, "base_fingerprint")
            meta, aliases = meta_from_pb(header.metadata)
            if header.weights_filename != WEIGHTS_FILE:
                check_weights_file(header.weights_filename, b"")
            if header.num_bytes > max_bytes:
                raise InvalidArgument(f"adapter of {header.num_bytes} bytes exceeds the "
                                      f"{max_bytes}-byte push limit")
            # Its size bound, DoRA, lm_head/embed_tokens targets, modules_to_save: all refused
            # before any upload (the whole check of config against weights comes after it).
            parse_config(header.config_json)
            await accepted(header)
            deadline = time.monotonic() + idle_s + header.num_bytes / min_bytes_per_s
        elif kind == "chunk":
            if len(data) + len(request.chunk) > header.num_bytes:
                raise InvalidArgument(f"the Push stream carries more than the {header.num_bytes} "
                                      "bytes its header announced")
            data += request.chunk
        else:
            raise InvalidArgument("a Push stream carries one header, then only chunks")
    if header is None:
        raise InvalidArgument("empty Push stream: send the header first")
    if len(data) != header.num_bytes:
        raise InvalidArgument(f"the Push stream carried {len(data)} bytes but its header announced "
                              f"{header.num_bytes} (interrupted upload?)")
    return header, meta, aliases, bytes(data)


async def _with_idle_limit(messages: AsyncIterator, idle_s: float) -> AsyncIterator:
    iterator = aiter(messages)
    while True:
        try:
            async with asyncio.timeout(idle_s):
                message = await anext(iterator)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise Unavailable(f"the Push stream sent nothing for {idle_s:g} s; the upload was "
                              "dropped, push again") from None
        yield message
