"""Which base model an executor serves: the fingerprint of its model folder
(common/base_fingerprint.py), and the id adapters' base_model must say.

The id, in order: --model-id when given; else the id the adapter store registered this
fingerprint under (`loraplex adapters base add`), asked of the stores at start within
--resolve-base-s; else the model's own (config.json's _name_or_path, or the folder's name). So an
executor started from any copy of a registered model, under any folder name, serves the adapters
the store matched to that base. When the stores cannot be asked (down, slow), the folder's name is
kept and said in the log; adapters matched to the base still fit by fingerprint (the scheduler and
the loader compare AdapterInfo.base_fingerprint with this one), but a pool's executors should
then be given --model-id to agree on one id.
"""

import asyncio
import dataclasses
import logging
import time

import grpc

from common.base_fingerprint import base_fingerprint
from common.server import insecure_channel
from executor.config import ExecutorConfig
from protos import adapter_store_pb2, adapter_store_pb2_grpc

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ModelIdentity:
    model_id: str  # "" = the model's own (its config's _name_or_path, or its folder's name)
    fingerprint: str  # "" for random weights and folders without safetensors weights
    source: str  # where model_id came from, for the log


async def resolve_identity(config: ExecutorConfig, service_key: str) -> ModelIdentity:
    """The served model's fingerprint and id (see the module docstring); every wait bounded by
    config.resolve_base_s."""
    if config.random_config is not None:
        return ModelIdentity(config.model_id, "", "--model-id" if config.model_id else
                             "the random model's name")
    fingerprint = await asyncio.to_thread(base_fingerprint, config.model) or ""
    if config.model_id:
        return ModelIdentity(config.model_id, fingerprint, "--model-id")
    if not fingerprint:
        return ModelIdentity("", "", "the model folder (no safetensors weights to fingerprint)")
    if config.resolve_base_s == 0:
        return ModelIdentity("", fingerprint, "the model folder (--resolve-base-s 0: the stores "
                                              "were not asked)")
    registered, why = await registered_id(config.stores, fingerprint, service_key,
                                          config.resolve_base_s)
    if registered:
        return ModelIdentity(registered, fingerprint, why)
    return ModelIdentity("", fingerprint, f"the model folder ({why})")


async def registered_id(stores: tuple[str, ...], fingerprint: str, service_key: str,
                        timeout_s: float) -> tuple[str, str]:
    """(the id a store registered `fingerprint` under, or "", and why), asking the stores in
    order within `timeout_s` in all. The stores share one registry: the first answer counts."""
    deadline = time.monotonic() + timeout_s
    failures = []
    for address in stores:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            failures.append(f"{address}: not asked, --resolve-base-s {timeout_s:g} s spent")
            continue
        async with insecure_channel(address, service_key) as channel:
            stub = adapter_store_pb2_grpc.AdapterStoreStub(channel)
            try:
                base = await stub.GetBaseModel(
                    adapter_store_pb2.GetBaseModelRequest(fingerprint=fingerprint),
                    timeout=remaining)
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND:
                    return "", f"no base model registered at {address} has its fingerprint"
                failures.append(f"{address}: {err.code().name} {err.details()}")
                continue
        return base.model_id, f"the base model registered at {address} with its fingerprint"
    return "", "no store answered which base has its fingerprint: " + "; ".join(failures)


def log_identity(identity: ModelIdentity, model_id: str) -> None:
    log.info("executor: model id %r, from %s; fingerprint %s", model_id, identity.source,
             identity.fingerprint[:16] + "..." if identity.fingerprint else "none")
