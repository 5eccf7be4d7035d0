"""vLLM's CPU build as a peer engine for bench/peers/run.py. Runs in bench/peers/.venv-vllm (made
by `make peers-venv`), which has vLLM and not loraplex: this file imports only vLLM and the stdlib.

One offline `LLM` with LoRA on (every adapter fits at once: max_loras = max_cpu_loras = the most
adapters a round asks for, max_lora_rank 16), float32, eager (no torch.compile), the whole batch
in one step's budget. A round is one `LLM.generate` over every prompt (token ids, no BOS added)
with a LoRARequest per request (none for the base model): SamplingParams(temperature 0,
max_tokens 32, ignore_eos), so every request runs its 32 tokens and EOS is not masked.

    bench/peers/.venv-vllm/bin/python bench/peers/vllm_worker.py MODEL_DIR ADAPTER_DIR \
        PROMPTS_JSON NUM_ADAPTERS

The caller sets the thread count (run.py: OMP_NUM_THREADS=1, VLLM_CPU_OMP_THREADS_BIND=nobind).
"""

from __future__ import annotations

import sys
import time

from worker_loop import MAX_NEW_TOKENS, Setup, protocol_out, serve

MAX_LORA_RANK = 16


def main() -> None:
    out = protocol_out()
    setup = Setup.from_argv(sys.argv[1:])
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    num_loras = max(setup.num_adapters, 1)
    batch_tokens = sum(map(len, setup.prompts)) + len(setup.prompts)
    llm = LLM(model=setup.model_dir, dtype="float32", enforce_eager=True, seed=0,
              enable_lora=True, max_loras=num_loras, max_cpu_loras=num_loras,
              max_lora_rank=MAX_LORA_RANK, max_num_seqs=len(setup.prompts),
              max_num_batched_tokens=max(batch_tokens, 2048), max_model_len=128,
              enable_prefix_caching=False)
    requests = {f"a{i}": LoRARequest(f"a{i}", i + 1, f"{setup.adapter_dir}/a{i}")
                for i in range(setup.num_adapters)}
    prompts = [TokensPrompt(prompt_token_ids=p) for p in setup.prompts]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)

    def run_round(names: list[str | None]) -> tuple[float, list[list[int]]]:
        loras = [requests[n] if n else None for n in names]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        seconds = time.perf_counter() - start
        return seconds, [list(o.outputs[0].token_ids) for o in outputs]

    run_round(setup.adapter_names(setup.num_adapters))  # warm-up: every adapter loaded once
    setting = (f"vLLM {vllm.__version__}: float32, eager, max_loras {num_loras}, "
               "LD_PRELOAD of tcmalloc and libiomp unset")
    serve(out, run_round, setup, {"engine": setting, "threads": torch.get_num_threads()})


if __name__ == "__main__":
    main()
