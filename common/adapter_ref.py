"""How adapters are named: the reference a client writes, and the exact version it resolves to.

    AdapterQuery  what a client writes: "support-bot", "support-bot@3", "support-bot@latest",
                  "support-bot@prod" (an alias an owner moves between versions)
    AdapterRef    one immutable version, name@version: what crosses every boundary once resolved
                  (proto message loraplex.v1.AdapterRef). A slot, a lease, a load, a prefix-cache
                  key hold an AdapterRef; nothing else builds or splits "name@version" strings.

Names are 1-128 characters of A-Z a-z 0-9 . _ - (not "." or ".."); aliases 1-64 of the same,
starting with a letter, never "latest"; versions 1..2^32-1.
"""

import dataclasses
import re

from common.errors import InvalidArgument, NotFound
from protos import common_pb2

MAX_VERSION = 2**32 - 1  # versions are uint32 on the wire
# Matched with fullmatch: "$" would also accept a trailing newline.
_NAME = r"[A-Za-z0-9._-]{1,128}"
_ALIAS = r"[A-Za-z][A-Za-z0-9._-]{0,63}"
_VERSION = r"[1-9][0-9]{0,9}"
_NAME_RE = re.compile(_NAME)
_ALIAS_RE = re.compile(_ALIAS)
_REF_RE = re.compile(rf"(?P<name>{_NAME})@(?P<version>{_VERSION})")
_QUERY_RE = re.compile(rf"(?P<name>{_NAME})(@((?P<version>{_VERSION})|(?P<alias>{_ALIAS})))?")


def not_found(name: str) -> NotFound:
    """The answer for a name that does not exist and for another tenant's: the same words."""
    return NotFound(f"adapter {name[:200]!r} not found; push it first or check the name")


def check_name(name: str) -> None:
    if not _NAME_RE.fullmatch(name) or name in (".", ".."):
        raise InvalidArgument(f"adapter name {name[:200]!r} is invalid: use 1-128 characters of "
                              "A-Z a-z 0-9 . _ - (not '.' or '..')")


def check_alias(alias: str) -> None:
    if not _ALIAS_RE.fullmatch(alias) or alias == "latest":
        raise InvalidArgument(f"alias {alias[:200]!r} is invalid: 1-64 characters of "
                              "A-Z a-z 0-9 . _ -, starting with a letter, not 'latest'")


def check_version(version: int) -> None:
    if not 1 <= version <= MAX_VERSION:
        raise InvalidArgument(f"adapter version {version} is out of range 1..{MAX_VERSION}")


@dataclasses.dataclass(frozen=True, order=True)
class AdapterRef:
    """One immutable adapter version."""

    name: str
    version: int

    def __post_init__(self) -> None:
        check_name(self.name)
        check_version(self.version)

    def __str__(self) -> str:
        return f"{self.name}@{self.version}"

    @classmethod
    def parse(cls, text: str) -> "AdapterRef":
        """"name@version" exactly as str() writes it (no sign, no leading zero)."""
        match = _REF_RE.fullmatch(text)
        if match is None:
            raise InvalidArgument(f"{text[:200]!r} is not an adapter version: use name@version, "
                                  "e.g. support-bot@3")
        return cls(match["name"], int(match["version"]))

    @classmethod
    def from_pb(cls, pb: common_pb2.AdapterRef) -> "AdapterRef":
        return cls(pb.name, pb.version)

    @classmethod
    def of(cls, info: common_pb2.AdapterInfo) -> "AdapterRef":
        """The version an adapter's registry record is of."""
        return cls(info.name, info.version)

    @classmethod
    def from_optional_pb(cls, pb: common_pb2.AdapterRef) -> "AdapterRef | None":
        """None for an unset or empty message (no adapter: the base model, an empty slot)."""
        return cls.from_pb(pb) if pb.name or pb.version else None

    def to_pb(self) -> common_pb2.AdapterRef:
        return common_pb2.AdapterRef(name=self.name, version=self.version)


@dataclasses.dataclass(frozen=True)
class AdapterQuery:
    """A client's reference: the latest version (version 0, no alias), one version, or an alias."""

    name: str
    version: int = 0
    alias: str = ""

    @classmethod
    def parse(cls, text: str) -> "AdapterQuery":
        match = _QUERY_RE.fullmatch(text)
        if match is None or match["name"] in (".", ".."):
            raise InvalidArgument(
                f"adapter {text[:200]!r} is not of the form name, name@<version>, name@latest or "
                "name@<alias> (name: 1-128 of A-Z a-z 0-9 . _ -; version: a number from 1; "
                "alias: starts with a letter)")
        version = int(match["version"] or 0)
        if version:
            check_version(version)
        alias = match["alias"] or ""
        return cls(match["name"], version, "" if alias == "latest" else alias)

    def __str__(self) -> str:
        tail = str(self.version) if self.version else self.alias
        return f"{self.name}@{tail}" if tail else self.name
