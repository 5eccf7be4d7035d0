"""The gateway tests' world: two pools with different base models (the demo model, which has no
chat template, and the fixture model, which has one), as real processes sharing one adapter
store, and a gateway in front (tests/gateway/openai_world.py holds the keys and the clients).
Module-scoped: each module that asks for it gets its own (one test stops a pool)."""

import os

import pytest

from loraplex import client
from loraplex.demo import MODEL_DIR as DEMO_MODEL_DIR
from loraplex.fixtures import MODEL_ID as FIXTURE_MODEL
from loraplex.launch import Fleet, FleetKeys, start_gateway
from tests.gateway.openai_world import DEMO_ADAPTERS, DEMO_MODEL, EXECUTOR, KEYS


@pytest.fixture(scope="module")
def world(request, tiny, tmp_path_factory, log_dir):
    """Pool "demo" (with the store), pool "fixture" (using the same store), and a gateway; their
    own loggers at DEBUG (a line per request, with its id)."""
    os.environ["LORAPLEX_LOG_LEVEL"] = "DEBUG"  # (read by the services this fixture starts)
    keys = FleetKeys(tenants={key: tenant for tenant, key in KEYS.items()})
    logs = log_dir / "gateway" / request.module.__name__.rsplit(".", 1)[-1]
    demo = Fleet(model=str(DEMO_MODEL_DIR), log_dir=logs / "demo", keys=keys,
                 store_url=tmp_path_factory.mktemp("store").as_uri(), executor_args=EXECUTOR)
    fixture = None
    gateway = None
    try:
        demo.start()
        fixture = Fleet(model=tiny["model_dir"], store_url="", log_dir=logs / "fixture",
                        keys=keys, store_addresses=demo.stores, executor_args=EXECUTOR).start()
        gateway = start_gateway({DEMO_MODEL: [demo.scheduler],
                                 FIXTURE_MODEL: [fixture.scheduler]}, demo.stores, logs, keys,
                                ["--rate-limit", "limited=0.02:1000000"])
        yield {"demo": demo, "fixture": fixture, "gateway": gateway, "keys": keys}
    finally:
        os.environ.pop("LORAPLEX_LOG_LEVEL", None)
        for part in (gateway, fixture, demo):
            if part is not None:
                part.stop()


@pytest.fixture(scope="module")
async def adapters(world, tiny):
    store = world["demo"].stores[0]
    await client.push_adapter(store, DEMO_ADAPTERS / "reverse-words", "reverse-words",
                              key=KEYS["acme"])
    await client.push_adapter(store, tiny["adapters"]["r4_attn"]["path"], "tiny-attn",
                              key=KEYS["acme"])
    await client.push_adapter(store, tiny["adapters"]["r8_mlp"]["path"], "globex-mlp",
                              key=KEYS["globex"])
    await client.push_adapter(store, tiny["adapters"]["r2_q"]["path"], "shared-q",
                              key=world["keys"].admin)  # public
    return world
