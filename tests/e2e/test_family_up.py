"""`loraplex up --model DIR` on a Gemma 2 folder (issue 32), every service its own process: a
tiny random Gemma 2 (sliding window of 6, soft caps, query_pre_attn_scalar) with a tokenizer and
a chat template in Gemma's style, a PEFT adapter pushed with the CLI, then the OpenAI API: a
chat's prompt is transformers' apply_chat_template of the messages, and its greedy reply and a
base-model completion are HF + PEFT's; a system message, which Gemma's template refuses, is 400."""

import json
import signal
import subprocess
import sys
import time

import openai
import pytest
import torch

from loraplex import fixtures
from tests.e2e.test_readme_gateway import free_base_port
from tests.family_templates import GEMMA2, GEMMA_TOKENS
from tests.oracle import hf_greedy, made_adapters

MODEL_ID = "tiny-gemma2"
MESSAGES = [{"role": "user", "content": "The river serves many small tunes"},
            {"role": "assistant", "content": "Seven quiet blocks."},
            {"role": "user", "content": "Every request names its own adapter"}]
EOS = (1, 3)  # <eos>, <end_of_turn>
NUM_TOKENS = 8


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """The model folder (its tokenizer, template and generation config beside it), the adapter's
    folder, and HF + PEFT with the adapter loaded."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("gemma-up")
    model_dir = fixtures.save_tiny_model(
        out / MODEL_ID, "gemma2", seed=5, sliding_window=6, query_pre_attn_scalar=32,
        attn_logit_softcapping=1.0, final_logit_softcapping=3.0)
    fixtures.save_tokenizer(model_dir, GEMMA_TOKENS, GEMMA2, "PreTrainedTokenizerFast")
    (model_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": list(EOS)}))
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    base.name_or_path = MODEL_ID  # the adapter's base_model_name_or_path: what `up` serves
    hf = made_adapters(base, out, {"g2-chat": {
        "r": 8, "lora_alpha": 16, "target_modules": fixtures.ATTN + fixtures.MLP}}, seed=21)
    return model_dir, out / "g2-chat", hf, AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def up(gemma, tmp_path_factory):
    """`loraplex up --model DIR` running; (store address, OpenAI client)."""
    model_dir = gemma[0]
    state = tmp_path_factory.mktemp("gemma-up-state")
    base, http = free_base_port(), free_base_port() + 1
    server = subprocess.Popen(
        [sys.executable, "-m", "loraplex.cli", "up", "--model", str(model_dir), "--state-dir",
         str(state), "--base-port", str(base), "--http-port", str(http),
         "--executor-args", "--threads 1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        for line in server.stdout:
            if line.startswith("serving") or time.monotonic() > deadline:
                break
        assert server.poll() is None, "loraplex up exited"
        yield f"127.0.0.1:{base + 1}", openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1",
                                                     api_key="sk-local", timeout=120)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)


def greedy_text(hf, tokenizer, ids, adapter=None) -> str:
    tokens, _ = hf_greedy(hf, ids, NUM_TOKENS, adapter)
    ended = next((i for i, t in enumerate(tokens) if t in EOS), len(tokens))
    return tokenizer.decode(tokens[:ended])


def test_a_gemma_folder_serves_its_template_and_adapter_as_transformers_would(gemma, up):
    model_dir, adapter_dir, hf, tokenizer = gemma
    store, api = up
    pushed = subprocess.run(
        [sys.executable, "-m", "loraplex.cli", "adapters", "push", str(adapter_dir), "--name",
         "g2-chat", "--store", store], capture_output=True, text=True, timeout=120)
    assert pushed.returncode == 0, pushed.stderr
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<bos><start_of_turn>user\n")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        chat = api.chat.completions.create(model="g2-chat", messages=MESSAGES,
                                           max_tokens=NUM_TOKENS, temperature=0)
        assert chat.usage.prompt_tokens == len(ids)
        reply = chat.choices[0].message.content
        assert reply and reply == greedy_text(hf, tokenizer, ids, "g2-chat")
        assert reply != greedy_text(hf, tokenizer, ids)  # (the adapter's, not the base's)
        prompt = "The scheduler shares"
        plain = api.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=NUM_TOKENS,
                                       temperature=0)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert plain.choices[0].text and plain.choices[0].text == greedy_text(hf, tokenizer,
                                                                              prompt_ids)
    with pytest.raises(openai.BadRequestError, match="System role not supported"):
        api.chat.completions.create(model="g2-chat", max_tokens=2, messages=[
            {"role": "system", "content": "Be brief."}, *MESSAGES])
