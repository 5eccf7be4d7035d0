"""`loraplex budget`: the executor's memory for a model and traffic mix, before anything starts.
Weights, slot pool and KV cache must be what a runner built with the printed flags allocates; the
plan must fit the usable memory and leave no whole block unused."""

import subprocess
import sys

import pytest
import torch

from executor.memory_budget import MemoryBudget
from executor.model.config import ModelConfig
from executor.runner import ModelRunner
from loraplex.budget import format_plan, plan
from tests.random_adapters import random_adapter
from tests.rank_threads import RankThreads

GIB = 2**30


def make_plan(config: ModelConfig, **changes):
    kw = dict(dtype=torch.float32, gpu_bytes=0.05 * GIB, utilization=0.9, adapter_slots=4,
              max_rank=8, block_size=16, max_batched_tokens=256, max_num_seqs=8, context=512)
    return plan(config, **{**kw, **changes})


def check_fits_and_is_maximal(p, wanted_tokens: int) -> None:
    """Everything fits; one block more would not (with the K/V a step would gather of it, when
    the cache, not the mix, bounds what a step gathers)."""
    kv = p.num_kv_blocks * p.block_size * p.kv_bytes_per_token
    held = p.weights_bytes + p.pool_bytes + p.workspace_bytes + p.graphs_bytes + kv
    assert held <= p.usable_bytes
    one_more = p.block_size * p.kv_bytes_per_token
    if wanted_tokens > p.kv_tokens:
        one_more += p.block_size * p.kv_bytes_per_token // p.config.num_hidden_layers
    assert held + one_more > p.usable_bytes


QWEN3_SHAPED = ModelConfig.named("tiny").replace(qk_norm=True, head_dim=48)  # (head_dim != 64)
GEMMA3_SHAPED = QWEN3_SHAPED.replace(  # four norms a layer, tied embeddings
    sandwich_norms=True, norm_unit_offset=True, tie_word_embeddings=True, sliding_window=8,
    layer_types=("sliding_attention", "full_attention") * 2)
MOE_SHAPED = QWEN3_SHAPED.replace(  # 6 experts of 96 in layers 0, 1, 3; layer 2's MLP dense
    num_experts=6, num_experts_per_tok=2, moe_intermediate_size=96, moe_layers=(0, 1, 3))


@pytest.mark.parametrize("context", [64, 100_000])  # the mix fits / the cache bounds the gather
@pytest.mark.parametrize("config", [ModelConfig.named("tiny"), QWEN3_SHAPED, GEMMA3_SHAPED,
                                    MOE_SHAPED], ids=["llama", "qwen3", "gemma3", "moe"])
def test_plan_is_what_a_runner_with_its_flags_allocates(context, config):
    p = make_plan(config, context=context)
    assert p.num_kv_blocks >= 1 and (8 * context > p.kv_tokens) == (context > 64)
    check_fits_and_is_maximal(p, 8 * context)
    runner = ModelRunner.random(config, num_kv_blocks=p.num_kv_blocks, block_size=p.block_size,
                                num_slots=4, max_rank=8)
    kv = p.num_kv_blocks * p.block_size * p.kv_bytes_per_token
    assert runner.memory_budget() == MemoryBudget(p.weights_bytes, kv, p.pool_bytes)
    assert p.page_bytes == runner.pool.page_bytes
    weights = random_adapter(config, 8, 0, same_rank=True)  # (on every projection and expert)
    assert p.mix_pages == p.padded_pages == runner.pool.pages_for(weights).num_pages


def test_a_larger_mix_leaves_less_cache_until_the_cache_bounds_it():
    config = ModelConfig.named("llama-3-8b")
    kw = dict(dtype=torch.bfloat16, gpu_bytes=80 * GIB, adapter_slots=64, max_rank=16,
              max_batched_tokens=2048, max_num_seqs=64)
    contexts = (1024, 4096, 10**7)
    small, large, huge = (make_plan(config, **kw, context=c) for c in contexts)
    assert small.num_kv_blocks > large.num_kv_blocks > huge.num_kv_blocks >= 1
    for p, context in zip((small, large, huge), contexts):
        check_fits_and_is_maximal(p, 64 * context)
    # 8B in bf16: 16.06 GB of weights, 128 KiB of KV per token, blocks of 2 MiB: a rank-16
    # adapter on all 7 projections takes 42 (88 MB, its rows 95% of them)
    assert (round(small.weights_bytes / 1e9, 2), small.kv_bytes_per_token, small.page_bytes,
            small.mix_pages) == (16.06, 128 * 1024, 2 * 2**20, 42)


def test_named_families_weigh_what_their_parameter_counts_say():
    """bf16 weights of the named shapes (random:NAME): Gemma 2 9B has 9.24B parameters, Gemma 3
    12B's text model 11.77B (embeddings tied, four norms a layer, Gemma 3's q/k norms), Phi-3
    mini 3.82B (fused qkv_proj and gate_up_proj)."""
    names = ("gemma-2-9b", "gemma-3-12b", "phi-3-mini", "qwen3-30b-a3b", "mixtral-8x7b")
    weights = {name: make_plan(ModelConfig.named(name), dtype=torch.bfloat16, gpu_bytes=80 * GIB)
               .weights_bytes / 1e9 for name in names}
    # (Qwen3-30B-A3B: 30.53B parameters; Mixtral 8x7B: 46.70B)
    assert {n: round(w, 2) for n, w in weights.items()} == {
        "gemma-2-9b": 18.48, "gemma-3-12b": 23.53, "phi-3-mini": 7.64, "qwen3-30b-a3b": 61.06,
        "mixtral-8x7b": 93.41}


def test_a_mixture_of_experts_budget_says_how_many_expert_adapters_fit():
    """Qwen3-30B-A3B on 80 GB: a rank-16 adapter on every projection adapts all 128 experts of
    48 layers (1.3 GB), 49x one on attention alone; the budget prints both counts."""
    p = make_plan(ModelConfig.named("qwen3-30b-a3b"), dtype=torch.bfloat16, gpu_bytes=80 * GIB,
                  adapter_slots=64, max_rank=16, max_batched_tokens=2048, max_num_seqs=16,
                  context=4096)
    assert p.mix_pages == 836 and p.attention_pages == 17
    text = format_plan(p, adapter_slots=64, max_rank=16, seqs=16, context=4096)
    assert "7 of the rank mix" in text and "49x the pages of one on attention alone; of those " \
        "355 fit" in text


def test_a_rank_mix_fits_more_adapters_in_pages_than_in_padded_slots():
    config = ModelConfig.named("llama-3-8b")
    kw = dict(dtype=torch.bfloat16, gpu_bytes=80 * GIB, adapter_slots=64, max_rank=64,
              max_batched_tokens=2048, max_num_seqs=64, context=4096)
    mixed = make_plan(config, **kw, adapter_ranks={8: 0.7, 16: 0.2, 64: 0.1})
    assert mixed.padded_pages == 8 * 21
    assert mixed.mix_pages == pytest.approx(0.7 * 21 + 0.2 * 42 + 0.1 * 168)
    text = format_plan(mixed, adapter_slots=64, max_rank=64, seqs=64, context=4096)
    paged, padded = (int(text.split(what)[0].split()[-1].replace(",", ""))
                     for what in (" of the rank mix", " in slots padded"))
    assert paged > 4 * padded > 0


def test_decode_graphs_keep_their_largest_bucket_s_step_where_the_executor_captures_them():
    """8B in bf16: the 256-row bucket's activations (64 Ki elements a row) and logits (bf16 and
    fp32) are 0.23 GB, taken from the blocks; none with --no-cuda-graphs, on tensor-parallel
    ranks, beside mixture-of-experts layers or window blocks (DecodeGraphs.supports)."""
    config = ModelConfig.named("llama-3-8b")
    kw = dict(dtype=torch.bfloat16, gpu_bytes=80 * GIB, adapter_slots=64, max_rank=16,
              max_batched_tokens=2048, max_num_seqs=64, context=4096)
    on, off = make_plan(config, **kw), make_plan(config, **kw, cuda_graphs=False)
    assert on.graphs_bytes == 256 * (65536 * 2 + 128256 * (4 + 2)) and off.graphs_bytes == 0
    assert abs(off.num_kv_blocks - on.num_kv_blocks - on.graphs_bytes / off.page_bytes) < 1
    assert make_plan(config, **kw, tensor_parallel=2).graphs_bytes == 0
    small = dict(kw, gpu_bytes=0.05 * GIB, dtype=torch.float32, max_batched_tokens=256)
    assert make_plan(MOE_SHAPED, **small).graphs_bytes == 0
    assert make_plan(GEMMA3_SHAPED, **small).graphs_bytes == 0
    assert make_plan(GEMMA3_SHAPED, **small, window_blocks=False).graphs_bytes > 0
    text = budget().stdout
    assert "  decode graphs             0.23 GB   (estimate: the 256-row bucket's step" in text
    assert f"--kv-blocks {on.num_kv_blocks} " in text
    text = budget("--no-cuda-graphs").stdout
    assert "decode graphs" not in text and f"--kv-blocks {off.num_kv_blocks} " in text
    assert "--dtype bfloat16 --no-cuda-graphs" in text


def budget(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loraplex.cli", "budget", *args],
                          capture_output=True, text=True, timeout=60, check=False)


def test_cli_prints_the_flags_and_whether_the_mix_fits(tiny):
    fits = budget("--model", tiny["model_dir"], "--dtype", "float32", "--gpu-gib", "0.05",
                  "--adapter-slots", "4", "--max-rank", "8", "--seqs", "8", "--context", "64",
                  "--max-batched-tokens", "256")
    assert fits.returncode == 0, fits.stderr
    p = make_plan(ModelConfig.from_pretrained(tiny["model_dir"]), context=64)
    assert f"--kv-blocks {p.num_kv_blocks} --block-size 16 --adapter-slots 4" in fits.stdout
    assert "traffic: 8 sequences of 64 tokens at once fits" in fits.stdout
    crowded = budget("--seqs", "512", "--context", "32768")  # 8B on 80 GiB
    assert crowded.returncode == 0 and "does NOT fit" in crowded.stdout
    assert "sequences fit at once" in crowded.stdout
    too_small = budget("--gpu-gib", "16")
    assert too_small.returncode == 2 and "does not fit" in too_small.stdout


def test_a_gpu_short_of_one_block_says_by_how_much():
    config = ModelConfig.named("llama-3-8b")
    kw = dict(dtype=torch.bfloat16, adapter_slots=64, max_rank=16, block_size=4096,
              max_batched_tokens=2048, max_num_seqs=64)
    empty = make_plan(config, gpu_bytes=0, **kw)
    room = empty.weights_bytes + empty.pool_bytes + empty.workspace_bytes + empty.graphs_bytes
    room += 2048 * empty.kv_bytes_per_token  # half a block of 4096 tokens: not one block
    edge = make_plan(config, gpu_bytes=room / 0.9 + 1, **kw)
    assert edge.num_kv_blocks == 0
    text = format_plan(edge, adapter_slots=64, max_rank=16, seqs=64, context=4096)
    short = float(text.split("does not fit: ")[1].split(" GB")[0])
    k = edge.kv_bytes_per_token  # a block plus the K/V a step gathers of it, less the room
    assert short == pytest.approx((4096 * k * (1 + 1 / 32) - 2048 * k) / 1e9, abs=0.01)
    for bad, message in [(("--seqs", "0"), "--seqs must be >= 1"),
                         (("--utilization", "1.5"), "--utilization in (0, 1]"),
                         (("--model", "/nonexistent"), "config.json not found"),
                         (("--tensor-parallel", "3"), "tensor parallel 3: does not divide the "
                                                      "model's num_attention_heads 32")]:
        run = budget(*bad)
        assert run.returncode == 1 and message in run.stderr, run.stderr


def test_a_tensor_parallel_plan_is_what_each_rank_allocates():
    config = ModelConfig.named("tiny")
    p = make_plan(config, context=64, tensor_parallel=2)
    whole = make_plan(config, context=64)
    assert p.kv_bytes_per_token == whole.kv_bytes_per_token // 2  # its KV head of 2
    ranks = RankThreads(2, lambda tp: ModelRunner.random(
        config, num_kv_blocks=p.num_kv_blocks, block_size=p.block_size, num_slots=4,
        max_rank=8, tp=tp))
    kv = p.num_kv_blocks * p.block_size * p.kv_bytes_per_token
    assert ranks.each(ModelRunner.memory_budget) == [MemoryBudget(p.weights_bytes, kv,
                                                                  p.pool_bytes)] * 2
    assert p.page_bytes == ranks.ranks[1].pool.page_bytes
    weights = ranks.ranks[0].shard.lora(random_adapter(config, 8, 0, same_rank=True))
    assert p.mix_pages == ranks.ranks[0].pool.pages_for(weights).num_pages
    ranks.close()


def test_a_70b_base_fits_four_80gb_gpus_and_not_one():
    config = ModelConfig.named("llama-3-70b")
    kw = dict(dtype=torch.bfloat16, gpu_bytes=80 * GIB, adapter_slots=64, max_rank=16,
              max_batched_tokens=2048, max_num_seqs=64, context=4096)
    one, four = make_plan(config, **kw), make_plan(config, **kw, tensor_parallel=4)
    assert one.num_kv_blocks < 1 and four.num_kv_blocks >= 1
    check_fits_and_is_maximal(four, 64 * 4096)
    assert one.weights_bytes / 4 < four.weights_bytes < one.weights_bytes / 4 * 1.001
    assert "--tensor-parallel 4" in format_plan(four, adapter_slots=64, max_rank=16, seqs=64,
                                                 context=4096)


def test_window_blocks_say_what_a_sliding_model_saves():
    """Gemma 3 12B at 32k tokens: 40 of its 48 layers slide over 1,024 keys. A sequence holds
    2,048 blocks of its 8 global layers and at most 5 x 65 of its window layers' (blocks of 8
    layers): 395.5 blocks of every layer against 2,048."""
    p = make_plan(ModelConfig.named("gemma-3-12b"), dtype=torch.bfloat16, gpu_bytes=80 * GIB,
                  context=32768)
    assert p.seq_blocks(32768) == (2048 + 5 * 65) * 8 / 48
    assert make_plan(ModelConfig.named("gemma-3-12b"), window_blocks=False).seq_blocks(
        32768) == 2048
    args = ("--model", "random:gemma-3-12b", "--context", "32768", "--seqs", "16")
    on, off = budget(*args), budget(*args, "--no-window-blocks")
    assert on.returncode == off.returncode == 0, on.stderr + off.stderr
    assert "window blocks: 40 of 48 layers slide over 1024 keys" in on.stdout
    assert "(81% less)" in on.stdout and "at once fits" in on.stdout
    assert "window blocks" not in off.stdout and "--no-window-blocks" in off.stdout
    assert "at once does NOT fit" in off.stdout
