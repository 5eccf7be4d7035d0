"""Random LoRA adapters for a model config, every module at its own rank (or all at one)."""

import torch

from executor.lora.slot_pool import LoraModuleWeights, LoraWeights


def random_adapter(config, rank, seed, modules=None, layers=None, same_rank=False):
    """On `modules` (default: every projection the model has)."""
    modules = config.lora_modules if modules is None else modules
    g = torch.Generator().manual_seed(seed)
    mods = {}
    for layer in layers if layers is not None else range(config.num_hidden_layers):
        for i, m in enumerate(modules):
            in_f, out_f = config.module_shape(m)
            r = rank if same_rank else max(1, rank - i)  # each module at its own rank
            mods[(layer, m)] = LoraModuleWeights(torch.randn(r, in_f, generator=g) * 0.1,
                                                 torch.randn(out_f, r, generator=g) * 0.1,
                                                 0.5 + i)
    return LoraWeights(mods)
