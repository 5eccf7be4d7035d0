"""Push through the real RPC: every bad input refused with INVALID_ARGUMENT naming what is wrong,
the header-accepted handshake (a refused header costs no upload and keeps its status), the
in-flight byte budget, stalled streams dropped, and a stream that must match its header."""

import asyncio
import dataclasses
import io
import json
import pickle

import grpc
import pytest
import safetensors.torch
import torch

from common import wire
from loraplex import client
from protos import adapter_store_pb2 as pb
from tests.store.helpers import (
    WEIGHTS,
    Store,
    expect_error,
    file_config,
    in_session_loop,
    lora_config,
    lora_tensors,
    make_adapter,
)


def _with_header(header: dict, data_section: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data_section


def _torch_save_bytes() -> bytes:
    buffer = io.BytesIO()
    torch.save(lora_tensors(), buffer)
    return buffer.getvalue()


def _drop(name: str) -> bytes:
    tensors = lora_tensors()
    del tensors[name]
    return safetensors.torch.save(tensors)


def _nan() -> bytes:
    tensors = lora_tensors()
    tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"][3, 2] = float("nan")
    return safetensors.torch.save(tensors)


GOOD_CONFIG, GOOD = make_adapter()
V_B1 = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
BAD_INPUTS = {
    # case: (name, filename, config_json, data, words the message must contain)
    "pickle-filename": ("a", "adapter_model.bin", GOOD_CONFIG, _torch_save_bytes(),
                        ["only safetensors"]),
    "torch-save-content": ("a", WEIGHTS, GOOD_CONFIG, _torch_save_bytes(), ["only safetensors"]),
    "pickle-content": ("a", WEIGHTS, GOOD_CONFIG, pickle.dumps({"x": 1}, protocol=4),
                       ["only safetensors"]),
    "truncated-data": ("a", WEIGHTS, GOOD_CONFIG, GOOD[:-100], ["truncated", V_B1]),
    "truncated-header": ("a", WEIGHTS, GOOD_CONFIG, GOOD[:50], ["header length", "truncated"]),
    "header-length-too-big": ("a", WEIGHTS, GOOD_CONFIG, (2**40).to_bytes(8, "little") + GOOD[8:],
                              ["header length", "limit"]),
    "header-not-json": ("a", WEIGHTS, GOOD_CONFIG, (4).to_bytes(8, "little") + b"{{{{",
                        ["header is not valid"]),
    "unknown-dtype": ("a", WEIGHTS, GOOD_CONFIG, _with_header(
        {"t": {"dtype": "F17", "shape": [1], "data_offsets": [0, 4]}}, bytes(4)),
        ["'t'", "unknown dtype"]),
    "overlap": ("a", WEIGHTS, GOOD_CONFIG, _with_header(
        {"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
         "u": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8)), ["overlaps"]),
    "config-not-json": ("a", WEIGHTS, "{r: 8", GOOD, ["adapter_config.json", "not valid JSON"]),
    "unknown-target-module": ("a", WEIGHTS, lora_config(targets=("q_proj", "lm_head")), GOOD,
                              ["'lm_head'", "not supported"]),
    "no-base-model": ("a", WEIGHTS, lora_config(base_model_name_or_path=""), GOOD,
                      ["base_model_name_or_path"]),
    "zero-rank": ("a", WEIGHTS, lora_config(rank=0), GOOD, ["r must be a positive integer"]),
    "missing-B": ("a", WEIGHTS, GOOD_CONFIG, _drop(V_B1),
                  ["model.layers.1.self_attn.v_proj", "no lora_B"]),
    "rank-mismatch": ("a", WEIGHTS, lora_config(rank=4), GOOD, ["rank 8 differs from 4"]),
    "untargeted-tensor": ("a", WEIGHTS, lora_config(targets=("q_proj",)), GOOD,
                          ["v_proj", "target_modules ['q_proj'] does not name"]),
    "not-a-lora-key": ("a", WEIGHTS, GOOD_CONFIG, safetensors.torch.save(
        {**lora_tensors(), "lm_head.weight": torch.zeros(4, 4)}), ["'lm_head.weight'"]),
    "nan": ("a", WEIGHTS, GOOD_CONFIG, _nan(), [V_B1, "NaN"]),
    "bad-name-slash": ("a/b", WEIGHTS, GOOD_CONFIG, GOOD, ["adapter name 'a/b' is invalid"]),
    "bad-name-empty": ("", WEIGHTS, GOOD_CONFIG, GOOD, ["adapter name '' is invalid"]),
    "bad-name-long": ("x" * 129, WEIGHTS, GOOD_CONFIG, GOOD, ["is invalid", "1-128"]),
    "bad-name-dotdot": ("..", WEIGHTS, GOOD_CONFIG, GOOD, ["is invalid"]),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
@in_session_loop
async def test_bad_push_is_invalid_argument(file_store, case):
    name, filename, config_json, data, words = BAD_INPUTS[case]
    details = await expect_error(grpc.StatusCode.INVALID_ARGUMENT, file_store.push(
        name, config_json, data, filename=filename))
    for word in words:
        assert word in details


@in_session_loop
async def test_a_refused_header_costs_no_upload_and_keeps_its_status(file_store):
    """The client sends chunks only after the store's header-accepted metadata: a refused header
    comes back as INVALID_ARGUMENT every time (a chunk in flight would turn it into INTERNAL)."""
    for name in ("a/b", "ok"):
        sent: list[int] = []
        header = pb.PushHeader(name=name, config_json=GOOD_CONFIG, weights_filename=WEIGHTS,
                               num_bytes=len(GOOD))
        pushing = client.push(file_store.stub, header, GOOD, chunk_bytes=1000,
                              progress=lambda done, total: sent.append(done))
        if name == "a/b":
            assert "is invalid" in await expect_error(grpc.StatusCode.INVALID_ARGUMENT, pushing)
            assert sent == []
        else:
            assert (await pushing).version == 1 and sent[-1] == len(GOOD) and len(sent) > 1
    # The name's owner and the rank limit are read from the header too: not a byte is sent.
    too_high = json.dumps({**json.loads(GOOD_CONFIG), "r": 100_000})
    for owner, config_json, code, words in (
            ("bob", GOOD_CONFIG, grpc.StatusCode.ALREADY_EXISTS, "taken by another owner"),
            ("", too_high, grpc.StatusCode.INVALID_ARGUMENT, "exceeds this store's maximum")):
        sent = []
        header = pb.PushHeader(name="ok", owner_tenant=owner, config_json=config_json,
                               weights_filename=WEIGHTS, num_bytes=len(GOOD))
        pushing = client.push(file_store.stub, header, GOOD, chunk_bytes=1000,
                              progress=lambda done, total: sent.append(done))
        assert words in await expect_error(code, pushing) and sent == []


@in_session_loop
async def test_pushes_in_flight_are_bounded_in_bytes(tmp_path):
    """Each push is held in RAM until registered: past twice max_adapter_bytes of pushes being
    received, a new one is RESOURCE_EXHAUSTED at its header; the budget frees as pushes end."""
    limit = len(GOOD) + 1000
    store = await Store(dataclasses.replace(file_config(tmp_path), max_adapter_bytes=limit)).start()
    try:
        def header(name: str) -> pb.PushHeader:
            return pb.PushHeader(name=name, config_json=GOOD_CONFIG, weights_filename=WEIGHTS,
                                 num_bytes=len(GOOD))
        slow = []
        for name in ("slow-1", "slow-2"):  # accepted, then they send nothing yet
            call = store.stub.Push()
            await call.write(pb.PushRequest(header=header(name)))
            assert wire.PUSH_ACCEPTED in tuple(await call.initial_metadata())
            slow.append(call)
        details = await expect_error(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                     client.push(store.stub, header("third"), GOOD))
        assert "budget for pushes in flight" in details
        await slow[0].write(pb.PushRequest(chunk=GOOD))
        await slow[0].done_writing()
        assert (await slow[0]).version == 1  # a finished push frees its share
        slow[1].cancel()  # and so does a client that goes away: then two fit at once again
        for _ in range(200):
            pair = [store.stub.Push() for _ in range(2)]
            for call, name in zip(pair, ("third", "fourth")):
                await call.write(pb.PushRequest(header=header(name)))
            accepted = [wire.PUSH_ACCEPTED in tuple(await c.initial_metadata()) for c in pair]
            if all(accepted):
                break
            for call in pair:
                call.cancel()
            await asyncio.sleep(0.05)  # the store may not have seen the cancel yet
        assert all(accepted), "the cancelled push's share was never freed"
        for call in pair:
            await call.write(pb.PushRequest(chunk=GOOD))
            await call.done_writing()
            assert (await call).version == 1
    finally:
        await store.stop()


@in_session_loop
async def test_a_stalled_push_is_dropped_and_frees_its_share(tmp_path):
    config = dataclasses.replace(file_config(tmp_path), max_adapter_bytes=len(GOOD),
                                 push_idle_s=0.3)  # the budget: two pushes of GOOD
    store = await Store(config).start()
    try:
        header = pb.PushHeader(name="stalled", config_json=GOOD_CONFIG, weights_filename=WEIGHTS,
                               num_bytes=len(GOOD))
        stalled = await accepted_pushes(store, header)  # then nothing
        await dropped(stalled, "sent nothing for 0.3 s")
        assert (await client.push(store.stub, header, GOOD)).version == 1
    finally:
        await store.stop()


@in_session_loop
async def test_a_push_that_trickles_is_dropped_and_frees_its_share(tmp_path):
    """A byte before each idle limit, for ever: bounded in all by the slowest rate allowed."""
    config = dataclasses.replace(file_config(tmp_path), max_adapter_bytes=len(GOOD),
                                 push_idle_s=0.5, push_min_bytes_per_s=len(GOOD) / 0.5)
    store = await Store(config).start()
    try:
        header = pb.PushHeader(name="slow", config_json=GOOD_CONFIG, weights_filename=WEIGHTS,
                               num_bytes=len(GOOD))
        slow = await accepted_pushes(store, header)
        for sent in range(100):  # 20 s at most
            try:
                for call in slow:
                    await call.write(pb.PushRequest(chunk=GOOD[sent:sent + 1]))
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
                break
            await asyncio.sleep(0.2)
        await dropped(slow, "slower than")
        assert (await client.push(store.stub, header, GOOD)).version == 1
    finally:
        await store.stop()


async def accepted_pushes(store, header: pb.PushHeader) -> list:
    """Two pushes of `header`, accepted: between them they hold the store's whole budget."""
    calls = [store.stub.Push() for _ in range(2)]
    for call in calls:
        await call.write(pb.PushRequest(header=header))
        assert wire.PUSH_ACCEPTED in tuple(await call.initial_metadata())
    return calls


async def dropped(calls: list, words: str) -> None:
    """Each of `calls` ended UNAVAILABLE saying `words`."""
    for call in calls:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE and words in info.value.details()


@in_session_loop
async def test_push_stream_must_match_its_header(file_store):
    short = await expect_error(grpc.StatusCode.INVALID_ARGUMENT, file_store.push(
        "a", GOOD_CONFIG, GOOD, num_bytes=len(GOOD) + 10))
    assert f"carried {len(GOOD)} bytes" in short
    long = await expect_error(grpc.StatusCode.INVALID_ARGUMENT, file_store.push(
        "a", GOOD_CONFIG, GOOD, num_bytes=len(GOOD) - 10))
    assert "more than" in long
    huge = await expect_error(grpc.StatusCode.INVALID_ARGUMENT, file_store.push(
        "a", GOOD_CONFIG, b"", num_bytes=3 * 1024**3))
    assert "push limit" in huge

    async def chunk_first():
        yield pb.PushRequest(chunk=b"x")
    first = await expect_error(grpc.StatusCode.INVALID_ARGUMENT,
                               file_store.stub.Push(chunk_first()))
    assert "header" in first
    listed = await file_store.stub.ListAdapters(pb.ListAdaptersRequest())
    assert not listed.adapters  # nothing half-stored
