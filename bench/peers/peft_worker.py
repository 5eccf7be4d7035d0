"""HF PEFT as a peer engine for bench/peers/run.py (runs in the project's .venv).

One PeftModel holding every adapter; a round is one `generate(..., adapter_names=[...])` over all
prompts as one left-padded batch ("__base__" rows for the base model), as bench/serving.py runs
PEFT. EOS is not a stop token here (generation_config.eos_token_id None), so every row runs its
32 greedy tokens with nothing masked: the same tokens an engine that ignores EOS produces.

    .venv/bin/python bench/peers/peft_worker.py MODEL_DIR ADAPTER_DIR PROMPTS_JSON NUM_ADAPTERS
"""

from __future__ import annotations

import sys
import time

from worker_loop import MAX_NEW_TOKENS, Setup, protocol_out, serve


def main() -> None:
    out = protocol_out()
    setup = Setup.from_argv(sys.argv[1:])
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    base = AutoModelForCausalLM.from_pretrained(setup.model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, f"{setup.adapter_dir}/a0", adapter_name="a0")
    for i in range(1, setup.num_adapters):
        model.load_adapter(f"{setup.adapter_dir}/a{i}", adapter_name=f"a{i}")
    model.eval()
    model.generation_config.eos_token_id = None
    width = max(map(len, setup.prompts))
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in setup.prompts])  # [B, width]
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p)
                                   for p in setup.prompts])  # [B, width]

    def run_round(names: list[str | None]) -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        with torch.inference_mode():
            ids = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                 adapter_names=[n or "__base__" for n in names],
                                 max_new_tokens=MAX_NEW_TOKENS, do_sample=False, pad_token_id=0)
        return time.perf_counter() - start, ids[:, width:].tolist()

    run_round(setup.adapter_names(setup.num_adapters))  # warm-up: every adapter used once
    serve(out, run_round, setup, {"engine": "HF PEFT", "threads": torch.get_num_threads()})


if __name__ == "__main__":
    main()
