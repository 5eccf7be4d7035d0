"""What `loraplex up` checks before it starts anything, each failure one line (UpError): the key
files, the model folder (config.json of a served family, safetensors weights), the model id, and
that every port it will take is free. Then the base model's registration in the store's blob
store (`register_base`), so adapters made for the model match it by fingerprint or by path."""

import dataclasses
import pathlib
import socket

from common.credentials import KeySources


class UpError(Exception):
    """A reason `up` cannot start, in one line."""


@dataclasses.dataclass(frozen=True)
class Checked:
    model_dir: str
    model_id: str
    fingerprint: str
    config_json: str


def check(args, state: pathlib.Path) -> Checked:
    """Every check, in the order a person would fix them; the fixture model is built (once) when
    no --model is given."""
    _check_keys(args)
    if args.model:
        model_dir = pathlib.Path(args.model).expanduser().resolve()
    else:
        model_dir = _fixture_model(state / "fixtures")
    fingerprint = _check_model(model_dir, args.model or str(model_dir))
    model_id = args.model_id or model_dir.name
    _check_model_id(model_id, bool(args.model_id))
    _check_ports(_ports(args))
    return Checked(str(model_dir), model_id, fingerprint,
                   (model_dir / "config.json").read_text())


def _check_keys(args) -> None:
    """The key files parse and hold long enough keys, as each service will read them."""
    sources = KeySources(args.api_keys_file, args.admin_keys_file, args.service_key_file)
    try:
        sources.load()
    except FileNotFoundError as err:
        raise UpError(f"key file {err.filename}: no such file") from None
    except (ValueError, OSError) as err:
        raise UpError(str(err)) from None


def _fixture_model(out: pathlib.Path) -> pathlib.Path:
    from loraplex import fixtures

    if not fixtures.is_made(out):
        print(f"building the fixture model and adapters under {out} (first run only, about "
              "10 s)", flush=True)
    return pathlib.Path(fixtures.ensure(out)["model_dir"])


def _check_model(model_dir: pathlib.Path, given: str) -> str:
    """The model folder's fingerprint, once it is known to hold a model of a served family (its
    config.json's other fields the executor checks as it starts: an error there is one line too)."""
    import json

    from common.base_fingerprint import base_fingerprint
    from common.model_families import read_config

    if not model_dir.is_dir():
        raise UpError(f"--model {given}: no such folder")
    if not (model_dir / "config.json").is_file():
        raise UpError(f"--model {given}: no config.json there: give a Hugging Face model folder "
                      "(config.json and safetensors weights)")
    try:
        config = json.loads((model_dir / "config.json").read_text())
        if not isinstance(config, dict):
            raise ValueError("config.json is not a JSON object")
        read_config(config)
        fingerprint = base_fingerprint(model_dir)
    except (ValueError, OSError) as err:
        raise UpError(f"--model {given}: {str(err).removeprefix('model config: ')}") from None
    if fingerprint is None:
        raise UpError(f"--model {given}: no safetensors weights there (model.safetensors, or "
                      "the shards model.safetensors.index.json lists)")
    return fingerprint


def _check_model_id(model_id: str, given: bool) -> None:
    from adapter_store.base_models import check_model_id
    from common.errors import InvalidArgument

    try:
        check_model_id(model_id)
    except InvalidArgument as err:
        where = "" if given else " (the model folder's name; give one with --model-id)"
        raise UpError(f"{err}{where}") from None


def _ports(args) -> list[tuple[int, str]]:
    """(port, what takes it) for every port `up` will listen on."""
    base = args.base_port
    ports = [(base, "the scheduler")]
    ports += [(base + 1 + i, f"adapter store {i}") for i in range(args.stores)]
    ports += [(base + 1 + args.stores + i, f"executor {i}") for i in range(args.executors)]
    if not args.no_gateway:
        ports += [(base - 1, "the gateway's gRPC"), (args.http_port, "the gateway's HTTP")]
    return ports


def _check_ports(ports: list[tuple[int, str]]) -> None:
    taken = [(port, what) for port, what in ports if not _is_free(port)]
    if taken:
        where = ", ".join(f"{port} ({what})" for port, what in taken)
        raise UpError(f"port{'s' if len(taken) > 1 else ''} {where} already in use on 127.0.0.1: "
                      "is another `loraplex up` running? Stop it, or give other ports "
                      "(--base-port, --http-port)")


def _is_free(port: int) -> bool:
    if not 0 < port < 65536:
        raise UpError(f"port {port} is out of range 1-65535 (--base-port, --http-port)")
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as the services bind)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def register_base(store_url: str, store_args: list[str], checked: Checked) -> str:
    """Register the served model as a base model (its id, config.json, fingerprint and folder)
    in the blob store the stores will serve, before they start: a push made the moment a store
    answers (`loraplex up &` then a push at once) is already matched to it, whether its
    base_model_name_or_path is this folder, a copy of it or the id. The line to print."""
    from adapter_store.base_models import BaseModels
    from adapter_store.blob_backends import open_blob_store
    from adapter_store.config import parse_args
    from common.errors import LoraplexError
    from common.server import run

    async def register() -> None:
        blobs = await open_blob_store(parse_args(["--url", store_url, *store_args]))
        try:
            await BaseModels(blobs).register(checked.model_id, checked.config_json,
                                             fingerprint=checked.fingerprint,
                                             names=[checked.model_dir])
        finally:
            await blobs.close()

    try:
        run(register)
    except (LoraplexError, ValueError, OSError) as err:
        return (f"note: base model {checked.model_id} not registered in the store ({err}); "
                f"adapters must name it {checked.model_id!r} in their base_model_name_or_path")
    return (f"base model {checked.model_id} registered in the store (fingerprint "
            f"{checked.fingerprint[:16]}...): adapters made for it match by its id, its folder "
            "or any copy of it")
