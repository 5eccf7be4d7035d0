"""Window blocks (issue 45, common/kv_layout.py): sliding-window layers keep KV in tables of their
own, blocks behind a sequence's window given back and reused by other sequences at once (the
stand-in scheduler's shuffled free list). Gemma 2 (alternating), a Gemma 3 of 7 layers every
3rd global (two columns of window blocks and a slack slot: layers_per_block 2, 5 window layers)
and Mistral (every layer windowed), prompts four windows long, alone, batched, chunked and with
a cached prefix: greedy tokens and logits equal HF + PEFT's, and equal the runner's without
window blocks exactly."""

import functools

import pytest
import torch

from common.kv_layout import KVKind, KVLayout
from common.sampling import SamplingParams
from executor.runner import ModelRunner, Row
from loraplex import fixtures
from tests.oracle import assert_matches_hf, tiny_family
from tests.runner_driver import BLOCK, load_folders, prompts, run

WINDOW, NUM_TOKENS = 6, 10
ADAPTERS = {"all_r8": {"r": 8, "lora_alpha": 16, "target_modules": fixtures.ATTN + fixtures.MLP}}
FAMILIES = {
    "gemma2": {"sliding_window": WINDOW, "head_dim": 64, "num_hidden_layers": 4},
    "gemma3_text": {"sliding_window": WINDOW, "head_dim": 32, "num_hidden_layers": 7,
                    "sliding_window_pattern": 3, "rope_local_base_freq": 100.0},
    "mistral": {"sliding_window": WINDOW, "num_hidden_layers": 3},
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    model_dir, hf = tiny_family(out, request.param, FAMILIES[request.param], 7, ADAPTERS, 70)
    return request.param, model_dir, out, hf


def make_runner(model_dir, folder, window_blocks: bool) -> ModelRunner:
    runner = ModelRunner.from_pretrained(model_dir, num_kv_blocks=2048, block_size=BLOCK,
                                         num_slots=1, max_rank=8, lora_backend="torch",
                                         window_blocks=window_blocks)
    return load_folders(runner, [folder / name for name in ADAPTERS])


def long_prompt(seed: int, length: int) -> list[int]:
    return (prompts(1, seed)[0] * length)[:length]


def test_the_layouts_of_the_families():
    assert KVLayout.of([6, None] * 2) == KVLayout(
        (KVKind(None, (1, 3), 1), KVKind(6, (0, 2), 1)), 2)
    gemma3 = KVLayout.of([6, 6, None] * 2 + [6])
    assert gemma3 == KVLayout((KVKind(None, (2, 5), 1), KVKind(6, (0, 1, 3, 4, 6), 3)), 2)
    assert [gemma3.place(layer) for layer in (0, 2, 4, 5, 6)] == [
        (1, 0, 0), (0, 0, 0), (1, 1, 1), (0, 0, 1), (1, 2, 0)]
    assert gemma3.layer_groups == 4  # (adapters' pages: 7 layers in blocks of 2)
    assert KVLayout.of([6] * 3) == KVLayout((KVKind(6, (0, 1, 2), 1),), 3)
    assert KVLayout.of([6, None], window_blocks=False).is_single
    window = gemma3.kinds[1]
    # a row from position 20 reads keys 15.. (window 6): token blocks from 3 (12..15) on
    assert [window.first_needed(p, 4) for p in (0, 5, 6, 9, 20)] == [0, 0, 0, 1, 3]
    assert window.most_held(1000, 4) == 3  # ceil(5 / 4) + 1
    assert gemma3.most_blocks(1000, 4) == 250 + 3 * 3


def test_tokens_and_logits_equal_hf_peft_and_the_whole_context_layout(family):
    name, model_dir, folder, hf = family
    windowed = make_runner(model_dir, folder, window_blocks=True)
    assert len(windowed.kv_layout.kinds) == (1 if name == "mistral" else 2)
    whole = make_runner(model_dir, folder, window_blocks=False)
    names = ["all_r8", None, "all_r8"]
    requests = {sid: (long_prompt(sid, 4 * WINDOW + sid), 0 if n else -1)
                for sid, n in enumerate(names)}
    got = run(windowed, requests, NUM_TOKENS, chunk=5, seed=1)  # (blocks reused at once)
    assert_matches_hf(hf, requests, names, got, NUM_TOKENS, atol=1e-4)
    reference = run(whole, requests, NUM_TOKENS, chunk=5, seed=1)
    for sid in requests:
        assert got[sid][0] == reference[sid][0]
        assert torch.equal(got[sid][1], reference[sid][1])
    alone = run(windowed, {0: requests[0]}, NUM_TOKENS, chunk=64)  # (one prefill step)
    assert alone[0][0] == got[0][0]
    torch.testing.assert_close(alone[0][1], got[0][1], atol=1e-5, rtol=0)


def test_a_cached_prefix_takes_only_its_window_of_the_window_layers(family):
    """Sequence 2 shares sequence 1's first 6 blocks (24 tokens): every global block, but of the
    window layers only the blocks its first row's window reads (from block 4: keys 19..); its
    tables start there (first_blocks), the blocks before left to others."""
    _, model_dir, folder, _ = family
    runner = make_runner(model_dir, folder, window_blocks=True)
    layout, free = runner.kv_layout, iter(runner.free_blocks())
    shared = long_prompt(11, 24)

    def blocks(kind, count):
        return [tuple(next(free) for _ in range(kind.columns)) for _ in range(count)]

    tables = [blocks(kind, 7) for kind in layout.kinds]  # sequence 1: 26 tokens
    runner.add_sequence(1, shared + [5, 6], SamplingParams(), 0)
    runner.step([row(1, 26, tables, layout)])

    prompt = shared + [7, 8, 9]
    first = [kind.first_needed(24, BLOCK) for kind in layout.kinds]
    assert first == [0, 4] or first == [4]  # (mistral: its only kind has the window)
    runner.add_sequence(2, prompt, SamplingParams(), 0, num_cached=24, first_blocks=first)
    reused = [table[f:6] + blocks(kind, 1) for kind, table, f in zip(layout.kinds, tables, first)]
    cached = decode(runner, 2, row(2, 3, reused, layout), layout, blocks)
    runner.add_sequence(3, prompt, SamplingParams(), 0)
    fresh = decode(runner, 3, row(3, 27, [blocks(kind, 7) for kind in layout.kinds], layout),
                   layout, blocks)
    assert cached[0] == fresh[0]
    torch.testing.assert_close(cached[1], fresh[1], atol=1e-5, rtol=0)


def row(seq_id: int, n: int, tables: list, layout: KVLayout) -> Row:
    """A row bringing each kind's token blocks `tables[k]` (tuples of its columns' blocks)."""
    counts = tuple(len(t) * kind.columns for t, kind in zip(tables, layout.kinds))
    ids = tuple(b for t in tables for entry in t for b in entry)
    return Row(seq_id, n, ids, counts if len(layout.kinds) > 1 else ())


def decode(runner, seq_id: int, first: Row, layout: KVLayout, blocks, steps: int = 8):
    """Run `first`, then `steps` decode rows (a token block of each kind every BLOCK tokens):
    greedy tokens and the logits of every sample."""
    sampled, logits = runner.step_with_logits([first])
    tokens, all_logits = [sampled[0].token_id], [logits[0]]
    length = len(runner.tokens(seq_id))
    for _ in range(steps):
        grow = (length - 1) % BLOCK == 0
        new = [blocks(kind, 1) if grow else [] for kind in layout.kinds]
        sampled, logits = runner.step_with_logits([row(seq_id, 1, new, layout)])
        tokens.append(sampled[0].token_id)
        all_logits.append(logits[0])
        length += 1
    return tokens, torch.stack(all_logits)


def test_bad_window_tables_are_refused(family):
    _, model_dir, folder, _ = family
    runner = make_runner(model_dir, folder, window_blocks=True)
    kinds = runner.kv_layout.kinds
    with pytest.raises(ValueError, match="first_blocks"):
        runner.add_sequence(1, list(range(2, 30)), SamplingParams(), -1, num_cached=24,
                            first_blocks=[0] * (len(kinds) + 1))
    with pytest.raises(ValueError, match="its first rows read token block 4"):
        runner.add_sequence(1, list(range(2, 30)), SamplingParams(), -1, num_cached=24,
                            first_blocks=[0] * (len(kinds) - 1) + [5])
    runner.add_sequence(2, list(range(2, 10)), SamplingParams(), -1)
    window = kinds[-1]
    if len(kinds) > 1:
        with pytest.raises(ValueError, match="kinds' counts"):
            runner.step([Row(2, 8, (0, 1), (2,))])
    if window.columns > 1:
        with pytest.raises(ValueError, match="not whole token blocks"):
            runner.step([Row(2, 4, (0, 1), (1, 1))])


def test_triton_attention_reads_each_columns_tables(family, monkeypatch):
    """The paged-attention kernel (the Triton interpreter here, as on CUDA) through each kind's
    column tables, blocks behind the window reused by others: the torch path's tokens."""
    pytest.importorskip("triton")
    from executor import runner as runner_module
    from kernels.sgmv_tiles import is_interpreted

    if not is_interpreted():
        pytest.skip("needs TRITON_INTERPRET=1 before triton is imported")
    _, model_dir, folder, _ = family
    requests = {sid: (long_prompt(sid, 3 * WINDOW + sid), 0 if sid != 1 else -1)
                for sid in range(3)}
    torch_path = run(make_runner(model_dir, folder, True), requests, 4, chunk=5, seed=2)
    monkeypatch.setattr(runner_module.StepMetadata, "build", functools.partial(
        runner_module.StepMetadata.build, attention="triton"))
    got = run(make_runner(model_dir, folder, True), requests, 4, chunk=5, seed=2)
    for sid in requests:
        assert got[sid][0] == torch_path[sid][0]
        torch.testing.assert_close(got[sid][1], torch_path[sid][1], atol=1e-4, rtol=0)
