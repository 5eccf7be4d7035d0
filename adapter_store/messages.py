"""The store's records as protobuf messages and back: AdapterRecord and BaseModel out, a pusher's
VersionMetadata in (checked). Plain conversions, no I/O."""

import bisect
import dataclasses
from collections.abc import Callable, Sequence

from adapter_store.base_models import BaseModel, MatchKind
from adapter_store.records import AdapterRecord, VersionMeta
from common.adapter_ref import AdapterRef, check_alias
from common.errors import InvalidArgument
from protos import adapter_store_pb2 as pb
from protos import common_pb2

_MAX_METADATA_CHARS = 256  # training_dataset, base_model_revision, an eval score's name
_MAX_EVAL_SCORES = 64
_MAX_ALIASES = 16  # set by one push
_INFO_FIELDS = tuple(common_pb2.AdapterInfo.DESCRIPTOR.fields_by_name)
_BASE_MATCH = {kind.value: common_pb2.BaseMatch.Value(f"BASE_MATCH_{kind.name}")
               for kind in MatchKind}  # "" (manifests written before matching): UNSPECIFIED


def record_to_pb(record: AdapterRecord) -> common_pb2.AdapterInfo:
    fields = dataclasses.asdict(record)
    fields["base_match"] = _BASE_MATCH.get(record.base_match, common_pb2.BASE_MATCH_UNSPECIFIED)
    fields["base_model_name_or_path"] = record.base_model_name_or_path or record.base_model
    return common_pb2.AdapterInfo(**{k: fields[k] for k in _INFO_FIELDS})


def base_to_pb(base: BaseModel, for_tenant: bool = False) -> pb.BaseModelInfo:
    """`for_tenant`: without the names that are paths on the servers' disks (a folder `loraplex
    up` or an operator registered), which tell a tenant of the servers and serve it nothing."""
    names = [n for n in base.names if not (for_tenant and n.startswith(("/", "~", ".")))]
    return pb.BaseModelInfo(model_id=base.model_id, revision=base.revision,
                            config_sha256=base.config_sha256, num_layers=base.num_layers,
                            fingerprint=base.fingerprint, names=names)


def record_to_details(record: AdapterRecord, aliases: list[str]) -> pb.AdapterDetails:
    return pb.AdapterDetails(
        info=record_to_pb(record), base_model_revision=record.base_model_revision,
        base_config_sha256=record.base_config_sha256, dtype=record.dtype,
        rank_pattern=record.rank_pattern, alpha_pattern=record.alpha_pattern,
        training_dataset=record.training_dataset, eval_scores=record.eval_scores,
        source=record.source, aliases=aliases)


def meta_from_pb(metadata: pb.VersionMetadata) -> tuple[VersionMeta, list[str]]:
    """The pusher's statements, checked, and the aliases to set once the version exists."""
    for field, text in (("training_dataset", metadata.training_dataset),
                        ("base_model_revision", metadata.base_model_revision),
                        *(("eval_scores key", name) for name in metadata.eval_scores)):
        if len(text) > _MAX_METADATA_CHARS:
            raise InvalidArgument(f"metadata.{field} is longer than {_MAX_METADATA_CHARS} "
                                  "characters")
        if not text.isprintable():  # (a tenant's words on an operator's terminal)
            raise InvalidArgument(f"metadata.{field} {text[:40]!r} holds a control character")
    for field, items, limit in (("eval_scores", metadata.eval_scores, _MAX_EVAL_SCORES),
                                ("aliases", metadata.aliases, _MAX_ALIASES)):
        if len(items) > limit:
            raise InvalidArgument(f"metadata.{field} has {len(items)} entries; at most {limit}")
    for alias in metadata.aliases:
        check_alias(alias)
    meta = VersionMeta(training_dataset=metadata.training_dataset,
                       eval_scores=dict(metadata.eval_scores),
                       base_model_revision=metadata.base_model_revision)
    meta.check()  # (at the header, before any upload)
    return meta, list(metadata.aliases)


LIST_PAGE_VERSIONS = 1000  # versions in one ListAdapters answer at most
LIST_PAGE_BYTES = 4 << 20  # and its messages' bytes (a version's config alone may be 64 KiB)


def list_page(records: Sequence[AdapterRecord], aliases_of: Callable[[AdapterRecord], list[str]],
              page_size: int, page_token: str) -> pb.ListAdaptersResponse:
    """One page of `records` (sorted by name, then version): those after `page_token` (the last
    one of the page before, "name@version"), up to page_size versions (0: the most) and
    LIST_PAGE_BYTES, with the token of its last if more follow."""
    start = 0
    if page_token:
        try:
            last = AdapterRef.parse(page_token)
        except InvalidArgument:
            raise InvalidArgument(f"page_token {page_token[:100]!r} is not one a ListAdapters "
                                  "answer gave") from None
        start = bisect.bisect_right([(r.name, r.version) for r in records],
                                    (last.name, last.version))
    size = min(page_size or LIST_PAGE_VERSIONS, LIST_PAGE_VERSIONS)
    page, num_bytes = pb.ListAdaptersResponse(), 0
    for record in records[start:start + size]:
        details = record_to_details(record, aliases_of(record))
        num_bytes += details.ByteSize()
        if page.adapters and num_bytes > LIST_PAGE_BYTES:
            break
        page.adapters.append(details)
    end = start + len(page.adapters)
    if end < len(records):
        page.next_page_token = str(AdapterRef(records[end - 1].name, records[end - 1].version))
    return page
