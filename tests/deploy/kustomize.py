"""A renderer for the subset of kustomize that deploy/ uses, so that its kustomizations can be
checked without a kustomize binary (tests/deploy/test_deploy.py cross-checks it against
`kubectl kustomize` where kubectl exists)."""

import copy
from pathlib import Path

import yaml

KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "namespace", "images", "patches"}
CLUSTER_SCOPED = {"Namespace", "PersistentVolume", "StorageClass", "ClusterRole",
                  "ClusterRoleBinding", "CustomResourceDefinition", "PriorityClass"}


def render(folder: Path) -> list[dict]:
    """The objects `kustomize build folder` prints, for kustomizations that use only
    resources, namespace, images and JSON 6902 patches (anything else is refused)."""
    k = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(k) - KUSTOMIZATION_KEYS
    assert not unknown, f"{folder}: kustomization uses {unknown}, which this renderer does not"
    objects: list[dict] = []
    for entry in k.get("resources", []):
        path = (folder / entry).resolve()
        if path.is_dir():
            objects += render(path)
        else:
            objects += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in k.get("patches", []):
        text = patch["patch"] if "patch" in patch else (folder / patch["path"]).read_text()
        ops = yaml.safe_load(text)
        assert isinstance(ops, list), \
            f"{folder}: only JSON 6902 patches (a list of ops) are rendered"
        targets = [o for o in objects if _matches(o, patch["target"])]
        assert targets, f"{folder}: patch target {patch['target']} matches nothing"
        for obj in targets:
            for op in ops:
                _apply_op(obj, op)
    for obj in objects:
        if "namespace" in k and obj["kind"] not in CLUSTER_SCOPED:
            obj["metadata"]["namespace"] = k["namespace"]
        for image in k.get("images", []):
            for container in _containers(obj):
                _set_image(container, image)
    return objects


def _matches(obj: dict, target: dict) -> bool:
    assert set(target) <= {"kind", "name"}, \
        f"patch target {target}: only kind and name are rendered"
    return target.get("kind", obj["kind"]) == obj["kind"] and \
        target.get("name", obj["metadata"]["name"]) == obj["metadata"]["name"]


def _apply_op(doc: dict, op: dict) -> None:
    """One RFC 6902 operation (add, remove, replace) on `doc`, in place."""
    *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
    node = doc
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if isinstance(node, list):
        index = len(node) if last == "-" else int(last)
        assert op["op"] == "add" or index < len(node), f"{op['path']}: no such item"
        if op["op"] == "add":
            node.insert(index, copy.deepcopy(op["value"]))
        elif op["op"] == "replace":
            node[index] = copy.deepcopy(op["value"])
        elif op["op"] == "remove":
            del node[index]
        else:
            raise AssertionError(f"JSON patch op {op['op']!r} is not rendered here")
    else:
        assert op["op"] == "add" or last in node, f"{op['path']}: no such field"
        if op["op"] in ("add", "replace"):
            node[last] = copy.deepcopy(op["value"])
        elif op["op"] == "remove":
            del node[last]
        else:
            raise AssertionError(f"JSON patch op {op['op']!r} is not rendered here")


def _containers(obj: dict) -> list[dict]:
    pod = obj.get("spec", {}).get("template", {}).get("spec", {})
    return pod.get("initContainers", []) + pod.get("containers", [])


def _set_image(container: dict, image: dict) -> None:
    name, _, tag = container["image"].partition(":")
    if name == image["name"]:
        container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag or 'latest')}"
