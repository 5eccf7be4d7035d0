"""Adapter load latency: S3 -> store host tier -> executor slot, against a raw S3 GET of the bytes.

    .venv/bin/python bench/store_load.py [--quick]

A SeaweedFS S3 server, two adapter store processes on one S3 prefix (one with no host tier, so
every Fetch reads S3; one with a warm host tier), and an in-process AdapterLoader over a
random-weight model sized so that 1, 16 and 64 MiB fp32 adapters fit its slots. This process
plays the executor's: uvloop, and freed memory kept for reuse (common.allocator), as in
the store. Per size, measured in rounds, each round one rep of every kind in turn, so that
machine noise (two cores shared with S3 and the stores) falls on all of them alike:
- raw GET streamed: one GetObject of the adapter's bytes, its body taken as it arrives and kept
  (no checksum: a ranged answer, as the store gets, carries none);
- raw GET read(): the same through aiobotocore's read() of the whole body (the former baseline:
  it joins the body and checks S3's CRC32 on it);
- verified GET: the streamed GET with each piece hashed in a worker thread as it arrives and the
  sha256 compared at the end, in this process: the floor of any load that checks what it reads
  from S3 (the issue asks for that), before a byte leaves for an executor;
- S3 -> slot: LoadAdapter's path from the store without host tier: GETs streamed on as they
  arrive (hashed in the store on the way), gRPC chunks to the loader (written to staging and
  hashed as they come), parse + validation, copy into the slot;
- host hit -> slot: the same from the store that holds the adapter in RAM;
- host hit Fetch: the store's part alone (Fetch RPC of a cached adapter, all chunks received).
Before each rep, its untimed preparation (emptying the slot a load fills, a separate unload);
the reps follow each other without pause: on this VM an idle pause of 20 ms adds ~2 ms to the
next 1 MiB GET (CPU wake-up), as it would to anything measured after it. The bench's loaders send
no residency reports (BenchLoader): those go out after each load or unload, in the background,
and here would land in the next rep's time.
Ratios: p50 over p50, and the median of each round's S3 -> slot over its raw GET, against the
faster raw GET at each size (read() wins for small objects, streaming for large ones).
The full run writes bench/results/store-load-cpu.md (the table; the analysis there is by hand).
"""

import argparse
import asyncio
import concurrent.futures
import contextlib
import hashlib
import json
import pathlib
import statistics
import sys
import tempfile
import time
import uuid

import botocore.config
import safetensors.torch
import torch
import uvloop
from aiobotocore.session import get_session

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.adapter_pages import padded_pages, plan_pages  # noqa: E402
from common.adapter_ref import AdapterRef  # noqa: E402
from common.allocator import keep_freed_memory  # noqa: E402
from common.server import insecure_channel  # noqa: E402
from executor.adapter_loader import AdapterLoader  # noqa: E402
from executor.lora.slot_pool import page_geometry  # noqa: E402
from executor.model.config import ModelConfig  # noqa: E402
from executor.runner import ModelRunner  # noqa: E402
from loraplex import client  # noqa: E402
from loraplex.launch import start_service  # noqa: E402
from protos import adapter_store_pb2 as pb  # noqa: E402
from protos import adapter_store_pb2_grpc  # noqa: E402
from tests.s3server import ACCESS_KEY, SECRET_KEY, SeaweedS3  # noqa: E402

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
KINDS = ("raw", "raw_read", "verified", "cold", "warm", "hit")  # the order of the reps in a round


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


async def no_preparation() -> None:
    pass


@contextlib.asynccontextmanager
async def s3_client(s3: SeaweedS3):
    config = botocore.config.Config(s3={"addressing_style": "path"},
                                    response_checksum_validation="when_required")
    async with get_session().create_client(
            "s3", endpoint_url=s3.endpoint_url, region_name="us-east-1",
            aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
            config=config) as s3c:
        yield s3c


class BenchLoader(AdapterLoader):
    """An AdapterLoader that keeps its residency to itself (see the module docstring)."""

    async def report_residency(self) -> bool:
        return True


class SizeBench:
    """The five kinds of rep for one adapter: kind -> (untimed preparation, timed call)."""

    hasher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bench-sha256")

    def __init__(self, s3c, bucket: str, key: str, info, runner: ModelRunner,
                 cold_address: str, warm_address: str,
                 warm_stub: adapter_store_pb2_grpc.AdapterStoreStub, num_pages: int):
        self.s3c, self.bucket, self.key = s3c, bucket, key
        self.runner, self.num_pages = runner, num_pages
        self.name, self.version, self.sha256 = info.name, info.version, info.sha256
        self.warm_stub = warm_stub
        self.loaders = [BenchLoader(runner, (cold_address,), holder="bench-cold"),
                        BenchLoader(runner, (warm_address,), holder="bench-warm")]
        self.reps = {"raw": (no_preparation, self.raw_get),
                     "raw_read": (no_preparation, self.raw_get_read),
                     "verified": (no_preparation, self.verified_get),
                     "cold": self.loads(self.loaders[0]),
                     "warm": self.loads(self.loaders[1]),
                     "hit": (no_preparation, self.fetch_hit)}

    async def raw_get(self) -> None:
        response = await self.s3c.get_object(Bucket=self.bucket, Key=self.key)
        async with response["Body"] as body:
            parts = [chunk async for chunk in body.iter_chunks(1 << 20)]
        assert sum(map(len, parts)) == response["ContentLength"]

    async def raw_get_read(self) -> None:
        response = await self.s3c.get_object(Bucket=self.bucket, Key=self.key,
                                             ChecksumMode="ENABLED")
        async with response["Body"] as body:
            await body.read()

    async def verified_get(self) -> None:
        loop, digest, hashed = asyncio.get_running_loop(), hashlib.sha256(), []
        response = await self.s3c.get_object(Bucket=self.bucket, Key=self.key)
        async with response["Body"] as body:
            async for chunk in body.iter_chunks(1 << 20):
                hashed.append(loop.run_in_executor(self.hasher, digest.update, chunk))
        await asyncio.gather(*hashed)
        assert digest.hexdigest() == self.sha256

    def loads(self, loader: AdapterLoader) -> tuple:
        """(empty the slot the next load fills, load into it): the unload is not timed."""
        state = {"slot": 0}

        async def unload_next() -> None:
            state["slot"] ^= 1
            await loader.unload(state["slot"])

        async def load() -> None:
            pages = tuple(self.runner.free_blocks()[:self.num_pages])  # (the other slot's kept)
            result = await loader.load(AdapterRef(self.name, self.version), state["slot"], pages)
            assert not result.was_resident
        return unload_next, load

    async def fetch_hit(self) -> None:
        ref = AdapterRef(self.name, self.version)
        async for _ in self.warm_stub.Fetch(pb.FetchRequest(adapter=ref.to_pb())):
            pass

    async def run(self, reps: int) -> dict[str, list[float]]:
        """Seconds per rep of every kind, rounds interleaved, after one warm-up round."""
        times: dict[str, list[float]] = {kind: [] for kind in KINDS}
        for rep in range(reps + 1):
            for kind in KINDS[rep % len(KINDS):] + KINDS[:rep % len(KINDS)]:  # rotated
                prepare, call = self.reps[kind]
                await prepare()
                start = time.perf_counter()
                await call()
                if rep:
                    times[kind].append(time.perf_counter() - start)
        return times

    async def close(self) -> None:
        for loader in self.loaders:
            await loader.close()


async def run(quick: bool) -> list[tuple]:
    keep_freed_memory()
    work = pathlib.Path(tempfile.mkdtemp(prefix="loraplex-bench-"))
    rows = []
    with SeaweedS3.start() as s3:
        prefix = f"bench-{uuid.uuid4().hex[:8]}"
        common = ["--url", f"s3://{s3.bucket}/{prefix}", "--s3-endpoint-url", s3.endpoint_url]
        cold = start_service("store-cold", "adapter_store.service",
                             [*common, "--host-cache-mb", "0"], work / "logs")
        warm = start_service("store-warm", "adapter_store.service",
                             [*common, "--host-cache-mb", "1024"], work / "logs")
        pages = padded_pages(128, page_geometry(MODEL, 8))  # room for two adapters of any size
        runner = ModelRunner.random(MODEL, num_kv_blocks=2 * pages, block_size=8, num_slots=2,
                                    max_rank=128)
        try:
            async with s3_client(s3) as s3c, insecure_channel(warm.address) as channel:
                warm_stub = adapter_store_pb2_grpc.AdapterStoreStub(channel)
                for label, (targets, rank) in SIZES.items():
                    name = f"bench-{label.split()[0]}mib"
                    size = make_adapter(work / name, targets, rank)
                    info = await client.push_adapter(cold.address, work / name, name)
                    await warm_stub.Prewarm(pb.HostPrewarmRequest(name=name,
                                                                  version=info.version))
                    reps = 5 if quick else (40 if size < 32 << 20 else 20)
                    key = f"{prefix}/adapters/{name}/weights/{info.sha256}.safetensors"
                    num_pages = plan_pages(dict.fromkeys(targets, rank),
                                           runner.pool.geometry).num_pages
                    bench = SizeBench(s3c, s3.bucket, key, info, runner, cold.address,
                                      warm.address, warm_stub, num_pages)
                    try:
                        times = await bench.run(reps)
                    finally:
                        await bench.close()
                    rows.append((label, size, reps, times))
                    print(f"{label}: raw p50 {pct(times['raw'], .5) * 1e3:.1f} ms, S3->slot p50 "
                          f"{pct(times['cold'], .5) * 1e3:.1f} ms", flush=True)
        finally:
            for service in (cold, warm):
                service.stop(grace=2)
    return rows


def report(rows: list[tuple]) -> str:
    def ms(values: list[float]) -> str:
        return f"{pct(values, .5) * 1e3:.1f} / {pct(values, .99) * 1e3:.1f}"

    lines = [
        "# Adapter load latency, S3 -> slot (CPU)", "",
        "`bench/store_load.py` (see its docstring): SeaweedFS 4.48 on loopback, two store "
        "processes (no host tier / warm host tier), in-process executor loader (uvloop) over a "
        "random 8-layer hidden-1024 model, fp32 adapters, all on the same 2 cores. Milliseconds; "
        "p50 / p99 over the rounds after one warm-up round; the kinds of rep interleaved. The "
        "baseline of the ratios is the faster of the two raw GETs (by p50) at each size.", "",
        "| adapter | bytes | rounds | raw GET streamed p50 / p99 | raw GET read() p50 / p99 "
        "| verified GET p50 / p99 (ratio) | S3 -> slot p50 / p99 | ratio p50 "
        "| ratio, median of rounds | host hit -> slot p50 / p99 | host hit Fetch p50 / p99 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, size, reps, t in rows:
        raw = min(t["raw"], t["raw_read"], key=lambda values: pct(values, .5))
        paired = statistics.median(c / r for c, r in zip(t["cold"], raw, strict=True))
        lines.append(
            f"| {label} | {size:,} | {reps} | {ms(t['raw'])} | {ms(t['raw_read'])} | "
            f"{ms(t['verified'])} ({pct(t['verified'], .5) / pct(raw, .5):.2f}x) | "
            f"{ms(t['cold'])} | {pct(t['cold'], .5) / pct(raw, .5):.2f}x | {paired:.2f}x | "
            f"{ms(t['warm'])} | {ms(t['hit'])} |")
    throughput = statistics.mean(size / min(pct(t["raw"], .5), pct(t["raw_read"], .5))
                                 for _, size, _, t in rows) / 2**20
    lines += ["", f"Machine: {torch.get_num_threads()} torch threads; mean raw GET throughput "
              f"{throughput:.0f} MiB/s.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 rounds, no results file")
    args = parser.parse_args()
    table = report(uvloop.run(run(args.quick)))
    print(table)
    if not args.quick:
        RESULTS.write_text(table)
        print(f"wrote {RESULTS} (add the analysis by hand)")


if __name__ == "__main__":
    main()
