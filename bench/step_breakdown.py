"""Where an executor decode step's time goes, measured in-process for bench/serving.py: the same
model, adapters and prompts in a ModelRunner (as the executor builds it), every request
prefilled whole, then decode steps over all of them, with timers around each part:

    base matmuls   F.linear (the dense projections and lm_head)
    LoRA           the backend's apply (shrink/expand of every group) and prepare
    attention      KV gather and scaled_dot_product_attention
    metadata       StepMetadata.build (positions, KV slots, attention masks)
    rest           the remainder of the step: norms, RoPE, KV writes, sampling, Python

The timers wrap functions for the duration of the measurement only; serving code is unchanged.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass

from common.adapter_pages import padded_pages
from common.sampling import SamplingParams
from executor.lora.peft_adapter import parse_peft_adapter
from executor.lora.slot_pool import page_geometry
from executor.lora.torch_backend import TorchLoraBackend
from executor.model import transformer
from executor.model.config import ModelConfig
from executor.model.kv_cache import PagedKVCache
from executor.runner import ModelRunner, Row

PARTS = ("base matmuls", "LoRA", "attention", "metadata", "rest")
BLOCK = 16


@dataclass
class Breakdown:
    step_ms: float  # mean wall time of a decode step
    parts_ms: dict[str, float]  # part -> mean ms per decode step


class _Timers:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, stack: contextlib.ExitStack, owner, name: str, part: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start

        setattr(owner, name, timed)
        stack.callback(setattr, owner, name, original)


def decode_breakdown(model_dir: str, adapters: list[tuple[str, bytes]],
                     prompts: list[list[int]], slot_of: list[int], num_steps: int) -> Breakdown:
    """Prefill every prompt (request i on adapter slot_of[i]), then time `num_steps` decode
    steps over all of them. `adapters`: (adapter_config.json, safetensors bytes) per slot."""
    blocks_each = -(-(max(map(len, prompts)) + num_steps + 1) // BLOCK)
    pages = padded_pages(32, page_geometry(ModelConfig.from_pretrained(model_dir), BLOCK))
    runner = ModelRunner.from_pretrained(  # the adapters' pages above the sequences' blocks
        model_dir, num_kv_blocks=blocks_each * len(prompts) + len(adapters) * pages,
        block_size=BLOCK, num_slots=len(adapters), max_rank=32, lora_backend="torch")
    for slot, (config_json, data) in enumerate(adapters):
        runner.load_adapter(slot, parse_peft_adapter(config_json, data, runner.config,
                                                     check_base_model=False))
    order = sorted(range(len(prompts)), key=lambda i: slot_of[i])  # rows sorted by adapter
    for i in order:
        runner.add_sequence(i, prompts[i], SamplingParams(), slot_of[i])
    runner.step([Row(i, len(prompts[i]), tuple(range(i * blocks_each, (i + 1) * blocks_each)))
                 for i in order])
    decode = [Row(i, 1) for i in order]
    runner.step(decode)  # warm-up: the LoRA stack is built here, as in serving
    timers = _Timers()
    with contextlib.ExitStack() as stack:
        timers.wrap(stack, transformer.F, "linear", "base matmuls")
        timers.wrap(stack, transformer.F, "scaled_dot_product_attention", "attention")
        timers.wrap(stack, PagedKVCache, "gather", "attention")
        timers.wrap(stack, TorchLoraBackend, "apply", "LoRA")
        timers.wrap(stack, TorchLoraBackend, "prepare", "LoRA")
        timers.wrap(stack, transformer.StepMetadata, "build", "metadata")
        start = time.perf_counter()
        for _ in range(num_steps):
            runner.step(decode)
        wall = time.perf_counter() - start
    parts = {p: timers.seconds[p] * 1e3 / num_steps for p in PARTS[:-1]}
    parts["rest"] = wall * 1e3 / num_steps - sum(parts.values())
    return Breakdown(wall * 1e3 / num_steps, parts)


def breakdown_table(rows: list[tuple[int, Breakdown]]) -> list[str]:
    lines = ["| distinct adapters | decode step (ms) | " + " | ".join(PARTS) + " |",
             "|---:|---:|" + "---:|" * len(PARTS)]
    for n, b in rows:
        lines.append(f"| {n} | {b.step_ms:.2f} | " + " | ".join(
            f"{b.parts_ms[p]:.2f} ({b.parts_ms[p] / b.step_ms:.0%})" for p in PARTS) + " |")
    return lines
