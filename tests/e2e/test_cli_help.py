"""`--help` as a newcomer reads it (issue 46, trip 16): `loraplex serve --help` lists the four
services and exits 0, the top-level help names the gateway among them, each service's help is
under its `loraplex serve NAME` name, and the options of loraplex's own commands and of every
service each say what they do and their default."""

import concurrent.futures
import functools
import re
import subprocess
import sys

import pytest

SERVICES = ("scheduler", "executor", "adapter-store", "gateway")
# Commands whose every option must have help.
COMMANDS = [["up"], ["generate"], ["adapters", "push"], ["adapters", "list"], ["admin", "stats"],
            ["admin", "prewarm"], ["budget"], ["demo"], ["serve", "gateway"],
            ["serve", "scheduler"], ["serve", "executor"], ["serve", "adapter-store"]]


@functools.cache
def help_of(*args: str) -> subprocess.CompletedProcess:
    """`loraplex ARGS --help` (each asked once; test_every_help runs them all at once first)."""
    return subprocess.run([sys.executable, "-m", "loraplex.cli", *args, "--help"],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module", autouse=True)
def every_help():
    asked = [(), ("serve",), *(("serve", s) for s in SERVICES), *map(tuple, COMMANDS)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda args: help_of(*args), asked))


def test_serve_help_lists_every_service():
    done = help_of("serve")
    assert done.returncode == 0 and not done.stderr, done.stderr
    assert all(re.search(rf"^  {name} +\S", done.stdout, re.M) for name in SERVICES), done.stdout
    top = help_of()
    assert top.returncode == 0
    serve = re.search(r"^    serve +(.*(?:\n {10,}.*)*)", top.stdout, re.M)[1]
    assert all(name in serve for name in SERVICES), serve


@pytest.mark.parametrize("service", SERVICES)
def test_each_service_help_is_under_its_loraplex_name(service):
    done = help_of("serve", service)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: loraplex serve {service} "), done.stdout[:200]
    assert "python -m" not in done.stdout


def options(text: str) -> dict[str, str]:
    """Each option of a --help text (its long name) -> its help, joined across lines."""
    body = text[text.index("options:"):]
    found, name = {}, None
    for line in body.splitlines()[1:]:
        m = re.match(r"^  (?:-\w, )?(--[\w-]+)(?: [^ ]+(?: [^ ]+)*?)?(?:  +(.*))?$", line)
        if m:
            name = m[1]
            found[name] = m[2] or ""
        elif name and line.startswith("      "):
            found[name] += " " + line.strip()
        elif line and not line.startswith(" "):
            break
    return found


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_option_says_what_it_does_and_its_default(command):
    done = help_of(*command)
    assert done.returncode == 0, done.stderr
    found = options(done.stdout)
    assert found, done.stdout
    bare = [name for name, text in found.items() if name != "--help" and not text.strip()]
    assert not bare, f"options without help in `loraplex {' '.join(command)}`: {bare}"


@pytest.mark.parametrize("command, option, default", [
    (["up"], "--http-port", "8000"), (["generate"], "--max-new-tokens", "32"),
    (["serve", "gateway"], "--grace-s", "30.0"), (["serve", "executor"], "--max-rank", "32"),
    (["serve", "adapter-store"], "--grace-s", "30.0"), (["budget"], "--gpu-gib", "80.0"),
    (["serve", "scheduler"], "--max-num-seqs", "64"),
    (["serve", "scheduler"], "--step-floor-s", "10.0"),
    (["admin", "prewarm"], "--executors", "1")], ids=lambda v: v if isinstance(v, str) else "")
def test_defaults_are_shown(command, option, default):
    text = options(help_of(*command).stdout)[option]
    assert re.search(rf"default:? {re.escape(default)}\b", text), text
