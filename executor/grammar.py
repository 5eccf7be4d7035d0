"""Constrained decoding in the executor: a grammar matcher per constrained sequence, whose token
mask is filled each step and applied to that row's logits before sampling; the sampled token then
advances it. Rows without a grammar are not touched.

The matcher runs here, beside the logits, because only here is each row's state current when the
next step runs: the scheduler pipelines steps (the next is sent before this one's samples come
back), and a mask is vocabulary bits per row per step, too many to ship (docs/scheduling.md,
structured outputs). A sequence's state is its tokens: one re-added after a preemption or a
failover (prompt + the tokens it had sampled, NewSequence.num_generated) replays those into a new
matcher, so it goes on where it stopped.

Once the grammar is complete, or its matcher is in error (a token it refused: only when the
logits were NaN), the mask allows only the end-of-sequence tokens. The engine (llguidance) is
imported on the first grammar, so an executor that never sees one runs without the package.

    rows = GrammarRows(tokenizer_json, vocab_size, eos_token_ids, device)
    rows.compile(grammar)             # ahead, off the step path (PrepareGrammar): seconds
    rows.add(seq_id, grammar, generated_token_ids)
    rows.constrain(logits, seq_ids)   # logits [S, V], row i is seq_ids[i]; in place
    rows.advance(seq_ids, token_ids)  # after sampling
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence

import torch

from common.grammar import Grammar, in_engine
from common.lru import Lru

log = logging.getLogger(__name__)

MAX_COMPILED = 256  # grammars kept compiled (LRU), each as a fresh matcher to copy


class GrammarRows:
    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int],
                 device: str | torch.device = "cpu", num_threads: int | None = None):
        if not tokenizer_json:
            raise ValueError("a grammar needs the model's tokenizer (tokenizer.json), and this "
                             "executor has none")
        try:
            import llguidance
            import llguidance.torch
        except ImportError as err:
            raise ValueError("the grammar engine (llguidance) is not installed on this "
                             "executor") from err

        self._llg, self._llg_torch = llguidance, llguidance.torch
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self._tokenizer = llguidance.LLTokenizer(
            engine_tokenizer_json(tokenizer_json), n_vocab=vocab_size,
            eos_token=list(eos_token_ids))
        self._executor = llguidance.LLExecutor(num_threads=num_threads or torch.get_num_threads())
        self._compiled: Lru[Grammar, object] = Lru(MAX_COMPILED)
        self._lock = threading.Lock()  # (compiled from PrepareGrammar's threads, read by steps)
        self._matchers: dict[int, object] = {}  # seq_id -> its matcher
        self._bits = byte_bits(self.device)  # [256, 8]

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def add(self, seq_id: int, grammar: Grammar, generated: Sequence[int]) -> None:
        """A matcher for `seq_id`, advanced over the tokens it `generated` before (a recompute);
        ValueError when the grammar does not compile or refuses those tokens."""
        matcher = self._fresh(grammar).deep_copy()
        if generated and not matcher.consume_tokens(list(generated)):
            raise ValueError(f"sequence {seq_id}: its grammar refuses the tokens it generated "
                             f"before ({matcher.get_error()})")
        self._matchers[seq_id] = matcher

    def free(self, seq_id: int) -> None:
        self._matchers.pop(seq_id, None)

    def clear(self) -> None:
        self._matchers.clear()

    def constrain(self, logits: torch.Tensor, seq_ids: Sequence[int]) -> None:
        """Set to -inf, in place, every token of logits [S, V] (row i: sequence seq_ids[i]) that
        its sequence's grammar does not allow next; rows without a grammar stay as they are."""
        rows = [i for i, s in enumerate(seq_ids) if s in self._matchers]
        if not rows:
            return
        packed = torch.zeros(len(rows), (self.vocab_size + 31) // 32, dtype=torch.int32)
        self._llg_torch.fill_next_token_bitmask_par(
            self._executor, [(self._matchers[seq_ids[i]], k) for k, i in enumerate(rows)],
            packed)  # [R, V/32]
        allowed = unpack_masks(packed.to(self.device), logits.shape[1], self._bits)  # [R, V]
        if len(rows) == len(seq_ids):  # every row constrained: in place, no gather
            logits.masked_fill_(~allowed, float("-inf"))
            return
        index = torch.tensor(rows, device=logits.device)  # [R]
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))

    def advance(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> None:
        """Each constrained sequence takes the token it sampled."""
        for seq_id, token in zip(seq_ids, token_ids):
            matcher = self._matchers.get(seq_id)
            if matcher is not None and not matcher.consume_token(token):
                # Only a row whose logits were NaN samples outside its mask: it is left in
                # error, and its masks allow only EOS from now on.
                log.warning("sequence %d: its grammar refused token %d (%s); only EOS may "
                            "follow", seq_id, token, matcher.get_error())

    def compile(self, grammar: Grammar) -> float:
        """Compile `grammar` now, if it is not (any thread); the seconds it took (0: it was
        compiled already). ValueError when it does not compile."""
        start = time.perf_counter()
        with self._lock:
            if self._compiled.get(grammar) is not None:
                return 0.0
        self._fresh(grammar)
        return time.perf_counter() - start

    def _fresh(self, grammar: Grammar):
        """A matcher at the grammar's start, compiled once per grammar (LRU)."""
        with self._lock:
            matcher = self._compiled.get(grammar)
        if matcher is None:  # (compiled outside the lock: a step needs only its own grammars)
            matcher = in_engine(lambda: self._llg.LLMatcher(self._tokenizer, grammar.engine_text(),
                                                            log_level=0))
            if matcher.is_error():
                raise ValueError(f"the grammar does not compile: {matcher.get_error()}")
            with self._lock:
                self._compiled.put(grammar, matcher)
        return matcher


def byte_bits(device: str | torch.device) -> torch.Tensor:
    """[256, 8] bool: each byte's bits, little-endian (unpack_masks' table)."""
    return ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool().to(device)


def unpack_masks(packed: torch.Tensor, vocab_size: int, bits: torch.Tensor) -> torch.Tensor:
    """Packed masks [R, ceil(V/32)] int32 (bit t of the row: token t allowed) -> [R, V] bool, on
    packed's device (a table lookup per byte: the bits of 32 tokens never loop in Python)."""
    allowed = bits[packed.view(torch.uint8).long()]  # [R, 4 * ceil(V/32), 8]
    return allowed.flatten(1)[:, :vocab_size]


def engine_tokenizer_json(tokenizer_json: str) -> str:
    """tokenizer.json with the steps that put a space before a text's start turned off (a
    ByteLevel pre-tokenizer's add_prefix_space, a Metaspace's prepend_scheme, a Prepend
    normalizer): the engine tokenizes pieces from the middle of an output, where the model's
    tokens carry no such space. The tokens and their bytes are unchanged."""
    spec = json.loads(tokenizer_json)

    def plain(node):
        if isinstance(node, list):
            return [plain(n) for n in node if not (isinstance(n, dict)
                                                     and n.get("type") == "Prepend")]
        if not isinstance(node, dict):
            return node
        if node.get("type") == "Prepend":
            return None
        node = {k: plain(v) for k, v in node.items()}
        if node.get("type") == "ByteLevel" and "add_prefix_space" in node:
            node["add_prefix_space"] = False
        if node.get("type") == "Metaspace":
            node["prepend_scheme"] = "never"
            node.pop("add_prefix_space", None)
        return node

    for part in ("normalizer", "pre_tokenizer"):
        spec[part] = plain(spec.get(part))
    return json.dumps(spec)
