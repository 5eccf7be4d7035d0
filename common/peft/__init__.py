"""The PEFT LoRA format, defined once: the adapter store validates every push with it and
executors read every load with it.

    modules             the projections (the LLaMA and fused layouts), shapes, tensor names
    config              adapter_config.json (bounded, plain LoRA only)
    patterns            target_modules / rank_pattern / alpha_pattern regexes, matched with a bound
    safetensors_header  the safetensors header, bounds-checked before anything is allocated;
                        pickle refused
    layout              which tensor is which projection's A or B, at what rank and scale
    finite              every value finite, on the bytes (numpy: the store loads no torch)
    tensors             the weights as torch views into the file's bytes (executors)
"""
