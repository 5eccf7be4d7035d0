"""`loraplex up --model DIR` on a Gemma 2 folder, a Phi-3 one (issue 32) and a multimodal Gemma 3
one, every service its own process: a tiny random model of the family (Gemma 2: a sliding window
of 6, soft caps, query_pre_attn_scalar; Phi-3: fused projections, its adapter on qkv_proj and
gate_up_proj, longrope whose switch the chat's reply crosses, so the scheduler ends its run there
and the executor computes it again with the long factors, as transformers' generate() does;
Gemma 3: Gemma3ForConditionalGeneration, its adapter on language-model projections
and a vision-tower linear by a regex, its template in chat_template.json alone, as its processor
keeps it) with a tokenizer and a chat template in the family's style, a PEFT adapter pushed with
the CLI (the store checks it, the scheduler plans its pages, the executor loads it), then the
OpenAI API: a chat's prompt is transformers' apply_chat_template of the messages, its greedy reply
and a base-model completion are HF + PEFT's; Gemma 2's template refuses a system message: 400."""

import json
import subprocess
import sys

import openai
import pytest
import torch

from loraplex import fixtures
from tests.e2e.local_up import serving
from tests.executor.test_longrope_oracle import LONGROPE
from tests.family_templates import GEMMA2, GEMMA3, GEMMA_TOKENS, PHI3, PHI3_TOKENS
from tests.multimodal import TEXT
from tests.oracle import hf_generate, made_adapters

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # (PEFT target_parameters)
FAMILIES = {  # model_type -> (model's quirks, special tokens, template, eos ids, adapter targets)
    "gemma2": ({"sliding_window": 6, "query_pre_attn_scalar": 32, "attn_logit_softcapping": 1.0,
                "final_logit_softcapping": 3.0}, GEMMA_TOKENS, GEMMA2, (1, 3),
               fixtures.ATTN + fixtures.MLP),
    "phi3": ({"sliding_window": 10}, PHI3_TOKENS, PHI3, (1, 4),
             ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    "gemma3": (TEXT, GEMMA_TOKENS, GEMMA3, (1, 3),
               r".*language_model.*\.(q_proj|v_proj|down_proj)|.*vision_tower.*\.fc1"),
    # (issue 41) a dense layer among MoE ones; every layer sliding. Adapters on attention and
    # on the experts' fused weights (PEFT's target_parameters)
    "qwen3_moe": ({"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                   "norm_topk_prob": True, "mlp_only_layers": [2], "head_dim": 64},
                  (fixtures.BOS, fixtures.EOS), fixtures.CHAT_TEMPLATE, (1,),
                  {"target_modules": ["q_proj", "v_proj"], "target_parameters": EXPERTS}),
    "mixtral": ({"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 128,
                 "sliding_window": 12}, (fixtures.BOS, fixtures.EOS), fixtures.CHAT_TEMPLATE,
                (1,), {"target_modules": ["o_proj"], "target_parameters": EXPERTS}),
}
MESSAGES = [{"role": "user", "content": "The river serves many small tunes"},
            {"role": "assistant", "content": "Seven quiet blocks."},
            {"role": "user", "content": "Every request names its own adapter"}]
NUM_TOKENS = 8
CROSSING = 3  # Phi-3: the chat's reply outgrows the longrope switch with its CROSSING-th token


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(model_type, model id, its folder (tokenizer, template, generation config beside it),
    the adapter's folder, HF + PEFT with the adapter loaded, the tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quirks, tokens, template, eos, targets = FAMILIES[request.param]
    model_id = f"tiny-{request.param}"
    out = tmp_path_factory.mktemp(model_id)
    model_dir = out / model_id
    model_dir.mkdir()
    fixtures.save_tokenizer(model_dir, tokens, template, "PreTrainedTokenizerFast")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if request.param == "phi3":
        switch = len(chat_ids(request.param, tokenizer)) + CROSSING - 1
        quirks = {**quirks, "rope_scaling": LONGROPE, "max_position_embeddings": 256,
                  "original_max_position_embeddings": switch}
    fixtures.save_tiny_model(model_dir, request.param, seed=5, **quirks)
    if request.param == "gemma3":  # (the processor's file alone holds the template)
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
        (model_dir / "chat_template.json").write_text(json.dumps(
            {"chat_template": config.pop("chat_template")}))
        (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (model_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": list(eos)}))
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    base.name_or_path = model_id  # the adapter's base_model_name_or_path: what `up` serves
    targets = targets if isinstance(targets, dict) else {"target_modules": targets}
    hf = made_adapters(base, out, {"chat": {"r": 8, "lora_alpha": 16, **targets}}, seed=21)
    tokenizer.chat_template = template  # (Gemma 3's: what AutoProcessor reads)
    return request.param, model_id, model_dir, out / "chat", hf, tokenizer


@pytest.fixture(scope="module")
def up(family, tmp_path_factory):
    """`loraplex up --model DIR` running; (store address, OpenAI client)."""
    with serving(family[2], tmp_path_factory.mktemp("family-up-state")) as (base, http):
        yield f"127.0.0.1:{base + 1}", openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1",
                                                     api_key="sk-local", timeout=120)


def chat_ids(model_type: str, tokenizer) -> list[int]:
    """The test chat's prompt, as transformers renders and tokenizes it."""
    messages = chat_messages(model_type)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def chat_messages(model_type: str) -> list[dict]:
    return MESSAGES if model_type == "gemma2" else [
        {"role": "system", "content": "Be brief."}, *MESSAGES]


def greedy_text(hf, tokenizer, ids, eos, adapter=None) -> str:
    """What transformers' generate() answers (greedy), to the first end-of-sequence token."""
    return greedy_reply(hf, tokenizer, ids, eos, adapter)[0]


def greedy_reply(hf, tokenizer, ids, eos, adapter=None) -> tuple[str, list[float]]:
    """greedy_text, and each of its tokens' logprob."""
    tokens, logits = hf_generate(hf, ids, NUM_TOKENS, adapter)
    ended = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
    logprobs = torch.log_softmax(logits.float(), -1)
    return (tokenizer.decode(tokens[:ended]),
            [float(logprobs[i, t]) for i, t in enumerate(tokens[:ended])])


def test_a_family_folder_serves_its_template_and_adapter_as_transformers_would(family, up):
    model_type, model_id, _, adapter_dir, hf, tokenizer = family
    eos = FAMILIES[model_type][3]
    store, api = up
    pushed = subprocess.run(
        [sys.executable, "-m", "loraplex.cli", "adapters", "push", str(adapter_dir), "--name",
         f"{model_type}-chat", "--store", store], capture_output=True, text=True, timeout=120)
    assert pushed.returncode == 0, pushed.stderr
    messages, ids = chat_messages(model_type), chat_ids(model_type, tokenizer)
    with torch.no_grad():
        chat = api.chat.completions.create(model=f"{model_type}-chat", messages=messages,
                                           max_tokens=NUM_TOKENS, temperature=0, logprobs=True)
        assert chat.usage.prompt_tokens == len(ids)
        reply = chat.choices[0].message.content
        if model_type == "phi3":  # (it ran past the switch)
            assert chat.usage.completion_tokens >= CROSSING
        text, logprobs = greedy_reply(hf, tokenizer, ids, eos, "chat")
        assert reply and reply == text
        served = [t.logprob for t in chat.choices[0].logprobs.content][:len(logprobs)]
        assert served == pytest.approx(logprobs, abs=1e-4)
        assert reply != greedy_text(hf, tokenizer, ids, eos)  # (the adapter's, not the base's)
        prompt = "The scheduler shares"
        plain = api.completions.create(model=model_id, prompt=prompt, max_tokens=NUM_TOKENS,
                                       temperature=0)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert plain.choices[0].text and plain.choices[0].text == greedy_text(
            hf, tokenizer, prompt_ids, eos)
    if model_type == "gemma2":
        with pytest.raises(openai.BadRequestError, match="System role not supported"):
            api.chat.completions.create(model=f"{model_type}-chat", max_tokens=2, messages=[
                {"role": "system", "content": "Be brief."}, *MESSAGES])
