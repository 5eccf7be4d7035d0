"""Where the executors are: static addresses, DNS names that resolve to many (a Kubernetes
headless Service), or a file of addresses (a local fleet). Re-resolved periodically by the engine,
so executors joining or leaving are picked up while traffic flows.

    127.0.0.1:50053                                   one executor
    dns:///loraplex-executor.ns.svc.cluster.local:50053   every A/AAAA record, same port
    file:///run/loraplex/executors.txt                one host:port per line, # comments
"""

import pathlib
import socket
from collections.abc import Sequence
from urllib.parse import urlparse


def resolve(specs: Sequence[str]) -> set[str]:
    """The executor addresses the specs name right now (blocking: run it in a thread)."""
    addresses: set[str] = set()
    for spec in specs:
        if spec.startswith("dns:"):
            addresses |= _resolve_dns(spec)
        elif spec.startswith("file:"):
            path = pathlib.Path(urlparse(spec).path)
            text = path.read_text() if path.exists() else ""
            addresses |= {line.split("#")[0].strip() for line in text.splitlines()} - {""}
        else:
            addresses.add(spec)
    return addresses


def _resolve_dns(spec: str) -> set[str]:
    host, _, port = spec.removeprefix("dns:").lstrip("/").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"executor {spec!r}: use dns:///name:port")
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except socket.gaierror:
        return set()  # no executors behind the name right now
    return {f"[{info[4][0]}]:{port}" if info[0] == socket.AF_INET6 else f"{info[4][0]}:{port}"
            for info in infos}
