"""Constrained decoding in the runner (executor/grammar.py): sampled at temperature 1.0 from the
random fixture model, every constrained output is a string of its grammar and ends there with
EOS, whatever adapter its row runs; rows without a grammar draw exactly what they draw alone;
a sequence recomputed after a preemption (prompt + its tokens, num_generated) goes on in its
grammar where it stopped."""

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer

from common.grammar import Grammar, GrammarKind
from common.sampling import SamplingParams
from executor.grammar import GrammarRows, engine_tokenizer_json
from executor.runner import ModelRunner, Row
from loraplex.demo import MODEL_DIR as DEMO_MODEL_DIR
from tests.own_process import run_script
from tests.runner_driver import Driver, make_runner, prompts

EOS = 1
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["river", "stone", "cloud"]},
        # (bounded, as every part of this schema: an unbounded number or string may run past
        # any max_tokens under a random model, and a cut output is no JSON: docs/api.md)
        "score": {"type": "number", "minimum": -100, "maximum": 100, "multipleOf": 0.25},
        "count": {"type": "integer", "minimum": 0, "maximum": 5000},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "owner": {"type": "object",
                  "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 10**6},
                                 "active": {"type": "boolean"}},
                  "required": ["id", "active"], "additionalProperties": False},
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object",
            "properties": {"sku": {"type": "string", "maxLength": 6},
                           "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
            "required": ["sku", "qty"], "additionalProperties": False}},
    },
    "required": ["name", "kind", "score", "owner", "items"],
    "additionalProperties": False,
}
JSON_GRAMMAR = Grammar(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def runner(tiny):
    return make_runner(tiny, num_kv_blocks=8192)


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return Tokenizer.from_file(str(Path(tiny["model_dir"]) / "tokenizer.json"))


def sampled(seed: int, grammar: Grammar | None = None) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, grammar=grammar)


def generate(runner, requests: dict, max_tokens: int, stop_after: dict | None = None) -> dict:
    """requests: seq_id -> (prompt, slot, sampling) run in one batch until EOS or max_tokens
    (or, for seq ids in stop_after, that many tokens) -> seq_id -> tokens (EOS included)."""
    driver = Driver(runner)
    out = {sid: [] for sid in requests}
    for sid, request in requests.items():
        driver.add(sid, *request)
    while driver.state:
        for sid, (token, _) in driver.step(chunk=16).items():
            out[sid].append(token)
            limit = (stop_after or {}).get(sid, max_tokens)
            if token == EOS or len(out[sid]) >= limit:
                driver.finish(sid)
    return out


def test_hundred_seeded_samples_follow_a_nested_schema_with_adapters_in_one_batch(
        runner, tokenizer):
    slots = [0, 1, 2, -1]  # three adapters and the base model
    requests = {i: (p, slots[i % 4], sampled(i, JSON_GRAMMAR))
                for i, p in enumerate(prompts(100, seed=3))}
    outputs = generate(runner, requests, max_tokens=400)
    for sid, tokens in outputs.items():
        assert tokens[-1] == EOS, f"sequence {sid} did not finish: {tokenizer.decode(tokens)!r}"
        value = json.loads(tokenizer.decode(tokens[:-1]))
        jsonschema.validate(value, SCHEMA)
    assert len({tuple(t) for t in outputs.values()}) == 100  # sampled, not one answer


def test_the_mask_is_per_row(runner, tokenizer):
    """Free rows (greedy and seeded) beside a constrained row draw what they draw alone."""
    free = {i: (p, [0, -1, 2][i], SamplingParams() if i == 0 else sampled(50 + i))
            for i, p in enumerate(prompts(3, seed=5))}
    alone = generate(runner, free, max_tokens=24)
    constrained_prompt = prompts(1, seed=6)[0]
    together = generate(runner, {**free, 9: (constrained_prompt, 1, sampled(9, JSON_GRAMMAR))},
                        max_tokens=200, stop_after={i: 24 for i in free})
    assert {i: together[i] for i in free} == alone
    jsonschema.validate(json.loads(tokenizer.decode(together[9][:-1])), SCHEMA)
    unconstrained = generate(runner, {9: (constrained_prompt, 1, sampled(9))}, max_tokens=24)
    assert unconstrained[9] != together[9][:24]  # the mask changed what row 9 drew


@pytest.mark.parametrize("grammar,check", [
    (Grammar(GrammarKind.REGEX, r"[a-z]{2,5}-[0-9]{2}( ok)?"),
     lambda text: re.fullmatch(r"[a-z]{2,5}-[0-9]{2}( ok)?", text)),
    (Grammar(GrammarKind.CHOICE, choices=("river", "stone quiet", "cloud 7")),
     lambda text: text in ("river", "stone quiet", "cloud 7")),
])
def test_regex_and_choice(runner, tokenizer, grammar, check):
    requests = {i: (p, i % 3 - 1, sampled(100 + i, grammar))
                for i, p in enumerate(prompts(12, seed=7))}
    outputs = generate(runner, requests, max_tokens=300)
    for tokens in outputs.values():
        assert tokens[-1] == EOS  # the grammar's end: only EOS may follow
        assert check(tokenizer.decode(tokens[:-1])), tokenizer.decode(tokens)


def test_a_recomputed_sequence_goes_on_in_its_grammar(runner, tokenizer):
    """As after a preemption or failover: freed after k tokens, then added again with prompt +
    those tokens (num_generated = k); its tokens are those of the run never interrupted."""
    prompt = prompts(1, seed=11)[0]
    whole = generate(runner, {1: (prompt, 0, sampled(77, JSON_GRAMMAR))}, max_tokens=300)[1]
    for k in (1, 7, len(whole) // 2):
        first = generate(runner, {2: (prompt, 0, sampled(77, JSON_GRAMMAR))}, max_tokens=k)[2]
        driver = Driver(runner, seed=k)
        driver.add(3, prompt + first, 0, sampled(77, JSON_GRAMMAR), num_generated=k)
        rest = []
        while not rest or rest[-1] != EOS and len(rest) < 300:
            rest += [token for token, _ in driver.step(chunk=16).values()]
        driver.finish(3)
        assert first + rest == whole, k


def test_grammars_need_the_models_tokenizer():
    runner = ModelRunner.random("tiny", num_kv_blocks=64, block_size=4, num_slots=1,
                                max_rank=8)
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        runner.add_sequence(1, [5, 6], sampled(1, JSON_GRAMMAR), -1)
    runner.add_sequence(2, [5, 6], sampled(1), -1)  # (unconstrained rows never need it)
    assert runner.step([Row(2, 2, (0,))])


def test_a_tokenizer_that_adds_a_prefix_space(tiny):
    """The demo model's tokenizer adds a space before a text (ByteLevel add_prefix_space): the
    engine must tokenize without it, or its forced tokens start with a space its grammar
    refuses (every output of this test was broken before engine_tokenizer_json)."""
    runner = ModelRunner.from_pretrained(DEMO_MODEL_DIR, num_kv_blocks=1024, block_size=4,
                                         num_slots=1, max_rank=8)
    pre_tokenizers = json.loads(runner.tokenizer_json)["pre_tokenizer"]["pretokenizers"]
    assert pre_tokenizers[0]["add_prefix_space"] is True
    plain = json.loads(engine_tokenizer_json(runner.tokenizer_json))["pre_tokenizer"]
    assert plain["pretokenizers"][0]["add_prefix_space"] is False
    schema = {"type": "object", "properties": {
        "word": {"enum": ["stone", "river quiet"]},
        "n": {"type": "integer", "minimum": -9, "maximum": 999}},
              "required": ["word", "n"], "additionalProperties": False}
    grammar = Grammar(GrammarKind.JSON_SCHEMA, json.dumps(schema))
    tokenizer = Tokenizer.from_str(runner.tokenizer_json)
    outputs = generate(runner, {i: (p, -1, sampled(i, grammar))
                                for i, p in enumerate([[2, 40 + i, 300 + i] for i in range(10)])},
                       max_tokens=120)
    for tokens in outputs.values():
        assert tokens[-1] == EOS
        jsonschema.validate(json.loads(tokenizer.decode(tokens[:-1])), schema)


def test_a_row_that_samples_outside_its_mask_may_only_end(tiny):
    rows = GrammarRows(Path(tiny["model_dir"], "tokenizer.json").read_text(), 1024, [EOS])
    rows.add(1, Grammar(GrammarKind.CHOICE, choices=("river",)), [])
    rows.advance([1], [EOS + 1])  # (refused: only NaN logits could draw it)
    logits = torch.zeros(1, 1024)
    rows.constrain(logits, [1])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [EOS]


def test_a_grammar_compiled_ahead_is_not_compiled_again_on_the_step_path(tiny, monkeypatch):
    """PrepareGrammar's compile (another thread) is the one a sequence's add then uses; a
    grammar that does not compile is refused there, before any step."""
    rows = GrammarRows(Path(tiny["model_dir"], "tokenizer.json").read_text(), 1024, [EOS])
    grammar = Grammar(GrammarKind.REGEX, "[a-z]{2,5}")
    assert rows.compile(grammar) > 0 and rows.compile(grammar) == 0.0
    monkeypatch.setattr(rows, "_llg", None)  # (any compile from here on would fail)
    rows.add(1, grammar, [])
    logits = torch.zeros(1, 1024)
    rows.constrain(logits, [1])
    assert torch.isfinite(logits[0]).sum() < 1024
    with pytest.raises(ValueError, match="does not compile"):
        GrammarRows(Path(tiny["model_dir"], "tokenizer.json").read_text(), 1024, [EOS]).compile(
            Grammar(GrammarKind.LARK, "start: undefined_rule"))


def test_the_executor_runs_without_the_engine_until_a_grammar_comes():
    """Where llguidance is not installed (the GPU check's machine), unconstrained steps run and
    a grammar is refused by name."""
    script = (
        "import sys; sys.modules['llguidance'] = None\n"
        "from common.grammar import Grammar, GrammarKind\n"
        "from common.sampling import SamplingParams\n"
        "from executor.runner import ModelRunner, Row\n"
        "runner = ModelRunner.random('tiny', num_kv_blocks=64, block_size=4, num_slots=1, "
        "max_rank=8)\n"
        "runner.tokenizer_json = '{}'\n"
        "assert not runner.prepare_grammars()\n"
        "runner.add_sequence(1, [5, 6], SamplingParams(), -1)\n"
        "assert runner.step([Row(1, 2, (0,))])\n"
        "try:\n"
        "    runner._grammar_rows()\n"
        "except ValueError as err:\n"
        "    print(err)\n")
    out = run_script(script)
    assert out.returncode == 0, out.stderr
    assert "llguidance" in out.stdout and "not installed" in out.stdout


def test_the_grammar_holds_over_logit_bias_and_logprobs_stay_the_models(runner, tokenizer):
    """The mask comes after logit_bias: a row biased +100 toward a token its grammar never
    allows still writes one of its choices, and its logprobs are the model's own (before the
    bias and the mask), as every row's are."""
    words = ("river", "stone")
    banned = next(t for t in range(2, runner.config.vocab_size)
                  if "q" in tokenizer.decode([t]))  # (no choice holds a q)
    sampling = SamplingParams(grammar=Grammar(GrammarKind.CHOICE, choices=words),
                              logit_bias=((banned, 100.0),))
    driver, tokens = Driver(runner), []
    driver.add(1, prompts(1, seed=3)[0], 0, sampling)  # (an adapter: slot 0)
    while driver.state:
        for sid, (token, logits) in driver.step(chunk=16).items():
            model = torch.log_softmax(logits.float(), dim=-1)[token].item()
            assert driver.samples[sid][-1].logprob == pytest.approx(model, abs=1e-5)
            tokens.append(token)
            if token == EOS or len(tokens) >= 16:
                driver.finish(sid)
    assert banned not in tokens and tokens[-1] == EOS
    assert tokenizer.decode(tokens[:-1]) in words


def test_the_deepest_grammar_within_bounds_compiles_and_masks_without_killing_the_executor():
    """The compile of a matcher runs on the engine's deep stack too (common/grammar.py): a Lark
    chain of 27,000 rules (256 KiB) compiles and masks, in a process of its own."""
    script = (
        "import json, torch\n"
        "from executor.grammar import GrammarRows\n"
        "from loraplex.demo import MODEL_DIR\n"
        "from tests.deep_grammars import deepest, lark_chain\n"
        "vocab = json.loads((MODEL_DIR / 'config.json').read_text())['vocab_size']\n"
        "rows = GrammarRows((MODEL_DIR / 'tokenizer.json').read_text(), vocab, [2])\n"
        "rows.add(1, deepest(lark_chain), [])\n"
        "logits = torch.zeros(1, vocab)\n"
        "rows.constrain(logits, [1])\n"
        "print('allowed', int((logits[0] > -1e9).sum()))\n")
    out = run_script(script)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["allowed", "1"]  # (only "b" can start it)
