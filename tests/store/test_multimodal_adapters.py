"""Adapters made on a Gemma 3 multimodal checkpoint (tests/multimodal.py) at a store with that
checkpoint registered as a base: in both namings PEFT writes, on the language model alone or
"all-linear" (the vision tower too), each is accepted, recorded with where its tensors put the
decoder layers and its language-model projections only; an adapter of another shape is refused.
The scheduler plans an adapter's pages from its record, by the paths its patterns were matched
under, and gets the ranks an executor's load of its tensors has."""

import json

import grpc
import pytest
import safetensors.torch

from common.adapter_pages import module_ranks
from common.model_families import base_shapes
from common.peft.config import parse_config
from common.peft.modules import LAYERS_PATHS
from executor.lora.peft_adapter import parse_peft_adapter
from executor.model.config import ModelConfig
from loraplex import client
from protos import adapter_store_pb2 as pb
from tests import multimodal
from tests.oracle import made_adapters
from tests.runner_driver import read_folder
from tests.store.helpers import Store, expect_error, file_config, lora_config, lora_tensors

BASE_ID = "org/gemma-3-tiny"
LM_MODULES = ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(the checkpoint's folder, adapter name -> (config_json, weights)) for both namings."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("gemma3")
    model_dir = multimodal.save_model(out / "model")
    made_adapters(AutoModelForCausalLM.from_pretrained(model_dir), out, multimodal.ADAPTERS,
                  seed=60)
    adapters = {}
    for name in multimodal.ADAPTERS:
        for suffix in ("", "_old"):
            if suffix:
                multimodal.old_naming(out / name, out / f"{name}{suffix}")
            config_json, data = read_folder(out / f"{name}{suffix}")
            config = {**json.loads(config_json), "base_model_name_or_path": BASE_ID}
            adapters[f"{name}{suffix}"] = (json.dumps(config), data)
    return model_dir, adapters


@pytest.fixture
async def store(tmp_path, made):
    store = await Store(file_config(tmp_path)).start()
    config_json = (made[0] / "config.json").read_text()
    await store.stub.RegisterBaseModel(pb.RegisterBaseModelRequest(model_id=BASE_ID,
                                                                   config_json=config_json))
    yield store
    await store.stop()


def push(store, name, config_json, data):
    return client.push(store.stub, pb.PushHeader(
        name=name, config_json=config_json, weights_filename=multimodal.WEIGHTS,
        num_bytes=len(data)), data)


def test_the_base_has_its_language_models_shapes(made):
    model_dir, _ = made
    config = multimodal.config_of(model_dir)
    assert config["model_type"] == "gemma3" and "vision_config" in config
    text = {**config["text_config"], "tie_word_embeddings": False}
    assert base_shapes(config) == base_shapes(text)
    # (its head_dim, not hidden / heads)
    assert base_shapes(config).projection_shapes["q_proj"] == (256, 4 * 48)


async def test_its_adapters_are_accepted_and_another_shape_refused(store, made):
    model_dir, adapters = made
    model = ModelConfig.from_pretrained(model_dir)
    for name, (config_json, data) in adapters.items():
        info = await push(store, name.replace("_", "-"), config_json, data)
        layers = LAYERS_PATHS[2] if name.endswith("_old") else LAYERS_PATHS[1]
        assert (info.base_model, info.layers_path) == (BASE_ID, layers), name
        assert tuple(info.target_modules) == LM_MODULES
        loaded = parse_peft_adapter(config_json, data, model, check_base_model=False)
        planned = module_ranks(parse_config(info.config_json), info.target_modules,
                               model.num_hidden_layers, info.layers_path)
        assert planned == loaded.module_ranks(), name  # the scheduler's pages = the executor's
        if name.startswith("lm"):  # (its regex names language_model: nothing under model.layers)
            assert module_ranks(parse_config(info.config_json), info.target_modules,
                                model.num_hidden_layers) == {}
    llama = safetensors.torch.save(lora_tensors())  # q_proj 256 -> 256; this base's is -> 192
    details = await expect_error(grpc.StatusCode.FAILED_PRECONDITION, push(
        store, "other-shape", lora_config(base_model_name_or_path=BASE_ID), llama))
    assert f"q_proj of {BASE_ID!r} has 192" in details
