"""Executor configuration: one frozen dataclass, validated at construction."""

import argparse
from dataclasses import dataclass

from common.credentials import KeySources, add_key_arguments, sources_from_args
from common.help_format import HelpFormatter

DTYPES = ("float32", "bfloat16", "float16")
LORA_BACKENDS = ("auto", "triton", "torch")  # auto: triton on CUDA, torch elsewhere
# A store's Fetch that sends no next message this long after the one before is stalled (a frozen
# replica): the next replica is tried. Sized as a store chunk (1 MiB by default) at a floor of
# 256 KiB/s, plus a second for the first byte of a cold read from S3.
FETCH_CHUNK_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ExecutorConfig:
    model: str  # HF model directory, or "random:<named config>" (e.g. random:llama-3-8b)
    stores: tuple[str, ...]  # adapter store addresses, tried in order
    address: str = "127.0.0.1:0"
    metrics_port: int = 0  # Prometheus endpoint; 0 = off
    grace_s: float = 30.0  # on SIGTERM: how long in-flight work may take to finish
    # What adapters' base_model must say. "" = the id a store registered the model folder's
    # fingerprint under (asked at start), else the config's _name_or_path or the folder's name.
    model_id: str = ""
    # At start: how long the stores together may take to say which registered base the model's
    # fingerprint is; past it (or while they are down) the folder's own name is kept.
    resolve_base_s: float = 5.0
    # A fetch from a store that stalls mid-stream this long (no next chunk) fails over to the next
    # store, from byte 0: a frozen store replica costs a load this, not the load's deadline.
    fetch_chunk_timeout_s: float = FETCH_CHUNK_TIMEOUT_S
    num_kv_blocks: int = 512  # KV memory, in blocks of every layer
    block_size: int = 16
    # Sliding-window layers keep KV of their own, only for their window (common/kv_layout.py);
    # off: every layer keeps the whole context in one table.
    window_blocks: bool = True
    # On CUDA, decode steps replay CUDA graphs, checked against the eager forward at start
    # (executor/decode_graphs.py); off: every step runs eagerly.
    cuda_graphs: bool = True
    adapter_slots: int = 8
    max_rank: int = 32
    lora_backend: str = "auto"
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0  # random-weights seed
    threads: int = 0  # torch intra-op threads on CPU; 0 = torch's default
    # Host memory for adapters staged ahead of their load (StageAdapter): pinned on CUDA.
    staging_mb: int = 1024
    # BENCHMARK MODE (executor/benchmark_runner.py): > 0 skips the forward pass; each step
    # returns deterministic tokens and lasts this long. Only with random weights.
    benchmark_step_s: float = 0.0
    # A Step stream that sends nothing this long ends (its scheduler probes an idle executor every
    # 2 s): a scheduler whose event loop hangs (it still answers keepalive pings) cannot hold the
    # executor, and the scheduler that replaces it can connect.
    step_idle_s: float = 60.0
    # Ranks (GPUs) the executor spans, with tensor parallelism (executor/tp/rank_group.py); 1: one
    # process on one device.
    tensor_parallel: int = 1
    # A rank of the group that does not meet a collective, or answer rank 0, this long is taken
    # as dead or frozen: the group restarts as one (its Step stream ends; the scheduler fails
    # over). Long enough for a rank's kernels to compile while the others wait.
    rank_timeout_s: float = 60.0
    # Where the service key is read (and admin keys, for operators' debugging): files or
    # LORAPLEX_* env. None: the executor runs open (common/credentials.py).
    keys: KeySources = KeySources()

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("executor: --model is required (a model directory or random:<name>)")
        if not self.stores:
            raise ValueError("executor: at least one adapter store address is required (--store)")
        if self.resolve_base_s < 0:
            raise ValueError(f"executor: resolve_base_s must be >= 0, got {self.resolve_base_s}")
        if not self.fetch_chunk_timeout_s > 0:
            raise ValueError("executor: fetch_chunk_timeout_s must be > 0, got "
                             f"{self.fetch_chunk_timeout_s}")
        if self.threads < 0:
            raise ValueError(f"executor: threads must be >= 0, got {self.threads}")
        if not self.step_idle_s > 0:
            raise ValueError(f"executor: step_idle_s must be > 0, got {self.step_idle_s}")
        for name in ("num_kv_blocks", "block_size", "adapter_slots", "max_rank", "staging_mb"):
            if getattr(self, name) < 1:
                raise ValueError(f"executor: {name} must be >= 1, got {getattr(self, name)}")
        if self.lora_backend not in LORA_BACKENDS:
            raise ValueError(f"executor: lora_backend must be one of {LORA_BACKENDS}, "
                             f"got {self.lora_backend!r}")
        if self.benchmark_step_s < 0 or (self.benchmark_step_s and not self.random_config):
            raise ValueError("executor: --benchmark-step-s (benchmark mode: no forward pass, "
                             "made-up tokens) needs --model random:<name>")
        if self.tensor_parallel < 1 or not self.rank_timeout_s > 0:
            raise ValueError(f"executor: tensor_parallel must be >= 1 and rank_timeout_s > 0, "
                             f"got {self.tensor_parallel} and {self.rank_timeout_s}")
        if self.tensor_parallel > 1 and self.benchmark_step_s:
            raise ValueError("executor: --benchmark-step-s runs one process; not with "
                             "--tensor-parallel")
        if self.tensor_parallel > 1 and self.device not in ("cpu", "cuda"):
            raise ValueError(f"executor: with --tensor-parallel, --device is cpu or cuda (rank r "
                             f"takes cuda:r), got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"executor: dtype must be one of {DTYPES}, got {self.dtype!r}")

    @property
    def random_config(self) -> str | None:
        return self.model.removeprefix("random:") if self.model.startswith("random:") else None

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> "ExecutorConfig":
        p = argparse.ArgumentParser(prog="loraplex serve executor", formatter_class=HelpFormatter,
                                    description="loraplex executor: a base model, its KV cache "
                                                "and a pool of adapter slots on one device")
        p.add_argument("--model", required=True,
                       help="HF model dir (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3: the family "
                            "is read from its config.json), or random:<name> (tiny, "
                            "llama-3-8b, qwen3-8b, gemma-2-9b, phi-3-mini, ...)")
        p.add_argument("--store", action="append", default=[],
                       help="adapter store host:port (repeatable)")
        p.add_argument("--address", default="127.0.0.1:0",
                       help="host:port to listen on (port 0 = any)")
        p.add_argument("--model-id", default="",
                       help="the base model's id adapters must name (default: the id a store "
                            "registered this model's fingerprint under, else the folder's name)")
        p.add_argument("--resolve-base-s", type=float, default=5.0,
                       help="at start, how long to ask the stores for the registered id of this "
                            "model's fingerprint (0 = do not ask)")
        p.add_argument("--fetch-chunk-timeout-s", type=float, default=FETCH_CHUNK_TIMEOUT_S,
                       help="a store whose Fetch sends no next chunk this long is passed over "
                            "and the next store tried, from byte 0 (size it as the stores' chunk "
                            "bytes over the slowest bandwidth to accept, plus a cold read's "
                            "first byte)")
        p.add_argument("--metrics-port", type=int, default=0,
                       help="Prometheus /metrics port (0 = off)")
        p.add_argument("--grace-s", type=float, default=30.0,
                       help="on SIGTERM, time to finish in-flight work")
        p.add_argument("--kv-blocks", type=int, default=512, dest="num_kv_blocks",
                       help="KV cache memory, in blocks of every layer, shared with adapters' "
                            "weights in pages (`loraplex budget` sizes it for a GPU); with "
                            "window blocks the same memory is cut into blocks of fewer layers")
        p.add_argument("--no-window-blocks", action="store_false", dest="window_blocks",
                       help="sliding-window layers keep the whole context's KV, as global "
                            "layers do (default: only their window's, in blocks of their own)")
        p.add_argument("--no-cuda-graphs", action="store_false", dest="cuda_graphs",
                       help="run every decode step eagerly (default on CUDA: decode steps "
                            "replay CUDA graphs, each checked against the eager forward at "
                            "start, and off with a log line if any differs)")
        p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
        p.add_argument("--adapter-slots", type=int, default=8,
                       help="adapters resident at once")
        p.add_argument("--max-rank", type=int, default=32,
                       help="largest LoRA rank a slot takes: the pool's limit, which higher-rank "
                            "adapters are refused by (`loraplex up` gives its stores the same)")
        p.add_argument("--lora-backend", default="auto", choices=LORA_BACKENDS,
                       help="auto = triton on CUDA, torch on CPU")
        p.add_argument("--dtype", default="float32", choices=DTYPES,
                       help="weights', KV cache's and adapters' dtype")
        p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
        p.add_argument("--seed", type=int, default=0,
                       help="seed of random weights (--model random:<name>)")
        p.add_argument("--threads", type=int, default=0,
                       help="torch CPU threads (0 = torch default)")
        p.add_argument("--staging-mb", type=int, default=1024,
                       help="host memory for adapters fetched ahead of their load (MiB)")
        p.add_argument("--benchmark-step-s", type=float, default=0.0,
                       help="BENCHMARK MODE, to measure the control plane alone: no forward "
                            "pass, deterministic made-up tokens, each step lasting this long "
                            "(needs --model random:<name>; 0 = off)")
        p.add_argument("--step-idle-s", type=float, default=60.0,
                       help="a scheduler's Step stream that sends nothing this long ends")
        p.add_argument("--tensor-parallel", type=int, default=1,
                       help="ranks (GPUs: rank r on cuda:r) the executor spans, serving as one "
                            "(on cpu: gloo ranks); 1 = one process")
        p.add_argument("--rank-timeout-s", type=float, default=60.0,
                       help="a rank that does not meet a collective or answer this long is taken "
                            "as dead: the group restarts as one")
        add_key_arguments(p)
        a = p.parse_args(argv)
        return cls(model=a.model, stores=tuple(a.store), address=a.address, model_id=a.model_id,
                   resolve_base_s=a.resolve_base_s, fetch_chunk_timeout_s=a.fetch_chunk_timeout_s,
                   metrics_port=a.metrics_port, grace_s=a.grace_s,
                   num_kv_blocks=a.num_kv_blocks, block_size=a.block_size,
                   window_blocks=a.window_blocks, cuda_graphs=a.cuda_graphs,
                   adapter_slots=a.adapter_slots,
                   max_rank=a.max_rank,
                   lora_backend=a.lora_backend, dtype=a.dtype, device=a.device, seed=a.seed,
                   threads=a.threads, staging_mb=a.staging_mb,
                   benchmark_step_s=a.benchmark_step_s, step_idle_s=a.step_idle_s,
                   tensor_parallel=a.tensor_parallel, rank_timeout_s=a.rank_timeout_s,
                   keys=sources_from_args(a))
