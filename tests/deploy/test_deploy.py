"""The Kubernetes manifests in deploy/ (the Dockerfile is checked in
tests/deploy/test_dockerfile.py).

Every kustomization is rendered without a kustomize binary (tests/deploy/kustomize.py,
cross-checked against `kubectl kustomize` where kubectl exists), validated against the Kubernetes
JSON schemas that kubernetes-validate ships (offline, strict: unknown fields fail), and held to the
rules the services need: native gRPC probes on the right port, a grace period that covers the
drain, a GPU per executor, secrets only in Secrets. Every container's args are parsed by its own
service's flags (tests/deploy/manifests.py); the gateway's own rules are in test_gateway.py.
"""

import copy
import json
import re
import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml

from common.server import NOT_SERVING_NOTICE_S
from tests.deploy.contract import (
    COMPONENTS,
    DEPLOY,
    DRAINS,
    HTTP_PORTS,
    METRICS_PORT,
    RENDERINGS,
    ROOT,
    RUN_AS_USER,
)
from tests.deploy.kustomize import render
from tests.deploy.manifests import by_kind, container, deployments, service_config

GPU_RENDERINGS = ["base", "overlays/production", "overlays/tensor-parallel"]
# Native gRPC probes are GA from 1.27 (the oldest version we support); 1.37 is the newest
# schema set the pinned kubernetes-validate ships.
K8S_VERSIONS = ["1.27.0", "1.37.0"]
# Names of configuration that must come from a Secret (MAX_BATCHED_TOKENS is no secret).
SECRET_NAME_RE = re.compile(r"(API|ADMIN|ACCESS|SECRET|AUTH)_?KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL"
                            r"|(AUTH|ACCESS|BEARER|API|SESSION|REFRESH)_?TOKEN", re.IGNORECASE)


# --- schemas ----------------------------------------------------------------------------------

@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_validates_against_the_kubernetes_schemas(rendering, version):
    name, objects = rendering
    assert len(objects) >= 12, f"{name}: rendered only {len(objects)} objects"
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{name}: {obj['kind']}/{obj['metadata']['name']} is not valid "
                        f"Kubernetes {version}: {e.message} at {list(e.absolute_path)}")


def test_the_validator_catches_a_misspelt_probe_field():
    """The schema check is live: an unknown field in a probe fails strict validation."""
    executor = copy.deepcopy(deployments(render(DEPLOY / "base"))["executor"])
    container(executor)["readinessProbe"]["grpc"] = {"prot": 50053}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(executor, K8S_VERSIONS[0], strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None,
                    reason="kubectl (its built-in kustomize) not installed")
@pytest.mark.parametrize("name", RENDERINGS)
def test_the_renderer_agrees_with_kubectl_kustomize(name):
    out = subprocess.run(["kubectl", "kustomize", str(DEPLOY / name)], capture_output=True,
                         text=True, timeout=60, check=True).stdout

    def key(o):
        return o["kind"], o["metadata"]["name"]

    expected = sorted((d for d in yaml.safe_load_all(out) if d), key=key)
    ours = sorted(render(DEPLOY / name), key=key)
    assert [key(o) for o in ours] == [key(o) for o in expected]
    for mine, theirs in zip(ours, expected):
        assert json.dumps(mine, sort_keys=True) == json.dumps(theirs, sort_keys=True), key(mine)


# --- what the services need -------------------------------------------------------------------

def test_one_deployment_per_service_with_native_grpc_probes_on_its_port(rendering):
    name, objects = rendering
    found = deployments(objects)
    assert set(found) == set(COMPONENTS), name
    for component, deployment in found.items():
        port = COMPONENTS[component][0]
        c = container(deployment)
        http = {"http": HTTP_PORTS[component]} if component in HTTP_PORTS else {}
        assert {p["name"]: p["containerPort"] for p in c["ports"]} == {
            "grpc": port, "metrics": METRICS_PORT, **http}, f"{name}/{component}"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            handlers = set(c[probe]) & {"grpc", "httpGet", "tcpSocket", "exec"}
            assert handlers == {"grpc"}, f"{name}/{component}: {probe} must be a native gRPC probe"
            assert c[probe]["grpc"]["port"] == port, f"{name}/{component}: {probe} port"
        # --address, or the store's LORAPLEX_STORE_ADDRESS, as the service itself reads it.
        assert service_config(objects, deployment).address == f"0.0.0.0:{port}", \
            f"{name}/{component}"


def test_every_flag_in_a_manifest_is_one_its_service_has(rendering):
    """Each container's args, $(NAME) expanded, parse with its service's own flags (in full, no
    abbreviations) and make a valid config: a misspelt or removed flag fails here, not at a
    pod's start."""
    _, objects = rendering
    for deployment in deployments(objects).values():
        service_config(objects, deployment)


def test_the_flag_contract_catches_a_flag_the_service_lacks():
    objects = render(DEPLOY / "base")
    for component, wrong in [("gateway", "--pools=base=loraplex-scheduler:50051"),
                             ("gateway", "--max-body=5"), ("executor", "--kv-block=64")]:
        deployment = copy.deepcopy(deployments(objects)[component])
        container(deployment)["args"].append(wrong)
        with pytest.raises(AssertionError, match="unrecognized arguments"):
            service_config(objects, deployment)


def test_termination_grace_covers_the_drain(rendering):
    """SIGTERM comes after the preStop pause; then the service reports NOT_SERVING for a notice
    and drains each of its servers in turn within --grace-s: all of it inside the grace."""
    name, objects = rendering
    for component, deployment in deployments(objects).items():
        pod = deployment["spec"]["template"]["spec"]
        pre_stop = container(deployment).get("lifecycle", {}).get("preStop", {})
        pause = int(pre_stop["exec"]["command"][-1]) if pre_stop else 0
        grace = pod["terminationGracePeriodSeconds"]
        assert grace >= COMPONENTS[component][1], f"{name}/{component}"
        assert pause < grace / 4, f"{name}/{component}: preStop eats the drain"
        drain_s = DRAINS.get(component, 1) * service_config(objects, deployment).grace_s
        assert pause + NOT_SERVING_NOTICE_S + drain_s < grace, \
            f"{name}/{component}: killed before its --grace-s drain ends"


@pytest.mark.parametrize("name", GPU_RENDERINGS)
def test_each_executor_requests_a_gpu_per_rank(name):
    """One GPU, or with --tensor-parallel N as many as its ranks (each takes cuda:r)."""
    objects = render(DEPLOY / name)
    executor = deployments(objects)["executor"]
    resources = container(executor)["resources"]
    gpus = str(service_config(objects, executor).tensor_parallel)
    assert resources["limits"]["nvidia.com/gpu"] == gpus
    assert resources["requests"]["nvidia.com/gpu"] == gpus
    config = by_kind(render(DEPLOY / name), "ConfigMap")["loraplex-executor-config"]["data"]
    assert (config["EXECUTOR_DEVICE"], config["EXECUTOR_DTYPE"]) == ("cuda", "bfloat16")


def test_only_gpu_executors_ask_for_gpus():
    for obj in render(DEPLOY / "overlays/cpu-smoke"):
        assert "nvidia.com/gpu" not in json.dumps(obj), f"{obj['kind']}/{obj['metadata']['name']}"


def test_secrets_stay_in_secrets(rendering):
    name, objects = rendering
    secret_values = {v for s in by_kind(objects, "Secret").values()
                     for v in {**s.get("stringData", {}), **s.get("data", {})}.values()}
    assert secret_values, f"{name}: no Secret holds the API keys"
    for cm in by_kind(objects, "ConfigMap").values():
        for key, value in cm.get("data", {}).items():
            assert not SECRET_NAME_RE.search(key), \
                f"{name}: ConfigMap key {key} looks like a secret"
            assert value not in secret_values, f"{name}: ConfigMap {key} holds a Secret's value"
    for component, deployment in deployments(objects).items():
        c = container(deployment)
        for env in c.get("env", []):
            if SECRET_NAME_RE.search(env["name"]):
                assert "secretKeyRef" in env.get("valueFrom", {}), \
                    f"{name}/{component}: {env['name']}"
        literal = json.dumps([c.get("args", []), c.get("command", []), c.get("env", [])])
        assert not any(v in literal for v in secret_values), \
            f"{name}/{component}: a secret in the spec"
    # Keys are files from the keys Secret, named by --*-keys-file flags; never a flag's value.
    # The gateway takes tenants' keys and the service key, no admin key (it grants admins nothing).
    flag_files = {"scheduler": 3, "adapter-store": 3, "executor": 1, "gateway": 2}
    for component, expected in flag_files.items():
        c = container(deployments(objects)[component])
        args = c.get("args", [])
        assert not [a for a in args if a.startswith(("--api-key=", "--admin-key="))], component
        files = [a.split("=", 1)[1] for a in args
                 if a.startswith(("--api-keys-file=", "--admin-keys-file=", "--service-key-file="))]
        assert len(files) == expected, f"{name}/{component}: key files {files}"
        mounts = {m["name"]: m for m in c.get("volumeMounts", [])}
        volumes = {v["name"]: v for v in deployments(objects)[component]["spec"]["template"]
                   ["spec"]["volumes"]}
        assert volumes["keys"]["secret"]["secretName"] == "loraplex-keys", component
        assert mounts["keys"]["readOnly"] and all(
            f.startswith(mounts["keys"]["mountPath"] + "/") for f in files), component


def test_every_variable_in_the_flags_is_defined(rendering):
    """Kubernetes passes an undefined $(NAME) through literally: every one must be defined."""
    name, objects = rendering
    keys = {("configMapRef", n): set(o.get("data", {}))
            for n, o in by_kind(objects, "ConfigMap").items()}
    keys |= {("secretRef", n): set(o.get("stringData", {})) | set(o.get("data", {}))
             for n, o in by_kind(objects, "Secret").items()}
    for component, deployment in deployments(objects).items():
        c = container(deployment)
        defined = {e["name"] for e in c.get("env", [])}
        for source in c.get("envFrom", []):
            ((kind, ref),) = source.items()
            defined |= keys[(kind, ref["name"])]
        used = set(re.findall(r"\$\((\w+)\)", " ".join(c.get("command", []) + c.get("args", []))))
        assert used <= defined, f"{name}/{component}: undefined {sorted(used - defined)}"


def test_discovery_services_and_selectors(rendering):
    name, objects = rendering
    services = by_kind(objects, "Service")
    pods = {c: d["spec"]["template"]["metadata"]["labels"] for c, d in deployments(objects).items()}
    for service in services.values():
        selector = service["spec"]["selector"]
        selected = [c for c, labels in pods.items() if selector.items() <= labels.items()]
        assert len(selected) == 1, \
            f"{name}: Service {service['metadata']['name']} selects {selected}"
        component = selected[0]
        ports = {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]}
        expected = {"grpc": (COMPONENTS[component][0], "grpc")}
        if component in HTTP_PORTS:
            expected["http"] = (HTTP_PORTS[component], "http")
        assert ports == expected, f"{name}: Service {service['metadata']['name']}"
    assert services["loraplex-executor"]["spec"]["clusterIP"] == "None"
    assert services["loraplex-adapter-store-headless"]["spec"]["clusterIP"] == "None"
    assert services["loraplex-scheduler"]["spec"]["type"] == "ClusterIP"
    assert services["loraplex-gateway"]["spec"]["type"] == "ClusterIP"
    dns = "dns:///{}.$(POD_NAMESPACE).svc.$(CLUSTER_DOMAIN):{}"
    scheduler_args = container(deployments(objects)["scheduler"])["args"]
    assert "--executor=" + dns.format("loraplex-executor", 50053) in scheduler_args
    for component in ("scheduler", "executor", "gateway"):
        args = container(deployments(objects)[component])["args"]
        assert "--store=" + dns.format("loraplex-adapter-store-headless", 50052) in args


def test_disruption_budgets_and_the_store_autoscaler(rendering):
    name, objects = rendering
    pods = {c: d["spec"]["template"]["metadata"]["labels"] for c, d in deployments(objects).items()}
    budgets = {c for pdb in by_kind(objects, "PodDisruptionBudget").values()
               for c, labels in pods.items()
               if pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()}
    assert budgets >= {"adapter-store", "executor", "gateway"}, name
    (hpa,) = by_kind(objects, "HorizontalPodAutoscaler").values()
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": "loraplex-adapter-store"}
    assert 2 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    found = deployments(objects)
    assert "replicas" not in found["adapter-store"]["spec"], "the HPA owns the store's replicas"
    assert found["executor"]["spec"]["replicas"] >= 1
    # The gateway is stateless: more than one, replaced with no gap.
    assert found["gateway"]["spec"]["replicas"] >= 2, name
    assert found["gateway"]["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0, name
    # An executor takes one scheduler's Step stream at a time: one scheduler per pool, replaced
    # by Recreate (a surge replica could not drive the executors).
    assert found["scheduler"]["spec"]["replicas"] == 1
    assert found["scheduler"]["spec"]["strategy"]["type"] == "Recreate"


def test_pods_run_locked_down_with_resources(rendering):
    name, objects = rendering
    for component, deployment in deployments(objects).items():
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == RUN_AS_USER
        assert pod["automountServiceAccountToken"] is False
        c = container(deployment)
        assert c["securityContext"] == {"allowPrivilegeEscalation": False,
                                        "readOnlyRootFilesystem": True,
                                        "capabilities": {"drop": ["ALL"]}}, f"{name}/{component}"
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]), f"{name}/{component}"
        assert "memory" in c["resources"]["limits"], f"{name}/{component}"
        assert "/tmp" in {m["mountPath"] for m in c["volumeMounts"]}, \
            "HOME and caches need a writable /tmp"
        assert container(deployment)["command"][:2] == ["python", "-m"]
        module = c["command"][2]
        assert (ROOT / (module.replace(".", "/") + ".py")).is_file(), module


def test_metrics_port_is_annotated_for_prometheus(rendering):
    name, objects = rendering
    for component, deployment in deployments(objects).items():
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == str(METRICS_PORT)
        assert f"--metrics-port={METRICS_PORT}" in container(deployment)["args"], \
            f"{name}/{component}"


def test_store_and_executor_configs_agree(rendering):
    name, objects = rendering
    config = {n: o["data"] for n, o in by_kind(objects, "ConfigMap").items()}
    store, executor = config["loraplex-adapter-store-config"], config["loraplex-executor-config"]
    assert store["LORAPLEX_MAX_RANK"] == executor["EXECUTOR_MAX_RANK"], \
        f"{name}: the store would register ranks the executors cannot hold"
    memory = container(deployments(objects)["adapter-store"])["resources"]["requests"]["memory"]
    assert _mebibytes(memory) > int(store["LORAPLEX_HOST_CACHE_MB"]), \
        f"{name}: host tier exceeds memory"


def _mebibytes(quantity: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024, "Ti": 1024 ** 2}
    number, unit = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]i)", quantity).groups()
    return float(number) * units[unit]
