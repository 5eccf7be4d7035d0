"""Activated LoRA through the real services (issue 43): an aLoRA adapter pushed to the store
(its invocation recorded), served through the gateway's OpenAI API. A base request reads a
context first; the aLoRA request on that context plus its invocation gets PEFT's greedy tokens
and reports the context's cached tokens (usage.prompt_tokens_details.cached_tokens: the blocks
before its invocation are the base model's); without the invocation in its prompt it answers as
the base model and says so (adapter_activated false); the registry shows the invocation."""

import copy
import secrets
import subprocess
import sys

import openai
import pytest
import torch
from transformers import AutoTokenizer

from common.alora import activation_start
from loraplex import client
from loraplex.launch import Fleet, FleetKeys, start_gateway
from tests.oracle import hf_greedy

KEY = secrets.token_hex(16)
NUM_TOKENS = 6


@pytest.fixture(scope="module")
def alora(tiny, tmp_path_factory):
    """(adapter folder, its invocation ids, the tokenizer, PEFT's aLoRA model, HF's base)."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny["model_dir"])
    invocation = tokenizer(" Verdict:", add_special_tokens=False)["input_ids"]
    base = AutoModelForCausalLM.from_pretrained(tiny["model_dir"]).eval()
    base.name_or_path = tiny["model_id"]
    torch.manual_seed(5)
    made = get_peft_model(copy.deepcopy(base), LoraConfig(
        r=8, lora_alpha=16, init_lora_weights=False, target_modules=["q_proj", "v_proj"],
        alora_invocation_tokens=invocation))
    folder = tmp_path_factory.mktemp("alora") / "checker"
    made.save_pretrained(folder)
    peft = PeftModel.from_pretrained(copy.deepcopy(base), folder).eval()
    return folder, invocation, tokenizer, peft, base


@pytest.fixture(scope="module")
def world(tiny, tmp_path_factory, log_dir, alora):
    keys = FleetKeys(tenants={KEY: "acme"})
    logs = log_dir / "alora"
    fleet = Fleet(model=tiny["model_dir"], store_url=tmp_path_factory.mktemp("store").as_uri(),
                  log_dir=logs / "pool", keys=keys, executor_args=["--threads", "1"])
    gateway = None
    try:
        fleet.start()
        gateway = start_gateway({tiny["model_id"]: [fleet.scheduler]}, fleet.stores, logs, keys)
        yield fleet, gateway
    finally:
        for part in (gateway, fleet):
            if part is not None:
                part.stop()


@torch.no_grad()
def peft_greedy(peft, prompt: list[int], invocation: list[int]) -> list[int]:
    """PEFT's aLoRA: whole forwards with explicit offsets (its generate() does not activate)."""
    start, seq, out = activation_start(prompt, invocation), list(prompt), []
    for _ in range(NUM_TOKENS):
        logits = peft(input_ids=torch.tensor([seq]), alora_offsets=[len(seq) - start]).logits
        out.append(int(logits[0, -1].argmax()))
        seq.append(out[-1])
    return out


async def test_an_activated_lora_shares_the_base_context_and_answers_as_peft(world, alora, tiny):
    fleet, gateway = world
    folder, invocation, tokenizer, peft, base = alora
    pushed = await client.push_adapter(fleet.stores[0], folder, "checker", key=KEY)
    assert list(pushed.alora_invocation_tokens) == invocation
    api = openai.AsyncOpenAI(base_url=f"http://{gateway.announced['gateway-http']}/v1",
                             api_key=KEY, max_retries=0, timeout=120)
    context = tokenizer("The scheduler shares memory every block cache rank alpha scale greedy "
                        "sample river mountain quiet bright seven", add_special_tokens=False
                        )["input_ids"]
    first = await api.completions.create(model=tiny["model_id"], prompt=context + [5],
                                         max_tokens=1, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    prompt = context + invocation
    checked = await api.completions.create(model="checker", prompt=prompt,
                                           max_tokens=NUM_TOKENS, temperature=0)
    want = peft_greedy(peft, prompt, invocation)
    assert checked.choices[0].text == tokenizer.decode(want)
    block = 16  # (the executor's default block size)
    assert checked.usage.prompt_tokens_details.cached_tokens == len(context) // block * block > 0
    assert getattr(checked, "adapter_activated", True) is True
    base_text = tokenizer.decode(hf_greedy(base, prompt, NUM_TOKENS)[0])
    assert base_text != checked.choices[0].text  # (the adapter mattered)
    absent = context + [7]
    plain = await api.completions.create(model="checker", prompt=absent, max_tokens=NUM_TOKENS,
                                         temperature=0)
    assert plain.adapter_activated is False
    assert plain.choices[0].text == tokenizer.decode(hf_greedy(base, absent, NUM_TOKENS)[0])
    chunks = [c async for c in await api.completions.create(
        model="checker", prompt=absent, max_tokens=2, temperature=0, stream=True)]
    assert all(c.adapter_activated is False for c in chunks)


def test_adapters_show_prints_the_invocation(world, alora, tmp_path):
    fleet, _ = world
    key = tmp_path / "key"
    key.write_text(KEY)
    shown = subprocess.run([sys.executable, "-m", "loraplex.cli", "adapters", "show", "checker",
                            "--store", fleet.stores[0], "--api-key-file", str(key)],
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert f"activated  from its invocation, token ids {alora[1]}" in shown.stdout
