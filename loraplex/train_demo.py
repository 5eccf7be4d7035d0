"""Train the demo's tiny base model and one LoRA adapter per task, on CPU, reproducibly.

    python -m loraplex.train_demo OUT_DIR     # ~6 min on 2 cores; the committed copy is
                                              # loraplex/demo_assets/

Writes OUT_DIR/loraplex-demo-tiny/ (config.json, model.safetensors, tokenizer.json),
OUT_DIR/adapters/<task>/ (PEFT adapter_config.json + adapter_model.safetensors) and
OUT_DIR/report.json (held-out exact-match accuracy of every adapter and of the base model alone,
training times, seeds, library versions).

The recipe: a byte-level tokenizer with no merges (one token per character, so string tasks stay
learnable) whose post-processor wraps every prompt as `<s> text <sep>`; a 4-layer LLaMA pre-trained
only to copy (`<s> text <sep> text </s>`, text drawn from every task's inputs and answers, so it
knows the alphabet of all of them but none of the tasks); then, per task in loraplex/demo_tasks.py,
a PEFT LoRA trained on `<s> input <sep> answer </s>` with the loss on the answer only.
"""

from __future__ import annotations

import copy
import json
import math
import platform
import random
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch

from loraplex.demo_tasks import TASKS, held_out

MODEL_ID = "loraplex-demo-tiny"
BOS, EOS, SEP = "<s>", "</s>", "<sep>"  # token ids 0, 1, 2; bytes follow
SEED = 1234
NUM_THREADS = 1
BATCH_SIZE = 32
BASE_STEPS = 1600
BASE_LR = 3e-3
ADAPTER_LR = 5e-3
NUM_EVAL = 100
VOCAB_SIZE = 1024


def build_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE trained on the demo's texts, big enough that each word of the tasks is
    one token; its post-processor wraps a prompt as `<s> text <sep>`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    # Every word gets its leading space (" river" is one token wherever it stands), digits are
    # single tokens, and the decoder drops the space the first word was given.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.ByteLevel(add_prefix_space=True),
        pre_tokenizers.Digits(individual_digits=True)])
    tok.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS, SEP],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A {SEP}", special_tokens=[(BOS, 0), (SEP, 2)])
    return tok


def model_config(vocab_size: int):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=192, intermediate_size=512, num_hidden_layers=4,
                       num_attention_heads=6, num_key_value_heads=2, head_dim=32,
                       vocab_size=vocab_size, max_position_embeddings=256, rms_norm_eps=1e-6,
                       bos_token_id=0, eos_token_id=1, tie_word_embeddings=True,
                       initializer_range=0.02)


class Encoder:
    def __init__(self, tok):
        self.tok = tok

    def prompt(self, text: str) -> list[int]:
        return self.tok.encode(text).ids  # <s> text <sep>

    def answer(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids + [1]

    def batch(self, pairs: list[tuple[str, str]], loss_on_prompt: bool):
        """input_ids, attention_mask, labels: [B, T], right-padded with </s>."""
        rows = []
        for text, answer in pairs:
            p, a = self.prompt(text), self.answer(answer)
            labels = (p[1:] if loss_on_prompt else [-100] * (len(p) - 1)) + a
            rows.append((p + a, [-100] + labels))
        width = max(len(ids) for ids, _ in rows)
        ids = torch.full((len(rows), width), 1)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        labels = torch.full((len(rows), width), -100)
        for i, (row_ids, row_labels) in enumerate(rows):
            ids[i, :len(row_ids)] = torch.tensor(row_ids)
            mask[i, :len(row_ids)] = 1
            labels[i, :len(row_ids)] = torch.tensor(row_labels)
        return ids, mask, labels


def _train(model, params, draw, enc: Encoder, steps: int, lr: float, loss_on_prompt: bool,
           seed: int) -> float:
    """AdamW with warmup + cosine decay over `steps` batches of fresh pairs from draw(rng);
    returns the last batch's loss."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (
        1 + math.cos(math.pi * min(s, steps) / steps)))
    model.train()
    loss = torch.tensor(0.0)
    batches: list[list[tuple[str, str]]] = []
    for _ in range(steps):
        if not batches:  # 16 batches at a time, cut from pairs sorted by length: little padding
            group = sorted((draw(rng) for _ in range(BATCH_SIZE * 16)),
                           key=lambda pair: len(pair[0]) + len(pair[1]))
            batches = [group[i:i + BATCH_SIZE] for i in range(0, len(group), BATCH_SIZE)]
            rng.shuffle(batches)
        ids, mask, labels = enc.batch(batches.pop(), loss_on_prompt)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    return float(loss.detach())


@torch.no_grad()
def greedy(model, enc: Encoder, texts: list[str], max_new_tokens: int = 80) -> list[str]:
    """Greedy answers, batched by prompt length (no padding, so no position subtleties)."""
    by_len: dict[int, list[int]] = {}
    prompts = [enc.prompt(t) for t in texts]
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    out = [""] * len(texts)
    for idx in by_len.values():
        ids = torch.tensor([prompts[i] for i in idx])  # [B, T]
        done = torch.zeros(len(idx), dtype=torch.bool)
        gen: list[torch.Tensor] = []
        past, step_in = None, ids
        for _ in range(max_new_tokens):
            res = model(input_ids=step_in, past_key_values=past, use_cache=True)
            past = res.past_key_values
            nxt = res.logits[:, -1].argmax(-1)  # [B]
            gen.append(torch.where(done, torch.ones_like(nxt), nxt))
            done |= nxt == 1
            if done.all():
                break
            step_in = nxt[:, None]
        rows = torch.stack(gen, 1).tolist()
        for i, row in zip(idx, rows):
            row = row[:row.index(1)] if 1 in row else row
            out[i] = enc.tok.decode(row)
    return out


def accuracy(model, enc: Encoder, pairs: list[tuple[str, str]]) -> float:
    got = greedy(model, enc, [t for t, _ in pairs])
    return sum(g == a for g, (_, a) in zip(got, pairs)) / len(pairs)


def draw_copy(rng: random.Random) -> tuple[str, str]:
    """A text from some task's inputs or answers (training split), to be echoed back."""
    text, answer = rng.choice(TASKS).draw(rng)
    return (text, text) if rng.random() < 0.5 else (answer, answer)


def tokenizer_corpus(num: int = 20000) -> list[str]:
    rng = random.Random(SEED)
    return [draw_copy(rng)[0] for _ in range(num)]


def train_all(out_dir: Path) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import GenerationConfig, LlamaForCausalLM

    torch.set_num_threads(NUM_THREADS)
    torch.manual_seed(SEED)
    tok = build_tokenizer(tokenizer_corpus())
    enc = Encoder(tok)
    model_dir = out_dir / MODEL_ID
    report: dict = {"model_id": MODEL_ID, "seed": SEED, "threads": NUM_THREADS,
                    "versions": {"torch": torch.__version__, "python": platform.python_version()},
                    "adapters": {}}

    start = time.perf_counter()
    base = LlamaForCausalLM(model_config(tok.get_vocab_size()))
    loss = _train(base, list(base.parameters()), draw_copy, enc, BASE_STEPS, BASE_LR,
                  loss_on_prompt=False, seed=SEED)
    report["base"] = {"train_seconds": round(time.perf_counter() - start, 1),
                      "final_loss": round(loss, 4), "steps": BASE_STEPS}
    print(f"base model: {BASE_STEPS} steps, loss {loss:.3f}, "
          f"{report['base']['train_seconds']}s", flush=True)
    base.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=1)
    base.save_pretrained(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({"_name_or_path": MODEL_ID, **cfg}, indent=2))
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "sep_token": SEP, "model_max_length": 256}, indent=2))
    base.name_or_path = MODEL_ID  # becomes each adapter's base_model_name_or_path

    for i, task in enumerate(TASKS):
        start = time.perf_counter()
        torch.manual_seed(SEED + 1 + i)
        peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(**task.lora))
        params = [p for p in peft_model.parameters() if p.requires_grad]
        loss = _train(peft_model, params, task.draw, enc, task.train_steps, ADAPTER_LR,
                      loss_on_prompt=False, seed=SEED + 1 + i)
        seconds = round(time.perf_counter() - start, 1)
        evals = held_out(task, NUM_EVAL)
        acc = accuracy(peft_model, enc, evals)
        base_acc = accuracy(base, enc, evals)
        peft_model.save_pretrained(out_dir / "adapters" / task.name)
        (out_dir / "adapters" / task.name / "README.md").unlink()  # PEFT's empty model card
        report["adapters"][task.name] = {"train_seconds": seconds, "final_loss": round(loss, 4),
                                         "held_out_exact": acc, "base_model_exact": base_acc,
                                         "steps": task.train_steps, "lora": task.lora}
        print(f"{task.name:14s} loss {loss:.3f}  held-out exact {acc:.0%}  "
              f"(base model alone {base_acc:.0%})  {seconds}s", flush=True)
    return report


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit("usage: python -m loraplex.train_demo OUT_DIR")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    # PEFT looks the base model id up on the hub (unreachable, and the id is local): expected.
    warnings.filterwarnings(
        "ignore", message=".*(Unable to fetch remote file|Could not find a config file).*")
    out = Path(argv[0])
    for made_here in (out / MODEL_ID, out / "adapters"):
        shutil.rmtree(made_here, ignore_errors=True)
    start = time.perf_counter()
    report = train_all(out)
    report["total_train_seconds"] = round(time.perf_counter() - start, 1)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"done in {report['total_train_seconds']}s; wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
