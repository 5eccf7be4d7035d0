"""Layers point down only (DESIGN.md, "Who owns what"), checked from the source:

    applications   loraplex/ (CLI, client, demo, launcher, budget, training, fixtures)
    services       scheduler/ executor/ adapter_store/ gateway/  (never each other, nor loraplex/)
    shared layer   common/                                     (no service, no application)
    contracts      protos/                                     (generated code and its generator)
    kernels        kernels/                     (torch and triton only; used by the executor)

Inside the executor, the wings that compute sit below its runner, service and rank processes:

    executor/ top   runner, service, sampling, adapter loads, ...; tp/ rank processes
    compute wings   executor/model/ executor/lora/ tp/shards.py tp/collectives.py  (only each other)
"""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIRST_PARTY = {"loraplex", "common", "protos", "scheduler", "executor", "adapter_store", "gateway",
               "kernels"}
SERVICES = ("scheduler", "executor", "adapter_store", "gateway")
# Which first-party packages each package may import (besides itself).
ALLOWED = {
    "protos": set(),
    "common": {"protos"},
    "kernels": set(),
    **{service: {"protos", "common"} for service in SERVICES},
}
ALLOWED["executor"].add("kernels")  # the LoRA ops it runs on the GPU
# Kernels import nothing but torch, triton and the standard library.
KERNEL_THIRD_PARTY = {"torch", "triton"}


# The executor's compute wings: the base model, the LoRA machinery, and what of tensor parallelism
# the forward and the loaders need (a rank's part, the collectives).
EXECUTOR_COMPUTE = ("executor.model.", "executor.lora.", "executor.tp.shards",
                    "executor.tp.collectives")


def imported_modules(path: pathlib.Path) -> set[str]:
    """Full dotted names of every absolute import in `path` (`from a import b`: a.b, as b may be a
    module), wherever the import statement sits."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def imported_packages(path: pathlib.Path) -> set[str]:
    """Top-level names of every module `path` imports, wherever the import statement sits."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def sources(package: str) -> list[pathlib.Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_layers_below(package):
    wrong = []
    for path in sources(package):
        found = imported_packages(path) & FIRST_PARTY - {package}
        for name in sorted(found - ALLOWED[package]):
            wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not wrong, "layers must point down (see this test's docstring):\n" + "\n".join(wrong)


def test_executor_compute_wings_import_only_each_other():
    """The model, LoRA and sharding code never reaches up into the runner, the service, the adapter
    loads or the rank processes: it is plain compute they drive, testable on its own."""
    wing_files = [path for path in sources("executor")
                  if f"{path.relative_to(ROOT).with_suffix('').as_posix().replace('/', '.')}."
                  .startswith(EXECUTOR_COMPUTE)]
    assert len(wing_files) > 20
    wrong = [f"{path.relative_to(ROOT)} imports {name}" for path in wing_files
             for name in sorted(imported_modules(path))
             if name.startswith("executor.") and not name.startswith(EXECUTOR_COMPUTE)]
    assert not wrong, "the compute wings sit below the runner (this test's docstring):\n" + \
        "\n".join(wrong)


def test_kernels_import_only_torch_and_triton():
    stdlib = set(sys.stdlib_module_names)
    wrong = [f"{path.relative_to(ROOT)} imports {name}" for path in sources("kernels")
             for name in sorted(imported_packages(path) - stdlib - KERNEL_THIRD_PARTY
                                - {"kernels", "__future__"})]
    assert not wrong, "\n".join(wrong)


def test_every_package_is_placed_in_a_layer():
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    assert packages == FIRST_PARTY, "a new top-level package needs its place in ALLOWED"


@pytest.mark.parametrize("service", ["scheduler", "gateway", "adapter_store"])
def test_control_plane_services_start_without_torch(service):
    """Only executors compute: the scheduler, the gateway and the adapter store (which checks
    pushed weights with numpy, common/peft/finite.py) never import torch, which takes seconds to
    load and would be in every replica's start."""
    probe = f"import sys, {service}.service; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == "False", f"{service}.service imports torch"
