"""Section 9 of the GPU check: a mixture-of-experts layer at Qwen3-30B-A3B's shapes (128 experts
of 768, top 8, hidden 2048), bf16: the grouped expert matmul (kernels/moe_gemm.py) against its
torch reference and against a per-expert loop of torch matmuls (what executor/model/moe.py runs on
CPU), and the experts' LoRA (rank 16 on both expert weights, the SGMV kernels over the pool's
flat offset tables, executor/lora/experts.py) against the torch path, for 1, 16 and 64 distinct
adapters over 64 decode rows and a 2048-row prefill.
"""

from __future__ import annotations

from gpu_harness import DEVICE, OPTS, REPORT, bench_ms, section, sync, table  # first

import torch
from executor.model.kv_cache import PagedKVCache
from executor.lora.experts import ExpertRuns
from executor.lora.torch_backend import TorchLoraBackend
from executor.lora.triton_backend import TritonLoraBackend
from executor.model.config import ModelConfig
from executor.model.moe import Routing, grouped_matmul
from executor.lora.slot_pool import LoraModuleWeights, LoraSlotPool, LoraWeights
from kernels.moe_gemm import moe_gemm
from kernels.moe_gemm_ref import moe_gemm_ref
from kernels.reference import TOLERANCES

DT = torch.bfloat16


def moe_config() -> ModelConfig:
    full = ModelConfig.named("qwen3-30b-a3b")
    if OPTS.smoke:
        return full.replace(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, num_experts=8,
                            num_experts_per_tok=2, moe_intermediate_size=32, moe_layers=(0,))
    return full.replace(num_hidden_layers=1, moe_layers=(0,))


def expert_pool(c: ModelConfig, num_adapters: int, rank: int) -> LoraSlotPool:
    experts = [m for m in c.lora_modules if m.startswith("experts.")]
    per = sum(-(-(c.module_shape(m)[0] + c.module_shape(m)[1]) * rank // (16 * c.kv_size))
              for m in experts)
    kv = PagedKVCache(num_layers=1, num_blocks=num_adapters * per + 64, block_size=16,
                      num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, dtype=DT,
                      device=DEVICE)
    pool = LoraSlotPool(c, num_slots=num_adapters, max_rank=rank, kv=kv)
    g = torch.Generator(device=DEVICE).manual_seed(3)
    for slot in range(num_adapters):
        mods = {}
        for m in experts:
            i, o = c.module_shape(m)
            mods[(0, m)] = LoraModuleWeights(
                torch.randn(rank, i, generator=g, device=DEVICE, dtype=DT) * 0.02,
                torch.randn(o, rank, generator=g, device=DEVICE, dtype=DT) * 0.02, 2.0)
        weights = LoraWeights(mods)
        free = sorted(set(range(kv.num_blocks)) - pool.page_blocks())
        pool.load(slot, weights, tuple(free[:pool.pages_for(weights).num_pages]))
        pool.mark_loaded(slot)
    return pool


@section("9. MoE: grouped expert matmul and expert LoRA (bf16, Qwen3-30B-A3B layer)")
def moe_check() -> None:
    c = moe_config()
    g = torch.Generator(device=DEVICE).manual_seed(1)
    w_gate_up = torch.randn(c.num_experts, 2 * c.moe_intermediate_size, c.hidden_size,
                            generator=g, device=DEVICE, dtype=DT) * 0.02
    router = torch.randn(c.num_experts, c.hidden_size, generator=g, device=DEVICE, dtype=DT)
    rows_list = (4, 16) if OPTS.smoke else (64, 2048)
    adapters_list = (2,) if OPTS.smoke else (1, 16, 64)
    rtol, atol = TOLERANCES[DT]
    base_rows, lora_rows = [], []
    for num_rows in rows_list:
        x = torch.randn(num_rows, c.hidden_size, generator=g, device=DEVICE, dtype=DT)
        routing = Routing.route(c, x, router, torch.full((num_rows,), -1, dtype=torch.long))
        xs = x.index_select(0, routing.rows)
        runs = routing.expert_runs
        got, want = moe_gemm(xs, w_gate_up, runs), moe_gemm_ref(xs, w_gate_up, runs)
        scale = float(want.float().abs().max())
        ok = bool(torch.allclose(got.float(), want.float(), rtol=rtol, atol=atol * scale))
        kernel_ms = bench_ms(lambda: moe_gemm(xs, w_gate_up, runs))
        loop_ms = bench_ms(lambda: grouped_matmul(xs, w_gate_up, runs))
        base_rows.append([num_rows, len(runs), kernel_ms * 1e3, loop_ms * 1e3,
                          loop_ms / kernel_ms, "yes" if ok else "NO"])
        for num_adapters in adapters_list:
            pool = expert_pool(c, num_adapters, 16)
            slots = torch.arange(num_rows) % num_adapters
            routing = Routing.route(c, x, router, slots.sort().values)
            xs = x.index_select(0, routing.rows)
            triton_lora, torch_lora = TritonLoraBackend(pool), TorchLoraBackend(pool)
            work = triton_lora.prepare_experts(routing.slots, routing.experts,
                                               routing.expert_runs)
            runs_t = torch_lora.prepare_experts(routing.slots, routing.experts,
                                                routing.expert_runs)
            out = torch.zeros(xs.shape[0], w_gate_up.shape[1], device=DEVICE, dtype=DT)
            got, want = out.clone(), out.clone()
            triton_lora.apply_experts(0, "gate_up_proj", xs, got, work)
            torch_lora.apply_experts(0, "gate_up_proj", xs, want, runs_t)
            sync()
            scale = float(want.float().abs().max()) or 1.0
            ok = bool(torch.allclose(got.float(), want.float(), rtol=rtol, atol=atol * scale))
            t_ms = bench_ms(lambda: triton_lora.apply_experts(0, "gate_up_proj", xs, out, work))
            r_ms = bench_ms(lambda: torch_lora.apply_experts(0, "gate_up_proj", xs, out, runs_t))
            lora_rows.append([num_rows, num_adapters, len(ExpertRuns.build(
                routing.slots, routing.expert_runs).runs), t_ms * 1e3, r_ms * 1e3,
                r_ms / t_ms, t_ms / kernel_ms, "yes" if ok else "NO"])
            print(lora_rows[-1], flush=True)
    REPORT.append(f"One MoE layer: {c.num_experts} experts of {c.moe_intermediate_size}, top "
                  f"{c.num_experts_per_tok}, hidden {c.hidden_size}, bf16; gate_up (the larger "
                  "of the two matmuls). us = do_bench median.\n\n")
    REPORT.append(table(["rows", "experts hit", "kernel us", "per-expert loop us",
                         "loop / kernel", "matches reference"], base_rows))
    REPORT.append("\nThe experts' LoRA of gate_up, rank 16 on every expert: SGMV over (expert, "
                  "adapter) runs against the torch path.\n\n")
    REPORT.append(table(["rows", "adapters", "(expert, adapter) runs", "triton us", "torch us",
                         "torch / triton", "LoRA / base matmul", "matches torch"], lora_rows))
