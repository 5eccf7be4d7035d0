"""The numerical oracle: HF transformers + PEFT on the fixture weights."""

import contextlib
from collections.abc import Mapping
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from loraplex import fixtures


def with_adapters(base, folders: Mapping[str, str | Path]) -> PeftModel:
    """`base` with the PEFT adapter of each folder loaded under its name."""
    first, *rest = folders
    model = PeftModel.from_pretrained(base, folders[first], adapter_name=first)
    for name in rest:
        model.load_adapter(folders[name], adapter_name=name)
    return model.eval()


def load_hf_peft(manifest: dict) -> PeftModel:
    """The tiny base model with every valid fixture adapter loaded under its own name."""
    base = AutoModelForCausalLM.from_pretrained(manifest["model_dir"])
    return with_adapters(base, {n: manifest["adapters"][n]["path"] for n in manifest["valid"]})


def made_adapters(base, out: Path, specs: Mapping[str, dict], seed: int) -> PeftModel:
    """PEFT adapters of `specs` (name -> LoraConfig arguments) made on `base` (seeds seed,
    seed + 1, ...), saved as out/<name>, and `base` with them all loaded."""
    for i, (name, args) in enumerate(specs.items()):
        fixtures._save_adapter(base, out / name, seed + i, args)
    return with_adapters(base, {name: out / name for name in specs})


def tiny_family(out: Path, model_type: str, config: Mapping, seed: int,
                adapters: Mapping[str, dict], adapter_seed: int) -> tuple[str, PeftModel]:
    """A tiny `model_type` model of `config`'s overrides saved in out/model, and its `adapters`
    made on it (made_adapters): (its folder, HF + PEFT with them all loaded)."""
    model_dir = fixtures.save_tiny_model(out / "model", model_type, seed=seed, **config)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    return model_dir, made_adapters(base, out, adapters, seed=adapter_seed)


def assert_matches_hf(hf, requests: dict, names: list, got: dict, num_tokens: int, *,
                      atol: float, adapter_matters: bool = True, what: str = "") -> None:
    """Each request's greedy tokens and logits (`got`, from tests.runner_driver.run) equal HF's
    for its adapter (names[sid]; None = the base model); with `adapter_matters`, the first
    request's adapter moves its logits off the base model's."""
    for sid, name in enumerate(names):
        ref_tokens, ref_logits = hf_greedy(hf, requests[sid][0], num_tokens, name)
        assert got[sid][0] == ref_tokens, f"{what}greedy tokens differ for adapter {name}"
        torch.testing.assert_close(got[sid][1], ref_logits, atol=atol, rtol=0)
    if adapter_matters and names[0]:
        base_logits = hf_greedy(hf, requests[0][0], 1)[1][0]
        assert (got[0][1][0] - base_logits).abs().max() > 1e-2  # the adapter matters


@contextlib.contextmanager
def active(model, adapter: str | None):
    """(the model to call, its keyword arguments) for `adapter` (None: the base model): a
    PeftModel's mixed-batch adapter_names, but an adapter on a mixture of experts' expert weights
    (PEFT's ParamWrapper refuses them) set active on the model PEFT injected it into."""
    if not isinstance(model, PeftModel):
        yield model, {}
    elif not any(getattr(c, "target_parameters", None) for c in model.peft_config.values()):
        yield model, {"adapter_names": [adapter or "__base__"]}
    elif adapter is None:
        with model.disable_adapter():
            yield model.base_model.model, {}
    else:
        model.set_adapter(adapter)
        yield model.base_model.model, {}


@torch.no_grad()
def hf_greedy(model, prompt: list[int], num_tokens: int, adapter: str | None = None):
    """Greedy tokens and the logits each came from; `adapter` None = the base model alone."""
    with active(model, adapter) as (model, kw):
        return _greedy(model, prompt, num_tokens, kw)


def _greedy(model, prompt: list[int], num_tokens: int, kw: dict):
    tokens, logits = [], []
    out = model(input_ids=torch.tensor([prompt]), use_cache=True, **kw)
    for _ in range(num_tokens):
        last = out.logits[0, -1]
        tokens.append(int(last.argmax()))
        logits.append(last)
        out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values,
                    use_cache=True, **kw)
    return tokens, torch.stack(logits)


@torch.no_grad()
def hf_generate(model, prompt: list[int], num_tokens: int, adapter: str | None = None):
    """hf_greedy's tokens and logits by transformers' generate() itself, which runs a model's own
    prepare_inputs_for_generation (Phi-3's drops its cache when a sequence outgrows the longrope
    switch and computes it again with the long factors), to `num_tokens` whatever they are."""
    with active(model, adapter) as (model, kw):
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=num_tokens,
                             do_sample=False, eos_token_id=None, output_logits=True,
                             return_dict_in_generate=True, **kw)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits)
