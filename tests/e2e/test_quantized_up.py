"""`loraplex up --model DIR` on a quantized folder (issue 44), every service its own process: a
tiny Llama quantized by compressed-tensors itself to W4A16 (groups of 32 with zero points, as
llm-compressor writes it), with a tokenizer and a chat template; a PEFT adapter made on it pushed
with the CLI (the store checks it against the quantized base, the executor serves it at full
precision over the quantized projections); then the OpenAI API: a chat's greedy reply with the
adapter and a base-model completion are transformers' (its compressed-tensors loader) + PEFT's.
The executor's Info says what the base is and what it frees."""

import asyncio
import shutil
import subprocess
import sys

import openai
import pytest
import torch

from common.server import insecure_channel
from loraplex import fixtures
from protos import executor_pb2, executor_pb2_grpc
from tests.e2e.local_up import serving
from tests.executor import quant_checkpoints as qc
from tests.oracle import hf_generate, made_adapters

MODEL_ID = "tiny-w4a16"
NUM_TOKENS = 8
W4A16 = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32}
MESSAGES = [{"role": "user", "content": "The river serves many small tunes"}]


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """(the quantized folder, HF + PEFT with the adapter, the tokenizer, the adapter folder)."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM, AutoTokenizer, CompressedTensorsConfig

    out = tmp_path_factory.mktemp("quantized-up")
    base = qc.base_model(out / "base")
    fixtures.save_tokenizer(base, (fixtures.BOS, fixtures.EOS), fixtures.CHAT_TEMPLATE,
                            "PreTrainedTokenizerFast")
    folder = qc.compressed_tensors(base, out, MODEL_ID, W4A16)
    for path in base.iterdir():  # (the tokenizer, its template, the generation config)
        if not (folder / path.name).exists():
            shutil.copy(path, folder / path.name)
    hf = AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=CompressedTensorsConfig(run_compressed=False)).eval()
    hf.name_or_path = MODEL_ID  # the adapter's base_model_name_or_path: what `up` serves
    peft = made_adapters(hf, out, {"chat": {"r": 8, "lora_alpha": 16,
                                            "target_modules": list(qc.PROJECTIONS)}}, seed=21)
    return folder, peft, AutoTokenizer.from_pretrained(folder), out / "chat"


@pytest.fixture(scope="module")
def up(quantized, tmp_path_factory):
    """`loraplex up --model DIR` running; (store address, executor address, OpenAI client,
    scheduler address)."""
    with serving(quantized[0], tmp_path_factory.mktemp("quantized-up-state")) as (base, http):
        yield (f"127.0.0.1:{base + 1}", f"127.0.0.1:{base + 2}",
               openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="sk-local",
                             timeout=120), f"127.0.0.1:{base}")


def greedy_text(hf, tokenizer, ids, adapter=None) -> str:
    tokens, _ = hf_generate(hf, ids, NUM_TOKENS, adapter)
    ended = next((i for i, t in enumerate(tokens) if t == 1), len(tokens))  # (EOS: 1)
    return tokenizer.decode(tokens[:ended])


def executor_info(address: str) -> executor_pb2.InfoResponse:
    async def ask():
        async with insecure_channel(address) as channel:
            return await executor_pb2_grpc.ExecutorStub(channel).Info(executor_pb2.InfoRequest())
    return asyncio.run(ask())


def test_a_quantized_folder_serves_a_pushed_adapter_through_the_openai_api(quantized, up):
    _, hf, tokenizer, adapter_dir = quantized
    store, executor, api, scheduler = up
    info = executor_info(executor)
    assert info.quantization == "compressed-tensors (pack-quantized): int4 group 32 zero points"
    assert info.dense_weight_bytes > 1.5 * info.weight_bytes
    stats = subprocess.run([sys.executable, "-m", "loraplex.cli", "admin", "stats", "--scheduler",
                            scheduler], capture_output=True, text=True, timeout=60)
    freed = (info.dense_weight_bytes - info.weight_bytes) / 1e9
    assert f"  quantized base ({info.quantization}): {freed:.2f} GB freed" in stats.stdout, \
        stats.stdout + stats.stderr
    pushed = subprocess.run(
        [sys.executable, "-m", "loraplex.cli", "adapters", "push", str(adapter_dir), "--name",
         "w4a16-chat", "--store", store], capture_output=True, text=True, timeout=120)
    assert pushed.returncode == 0, pushed.stderr
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        chat = api.chat.completions.create(model="w4a16-chat", messages=MESSAGES,
                                           max_tokens=NUM_TOKENS, temperature=0)
        assert chat.usage.prompt_tokens == len(ids)
        reply = chat.choices[0].message.content
        assert reply and reply == greedy_text(hf, tokenizer, ids, "chat")
        assert reply != greedy_text(hf, tokenizer, ids)  # (the adapter's, not the base's)
        prompt = "The scheduler shares"
        plain = api.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=NUM_TOKENS,
                                       temperature=0)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert plain.choices[0].text == greedy_text(hf, tokenizer, prompt_ids)
