"""The model wing: the base model a runner serves, on its own. Its shape and numerics (config.py,
read from config.json family by family in family_quirks.py), its weights (weights.py, a mixture of
experts' in expert_weights.py; quantized bases in quant*.py, MXFP4 experts in mxfp4.py), the paged
KV cache (kv_cache.py) and the forward over a step's rows (transformer.py: rope.py, attention.py,
layer_ops.py, moe.py), which calls the LoRA backend's contract (executor/lora/backend.py)."""
