"""Deterministic tiny fixtures for the demo and the tests: a LLaMA base model with a byte-level
BPE tokenizer, and PEFT LoRA adapters (valid ones of many ranks and module sets, plus deliberately
broken ones). Made with transformers and peft themselves, so they are what users would push.

    python -m loraplex.fixtures OUT_DIR      # writes OUT_DIR/... and prints the manifest
"""

from __future__ import annotations

import copy
import json
import random
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from common.peft.config import parse_config
from common.peft.layout import plan_adapter
from common.peft.safetensors_header import WEIGHTS_FILE, parse_header

MODEL_ID = "loraplex-tiny-llama"
BOS, EOS = "<s>", "</s>"  # token ids 0 and 1
# Bumped whenever generate() writes something new: ensure() then makes the fixtures again.
VERSION = 4
# Under the output folder: the valid adapters (what `loraplex up` offers to push), and the
# deliberately broken ones, kept apart so that pushing adapters/* pushes only valid ones.
VALID_DIR, INVALID_DIR = "adapters", "invalid_adapters"
# A chat template in the style of HF models' (roles checked with raise_exception, whitespace
# trimmed by trim_blocks/lstrip_blocks), so chat requests can be checked against transformers.
# With `tools` it lists them and asks for calls in the Hermes / Qwen format (<tool_call> JSON
# </tool_call>, what gateway/tool_calls.py reads), and renders earlier calls and tool results.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "<|system|>\nYou may call these functions. For each call, reply with <tool_call>\n"
    "{\"name\": <function name>, \"arguments\": <arguments object>}\n</tool_call>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}{{ eos_token }}\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{% if message['role'] == 'assistant' and message['tool_calls'] %}"
    "<|assistant|>\n{% for call in message['tool_calls'] %}<tool_call>\n"
    "{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}"
    "\n</tool_call>\n{% endfor %}{{ eos_token }}\n"
    "{% elif message['role'] == 'tool' %}"
    "<|tool|>\n<tool_response>\n{{ message['content'] | trim }}\n</tool_response>{{ eos_token }}\n"
    "{% else %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] | trim }}{{ eos_token }}\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]

# name -> LoraConfig arguments. All valid ones fit a pool with max_rank 32.
ADAPTERS: dict[str, dict[str, Any]] = {
    "r4_attn": {"r": 4, "lora_alpha": 8, "target_modules": ATTN},
    "r8_mlp": {"r": 8, "lora_alpha": 16, "target_modules": MLP},
    "r16_all": {"r": 16, "lora_alpha": 32, "target_modules": ATTN + MLP},
    "r32_all": {"r": 32, "lora_alpha": 16, "target_modules": ATTN + MLP},
    "r2_q": {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]},
    "r1_down": {"r": 1, "lora_alpha": 2, "target_modules": ["down_proj"]},
    "r8_rslora": {"r": 8, "lora_alpha": 8, "target_modules": ATTN + MLP, "use_rslora": True},
    "r8_patterns": {"r": 8, "lora_alpha": 16, "target_modules": ATTN + MLP,
                        "rank_pattern": {"q_proj": 16, "layers.1.mlp.down_proj": 4},
                        "alpha_pattern": {"v_proj": 4, "model.layers.2.self_attn.o_proj": 64}},
    "r12_vo": {"r": 12, "lora_alpha": 24, "target_modules": ["v_proj", "o_proj"]},
    "r6_layers": {"r": 6, "lora_alpha": 12, "target_modules": ATTN + MLP,
                  "layers_to_transform": [0, 2]},
    "r24_k_up": {"r": 24, "lora_alpha": 12, "target_modules": ["k_proj", "up_proj"]},
}
OTHER_BASE = "other-org/other-base-model"
BROKEN = {  # name -> LoraConfig arguments (the breakage is applied after saving)
    "other_base": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]},
    "r64": {"r": 64, "lora_alpha": 64, "target_modules": ATTN + MLP},
}


def tiny_config(model_type: str = "llama", **overrides: Any):
    """An HF config of the tiny model family (llama, mistral, qwen2, qwen3, gemma2, gemma3_text,
    phi3, qwen3_moe, mixtral or gpt_oss; or gemma3: a Gemma 3 with a tiny vision tower,
    `overrides` its text model's)."""
    import transformers

    if model_type == "gemma3":
        vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                  "num_attention_heads": 2, "image_size": 28, "patch_size": 14,
                  "vision_use_head": False}  # (as Gemma 3's SigLIP has none)
        text = tiny_config("gemma3_text", **overrides)
        return transformers.Gemma3Config(  # image tokens in the vocabulary, as Gemma 3's are
            text_config=text.to_dict(), vision_config=vision, mm_tokens_per_image=4,
            boi_token_index=1021, eoi_token_index=1022, image_token_index=1023,
            tie_word_embeddings=text.tie_word_embeddings)
    cls = getattr(transformers, {
        "llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
        "qwen3": "Qwen3Config", "gemma2": "Gemma2Config", "gemma3_text": "Gemma3TextConfig",
        "phi3": "Phi3Config", "qwen3_moe": "Qwen3MoeConfig",
        "mixtral": "MixtralConfig", "gpt_oss": "GptOssConfig"}[model_type])
    args = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024,
                "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "initializer_range": 0.05,
                "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False}
    if model_type in ("llama", "gemma2", "gemma3_text"):
        args["head_dim"] = 64  # (Gemma's default is 256 whatever the hidden size)
    if model_type == "phi3":
        args["pad_token_id"] = 1  # (Phi3Config's 32000 lies outside the tiny vocabulary)
    args.update(overrides)
    return cls(**args)


def save_tiny_model(out_dir: Path, model_type: str = "llama", seed: int = 0,
                    max_shard_size: str | None = None, **overrides: Any) -> Path:
    """Build a random tiny model (fixed seed) and save it as HF safetensors in out_dir."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides))
    with torch.no_grad():  # norms (ones) and biases (zeros) get noise, so a wrong one shows
        for name, param in model.named_parameters():
            if param.dim() == 1 or name.endswith("_bias"):  # (gpt-oss's experts' [E, n] biases)
                param.add_(torch.randn_like(param) * 0.1)
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=1)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    return Path(out_dir)


def _training_text(seed: int = 0, num_sentences: int = 300) -> list[str]:
    rng = random.Random(seed)
    words = ["the", "a", "model", "adapter", "serves", "many", "small", "fine", "tunes", "of",
             "one", "base", "every", "request", "names", "its", "own", "tokens", "batch", "shares",
             "memory", "kernel", "scheduler", "executor", "store", "block", "cache", "rank",
             "alpha", "scale", "greedy", "sample", "river", "mountain", "quiet", "bright", "seven"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(4, 14))).capitalize() + "."
            for _ in range(num_sentences)]


def save_tokenizer(out_dir: Path, special_tokens: tuple[str, ...] = (BOS, EOS),
                   chat_template: str = CHAT_TEMPLATE, tokenizer_class: str = "") -> None:
    """A byte-level BPE of 1024 tokens; `special_tokens` take ids 0, 1, ... (bos, eos, then any
    a family's chat template uses, e.g. Gemma's turn markers). `tokenizer_class` names the class
    transformers loads it as (PreTrainedTokenizerFast: not the family's own, which expects the
    family's vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)  # (off a terminal: blank lines)
    tok.train_from_iterator(_training_text(), trainer=trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {"bos_token": special_tokens[0], "eos_token": special_tokens[1],
              "model_max_length": 2048, "chat_template": chat_template}
    if tokenizer_class:
        config["tokenizer_class"] = tokenizer_class
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _save_adapter(base, out_dir: Path, seed: int, lora_args: dict[str, Any]) -> None:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(init_lora_weights=False,
                                                                  **lora_args))
    peft_model.save_pretrained(out_dir)


def _rank(adapter_dir: Path) -> int:
    """A saved adapter's rank, by the format's one definition (AdapterLayout.rank)."""
    config = parse_config((adapter_dir / "adapter_config.json").read_text())
    return plan_adapter(config, parse_header((adapter_dir / WEIGHTS_FILE).read_bytes())).rank


def is_made(out_dir: str | Path) -> bool:
    """Whether out_dir holds this version's fixtures (ensure() makes none)."""
    manifest = Path(out_dir) / "manifest.json"
    try:
        return json.loads(manifest.read_text()).get("version") == VERSION
    except (OSError, ValueError):
        return False


def ensure(out_dir: str | Path) -> dict[str, Any]:
    """The manifest of the fixtures under out_dir, making them first if they are not there."""
    manifest = Path(out_dir) / "manifest.json"
    if manifest.exists():
        made = json.loads(manifest.read_text())
        if made.get("version") == VERSION:
            return made
    return generate(out_dir)


def generate(out_dir: str | Path) -> dict[str, Any]:
    """Write every fixture under out_dir and return the manifest (also saved as manifest.json)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    # PEFT looks the base model id up on the hub (unreachable, and the id is local): expected.
    warnings.filterwarnings(
        "ignore", message=".*(Unable to fetch remote file|Could not find a config file).*")
    # PEFT calls transformers' deprecated names (is_gradient_checkpointing): not ours to fix.
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")

    out = Path(out_dir)
    for made_here in (out / MODEL_ID, out / VALID_DIR, out / INVALID_DIR):  # (an earlier run's)
        shutil.rmtree(made_here, ignore_errors=True)
    model_dir = save_tiny_model(out / MODEL_ID)
    save_tokenizer(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    base.name_or_path = MODEL_ID  # becomes base_model_name_or_path in each adapter_config.json
    adapters = {}
    for i, (name, args) in enumerate({**ADAPTERS, **BROKEN}.items()):
        path = out / (INVALID_DIR if name in BROKEN else VALID_DIR) / name
        _save_adapter(base, path, seed=100 + i, lora_args=args)
        adapters[name] = {"path": str(path),
                          "rank": _rank(path),
                          "target_modules": sorted(args["target_modules"])}
    cfg_path = out / INVALID_DIR / "other_base" / "adapter_config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()),
                                    "base_model_name_or_path": OTHER_BASE}, indent=2))

    truncated = out / INVALID_DIR / "truncated"
    shutil.copytree(out / VALID_DIR / "r8_mlp", truncated)
    data = (truncated / "adapter_model.safetensors").read_bytes()
    (truncated / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    pickled = out / INVALID_DIR / "pickle"
    shutil.copytree(out / VALID_DIR / "r4_attn", pickled)
    from safetensors.torch import load_file
    torch.save(load_file(pickled / "adapter_model.safetensors"), pickled / "adapter_model.bin")
    (pickled / "adapter_model.safetensors").unlink()
    adapters["truncated"] = {**adapters["r8_mlp"], "path": str(truncated)}
    adapters["pickle"] = {**adapters["r4_attn"], "path": str(pickled)}

    manifest = {"version": VERSION, "model_dir": str(model_dir), "model_id": MODEL_ID,
                "adapters": adapters,
                "valid": list(ADAPTERS), "invalid": [*BROKEN, "truncated", "pickle"]}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m loraplex.fixtures OUT_DIR")
    print(json.dumps(generate(sys.argv[1]), indent=2))
