"""Reading rendered manifests: objects by kind, each service's Deployment and container, and the
configuration a container's command line gives its service, parsed by the service's own flags."""

import argparse
import contextlib
import io
import re
from collections.abc import Callable, Mapping
from unittest import mock

from adapter_store.config import parse_args as store_args
from executor.config import ExecutorConfig
from gateway.config import GatewayConfig
from scheduler.config import SchedulerConfig

# The module a container runs (`python -m MODULE`) -> how that module turns its command line (and
# its environment, for the store's LORAPLEX_* variables) into its config, as its main() does.
SERVICE_CONFIGS: dict[str, Callable[[list[str], Mapping[str, str]], object]] = {
    "gateway.service": lambda argv, env: GatewayConfig.from_args(argv),
    "scheduler.service": lambda argv, env: SchedulerConfig.from_args(argv),
    "executor.service": lambda argv, env: ExecutorConfig.from_args(argv),
    "adapter_store.service": lambda argv, env: store_args(argv, environ=env),
}


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def deployments(objects: list[dict]) -> dict[str, dict]:
    """component label -> Deployment."""
    return {d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]: d
            for d in by_kind(objects, "Deployment").values()}


def container(deployment: dict) -> dict:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def container_env(objects: list[dict], deployment: dict) -> dict[str, str]:
    """The variables the container starts with: envFrom's ConfigMaps and Secrets, then env
    (which wins), with the pod's namespace for a metadata.namespace fieldRef."""
    sources = {("configMapRef", n): o.get("data", {})
               for n, o in by_kind(objects, "ConfigMap").items()}
    sources |= {("secretRef", n): {**o.get("stringData", {}), **o.get("data", {})}
                for n, o in by_kind(objects, "Secret").items()}
    c = container(deployment)
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        ((kind, ref),) = source.items()
        env |= sources[(kind, ref["name"])]
    namespace = deployment["metadata"].get("namespace", "default")
    for var in c.get("env", []):
        field = var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        env[var["name"]] = namespace if field == "metadata.namespace" else var.get("value", "")
    return env


def service_config(objects: list[dict], deployment: dict):
    """The config the container's service builds from its args, $(NAME) expanded as Kubernetes
    expands it. Flags must be spelt in full (argparse would take a unique prefix; a manifest
    must not rely on that). A flag the service does not have, or a value it refuses, is an
    AssertionError with the service's own message."""
    c = container(deployment)
    env = container_env(objects, deployment)
    argv = [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), a)
            for a in c.get("args", [])]
    module = c["command"][2]
    assert module in SERVICE_CONFIGS, f"no flag contract for {module}: add it to SERVICE_CONFIGS"
    parse_args = argparse.ArgumentParser.parse_args

    def parse_in_full(parser, *args, **kwargs):
        parser.allow_abbrev = False
        return parse_args(parser, *args, **kwargs)

    errors = io.StringIO()
    try:
        with (mock.patch.object(argparse.ArgumentParser, "parse_args", parse_in_full),
              contextlib.redirect_stderr(errors)):
            return SERVICE_CONFIGS[module](argv, env)
    except SystemExit:
        raise AssertionError(f"{module} refuses its manifest's args {argv}: "
                             f"{errors.getvalue().strip().splitlines()[-1]}") from None
    except ValueError as err:
        raise AssertionError(f"{module} refuses its manifest's args {argv}: {err}") from None
