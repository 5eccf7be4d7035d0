"""Every code block of the README, run as written (only the ports and the state folder moved, so
the tests need no fixed free port). The five-minute tour here: `loraplex up` on the demo model, an
adapter push, the CLI against the store and the scheduler, curl against the gateway's OpenAI API,
then the Python blocks in order as one session (the openai client, structured outputs); then
`loraplex up` stops every service it started. The two `make` commands: tests/e2e/test_demo.py."""

import json
import os
import re
import subprocess
import sys

import jsonschema
import pytest

from tests.e2e.local_up import (  # noqa: F401  (free_base_port, wait_serving: test_family_up's)
    BIN,
    ROOT,
    free_base_port,
    kill_leftovers,
    start_up,
    stop,
    wait_gone,
    wait_serving,
)

TOUR = "## A five-minute tour"
# Where each of the README's blocks runs: its section -> the test that runs all of its blocks.
RUNNERS = {"## The two commands": "tests/e2e/test_demo.py (make demo; make test's commands)",
           TOUR: "this module (the bash block, then every python block in one session)"}
SAMPLED_RUNS = 12  # the structured-output example, sampled with as many seeds


def readme_blocks() -> list[tuple[str, str, str]]:
    """(section heading, language, text) of every fenced block of the README."""
    blocks, section = [], ""
    for part in re.split(r"(^## [^\n]*$|^```\w*\n.*?^```$)", (ROOT / "README.md").read_text(),
                         flags=re.M | re.S):
        if part.startswith("## "):
            section = part.strip()
        elif part.startswith("```"):
            lang, _, body = part.removeprefix("```").partition("\n")
            blocks.append((section, lang, body.removesuffix("```")))
    return blocks


def section_blocks() -> tuple[list[str], str]:
    """The tour's bash commands (continuation lines joined), and its python blocks as one
    script, in order."""
    tour = [(lang, text) for section, lang, text in readme_blocks() if section == TOUR]
    (bash,) = [text.replace("\\\n", " ") for lang, text in tour if lang == "bash"]
    python = "\n".join(text for lang, text in tour if lang == "python")
    return [line.strip() for line in bash.splitlines() if line.strip()], python


def test_every_readme_block_has_a_runner():
    """A block added outside the sections whose blocks the suite runs fails here."""
    unrun = [(section, lang, text[:60]) for section, lang, text in readme_blocks()
             if section not in RUNNERS or lang not in ("bash", "python")]
    assert not unrun, f"README blocks no test runs: {unrun}"
    assert sum(lang == "python" for section, lang, _ in readme_blocks() if section == TOUR) >= 2


@pytest.fixture(scope="module")
def tour(tmp_path_factory):
    """`loraplex up` as the tour's first line starts it; (its process, base port, HTTP port,
    state folder)."""
    state = tmp_path_factory.mktemp("tour-state")
    commands, _ = section_blocks()
    up = commands[0]
    assert up.startswith(".venv/bin/loraplex up ") and up.endswith(" &"), up
    base, http = free_base_port(), free_base_port() + 1
    server = start_up(*up.removesuffix(" &").split()[2:], state=state, base=base, http=http)
    try:
        wait_serving(server)
        yield server, base, http, state
    finally:
        stop(server)
        kill_leftovers(f"127.0.0.1:{base}", str(state))


def localize(command: str, tour) -> str:
    _, _, http, state = tour
    return (command.replace(".venv/bin/", f"{BIN}/")
            .replace("~/.local/state/loraplex", str(state))
            .replace("127.0.0.1:8000", f"127.0.0.1:{http}"))


def test_the_tour_commands_work(tour):
    _, base, _, _ = tour
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    outputs = []
    for command in section_blocks()[0][1:]:
        if "loraplex adapters" in command:
            command += f" --store 127.0.0.1:{base + 1}"
        elif "loraplex generate" in command or "loraplex admin" in command:
            command += f" --scheduler 127.0.0.1:{base}"
        done = subprocess.run(localize(command, tour), shell=True, capture_output=True,
                              text=True, timeout=120, cwd=ROOT, env=env)
        assert done.returncode == 0, (command, done.stdout, done.stderr)
        outputs.append((command, done.stdout))
    by_adapter = [out for command, out in outputs if "generate --adapter" in command]
    assert by_adapter and all(out.strip() == "stone river quiet" for out in by_adapter)
    completions = [out for command, out in outputs if "/v1/completions" in command]
    assert completions and all('"text_completion"' in out and '"finish_reason"' in out
                               for out in completions)
    models = [out for command, out in outputs if "/v1/models" in command]
    assert models and all('"reverse-words"' in out for out in models)


def test_the_tour_python_blocks_work_as_one_session(tour):
    """The openai client's stream, then the structured output: JSON valid against the block's
    own schema, ended by itself."""
    done = subprocess.run([sys.executable, "-c", localize(section_blocks()[1], tour)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    streamed, structured = done.stdout.strip().splitlines()
    assert streamed == "stone river quiet"
    text, finish_reason = structured.rsplit(" ", 1)
    assert finish_reason == "stop"
    jsonschema.validate(json.loads(text), _readme_request(tour)[1]["extra_body"]["guided_json"])


def _readme_request(tour) -> tuple[object, dict]:
    """(an openai client on the tour's gateway, the structured-output block's create() arguments),
    read by running the tour's python blocks with the client's create() recorded."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{tour[2]}/v1", api_key="sk-local")
    calls = []

    class Recorded:
        def create(self, **kwargs):
            calls.append(kwargs)
            return client.completions.create(**kwargs)

    class Client:
        completions = Recorded()

    script = localize(section_blocks()[1], tour).replace("client = OpenAI(", "_ = OpenAI(")
    exec(compile(script, "README.md", "exec"), {"client": Client(), "print": lambda *a, **k: None})
    (structured,) = [c for c in calls if "guided_json" in c.get("extra_body", {})]
    return client, structured


def test_the_structured_output_example_finishes_when_sampled(tour):
    """The README's schema bounds its output below its max_tokens: sampled (temperature 1, a seed
    per run), every run ends by itself with JSON valid against the schema. A schema on the same
    request that cannot finish within max_tokens says so: finish_reason "length"."""
    client, request = _readme_request(tour)
    schema = request["extra_body"]["guided_json"]
    for seed in range(SAMPLED_RUNS):
        choice = client.completions.create(**{**request, "temperature": 1.0,
                                              "seed": seed}).choices[0]
        assert choice.finish_reason == "stop", (seed, choice.text)
        jsonschema.validate(json.loads(choice.text), schema)
    too_long = {"type": "object", "required": ["note"],  # (more than 8 tokens can hold)
                "properties": {"note": {"type": "string", "minLength": 400}}}
    cut = [client.completions.create(**{**request, "temperature": 1.0, "seed": seed,
                                        "max_tokens": 8,
                                        "extra_body": {"guided_json": too_long}}).choices[0]
           for seed in range(3)]
    for choice in cut:
        assert choice.finish_reason == "length" and len(choice.text) > 0
        with pytest.raises(ValueError):
            json.loads(choice.text)


def test_up_stops_every_service(tour):
    """SIGTERM, twice (a second one must not leave services behind): nothing `up` started is
    left running."""
    server, base, _, state = tour
    server.send_signal(15)
    stop(server)
    assert not wait_gone(f"127.0.0.1:{base}", str(state)), "services left running"
