"""The numerical oracle: HF transformers + PEFT on the fixture weights."""

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM


def load_hf_peft(manifest: dict) -> PeftModel:
    """The tiny base model with every valid fixture adapter loaded under its own name."""
    base = AutoModelForCausalLM.from_pretrained(manifest["model_dir"])
    first, *rest = manifest["valid"]
    model = PeftModel.from_pretrained(base, manifest["adapters"][first]["path"], adapter_name=first)
    for name in rest:
        model.load_adapter(manifest["adapters"][name]["path"], adapter_name=name)
    return model.eval()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], num_tokens: int, adapter: str | None = None):
    """Greedy tokens and the logits each came from; `adapter` None = the base model alone."""
    kw = {"adapter_names": [adapter or "__base__"]} if isinstance(model, PeftModel) else {}
    tokens, logits = [], []
    out = model(input_ids=torch.tensor([prompt]), use_cache=True, **kw)
    for _ in range(num_tokens):
        last = out.logits[0, -1]
        tokens.append(int(last.argmax()))
        logits.append(last)
        out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values,
                    use_cache=True, **kw)
    return tokens, torch.stack(logits)
