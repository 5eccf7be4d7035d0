"""The pools a gateway sends requests to, and their cells.

A pool serves one base model with one or more schedulers ("cells", each with executors of its
own). Configuration names each pool's base model and its cells: `--pool MODEL_ID=HOST:PORT[,...]`
(repeatable) and a roster file of `MODEL_ID HOST:PORT [HOST:PORT ...]` lines (`#` comments),
read again whenever it changes. A host name that resolves to several addresses (a Kubernetes
headless Service) is one cell per address; names are resolved again at every refresh.

Every `refresh_s` each cell is asked for its model (the Model RPC, within `rpc_s`; only a
fingerprint comes back while the model is the one known): a cell that answers is up, one that
does not is down until it answers again, and one that serves another model than its pool's is
never used (an operator's mistake: logged). A pool's model facts (tokenizer, chat template,
context) come from its cells' answers and are kept while every cell is down, so a pool that is
down is known as down (UNAVAILABLE), not as unknown.

Which cell serves a request: for an adapter, the up cell that ranks first for the adapter's name
by rendezvous (highest random weight) hashing, so each adapter stays hot in one cell and a cell
that comes or goes moves only its own share of adapters; for the base model, any up cell. A cell
found down (a failed probe: dead, frozen, or too slow to answer one) gives up the requests that
wait for its first answer: they go to the next cell (gateway/frontend.py).
"""

import asyncio
import dataclasses
import functools
import hashlib
import ipaddress
import logging
import os
import random
import socket

import grpc
from tokenizers import Tokenizer

from common.credentials import metadata
from common.prompt_bounds import ModelPrompts
from common.server import insecure_channel
from gateway.cell_stream import Cell
from gateway.chat import ChatTemplate
from protos import scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger(__name__)


class PoolModel:
    """What a pool's cells say of their base model, ready to use."""

    def __init__(self, answer: scheduler_pb2.ModelResponse):
        self.answer = answer
        self.model_id = answer.model_id
        self.max_model_len = answer.max_model_len
        self.vocab_size = answer.vocab_size
        self.tokenizer = (Tokenizer.from_str(answer.tokenizer_json) if answer.tokenizer_json
                          else None)
        self.prompts = ModelPrompts(answer.model_id, self.tokenizer, answer.max_model_len)
        self.chat = ChatTemplate(answer.chat_template, dict(answer.special_tokens))


@dataclasses.dataclass(eq=False)
class Pool:
    model_id: str
    cells: dict[str, Cell] = dataclasses.field(default_factory=dict)  # address -> cell
    model: PoolModel | None = None  # None until a cell answered

    def cells_for(self, adapter_name: str | None) -> list[Cell]:
        """Up cells in the order to try them (see the module docstring)."""
        up = [c for c in self.cells.values() if c.is_up]
        if adapter_name is None:
            random.shuffle(up)
            return up
        return sorted(up, key=lambda c: _weight(adapter_name, c.address), reverse=True)

    def why_down(self) -> str:
        if not self.cells:
            return "it has no scheduler address (yet)"
        return "; ".join(f"{c.address}: {c.problem}" for c in self.cells.values())


def _weight(key: str, address: str) -> int:
    digest = hashlib.blake2b(f"{key}\0{address}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def parse_pool(text: str) -> tuple[str, list[str]]:
    """`MODEL_ID=HOST:PORT[,HOST:PORT...]` -> (model id, addresses)."""
    model_id, sep, addresses = text.partition("=")
    hosts = [a.strip() for a in addresses.split(",") if a.strip()]
    if not sep or not model_id.strip() or not hosts:
        raise ValueError(f"--pool must look like MODEL_ID=HOST:PORT[,HOST:PORT...], got {text!r}")
    return model_id.strip(), hosts


def read_roster(path: str) -> dict[str, list[str]]:
    """`MODEL_ID HOST:PORT [HOST:PORT ...]` per line; `#` starts a comment."""
    pools: dict[str, list[str]] = {}
    with open(path) as roster:
        for number, line in enumerate(roster, 1):
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            if len(words) < 2:
                raise ValueError(f"{path}:{number}: expected MODEL_ID HOST:PORT [HOST:PORT ...]")
            pools.setdefault(words[0], []).extend(words[1:])
    return pools


class Pools:
    def __init__(self, configured: dict[str, list[str]], roster: str = "", service_key: str = "",
                 refresh_s: float = 2.0, rpc_s: float = 2.0):
        self._configured = configured
        self._roster, self._roster_stamp, self._roster_pools = roster, None, {}
        self._service_key = service_key
        self._refresh_s, self._rpc_s = refresh_s, rpc_s
        self._pools: dict[str, Pool] = {}
        self._resolved: dict[str, list[str]] = {}  # host:port -> the addresses it resolved to
        self._wake = asyncio.Event()
        self._refreshed = asyncio.Event()  # set (and replaced) as each refresh ends
        self._task: asyncio.Task | None = None

    def get(self, model_id: str) -> Pool | None:
        return self._pools.get(model_id)

    def model_ids(self) -> list[str]:
        return sorted(self._pools)

    async def start(self) -> "Pools":
        await self.refresh()
        self._task = asyncio.create_task(self._refresh_forever(), name="pool refresh")
        return self

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for pool in self._pools.values():
            for cell in pool.cells.values():
                cell.close_stream()
                await cell.channel.close()

    def cell_failed(self, cell: Cell, problem: str) -> None:
        """A call found `cell` unreachable: no requests go to it until it answers a probe (one
        starts now)."""
        cell.down(problem, by_call=True)
        self._wake.set()

    async def settle(self, pool: Pool) -> None:
        """Wait until every cell of `pool` that a call found unreachable has answered a probe or
        failed one, at most two probes' time: a broken stream is not always a scheduler down
        (the scheduler's keepalive cuts a stream this gateway left unanswered while frozen), and
        the request that met it, or one that comes right after, may be served."""
        try:
            async with asyncio.timeout(2 * self._rpc_s + 1.0):
                while any(c.unprobed for c in pool.cells.values()):
                    self._wake.set()
                    await self._refreshed.wait()
        except TimeoutError:
            pass

    async def _refresh_forever(self) -> None:
        while True:
            try:
                async with asyncio.timeout(self._refresh_s):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - the next refresh tries again
                log.exception("refreshing the pools failed")

    async def refresh(self) -> None:
        """Read the roster, resolve addresses, and ask every cell for its model."""
        wanted: dict[str, list[str]] = {}
        for model_id, hosts in (*self._configured.items(), *self._read_roster().items()):
            wanted.setdefault(model_id, []).extend(hosts)
        for model_id, hosts in wanted.items():
            addresses = [a for host in dict.fromkeys(hosts) for a in await self._resolve(host)]
            self._place(self._pools.setdefault(model_id, Pool(model_id)), addresses)
        for model_id in set(self._pools) - set(wanted):
            self._place(self._pools.pop(model_id), [])
        await asyncio.gather(*(self._probe(pool, cell) for pool in self._pools.values()
                               for cell in pool.cells.values()))
        self._refreshed.set()
        self._refreshed = asyncio.Event()

    def _read_roster(self) -> dict[str, list[str]]:
        if not self._roster:
            return {}
        try:
            stamp = os.stat(self._roster).st_mtime_ns
            if stamp != self._roster_stamp:
                self._roster_pools, self._roster_stamp = read_roster(self._roster), stamp
        except (OSError, ValueError) as err:
            log.error("roster %s unreadable (%s); keeping the pools it gave before",
                      self._roster, err)
        return self._roster_pools

    async def _resolve(self, host_port: str) -> list[str]:
        """host:port -> "ip:port" per address (IPv4 first); the last answer when DNS fails."""
        host, _, port = host_port.removeprefix("dns:///").rpartition(":")
        host = host.strip("[]")
        try:
            ipaddress.ip_address(host)
            return [host_port]
        except ValueError:
            pass
        try:
            async with asyncio.timeout(self._rpc_s):
                infos = await asyncio.get_running_loop().getaddrinfo(
                    host, port, type=socket.SOCK_STREAM)
            ips = sorted({info[4][0] for info in infos if info[0] == socket.AF_INET}) or sorted(
                {f"[{info[4][0]}]" for info in infos if info[0] == socket.AF_INET6})
            self._resolved[host_port] = [f"{ip}:{port}" for ip in ips] or [host_port]
        except (OSError, TimeoutError) as err:
            log.warning("resolving %s failed (%s)", host_port, err)
        return self._resolved.get(host_port, [host_port])

    def _place(self, pool: Pool, addresses: list[str]) -> None:
        for address in set(pool.cells) - set(addresses):
            cell = pool.cells.pop(address)
            cell.close_stream()
            asyncio.ensure_future(cell.channel.close())
        for address in addresses:
            if address not in pool.cells:
                channel = insecure_channel(address, keepalive=True)
                pool.cells[address] = Cell(address, channel,
                                           scheduler_pb2_grpc.SchedulerStub(channel),
                                           auth=metadata(self._service_key))

    async def _probe(self, pool: Pool, cell: Cell) -> None:
        known = pool.model.answer.fingerprint if pool.model else ""
        ask = functools.partial(cell.stub.Model, scheduler_pb2.ModelRequest(
            known_fingerprint=known), metadata=cell.auth, timeout=self._rpc_s)
        try:
            try:
                answer = await ask()
            except grpc.aio.AioRpcError as err:
                # A cell up till now, or one a broken call took down, is asked once more when
                # that fails at once: a connection its scheduler cut (keepalive, while this
                # gateway was frozen) fails the first call made on it; the next connects anew
                # (a scheduler that is stopping refuses both at once)
                if not (cell.is_up or cell.unprobed) or err.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                answer = await ask()
        except grpc.aio.AioRpcError as err:
            if cell.is_up:
                log.warning("scheduler %s of pool %s is down: %s", cell.address, pool.model_id,
                            err.details())
            cell.down(f"{err.code().name}: {err.details()}")
            return
        if answer.model_id != pool.model_id:
            if cell.problem != (problem := f"serves {answer.model_id!r}, not {pool.model_id!r}"):
                log.error("scheduler %s is configured for pool %s but %s: not used",
                          cell.address, pool.model_id, problem)
            cell.down(problem)
            return
        if answer.fingerprint != known:  # a full answer: the model changed, or is new here
            pool.model = PoolModel(answer)
        if not cell.is_up:
            log.info("scheduler %s of pool %s is up", cell.address, pool.model_id)
        cell.up()
