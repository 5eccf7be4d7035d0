"""Adapter store configuration: one frozen dataclass, validated at construction.

Environment variables (all optional, read only by `StoreConfig.from_env`, never at import time):
  LORAPLEX_STORE_URL            file:///abs/dir or s3://bucket/prefix
                                (default file://~/.cache/loraplex/adapters)
  LORAPLEX_S3_ENDPOINT_URL      e.g. http://127.0.0.1:8333 (SeaweedFS, MinIO); unset = AWS
  LORAPLEX_S3_ACCESS_KEY_ID     with LORAPLEX_S3_SECRET_ACCESS_KEY; unset = botocore's own chain
  LORAPLEX_S3_SECRET_ACCESS_KEY
  LORAPLEX_S3_REGION            default us-east-1
  LORAPLEX_STORE_ADDRESS        host:port to listen on (default 127.0.0.1:0 = any free port)
  LORAPLEX_HOST_CACHE_MB        size of the warm host-RAM tier (default 4096)
  LORAPLEX_CHUNK_BYTES          size of Fetch chunks (default 1 MiB)
  LORAPLEX_MAX_RANK             largest LoRA rank a push may register (default 256)
  LORAPLEX_MAX_ADAPTER_MB       largest adapter_model.safetensors a push or register takes
                                (default 2048)
  LORAPLEX_REQUIRE_BASE_MODEL   1 = refuse adapters whose base model has no registered config.json
"""

import argparse
import dataclasses
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from urllib.parse import unquote, urlparse

from common.credentials import KeySources, add_key_arguments, sources_from_args
from common.help_format import HelpFormatter

MIB = 1024 * 1024
# The S3 bucket naming rules, loosely: lowercase letters, digits, dots and dashes.
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_ADDRESS_RE = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]+):(\d{1,5})$")


def _default_url() -> str:
    return (Path.home() / ".cache" / "loraplex" / "adapters").as_uri()


@dataclasses.dataclass(frozen=True)
class StoreConfig:
    """Where adapters live and how the store serves them."""

    # file:///abs/dir (embedded default) or s3://bucket[/prefix].
    url: str = dataclasses.field(default_factory=_default_url)
    # S3 endpoint of a non-AWS server (SeaweedFS, MinIO); None = AWS.
    s3_endpoint_url: str | None = None
    # None = botocore's default credential chain; with a custom endpoint, dummy keys.
    s3_access_key_id: str | None = None
    s3_secret_access_key: str | None = dataclasses.field(default=None, repr=False)
    s3_region: str = "us-east-1"
    # Path-style addressing (http://host/bucket/key): what SeaweedFS and MinIO expect.
    s3_path_style: bool = True
    # Byte budget of the warm host-RAM tier in front of the blob store, reads in flight included:
    # a read to be kept reserves its size when it starts.
    host_cache_bytes: int = 4096 * MIB
    # A read into the host tier waits at most this long for room while reads in flight reserve
    # the whole budget; then it is read through (served, not kept).
    host_fill_wait_s: float = 10.0
    # Size of each chunk a Fetch streams.
    chunk_bytes: int = 1 * MIB
    # host:port the gRPC server binds; port 0 = any free port.
    address: str = "127.0.0.1:0"
    # Prometheus /metrics port; 0 = off.
    metrics_port: int = 0
    # On SIGTERM: how long in-flight RPCs may take to finish.
    grace_s: float = 30.0
    # S3 reads: objects larger than one part are read as parallel ranged GETs.
    s3_part_bytes: int = 8 * MIB
    s3_max_concurrency: int = 8
    # Every S3 call is bounded, so a frozen S3 is an error within seconds, like a dead one:
    # connecting, each read of a response body, each call as a whole (headers of a GET, a put, a
    # list page, a delete), and the tries of one call (botocore's retries, timeouts included).
    s3_connect_timeout_s: float = 2.0
    s3_read_timeout_s: float = 10.0
    s3_call_timeout_s: float = 20.0
    s3_max_attempts: int = 2
    # Reads of an adapter whose bytes fail the sha256 check before it is declared DATA_LOSS.
    read_attempts: int = 3
    # Largest LoRA rank (the largest its tensors use) a push may register.
    max_rank: int = 256
    # Refuse pushes for base models without a registered config.json (else: shape checks only
    # when the base model is registered).
    require_base_model: bool = False
    # Executors' residency reports expire after this many seconds without renewal.
    lease_ttl_s: float = 30.0
    # Largest adapter a Push or Register may carry (a rank-256 adapter on all projections of a
    # 70B model is ~5 GB in fp32; split such pushes later, with ranged uploads).
    max_adapter_bytes: int = 2 * 1024**3
    # A Push whose client sends nothing for this long is dropped (UNAVAILABLE): an accepted
    # push holds a share of the in-flight budget, a stalled client must not hold it for ever.
    push_idle_s: float = 60.0
    # And one slower than this in all (push_idle_s + its bytes at this rate) is dropped too: a
    # client trickling a byte now and then would hold its share for ever.
    push_min_bytes_per_s: float = 1e6
    # A push, its bytes received, writes its weights and registers its version within this
    # (UNAVAILABLE, push again, if not).
    push_register_s: float = 120.0
    # Weights no live version uses (after a delete) are removed by a sweep once unused this long
    # (adapter_store/orphans.py); a sweep every quarter of it. Outlasts any push's registration:
    # a push of the same bytes racing the delete keeps them.
    blob_grace_s: float = 7200.0
    # Where the keys of tenants, admins and services are read (files; also LORAPLEX_* env).
    keys: KeySources = KeySources()

    def __post_init__(self) -> None:
        parsed = urlparse(self.url)
        if parsed.scheme == "file":
            if parsed.netloc not in ("", "localhost") or not parsed.path.startswith("/"):
                raise ValueError(f"store url {self.url!r}: use file:///absolute/dir")
        elif parsed.scheme == "s3":
            if not _BUCKET_RE.match(parsed.netloc):
                raise ValueError(f"store url {self.url!r}: {parsed.netloc!r} is not a valid bucket")
        else:
            raise ValueError(f"store url {self.url!r}: use file:///abs/dir or s3://bucket/prefix")
        if self.s3_endpoint_url is not None:
            endpoint = urlparse(self.s3_endpoint_url)
            if endpoint.scheme not in ("http", "https") or not endpoint.netloc:
                raise ValueError(f"s3 endpoint {self.s3_endpoint_url!r}: use http(s)://host:port")
        if (self.s3_access_key_id is None) != (self.s3_secret_access_key is None):
            raise ValueError("give both the S3 access key id and the secret access key, or neither")
        if not self.push_idle_s > 0:
            raise ValueError(f"push_idle_s must be > 0, got {self.push_idle_s}")
        if not self.push_min_bytes_per_s > 0:
            raise ValueError(f"push_min_bytes_per_s must be > 0, got {self.push_min_bytes_per_s}")
        if not 0 < 2 * self.push_register_s <= self.blob_grace_s:
            raise ValueError(f"blob_grace_s ({self.blob_grace_s}) must be at least twice "
                             f"push_register_s ({self.push_register_s}) > 0: a sweep must never "
                             "remove weights a push is registering")
        if self.host_cache_bytes < 0 or self.host_fill_wait_s < 0:
            raise ValueError("host_cache_bytes and host_fill_wait_s must be >= 0, got "
                             f"{self.host_cache_bytes} and {self.host_fill_wait_s}")
        if not 1024 <= self.chunk_bytes <= 32 * MIB:
            raise ValueError(f"chunk_bytes must be within 1 KiB..32 MiB, got {self.chunk_bytes}")
        if not (self.s3_connect_timeout_s > 0 and self.s3_read_timeout_s > 0
                and self.s3_call_timeout_s > 0 and self.s3_max_attempts >= 1):
            raise ValueError("S3 timeouts must be > 0 and s3_max_attempts >= 1")
        if not (64 * 1024 <= self.s3_part_bytes <= 1024 * MIB
                and 1 <= self.s3_max_concurrency <= 64):
            raise ValueError(
                "s3_part_bytes must be within 64 KiB..1 GiB and s3_max_concurrency within 1..64, "
                f"got {self.s3_part_bytes} and {self.s3_max_concurrency}")
        if (self.read_attempts < 1 or self.max_rank < 1 or self.lease_ttl_s <= 0
                or self.max_adapter_bytes < 1):
            raise ValueError("read_attempts, max_rank and max_adapter_bytes must be >= 1 and "
                             "lease_ttl_s > 0")
        match = _ADDRESS_RE.match(self.address)
        if not match or int(match.group(2)) > 65535:
            raise ValueError(f"address {self.address!r}: use host:port (port 0 = any free port)")

    @property
    def is_s3(self) -> bool:
        return self.url.startswith("s3://")

    @property
    def file_root(self) -> Path:
        """The directory of a file:// store."""
        return Path(unquote(urlparse(self.url).path))

    @property
    def s3_bucket(self) -> str:
        return urlparse(self.url).netloc

    @property
    def s3_prefix(self) -> str:
        """Key prefix inside the bucket, "" or ending with "/"."""
        prefix = urlparse(self.url).path.strip("/")
        return f"{prefix}/" if prefix else ""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> "StoreConfig":
        """A config from LORAPLEX_* variables; `overrides` that are not None win."""
        env = os.environ if environ is None else environ
        values: dict = {}
        if "LORAPLEX_STORE_URL" in env:
            values["url"] = env["LORAPLEX_STORE_URL"]
        for field, var in [("s3_endpoint_url", "LORAPLEX_S3_ENDPOINT_URL"),
                           ("s3_access_key_id", "LORAPLEX_S3_ACCESS_KEY_ID"),
                           ("s3_secret_access_key", "LORAPLEX_S3_SECRET_ACCESS_KEY"),
                           ("s3_region", "LORAPLEX_S3_REGION"),
                           ("address", "LORAPLEX_STORE_ADDRESS")]:
            if env.get(var):
                values[field] = env[var]
        if env.get("LORAPLEX_HOST_CACHE_MB"):
            values["host_cache_bytes"] = _env_int(env, "LORAPLEX_HOST_CACHE_MB") * MIB
        if env.get("LORAPLEX_CHUNK_BYTES"):
            values["chunk_bytes"] = _env_int(env, "LORAPLEX_CHUNK_BYTES")
        if env.get("LORAPLEX_MAX_RANK"):
            values["max_rank"] = _env_int(env, "LORAPLEX_MAX_RANK")
        if env.get("LORAPLEX_MAX_ADAPTER_MB"):
            values["max_adapter_bytes"] = _env_int(env, "LORAPLEX_MAX_ADAPTER_MB") * MIB
        if env.get("LORAPLEX_REQUIRE_BASE_MODEL"):
            values["require_base_model"] = env["LORAPLEX_REQUIRE_BASE_MODEL"] not in ("0", "false")
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def _env_int(env: Mapping[str, str], var: str) -> int:
    try:
        return int(env[var])
    except ValueError:
        raise ValueError(f"{var}={env[var]!r} is not an integer") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The store's command-line flags; unset flags fall back to LORAPLEX_* variables."""
    parser.add_argument("--url", help="file:///abs/dir or s3://bucket/prefix (LORAPLEX_STORE_URL)")
    parser.add_argument("--s3-endpoint-url", help="S3 endpoint, e.g. http://127.0.0.1:8333")
    parser.add_argument("--address", help="host:port to listen on (default 127.0.0.1:0)")
    parser.add_argument("--port", type=int, help="listen port; overrides the port of --address")
    parser.add_argument("--host-cache-mb", type=int, help="warm host-RAM tier size in MiB")
    parser.add_argument("--chunk-bytes", type=int, help="Fetch chunk size in bytes (default 1 MiB)")
    parser.add_argument("--max-rank", type=int, help="largest LoRA rank a push may register")
    parser.add_argument("--max-adapter-mb", type=int,
                        help="largest adapter_model.safetensors a push or register takes (MiB)")
    parser.add_argument("--blob-grace-s", type=float,
                        help="weights a delete left unused are removed after this (default 7200)")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="Prometheus /metrics port (0 = off)")
    parser.add_argument("--grace-s", type=float, default=30.0,
                        help="on SIGTERM, time to finish in-flight RPCs")
    add_key_arguments(parser)
    parser.add_argument("--require-base-model", action="store_true", default=None,
                        help="refuse adapters whose base model config.json is not registered")


def config_from_args(args: argparse.Namespace,
                     environ: Mapping[str, str] | None = None) -> StoreConfig:
    """Flags first, then LORAPLEX_* variables, then defaults."""
    config = StoreConfig.from_env(
        environ, url=args.url, s3_endpoint_url=args.s3_endpoint_url, address=args.address,
        chunk_bytes=args.chunk_bytes, max_rank=args.max_rank,
        require_base_model=args.require_base_model, blob_grace_s=args.blob_grace_s,
        host_cache_bytes=None if args.host_cache_mb is None else args.host_cache_mb * MIB,
        max_adapter_bytes=None if args.max_adapter_mb is None else args.max_adapter_mb * MIB)
    config = dataclasses.replace(config, metrics_port=args.metrics_port, grace_s=args.grace_s,
                                 keys=sources_from_args(args))
    if args.port is not None:
        host = config.address.rsplit(":", 1)[0]
        config = dataclasses.replace(config, address=f"{host}:{args.port}")
    return config


def parse_args(argv: Sequence[str] | None = None,
               environ: Mapping[str, str] | None = None) -> StoreConfig:
    parser = argparse.ArgumentParser(prog="loraplex serve adapter-store",
                                     formatter_class=HelpFormatter,
                                     description="loraplex adapter store: the registry of PEFT "
                                                 "adapters and their bytes")
    add_arguments(parser)
    return config_from_args(parser.parse_args(argv), environ)
