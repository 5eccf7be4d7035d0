"""The container build file in deploy/. It cannot be built here (no container engine), so its
steps are checked against the Makefile, pyproject.toml and what the Kubernetes manifests expect
of the image (tests/deploy/test_deploy.py)."""

import re
import tomllib

from tests.deploy.contract import COMPONENTS, DEPLOY, HTTP_PORTS, METRICS_PORT, ROOT, RUN_AS_USER


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines, current = [], ""
    for raw in (DEPLOY / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        current += " " + line.removesuffix("\\").strip()
        if not line.endswith("\\"):
            lines.append(current.strip())
            current = ""
    assert not current, "Dockerfile ends inside a continued line"
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def makefile() -> tuple[dict[str, str], dict[str, list[str]]]:
    """The Makefile's variables and each rule's prerequisites, variables expanded."""
    text = (ROOT / "Makefile").read_text()
    assignments = re.findall(r"^(\w+)\s*(\?=|:=|=)(.*)$", text, re.MULTILINE)
    variables = {m[0]: m[2].strip() for m in assignments}

    def expand(s: str) -> str:
        while m := re.search(r"\$\((\w+)\)", s):
            s = s.replace(m.group(0), variables[m.group(1)])
        return s

    rules = {}
    rule_re = re.compile(r"^([^\s#.=:][^=:]*|\$\(\w+\)):(?!=)(.*)$", re.MULTILINE)
    for target, prereqs in rule_re.findall(text):
        rules[expand(target.strip())] = expand(prereqs).split()
    return {k: expand(v) for k, v in variables.items()}, rules


def test_dockerfile_installs_with_the_readme_make_rule_only():
    _, rules = makefile()
    # `make demo` and `make test`, the README's two commands, both start with the install rule.
    (install,) = set(rules["demo"]) & set(rules["test"])
    runs = [args for instruction, args in dockerfile_instructions() if instruction == "RUN"]
    steps = [step.strip() for run in runs for step in run.split("&&")]
    assert f"make {install}" in steps
    for step in steps:
        assert "pip" not in step.split(), f"a pip step outside the Makefile: {step!r}"
        allowed = (step.startswith(("apt-get update", "apt-get install ",
                                    "rm -rf /var/lib/apt/lists", "useradd "))
                   or (step.startswith("make ") and set(step.split()[1:]) <= set(rules)))
        assert allowed, f"RUN step {step!r} is not a README/Makefile install step"


def test_dockerfile_matches_the_manifests_and_pyproject():
    instructions = dockerfile_instructions()
    variables, _ = makefile()
    workdir = next(args for i, args in instructions if i == "WORKDIR")
    env = " ".join(args for i, args in instructions if i == "ENV")
    assert f"PATH={workdir}/{variables['VENV']}/bin:" in env, "manifests run `python` from the venv"
    assert "HOME=/tmp" in env
    user = next(args for i, args in instructions if i == "USER")
    assert user.split(":")[0] == str(RUN_AS_USER)
    exposed = {int(p) for i, args in instructions if i == "EXPOSE" for p in args.split()}
    assert exposed == ({port for port, _ in COMPONENTS.values()} | set(HTTP_PORTS.values())
                       | {METRICS_PORT})
    assert ("COPY", ". .") in instructions
    python = next(args for i, args in instructions
                  if i == "ARG" and args.startswith("PYTHON_VERSION="))
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    minimum = tuple(int(x) for x in requires.removeprefix(">=").split("."))
    assert tuple(int(x) for x in python.split("=")[1].split(".")) >= minimum
    ignored = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    assert {".venv", ".fixtures", ".git"} <= set(ignored), \
        "the host's venv must not enter the image"
