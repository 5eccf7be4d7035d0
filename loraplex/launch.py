"""Start and stop loraplex services as separate processes on this machine.

Each service prints "<name> listening on HOST:PORT" once it serves (the gateway prints two:
gateway-http, then gateway); `start_service` waits for that line, so callers get a ready address.
`Fleet` starts a whole pool: stores, executors, a scheduler; `start_gateway` a gateway in front
of pools.
"""

import ctypes
import itertools
import os
import pathlib
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

_LISTENING = re.compile(r"^(\S+) listening on (\S+)$")


@dataclass
class ServiceProcess:
    name: str
    process: subprocess.Popen
    address: str
    log_path: pathlib.Path
    announced: dict[str, str] = field(default_factory=dict)  # every "<name> listening on" line

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM (graceful drain), then SIGKILL after `grace` seconds."""
        self.terminate()
        self.wait_stopped(grace)

    def terminate(self) -> None:
        """SIGTERM: the service drains and exits (wait_stopped waits for it)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.thaw()  # a frozen process would not act on it

    def wait_stopped(self, grace: float) -> None:
        """Wait up to `grace` seconds for the process to exit; then SIGKILL."""
        try:
            self.process.wait(grace)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def freeze(self) -> None:
        """SIGSTOP: alive but answering nothing, like a hung process or GPU (outage drills)."""
        os.killpg(self.process.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.killpg(self.process.pid, signal.SIGCONT)


def start_service(name: str, module: str, args: list[str], log_dir: pathlib.Path,
                  timeout: float = 120.0, wait_for: str = "") -> ServiceProcess:
    """Run `python -m module args`, stderr to log_dir/name.log; returns once it listens (once
    it announced `wait_for`, when given; `address` is that announcement's)."""
    return spawn_service(name, module, args, log_dir, wait_for).wait_listening(timeout)


@dataclass
class Spawned:
    """A service's process, started and not yet listening: `wait_listening` waits for its
    "<name> listening on" line (or its end)."""

    name: str
    process: subprocess.Popen
    log_path: pathlib.Path
    log_start: int  # where this run's lines begin in the log (runs append to one file)
    wait_for: str = ""
    found: list[str] = field(default_factory=list)
    announced: dict[str, str] = field(default_factory=dict)
    ready: threading.Event = field(default_factory=threading.Event)

    def read_stdout(self) -> None:  # keeps draining stdout so the child never blocks on a pipe
        for line in self.process.stdout:
            m = _LISTENING.match(line.strip())
            if m:
                self.announced[m[1]] = m[2]
            if m and not self.found and m[1] == (self.wait_for or m[1]):
                self.found.append(m[2])
                self.ready.set()
        self.ready.set()

    def wait_listening(self, timeout: float = 120.0) -> ServiceProcess:
        """The running service once it listens. TimeoutError (having killed it) after `timeout`
        seconds; RuntimeError with the end of this run's log when it exited first."""
        deadline = time.monotonic() + timeout
        while not self.ready.wait(0.1):
            if time.monotonic() > deadline:
                self.process.kill()
                raise TimeoutError(f"{self.name} did not start within {timeout:.0f}s; see "
                                   f"{self.log_path}")
        if not self.found:
            self.process.wait()
            raise ServiceFailed(self.name, self.process.returncode, self.log_path,
                                self.run_log()[-2000:])
        return ServiceProcess(self.name, self.process, self.found[0], self.log_path,
                              self.announced)

    def run_log(self) -> str:
        """What this run wrote to its log (not the runs before it)."""
        with open(self.log_path, "rb") as log:
            log.seek(self.log_start)
            return log.read().decode(errors="replace")


class ServiceFailed(RuntimeError):
    """A service exited before it listened; `tail` is the end of what it logged this run."""

    def __init__(self, name: str, returncode: int, log_path: pathlib.Path, tail: str):
        super().__init__(f"{name} exited with {returncode} before listening:\n{tail}")
        self.name, self.returncode, self.log_path, self.tail = name, returncode, log_path, tail

    @property
    def reason(self) -> str:
        """The last line of its log: what a service that fails to start last says (the
        exception's message)."""
        lines = [line.strip() for line in self.tail.splitlines() if line.strip()]
        return lines[-1] if lines else f"exit status {self.returncode}, nothing logged"


def spawn_service(name: str, module: str, args: list[str], log_dir: pathlib.Path,
                  wait_for: str = "") -> Spawned:
    """Start `python -m module args` (stderr appended to log_dir/name.log, after a line that
    marks where this run begins). Started from the main thread, the service gets SIGTERM when
    this process dies (Linux's parent-death signal), so a launcher killed any way leaves none
    behind; from another thread it does not (the signal follows the thread that started it)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    env = dict(os.environ, GRPC_VERBOSITY=os.environ.get("GRPC_VERBOSITY", "ERROR"))
    with open(log_path, "ab") as log:
        log.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} {name}: python -m {module} "
                  f"{' '.join(args)}\n".encode())
        log.flush()
        start = log.tell()
        proc = subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.PIPE,
                                stderr=log, env=env, text=True, start_new_session=True,
                                preexec_fn=_dies_with_parent())
    spawned = Spawned(name, proc, log_path, start, wait_for)
    threading.Thread(target=spawned.read_stdout, daemon=True).start()
    return spawned


def _dies_with_parent():
    """A preexec_fn that has the child get SIGTERM when this process dies, or None off the main
    thread. Everything it calls is resolved before the fork (a child of a threaded parent must
    not import or allocate)."""
    if threading.current_thread() is not threading.main_thread() or sys.platform != "linux":
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # it died before the line above
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass(frozen=True)
class FleetKeys:
    """The keys of a local fleet: tenant keys, an admin key and the service key its services
    present to each other. `write` puts them in files only this user can read, and returns the
    flags that point each service at them (keys never go on a command line)."""

    tenants: Mapping[str, str] = field(default_factory=dict)  # key -> tenant
    admin: str = field(default_factory=lambda: secrets.token_hex(16))
    service: str = field(default_factory=lambda: secrets.token_hex(16))

    def write(self, folder: pathlib.Path) -> dict[str, list[str]]:
        """Flags per service kind ("store", "executor", "scheduler", "gateway")."""
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        files = {"api-keys": "".join(f"{k}={t}\n" for k, t in self.tenants.items()),
                 "admin-keys": f"{self.admin}\n", "service-key": f"{self.service}\n"}
        for name, text in files.items():
            path = folder / name
            path.touch(mode=0o600)
            path.write_text(text)
        every = ["--api-keys-file", str(folder / "api-keys"),
                 "--admin-keys-file", str(folder / "admin-keys"),
                 "--service-key-file", str(folder / "service-key")]
        return {"store": every, "scheduler": every, "gateway": every,
                "executor": ["--service-key-file", str(folder / "service-key")]}


@dataclass
class Fleet:
    """A local pool: adapter stores, executors (one model), one scheduler. With `keys`, every
    service authenticates its callers (common/credentials.py); without, all run open."""

    model: str
    store_url: str
    log_dir: pathlib.Path
    num_executors: int = 1
    num_stores: int = 1
    # Stores already running (another fleet's): none of its own is started.
    store_addresses: list[str] = field(default_factory=list)
    # 0: every service on a free port. Else the scheduler on base_port, stores on the next ports,
    # then executors (the CLI's `up` uses 50051: scheduler 50051, store 50052, executor 50053).
    base_port: int = 0
    executor_args: list[str] = field(default_factory=list)
    scheduler_args: list[str] = field(default_factory=list)
    store_args: list[str] = field(default_factory=list)
    keys: FleetKeys | None = None
    services: list[ServiceProcess] = field(default_factory=list)

    def _address(self, offset: int) -> str:
        return f"127.0.0.1:{self.base_port + offset if self.base_port else 0}"

    def start(self) -> "Fleet":
        """Stores, then executors (they are given the stores' addresses), then the scheduler
        (given theirs); the services of a tier start at once, each tier once the one before
        listens."""
        keys = self.keys.write(self.log_dir / "keys") if self.keys else {}
        try:
            if not self.store_addresses:
                self._start_tier([
                    (f"adapter_store-{i}", "adapter_store.service",
                     ["--url", self.store_url, "--address", self._address(1 + i),
                      *keys.get("store", ()), *self.store_args])
                    for i in range(self.num_stores)])
            store_flags = [f for address in self.stores for f in ("--store", address)]
            executors = self._start_tier([
                (f"executor-{i}", "executor.service",
                 ["--model", self.model, "--address", self._address(1 + self.num_stores + i),
                  *store_flags, *keys.get("executor", ()), *self.executor_args])
                for i in range(self.num_executors)])
            self._start_tier([("scheduler", "scheduler.service",
                               ["--address", self._address(0), *store_flags,
                                *keys.get("scheduler", ()), *self.scheduler_args,
                                *(f for e in executors for f in ("--executor", e.address))])])
        except BaseException:
            self.stop()
            raise
        return self

    def _start_tier(self, specs: list[tuple[str, str, list[str]]]) -> list[ServiceProcess]:
        """Start every (name, module, args) at once; the services in `specs`' order. Each is in
        `services` from its start, so a failure or an interrupt while they come up stops them
        all (the caller's `stop`); the first error is raised."""
        first, spawned = len(self.services), []
        for name, module, args in specs:
            spawned.append(spawn_service(name, module, args, self.log_dir))
            self.services.append(ServiceProcess(name, spawned[-1].process, "",
                                                spawned[-1].log_path))
        started: list[ServiceProcess | None] = [None] * len(specs)
        errors: list[BaseException] = []

        def wait(i: int) -> None:
            try:
                started[i] = spawned[i].wait_listening()
            except BaseException as err:  # noqa: BLE001 (raised below, in the caller's thread)
                errors.append(err)

        threads = [threading.Thread(target=wait, args=(i,), daemon=True)
                   for i in range(len(specs))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for i, service in enumerate(started):
            if service is not None:
                self.services[first + i] = service
        if errors:
            raise errors[0]
        return started

    def add_gateway(self, pools: Mapping[str, list[str]], args: list[str] = (),
                    grpc_address: str = "127.0.0.1:0",
                    http_address: str = "127.0.0.1:0") -> ServiceProcess:
        """A gateway in front of `pools` and this fleet's stores, one of its `services` from its
        start (so a failure or an interrupt while it comes up stops it with the rest)."""
        keys = self.keys.write(self.log_dir / "keys")["gateway"] if self.keys else []
        spawned = spawn_service("gateway", "gateway.service", gateway_args(
            pools, self.stores, [*keys, *args], grpc_address, http_address), self.log_dir,
            wait_for="gateway")
        self.services.append(ServiceProcess("gateway", spawned.process, "", spawned.log_path))
        self.services[-1] = spawned.wait_listening()
        return self.services[-1]

    def by_name(self, prefix: str) -> list[ServiceProcess]:
        return [s for s in self.services if s.name.startswith(prefix)]

    @property
    def scheduler(self) -> str:
        return self.by_name("scheduler")[0].address

    @property
    def stores(self) -> list[str]:
        return self.store_addresses or [s.address for s in self.by_name("adapter_store")]

    def stop(self, grace: float = 10.0) -> None:
        """Stop in the reverse of the start's order, a tier at once: the scheduler first (it
        drains), then the executors together, then the stores together."""
        for _, tier in itertools.groupby(reversed(self.services),
                                         key=lambda service: service.name.split("-")[0]):
            tier = list(tier)
            for service in tier:
                service.terminate()
            for service in tier:
                service.wait_stopped(grace)
        self.services.clear()

    def __enter__(self) -> "Fleet":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def start_gateway(pools: Mapping[str, list[str]], stores: list[str], log_dir: pathlib.Path,
                  keys: FleetKeys | None = None, args: list[str] = (), name: str = "gateway",
                  grpc_address: str = "127.0.0.1:0",
                  http_address: str = "127.0.0.1:0") -> ServiceProcess:
    """A gateway in front of `pools` (base model id -> scheduler addresses); `address` is its
    gRPC address, `announced["gateway-http"]` its HTTP one."""
    flags = keys.write(log_dir / "keys")["gateway"] if keys else []
    return start_service(name, "gateway.service",
                         gateway_args(pools, stores, [*flags, *args], grpc_address, http_address),
                         log_dir, wait_for="gateway")


def gateway_args(pools: Mapping[str, list[str]], stores: list[str], args: list[str],
                 grpc_address: str, http_address: str) -> list[str]:
    """A gateway's command line: its addresses, pools and stores, then `args`."""
    pool_flags = [f for model_id, addresses in pools.items()
                  for f in ("--pool", f"{model_id}={','.join(addresses)}")]
    return ["--address", grpc_address, "--http-address", http_address, *pool_flags,
            *(f for a in stores for f in ("--store", a)), *args]
