"""Grammar engines compared for structured outputs: xgrammar against llguidance, and what a
token mask would cost to ship over gRPC (where the matcher runs: docs/scheduling.md).

    .venv/bin/python bench/grammar_engines.py [--vocab 128000] [--rows 256] [--steps 48] [--out]

xgrammar is not a dependency of loraplex (`pip install xgrammar` into the venv to run this).
A byte-level BPE tokenizer of --vocab tokens is trained with `tokenizers` on synthetic text (words
from syllables, JSON lines; cached in the temp folder), and a nested JSON schema (objects, arrays,
enums, numbers, bounded strings, required fields) is compiled by each engine:

- compile: from the schema text to a matcher ready to give its first mask, cold (a compiler or
  tokenizer with no cache) and cached (xgrammar's compiler cache; llguidance builds lazily, so
  each new matcher is its "cached" case);
- mask: --rows matchers each walk the grammar for --steps tokens, each step a uniformly random
  allowed token (seeded), restarting when a row completes; per step the masks of all rows are
  filled one row at a time (one thread: the per-row cost) and with the engine's batch call;
- apply: the masks applied to fp32 logits [rows, vocab] on the CPU, as the executor does
  (executor/grammar.py unpack_masks);
- ship: the bytes of the packed masks of one step, and protobuf serialize + parse of a message
  that carries them (the least a scheduler- or gateway-side matcher would add per step).

Medians over the steps; one process, one torch thread. --out writes bench/results/grammar-cpu.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import random
import statistics
import tempfile
import time

import torch
from serving import machine_line

from executor.grammar import byte_bits, unpack_masks

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "grammar-cpu.md"
EOS = 1
BITS = byte_bits("cpu")

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string", "maxLength": 24},
        "kind": {"enum": ["person", "org", "place"]},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 16},
                                   "zip": {"type": "integer"}},
                    "required": ["city"], "additionalProperties": False},
        "items": {"type": "array", "maxItems": 3, "items": {
            "type": "object",
            "properties": {"sku": {"type": "string", "maxLength": 8}, "qty": {"type": "integer"},
                           "price": {"type": "number"}},
            "required": ["sku", "qty"], "additionalProperties": False}},
    },
    "required": ["id", "name", "kind", "items"],
    "additionalProperties": False,
}


def synthetic_tokenizer(vocab_size: int) -> str:
    """tokenizer.json text of a byte-level BPE with `vocab_size` tokens (ids 0, 1: <s>, </s>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = pathlib.Path(tempfile.gettempdir()) / f"loraplex-bench-bpe-{vocab_size}.json"
    if path.exists():
        return path.read_text()
    rng = random.Random(0)
    syllables = [a + b for a in "bcdfghjklmnprstvwzqx" for b in "aeiouy"] + list("aeiou")
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 5)))
             for _ in range(300_000)]

    def lines():
        for _ in range(200_000):
            picked = [rng.choice(words) for _ in range(rng.randint(3, 15))]
            if rng.random() < 0.3:
                yield json.dumps({picked[0]: rng.randint(0, 10 ** rng.randint(1, 8)),
                                  picked[1]: [picked[2], rng.random()], "name": picked[-1]})
            else:
                yield " ".join(picked)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(lines(), trainer=trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path.write_text(tok.to_str())
    return path.read_text()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer_json: str, vocab_size: int):
        import xgrammar
        from tokenizers import Tokenizer

        self.xgr = xgrammar
        start = time.perf_counter()
        vocab = [""] * vocab_size
        for text, i in Tokenizer.from_str(tokenizer_json).get_vocab(True).items():
            vocab[i] = text
        meta = xgrammar.TokenizerInfo._detect_metadata_from_hf(tokenizer_json)
        self.info = xgrammar.TokenizerInfo(vocab, meta["vocab_type"], vocab_size=vocab_size,
                                           stop_token_ids=[EOS],
                                           add_prefix_space=meta["add_prefix_space"])
        self.setup_s = time.perf_counter() - start
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=1)
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=1)

    def compile_cold(self, schema: str) -> float:
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        start = time.perf_counter()
        compiler.compile_json_schema(schema)
        return time.perf_counter() - start

    def compile_cached(self, schema: str) -> float:
        self.compiler.compile_json_schema(schema)
        start = time.perf_counter()
        self.compiled = self.compiler.compile_json_schema(schema)
        return time.perf_counter() - start

    def matcher(self):
        return self.xgr.GrammarMatcher(self.compiled)

    def fill(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def fill_batch(self, matchers: list, bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab_size: int):
        import llguidance
        import llguidance.torch

        self.llg, self.llg_torch = llguidance, llguidance.torch
        start = time.perf_counter()
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=EOS)
        self.setup_s = time.perf_counter() - start
        self.tokenizer_json, self.vocab_size = tokenizer_json, vocab_size
        self.executor = llguidance.LLExecutor(num_threads=1)

    def _first_mask(self, tokenizer, schema: str) -> None:
        matcher = self.llg.LLMatcher(tokenizer, self.llg.LLMatcher.grammar_from_json_schema(
            schema))
        bitmask = torch.zeros(1, (self.vocab_size + 31) // 32, dtype=torch.int32)
        self.llg_torch.fill_next_token_bitmask(matcher, bitmask, 0)
        assert not matcher.is_error(), matcher.get_error()

    def compile_cold(self, schema: str) -> float:
        """With a fresh tokenizer (its token trie's caches empty); its own build not timed."""
        tokenizer = self.llg.LLTokenizer(self.tokenizer_json, n_vocab=self.vocab_size,
                                         eos_token=EOS)
        start = time.perf_counter()
        self._first_mask(tokenizer, schema)
        return time.perf_counter() - start

    def compile_cached(self, schema: str) -> float:
        self._first_mask(self.tokenizer, schema)
        self.grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
        start = time.perf_counter()
        self._first_mask(self.tokenizer, schema)
        return time.perf_counter() - start

    def matcher(self):
        return self.llg.LLMatcher(self.tokenizer, self.grammar)

    def fill(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        self.llg_torch.fill_next_token_bitmask(matcher, bitmask, row)

    def fill_batch(self, matchers: list, bitmask: torch.Tensor) -> None:
        self.llg_torch.fill_next_token_bitmask_par(
            self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)


def allowed_tokens(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The token ids a packed mask row [vocab/32] int32 allows."""
    return torch.nonzero(unpack_masks(words[None], vocab_size, BITS)[0]).flatten()


def run_engine(engine, schema: str, rows: int, steps: int, vocab_size: int) -> dict:
    cold = statistics.median(engine.compile_cold(schema) for _ in range(3))
    cached = statistics.median(engine.compile_cached(schema) for _ in range(5))
    rng = random.Random(0)
    matchers = [engine.matcher() for _ in range(rows)]
    bitmask = torch.zeros(rows, (vocab_size + 31) // 32, dtype=torch.int32)
    single, batch, accept = [], [], []
    for _ in range(steps):
        start = time.perf_counter()
        for i, m in enumerate(matchers):
            engine.fill(m, bitmask, i)
        single.append(time.perf_counter() - start)
        start = time.perf_counter()
        engine.fill_batch(matchers, bitmask)
        batch.append(time.perf_counter() - start)
        picks = [int(rng.choice(allowed_tokens(bitmask[i], vocab_size))) for i in range(rows)]
        start = time.perf_counter()
        for i, (m, token) in enumerate(zip(matchers, picks)):
            if not engine.accept(m, token):
                raise AssertionError(f"{engine.name} refused token {token} its mask allowed")
            if token == EOS:
                matchers[i] = engine.matcher()
        accept.append(time.perf_counter() - start)
    return {"setup_s": engine.setup_s, "cold_ms": cold * 1e3, "cached_ms": cached * 1e3,
            "row_us": statistics.median(single) / rows * 1e6,
            "step_ms": statistics.median(single) * 1e3,
            "batch_ms": statistics.median(batch) * 1e3,
            "accept_us": statistics.median(accept) / rows * 1e6}


def apply_and_ship(rows: int, vocab_size: int) -> dict:
    from google.protobuf.wrappers_pb2 import BytesValue

    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, (vocab_size + 31) // 32),
                            dtype=torch.int32)
    logits = torch.randn(rows, vocab_size)
    times = []
    for _ in range(7):
        start = time.perf_counter()
        logits.masked_fill_(~unpack_masks(bitmask, vocab_size, BITS), float("-inf"))
        times.append(time.perf_counter() - start)
    payload = bitmask.numpy().tobytes()
    ship = []
    for _ in range(7):
        start = time.perf_counter()
        wire = BytesValue(value=payload).SerializeToString()
        assert len(BytesValue.FromString(wire).value) == len(payload)
        ship.append(time.perf_counter() - start)
    return {"apply_ms": statistics.median(times) * 1e3, "mask_bytes": len(payload),
            "copy_ms": statistics.median(ship) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=128_000)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--out", action="store_true", help=f"write {RESULTS.relative_to(REPO)}")
    args = parser.parse_args()
    if importlib.util.find_spec("xgrammar") is None:
        raise SystemExit("xgrammar is not installed (it is no dependency of loraplex): "
                         "`.venv/bin/pip install xgrammar`, then run this again")
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    tokenizer_json = synthetic_tokenizer(args.vocab)
    schema = json.dumps(SCHEMA)
    results = {}
    for cls in (Xgrammar, Llguidance):
        engine = cls(tokenizer_json, args.vocab)
        results[cls.name] = run_engine(engine, schema, args.rows, args.steps, args.vocab)
    costs = apply_and_ship(args.rows, args.vocab)
    lines = [
        "# Grammar engines: compile and per-token mask cost (CPU)", "",
        f"`.venv/bin/python bench/grammar_engines.py --vocab {args.vocab} --rows {args.rows} "
        f"--steps {args.steps}{' --out' if args.out else ''}`", "",
        machine_line(load),
        f"- tokenizer: byte-level BPE, {args.vocab} tokens (synthetic, trained here); the nested "
        "JSON schema of the script; one thread", "",
        "| engine | tokenizer setup s | compile cold ms | compile cached ms | mask µs/row "
        f"| masks of {args.rows} rows, ms (one by one) | batch call ms | accept µs/row |",
        "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['setup_s']:.2f} | {r['cold_ms']:.1f} | {r['cached_ms']:.2f} "
                     f"| {r['row_us']:.1f} | {r['step_ms']:.2f} | {r['batch_ms']:.2f} "
                     f"| {r['accept_us']:.1f} |")
    lines += ["", f"Applying {args.rows} masks to fp32 logits [{args.rows}, {args.vocab}] (torch, "
              f"CPU): {costs['apply_ms']:.1f} ms.", "",
              f"Shipping the masks instead of computing them where the logits are: "
              f"{costs['mask_bytes'] / 2**20:.2f} MiB per step ({args.vocab} bits x {args.rows} "
              f"rows), {costs['copy_ms']:.2f} ms to serialize and parse them (protobuf) per hop, "
              "before any network."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        RESULTS.write_text(text)


if __name__ == "__main__":
    main()
