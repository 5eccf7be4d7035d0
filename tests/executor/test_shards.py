"""What part of the model each rank of a tensor-parallel executor holds (executor/tp/shards.py): the
parts of every projection cover it whole, heads stay whole (KV heads replicated when fewer than
the ranks), fused projections cut as their parts, checkpoints are read part by part, and
adapters are cut the way the base is."""

import pytest
import torch

from executor.lora.slot_pool import LoraModuleWeights, LoraWeights
from executor.model.config import ModelConfig
from executor.model.weights import load_weights, random_weights
from executor.tp.shards import FUSED_PARTS, Shard

TINY = ModelConfig.named("tiny")  # hidden 256, 4 heads / 2 KV heads of 64, intermediate 688


def covered(ranges_per_rank: list[tuple[tuple[int, int], ...]]) -> list[int]:
    return sorted({i for ranges in ranges_per_rank for a, b in ranges for i in range(a, b)})


def test_the_running_example():
    rank3 = Shard(TINY, 3, 4)
    assert rank3.ranges("q_proj") == ((192, 256),) == rank3.ranges("o_proj")
    assert rank3.ranges("k_proj") == ((64, 128),) == Shard(TINY, 2, 4).ranges("v_proj")
    assert rank3.ranges("gate_proj") == ((516, 688),) == rank3.ranges("down_proj")
    assert (rank3.vocab_start, rank3.vocab_rows) == (768, 256)
    local = rank3.config
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size,
            local.head_dim, local.hidden_size) == (1, 1, 172, 64, 256)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_the_parts_cover_every_projection_whole(world):
    for module in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "qkv_proj",
                   "gate_up_proj"):
        parts = [Shard(TINY, r, world).ranges(module) for r in range(world)]
        size = (TINY.q_size + 2 * TINY.kv_size if module == "qkv_proj" else
                2 * TINY.intermediate_size if module == "gate_up_proj" else
                TINY.module_shape(module)[1])
        assert covered(parts) == list(range(size)), module
    kv = [Shard(TINY, r, world).ranges("k_proj") for r in range(world)]
    assert len(set(kv)) == min(world, 2)  # two KV heads: split, then each held by two ranks


def test_a_fused_projection_is_cut_as_its_parts():
    g = torch.Generator().manual_seed(0)
    parts = {m: torch.randn(TINY.module_shape(m)[1], 5, generator=g)
             for m in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")}
    for rank in range(4):
        shard = Shard(TINY, rank, 4)
        for fused, names in FUSED_PARTS.items():
            b = torch.cat([parts[m] for m in names])  # [fused out, r]: B of the fused module
            cut = torch.cat([b[x:y] for x, y in shard.ranges(fused)])
            want = torch.cat([parts[m][x:y] for m in names for x, y in shard.ranges(m)])
            assert torch.equal(cut, want), (fused, rank)


@pytest.mark.parametrize("world, field", [(3, "num_attention_heads 4"),
                                          (8, "num_attention_heads 4")])
def test_a_group_the_model_does_not_split_into_is_refused(world, field):
    with pytest.raises(ValueError, match=field):
        Shard(TINY, 0, world)
    with pytest.raises(ValueError, match="num_key_value_heads 3"):
        Shard(TINY.replace(num_attention_heads=6, num_key_value_heads=3), 0, 2)


def test_each_rank_reads_its_part_of_the_checkpoint(tiny):
    config = ModelConfig.from_pretrained(tiny["model_dir"])
    whole = load_weights(tiny["model_dir"], config)
    for rank in range(2):
        shard = Shard(config, rank, 2)
        part = load_weights(tiny["model_dir"], config, shard=shard)
        q, kv = config.q_size, config.kv_size
        (qa, qb), = shard.ranges("q_proj")
        (ka, kb), = shard.ranges("k_proj")
        (ia, ib), = shard.ranges("gate_proj")
        for got, w in zip(part.layers, whole.layers):
            want_qkv = torch.cat([w.wqkv[qa:qb], w.wqkv[q + ka:q + kb],
                                  w.wqkv[q + kv + ka:q + kv + kb]])
            assert torch.equal(got.wqkv, want_qkv)
            assert torch.equal(got.wo, w.wo[:, qa:qb])
            inter = config.intermediate_size
            assert torch.equal(got.w_gate_up, torch.cat([w.w_gate_up[ia:ib],
                                                         w.w_gate_up[inter + ia:inter + ib]]))
            assert torch.equal(got.w_down, w.w_down[:, ia:ib])
            assert torch.equal(got.input_norm, w.input_norm)
        rows = slice(shard.vocab_start, shard.vocab_start + shard.vocab_rows)
        assert torch.equal(part.embed, whole.embed[rows]) and part.vocab_start == rows.start
        assert torch.equal(part.lm_head, whole.lm_head[rows])


def test_a_vocabulary_that_does_not_split_evenly_is_padded():
    config = TINY.replace(vocab_size=1001)
    whole = random_weights(config, seed=3)
    last = random_weights(config, seed=3, shard=Shard(config, 1, 2))
    assert last.embed.shape == (501, 256) and last.vocab_start == 501
    assert torch.equal(last.embed[:500], whole.embed[501:]) and not last.embed[500].any()


def test_adapters_are_cut_as_the_base():
    g = torch.Generator().manual_seed(1)

    def module(m: str) -> LoraModuleWeights:
        in_f, out_f = TINY.module_shape(m)
        return LoraModuleWeights(torch.randn(4, in_f, generator=g),
                                 torch.randn(out_f, 4, generator=g), 0.5)

    weights = LoraWeights({(0, "k_proj"): module("k_proj"), (1, "down_proj"): module("down_proj")})
    assert Shard(TINY).lora(weights) is weights
    shard = Shard(TINY, 1, 2)
    cut = shard.lora(weights).modules
    k, down = weights.modules[(0, "k_proj")], weights.modules[(1, "down_proj")]
    assert torch.equal(cut[(0, "k_proj")].a, k.a)  # column-parallel: A whole, B's rows
    assert torch.equal(cut[(0, "k_proj")].b, k.b[64:128])
    assert torch.equal(cut[(1, "down_proj")].a, down.a[:, 344:])  # row-parallel: A's columns
    assert torch.equal(cut[(1, "down_proj")].b, down.b)
    assert cut[(1, "down_proj")].scale == 0.5
