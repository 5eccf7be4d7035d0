"""Adapter load latency: S3 -> store host tier -> executor slot, against a raw S3 GET of the bytes.

    .venv/bin/python bench/store_load.py [--quick]

A SeaweedFS S3 server, two adapter store processes on one S3 prefix (one with no host tier, so
every Fetch reads S3; one with a warm host tier), and an in-process AdapterLoader over a
random-weight model sized so that 1, 16 and 64 MiB fp32 adapters fit its slots. Per size:
- raw S3 GET: one GetObject of the adapter's bytes (aiobotocore, whole body), the baseline;
- S3 -> slot: LoadAdapter path from a cold store: parallel ranged GETs streamed on as they
  arrive (hashed in the store on the way), gRPC chunks to the loader (written to staging and
  hashed on arrival), parse + validation, copy into the slot (emptying the slot beforehand, a
  separate unload, is not timed);
- host hit -> slot: the same from a store that holds the adapter in RAM;
- host hit Fetch: the store's part alone (Fetch RPC of a cached adapter, all chunks received).
The full run writes bench/results/store-load-cpu.md.
"""

import argparse
import asyncio
import json
import pathlib
import statistics
import sys
import tempfile
import time
import uuid

import safetensors.torch
import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from adapter_store.config import StoreConfig  # noqa: E402
from adapter_store.s3_blobs import S3BlobStore  # noqa: E402
from executor.adapter_loader import AdapterLoader  # noqa: E402
from executor.model_config import ModelConfig  # noqa: E402
from executor.runner import ModelRunner  # noqa: E402
from loraplex import client  # noqa: E402
from loraplex.launch import start_service  # noqa: E402
from loraplex.server import insecure_channel  # noqa: E402
from protos import adapter_store_pb2 as pb  # noqa: E402
from protos import adapter_store_pb2_grpc  # noqa: E402
from tests.s3server import SeaweedS3  # noqa: E402

RESULTS = REPO / "bench" / "results" / "store-load-cpu.md"
MODEL = ModelConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                    num_attention_heads=8, num_key_value_heads=8, vocab_size=1024,
                    model_id="bench-llama")
MODULES = {"q_proj": ("self_attn", 1024, 1024), "k_proj": ("self_attn", 1024, 1024),
           "v_proj": ("self_attn", 1024, 1024), "o_proj": ("self_attn", 1024, 1024),
           "gate_proj": ("mlp", 1024, 2816), "up_proj": ("mlp", 1024, 2816),
           "down_proj": ("mlp", 2816, 1024)}
# size label -> (targets, rank): fp32 bytes = 4 * rank * sum(in + out) * layers
SIZES = {"1 MiB": (("q_proj", "v_proj"), 8), "16 MiB": (tuple(MODULES), 27),
         "64 MiB": (tuple(MODULES), 106)}


def make_adapter(folder: pathlib.Path, targets: tuple[str, ...], rank: int) -> int:
    gen = torch.Generator().manual_seed(rank)
    tensors = {}
    for layer in range(MODEL.num_hidden_layers):
        for module in targets:
            block, d_in, d_out = MODULES[module]
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, d_in, generator=gen) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(d_out, rank, generator=gen) * 0.01
    folder.mkdir(parents=True)
    safetensors.torch.save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets),
        "base_model_name_or_path": MODEL.model_id}))
    return (folder / "adapter_model.safetensors").stat().st_size


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def measure(reps: int, fn, prepare=None) -> list[float]:
    """Seconds of `fn` per rep, after one warm-up (connections, allocator); `prepare` runs
    untimed before each call."""
    times = []
    for rep in range(reps + 1):
        if prepare is not None:
            await prepare()
        start = time.perf_counter()
        await fn()
        if rep:
            times.append(time.perf_counter() - start)
    return times


async def run(quick: bool) -> str:
    work = pathlib.Path(tempfile.mkdtemp(prefix="loraplex-bench-"))
    rows = []
    with SeaweedS3.start() as s3:
        url = f"s3://{s3.bucket}/bench-{uuid.uuid4().hex[:8]}"
        common = ["--url", url, "--s3-endpoint-url", s3.endpoint_url]
        cold = start_service("store-cold", "adapter_store.service",
                             [*common, "--host-cache-mb", "0"], work / "logs")
        warm = start_service("store-warm", "adapter_store.service",
                             [*common, "--host-cache-mb", "1024"], work / "logs")
        blobs = await S3BlobStore.open(StoreConfig(url=url, s3_endpoint_url=s3.endpoint_url))
        runner = ModelRunner.random(MODEL, num_kv_blocks=8, block_size=8, num_slots=2,
                                    max_rank=128)
        try:
            for label, (targets, rank) in SIZES.items():
                name = f"bench-{label.split()[0]}mib"
                size = make_adapter(work / name, targets, rank)
                info = await client.push_adapter(cold.address, work / name, name)
                reps = 5 if quick else (30 if size < 32 << 20 else 15)
                key = f"adapters/{name}/weights/{info.sha256}.safetensors"

                async def raw_get() -> None:
                    response = await blobs._client.get_object(Bucket=s3.bucket,
                                                              Key=blobs._prefix + key)
                    async with response["Body"] as body:
                        await body.read()

                def load_via(address: str) -> tuple:
                    """(load, empty the slot it loads next): the unload is not timed."""
                    loader = AdapterLoader(runner, (address,), holder=f"bench-{address}")
                    state = {"slot": 0}

                    async def unload_next() -> None:
                        state["slot"] ^= 1
                        await loader.unload(state["slot"])

                    async def load() -> None:
                        result = await loader.load(name, info.version, state["slot"])
                        assert not result.was_resident
                    return load, unload_next

                async with insecure_channel(warm.address) as channel:
                    stub = adapter_store_pb2_grpc.AdapterStoreStub(channel)
                    await stub.Prewarm(pb.HostPrewarmRequest(name=name, version=info.version))

                    async def fetch_hit() -> None:
                        async for _ in stub.Fetch(pb.FetchRequest(name=name,
                                                                  version=info.version)):
                            pass

                    raw = await measure(reps, raw_get)
                    cold_load = await measure(reps, *load_via(cold.address))
                    warm_load = await measure(reps, *load_via(warm.address))
                    hit = await measure(reps, fetch_hit)
                rows.append((label, size, reps, raw, cold_load, warm_load, hit))
                print(f"{label}: raw p50 {pct(raw, .5) * 1e3:.1f} ms, S3->slot p50 "
                      f"{pct(cold_load, .5) * 1e3:.1f} ms", flush=True)
        finally:
            await blobs.close()
            for service in (cold, warm):
                service.stop(grace=2)
    return report(rows)


def report(rows) -> str:
    ms = lambda v: f"{v * 1e3:.1f}"  # noqa: E731
    lines = [
        "# Adapter load latency, S3 -> slot (CPU)", "",
        "`bench/store_load.py`: SeaweedFS 4.48 on loopback, two store processes (no host tier / "
        "warm host tier), in-process executor loader over a random 8-layer hidden-1024 model, "
        "fp32 adapters. Milliseconds; p50 / p99 over the reps after one warm-up.", "",
        "| adapter | bytes | reps | raw S3 GET p50 / p99 | S3 -> slot p50 / p99 | ratio p50 "
        "| host hit -> slot p50 / p99 | host hit Fetch p50 / p99 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for label, size, reps, raw, cold, warm, hit in rows:
        lines.append(
            f"| {label} | {size:,} | {reps} | {ms(pct(raw, .5))} / {ms(pct(raw, .99))} | "
            f"{ms(pct(cold, .5))} / {ms(pct(cold, .99))} | "
            f"{pct(cold, .5) / pct(raw, .5):.2f}x | {ms(pct(warm, .5))} / {ms(pct(warm, .99))} | "
            f"{ms(pct(hit, .5))} / {ms(pct(hit, .99))} |")
    throughput = statistics.mean(r[1] / pct(r[3], .5) for r in rows) / 2**20
    lines += ["", f"Machine: {torch.get_num_threads()} torch threads; "
              f"mean raw GET throughput {throughput:.0f} MiB/s.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 reps, no results file")
    args = parser.parse_args()
    table = asyncio.run(run(args.quick))
    print(table)
    if not args.quick:
        RESULTS.write_text(table)
        print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
