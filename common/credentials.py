"""Who is calling: API keys mapped to a role and a tenant, read from files or the environment.

Every caller presents one key, as gRPC metadata `authorization: Bearer <key>`:

    tenant key    acts as its tenant: its own adapters, public ones, its own requests
    service key   loraplex services calling each other (executor -> store Fetch and residency,
                  scheduler -> store resolution and host prewarm, scheduler -> executor); may act
                  on behalf of the tenant a request names
    admin key     operators: admin RPCs, other tenants' and public adapters, base models

Keys never appear on a command line (where `ps` and /proc show them to every user of the
machine): they come from files (a Kubernetes Secret mounted as a volume) or from environment
variables (a Secret as env), read once at start. Files hold one entry per line, `#` comments:

    api keys file      KEY=TENANT       (LORAPLEX_API_KEYS: "KEY=TENANT,KEY=TENANT")
    admin keys file    KEY              (LORAPLEX_ADMIN_KEYS: "KEY,KEY")
    service key file   KEY              (LORAPLEX_SERVICE_KEY: "KEY")

A service configured with no key at all runs open (the embedded single-machine default): every
caller is an operator, and a request's tenant field is taken as given. Configure keys for
anything reachable by more than one party.

Keys are held as SHA-256 digests and looked up by digest, so a lookup's time does not depend on
how much of a wrong key matches a right one.
"""

import dataclasses
import enum
import hashlib
import logging
import os
from collections.abc import Iterable, Mapping

import grpc

from common import wire
from common.errors import InvalidArgument, PermissionDenied, Unauthenticated

log = logging.getLogger(__name__)

_MIN_KEY_CHARS = 16


class Role(enum.Enum):
    TENANT = "tenant"
    SERVICE = "service"
    ADMIN = "admin"


@dataclasses.dataclass(frozen=True)
class Caller:
    role: Role
    tenant: str = ""  # the tenant of a tenant key; "" for services and admins

    @property
    def is_trusted(self) -> bool:
        """Services and admins may act on behalf of any tenant."""
        return self.role is not Role.TENANT


OPERATOR = Caller(Role.ADMIN)  # every caller of a service that runs open
DEFAULT_TENANT = "default"  # the tenant of every request to a service that runs open


@dataclasses.dataclass(frozen=True)
class KeySources:
    """Where a service reads its keys: files and environment variables (never flags' values)."""

    api_keys_file: str = ""
    admin_keys_file: str = ""
    service_key_file: str = ""

    def load(self, environ: Mapping[str, str] | None = None) -> "KeyRing":
        """The keys, in order. A file named but holding no key is an error, not open access.
        The first service key (its file's first line, else LORAPLEX_SERVICE_KEY) is the one
        this service presents; every one listed is accepted (a rotation lists old and new)."""
        env = os.environ if environ is None else environ
        tenants = _pairs(_lines(self.api_keys_file), "api keys file")
        tenants.update(_pairs(_split(env.get("LORAPLEX_API_KEYS", "")), "LORAPLEX_API_KEYS"))
        admins = _lines(self.admin_keys_file) + _split(env.get("LORAPLEX_ADMIN_KEYS", ""))
        services = _lines(self.service_key_file) + _split(env.get("LORAPLEX_SERVICE_KEY", ""))
        return KeyRing(tenants, admins, services)


def add_key_arguments(parser) -> None:
    """The --*-keys-file flags of a service (argparse)."""
    parser.add_argument("--api-keys-file", default="",
                        help="file of KEY=TENANT lines (also LORAPLEX_API_KEYS=KEY=TENANT,...)")
    parser.add_argument("--admin-keys-file", default="",
                        help="file of admin keys, one per line (also LORAPLEX_ADMIN_KEYS)")
    parser.add_argument("--service-key-file", default="",
                        help="file holding the key services use with each other (also "
                             "LORAPLEX_SERVICE_KEY)")


def sources_from_args(args) -> KeySources:
    return KeySources(args.api_keys_file, args.admin_keys_file, args.service_key_file)


class KeyRing:
    """Keys -> callers. Empty: the service runs open."""

    def __init__(self, tenant_keys: Mapping[str, str] | None = None,
                 admin_keys: Iterable[str] = (), service_keys: Iterable[str] = ()):
        self._callers: dict[bytes, Caller] = {}
        self.service_key = ""  # the key this service presents to others ("" = none)
        for key, tenant in (tenant_keys or {}).items():
            self._add(key, Caller(Role.TENANT, tenant))
        for key in admin_keys:
            self._add(key, Caller(Role.ADMIN))
        for key in service_keys:
            self._add(key, Caller(Role.SERVICE))
            self.service_key = self.service_key or key

    def _add(self, key: str, caller: Caller) -> None:
        if len(key) < _MIN_KEY_CHARS:
            raise ValueError(f"{_a(caller.role.value)} key is shorter than {_MIN_KEY_CHARS} "
                             "characters; use a long random key (e.g. openssl rand -hex 24)")
        if caller.role is Role.TENANT and not caller.tenant:
            raise ValueError("a tenant key needs a tenant name: KEY=TENANT")
        digest = _digest(key)
        if digest in self._callers and self._callers[digest] != caller:
            raise ValueError(f"one key is given twice, as {self._callers[digest].role.value} and "
                             f"as {caller.role.value}")
        self._callers[digest] = caller

    @property
    def is_open(self) -> bool:
        return not self._callers

    @property
    def tenants(self) -> set[str]:
        return {c.tenant for c in self._callers.values() if c.role is Role.TENANT}

    def identify(self, key: str) -> Caller | None:
        return self._callers.get(_digest(key)) if key else None

    def caller(self, context: grpc.aio.ServicerContext) -> Caller:
        """Who is calling; UNAUTHENTICATED without a known key (OPERATOR when open)."""
        return self.authenticate(bearer(context.invocation_metadata() or ()))

    def authenticate(self, key: str) -> Caller:
        """Who presents `key` (from gRPC metadata or an HTTP header); UNAUTHENTICATED when it
        is missing or unknown (OPERATOR when open)."""
        if self.is_open:
            return OPERATOR
        caller = self.identify(key)
        if caller is None:
            raise Unauthenticated(f"missing or unknown API key: send "
                                  f"'{wire.AUTHORIZATION}: {wire.BEARER}<key>'")
        return caller

    def check(self, caller: Caller, *roles: Role) -> Caller:
        """`caller`, if it has one of `roles` (anyone, when open); PERMISSION_DENIED
        otherwise."""
        if caller.role not in roles and not self.is_open:
            wanted = " or ".join(_a(f"{r.value} key") for r in roles)
            raise PermissionDenied(f"this call needs {wanted}; the key given is "
                                   f"{_a(caller.role.value + ' key')}")
        return caller

    def require(self, context: grpc.aio.ServicerContext, *roles: Role) -> Caller:
        """The caller, if it has one of `roles` (anyone, when open); PERMISSION_DENIED
        otherwise."""
        return self.check(self.caller(context), *roles)


def request_tenant(caller: Caller, is_open: bool, on_behalf_of: str, unnamed: str) -> str:
    """The tenant a request is for (its queue, rate limit and adapters): DEFAULT_TENANT when the
    service runs open, a tenant key's own tenant (whatever the request names), else the tenant
    a service key names on behalf of (`on_behalf_of`: from metadata or a field); INVALID_ARGUMENT
    with the message `unnamed` when it names none. Check the caller's role first."""
    if is_open:
        return DEFAULT_TENANT
    if caller.role is Role.TENANT:
        return caller.tenant
    if not on_behalf_of:
        raise InvalidArgument(unnamed)
    return on_behalf_of


def acting_tenant(caller: Caller, requested: str) -> str:
    """The tenant a request acts as: a tenant key's own (a request naming another tenant is
    PERMISSION_DENIED), or for services and admins the tenant the request names ("" = none: a
    trusted view of every adapter)."""
    if caller.is_trusted:
        return requested
    if requested and requested != caller.tenant:
        raise PermissionDenied(f"a tenant key acts as its own tenant only; this request names "
                               f"tenant {requested[:100]!r}")
    return caller.tenant


def bearer(metadata: Iterable[tuple[str, str | bytes]]) -> str:
    """The key of an `authorization: Bearer <key>` entry, "" when there is none. The scheme is
    case-insensitive ("bearer", "BEARER": RFC 7235); a value without it is taken as the key."""
    for name, value in metadata:
        if name == wire.AUTHORIZATION and isinstance(value, str):
            if value[:len(wire.BEARER)].lower() == wire.BEARER.lower():
                value = value[len(wire.BEARER):]
            return value.strip()
    return ""


def metadata(key: str) -> tuple[tuple[str, str], ...]:
    """The metadata that presents `key` ("" presents none)."""
    return ((wire.AUTHORIZATION, f"{wire.BEARER}{key}"),) if key else ()


def _a(noun: str) -> str:
    """"an admin key", "a tenant key"."""
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _lines(path: str) -> list[str]:
    if not path:
        return []
    with open(path) as f:
        lines = [line.strip() for line in f
                 if line.strip() and not line.lstrip().startswith("#")]
    if not lines:
        raise ValueError(f"key file {path} holds no key: refusing to start with it (an empty "
                         "file would leave the service open to every caller)")
    return lines


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _pairs(items: list[str], what: str) -> dict[str, str]:
    pairs = {}
    for item in items:
        key, sep, tenant = item.partition("=")
        if not sep or not key.strip() or not tenant.strip():
            raise ValueError(f"{what}: an entry is not KEY=TENANT (the key is not shown)")
        pairs[key.strip()] = tenant.strip()
    return pairs
