"""Two LoRA backends' outputs side by side, on the same random inputs."""

import torch

from executor.slot_pool import LORA_GROUPS


def backend_outputs(config, first, second, row_slots, seed):
    """(layer, group, base, first's output, second's output) of two LoRA backends' apply on the
    same random inputs, for every layer and group."""
    first_meta, second_meta = first.prepare(row_slots), second.prepare(row_slots)
    g = torch.Generator().manual_seed(seed)
    for layer in range(config.num_hidden_layers):
        for group, modules in LORA_GROUPS.items():
            in_f = config.module_shape(modules[0])[0]
            width = sum(config.module_shape(m)[1] for m in modules)
            x = torch.randn(len(row_slots), in_f, generator=g)
            base = torch.randn(len(row_slots), width, generator=g)
            got, want = base.clone(), base.clone()
            first.apply(layer, group, x, got, first_meta)
            second.apply(layer, group, x, want, second_meta)
            yield layer, group, base, got, want
