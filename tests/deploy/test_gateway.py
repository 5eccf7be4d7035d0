"""The gateway's manifests beyond what every service shares (tests/deploy/test_deploy.py): its
HTTP face, and a roster that sends each base model to a scheduler that serves it."""

from pathlib import PurePosixPath

from executor.model.config import ModelConfig
from gateway.pools import read_roster
from tests.deploy.contract import COMPONENTS, HTTP_PORTS
from tests.deploy.manifests import by_kind, container, deployments, service_config


def test_the_gateway_listens_where_its_service_sends(rendering):
    name, objects = rendering
    config = service_config(objects, deployments(objects)["gateway"])
    assert config.address == f"0.0.0.0:{COMPONENTS['gateway'][0]}", name
    assert config.http_address == f"0.0.0.0:{HTTP_PORTS['gateway']}", name
    assert not config.pools, f"{name}: pools come from the roster ConfigMap, not --pool"


def roster_source(objects: list[dict]) -> tuple[dict, dict, str]:
    """(the volume mount holding the gateway's --roster file, the ConfigMap behind it, the
    file's key in that ConfigMap)."""
    gateway = deployments(objects)["gateway"]
    roster = PurePosixPath(service_config(objects, gateway).roster)
    (mount,) = [m for m in container(gateway)["volumeMounts"]
                if roster.is_relative_to(m["mountPath"])]
    (volume,) = [v for v in gateway["spec"]["template"]["spec"]["volumes"]
                 if v["name"] == mount["name"]]
    configmap = by_kind(objects, "ConfigMap")[volume["configMap"]["name"]]
    return mount, configmap, str(roster.relative_to(mount["mountPath"]))


def test_the_roster_is_a_configmap_the_gateway_sees_change(rendering):
    """--roster names a file of a ConfigMap mounted as a folder: a subPath mount would never be
    updated, and the gateway reads the roster again only when the file changes."""
    name, objects = rendering
    mount, configmap, key = roster_source(objects)
    assert "subPath" not in mount and mount["readOnly"], name
    assert key in configmap["data"], name


def test_the_roster_sends_the_pools_model_to_its_scheduler(rendering, tmp_path):
    """The gateway uses a cell only when the scheduler reports the model id its roster line
    names; the id is the executors' (EXECUTOR_MODEL_ID, or a random model's named config's),
    and every address is a Service in front of the scheduler, on its port."""
    name, objects = rendering
    _, configmap, key = roster_source(objects)
    roster = tmp_path / "roster"
    roster.write_text(configmap["data"][key])
    pools = read_roster(str(roster))  # the gateway's own parser

    found = deployments(objects)
    executor = service_config(objects, found["executor"])
    model_id = (ModelConfig.named(executor.random_config).model_id if executor.random_config
                else executor.model_id)
    assert model_id, f"{name}: the executors' model id must be set for the roster to name it"
    assert list(pools) == [model_id], f"{name}: roster {pools}, executors serve {model_id!r}"
    scheduler_labels = found["scheduler"]["spec"]["template"]["metadata"]["labels"]
    services = by_kind(objects, "Service")
    for address in pools[model_id]:
        host, _, port = address.rpartition(":")
        service = services[host.split(".")[0]]
        assert service["spec"]["selector"].items() <= scheduler_labels.items(), address
        assert int(port) == COMPONENTS["scheduler"][0], address
        assert int(port) in {p["port"] for p in service["spec"]["ports"]}, address
