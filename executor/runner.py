"""ModelRunner: the executor's plain-Python core. It executes exactly the step it is given and
keeps no policy: the scheduler owns block tables (the runner mirrors them), slot placement and
batching; no gRPC here. What each adapter slot holds is the slot pool's record (`pool`,
executor/lora/slot_pool.py): the runner asks it whether a step's slots are loaded.

On a rank of a tensor-parallel executor (`tp`, executor/tp/collectives.py) the runner holds the
rank's part (`shard`, executor/tp/shards.py): weights, KV heads, and adapters cut to it as they are
loaded; `config` stays the whole model's. Every rank runs the same steps; rank 0 alone samples
(it gathers the logits), and the others take its tokens.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from common.sampling import SamplingParams
from executor.grammar import GrammarRows
from executor.kv_tables import KVTables
from executor.logprobs import PromptLogprobs
from executor.lora.backend import make_lora_backend
from executor.lora.merge import Merged, merge, unmerge
from executor.lora.slot_pool import LoraSlotPool, LoraWeights
from executor.memory_budget import MemoryBudget
from executor.model.attention import resolve_attention_backend
from executor.model.config import ModelConfig
from executor.model.kv_cache import PagedKVCache
from executor.model.transformer import RowSpec, StepMetadata, Transformer
from executor.model.weights import ModelWeights, load_weights, random_weights
from executor.runner_checks import check_new_sequence, check_rows
from executor.sampling import DrawStream, Sampler
from executor.sequence_state import Row, Sampled, SequenceState
from executor.tp.collectives import SINGLE, TensorParallel
from executor.tp.shards import Shard

if TYPE_CHECKING:
    from common.grammar import Grammar
    from executor.decode_graphs import DecodeGraphs


class ModelRunner:
    def __init__(self, config: ModelConfig, weights: ModelWeights, *, num_kv_blocks: int,
                 block_size: int, num_slots: int, max_rank: int, lora_backend: str = "auto",
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 tp: TensorParallel = SINGLE, window_blocks: bool = False,
                 attention_backend: str = "auto", scratch_block: bool = False) -> None:
        """`weights`: the rank's part (load_weights / random_weights with its shard);
        `window_blocks`: sliding-window layers keep KV of their own, only for their window
        (common/kv_layout.py; what the executor serves with), else every layer keeps the whole
        context in one table per sequence. `attention_backend`: executor/model/attention.py's
        ('auto': by device). `scratch_block`: one block more than `num_kv_blocks`, never given
        to a sequence or an adapter (the scheduler places blocks [0, num_kv_blocks)): decode
        graphs' padding rows write their K/V there (executor/decode_graphs.py)."""
        self.config, self.weights, self.device = config, weights, torch.device(device)
        self.tp, self.shard = tp, Shard(config, tp.rank, tp.world)
        local = self.shard.config  # (config itself on one rank)
        self.kv_layout = config.kv_layout(window_blocks)
        self.attention_backend = resolve_attention_backend(attention_backend, self.device)
        self.num_kv_blocks = num_kv_blocks  # the blocks the scheduler places
        self.scratch_block = num_kv_blocks if scratch_block else None
        self.kv = PagedKVCache(num_layers=self.kv_layout.layers_per_block,
                               num_blocks=num_kv_blocks + scratch_block, block_size=block_size,
                               num_kv_heads=local.num_key_value_heads, head_dim=local.head_dim,
                               dtype=dtype, device=device)
        self.kv_tables = KVTables(self.kv_layout, block_size)
        self.pool = LoraSlotPool(local, num_slots=num_slots, max_rank=max_rank, kv=self.kv,
                                 layout=self.kv_layout)
        # Held while a slot is written (a load's copy, an unload) or merged: a merge and a write
        # into the merged slot never interleave (the step thread merges, a loader thread copies).
        self.slot_writes = threading.Lock()
        self.lora = make_lora_backend(lora_backend, self.pool)
        self.model = Transformer(local, weights, self.lora, tp, self.kv_layout)
        self.sampler = Sampler(config.vocab_size, self.device)  # (rank 0's alone samples)
        self._seqs: dict[int, SequenceState] = {}
        self._num_prompt_logprobs = 0  # sequences whose prompt logprobs are being made
        self._merged: Merged | None = None  # the adapter folded into the weights (lora/merge.py)
        self.base_fingerprint = ""  # of the model folder (common/base_fingerprint.py); "": none
        self.tokenizer_json = ""  # the model's tokenizer.json: what grammars compile against
        self._grammars: GrammarRows | None = None  # made at the first constrained sequence
        # Decode steps replayed from CUDA graphs (executor/decode_graphs.py: DecodeGraphs.check
        # sets them up); None: every step runs eagerly, on CUDA for the reason `graphs_off`
        # gives. graph_steps: the steps replayed so far.
        self.graphs: DecodeGraphs | None = None
        self.graphs_off = ""
        self.graph_steps = 0

    def set_identity(self, model_id: str, base_fingerprint: str) -> None:
        """Who the served model is: `model_id`, what adapters' base_model must say (the id the
        store registered its fingerprint under, --model-id, or the folder's own name), and its
        folder's fingerprint: an adapter matched to a base of that fingerprint fits whatever
        model_id says."""
        self.config = self.config.replace(model_id=model_id)
        self.base_fingerprint = base_fingerprint

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, *, model_id: str = "",
                        **kw: Any) -> ModelRunner:
        config = ModelConfig.from_pretrained(model_dir, model_id=model_id)
        tp = kw.get("tp", SINGLE)
        weights = load_weights(model_dir, config, dtype=kw.get("dtype", torch.float32),
                               device=kw.get("device", "cpu"),
                               shard=Shard(config, tp.rank, tp.world))
        runner = cls(config, weights, **kw)
        tokenizer = Path(model_dir) / "tokenizer.json"
        runner.tokenizer_json = tokenizer.read_text() if tokenizer.exists() else ""
        return runner

    @classmethod
    def random(cls, config_name_or_config: str | ModelConfig, seed: int = 0,
               **kw: Any) -> ModelRunner:
        config = config_name_or_config
        if isinstance(config, str):
            config = ModelConfig.named(config)
        tp = kw.get("tp", SINGLE)
        weights = random_weights(config, seed, dtype=kw.get("dtype", torch.float32),
                                 device=kw.get("device", "cpu"),
                                 shard=Shard(config, tp.rank, tp.world))
        return cls(config, weights, **kw)

    def memory_budget(self) -> MemoryBudget:
        return MemoryBudget(self.weights.num_bytes(), self.kv.num_bytes(), self.pool.num_bytes())

    def load_adapter(self, slot: int, weights: LoraWeights,
                     pages: tuple[int, ...] | None = None) -> None:
        """Copy an adapter into `slot`, its weights into `pages`, on the current stream (the
        steps' own): loaded at once. Without `pages` (tests and tools that drive a runner
        without a scheduler), the highest blocks that no sequence or slot uses: those must keep
        their sequences off them (ModelRunner.free_blocks). The executor's loads go through
        AdapterLoader instead (side stream, store reference, pages from the scheduler).
        `weights`: the whole adapter (the runner keeps its rank's part)."""
        weights = self.shard.lora(weights)
        if pages is None:
            free, needed = self.free_blocks(), self.pool.pages_for(weights).num_pages
            if needed > len(free):
                raise ValueError(f"the adapter's weights take {needed} blocks, {len(free)} free")
            pages = tuple(free[len(free) - needed:])
        with self.slot_writes:
            self.pool.load(slot, weights, pages)
        self.pool.mark_loaded(slot)

    def free_blocks(self) -> list[int]:
        """Blocks in no sequence's table and no slot's pages, in order (the scratch block
        never)."""
        used = self.pool.page_blocks() | {b for s in self._seqs.values() for t in s.tables
                                          for b in t}
        return [b for b in range(self.num_kv_blocks) if b not in used]

    @property
    def merged_slot(self) -> int | None:
        """The slot whose adapter is merged into the weights, if any."""
        return self._merged.slot if self._merged else None

    def merge(self, slot: int) -> None:
        """Fold the adapter in `slot` into the base weights (executor/lora/merge.py): its rows then
        do no LoRA work; no other adapter's (nor the base model's) rows may run until `unmerge`.
        Refused while a sequence of anything else is registered."""
        if self._merged is not None:
            raise ValueError(f"slot {self._merged.slot} is merged already: unmerge it first")
        if not self.pool.is_loaded(slot):
            raise ValueError(f"cannot merge adapter slot {slot}: it holds no adapter")
        if any(s.lora_from for s in self._seqs.values() if s.slot == slot):
            raise ValueError(f"cannot merge adapter slot {slot}: an activated LoRA applies from "
                             "its invocation on, which a merged weight cannot")
        others = sorted(i for i, s in self._seqs.items() if s.slot != slot)
        if others:
            raise ValueError(f"cannot merge adapter slot {slot} while sequences of other "
                             f"adapters are registered (e.g. {others[0]})")
        with self.slot_writes:
            if not self.pool.is_loaded(slot):  # (a write into it began meanwhile)
                raise ValueError(f"cannot merge adapter slot {slot}: it is being rewritten")
            self._merged = merge(self.weights, self.pool, slot)

    def unmerge(self) -> None:
        """Restore the base weights bit for bit (no-op when nothing is merged)."""
        if self._merged is not None:
            unmerge(self.weights, self._merged)
            self._merged = None

    @property
    def rope_switch_len(self) -> int:
        """The model's longrope switch (ModelConfig.rope_switch_len; 0: none)."""
        return self.config.rope_switch_len

    def add_sequence(self, seq_id: int, token_ids: Sequence[int], sampling: SamplingParams,
                     slot: int, num_generated: int = 0, num_cached: int = 0,
                     lora_from: int = 0, first_blocks: Sequence[int] = ()) -> None:
        """Register a sequence (prompt token ids; after a preemption or failover, prompt and the
        `num_generated` tokens sampled so far); slot -1 = base model only. The KV of its first
        `num_cached` tokens is in the blocks its first rows bring (a prefix cache hit): its
        first row computes from there. Its prompt's logprobs, when its sampling asks for them,
        come with its first sample (not again for a recompute after it: num_generated > 0).
        On a longrope model (ModelConfig.rope_switch_len) it computes with the long factors when
        it has more tokens than the switch, with the short ones otherwise, and then never past
        the switch: one that outgrows it is recomputed (freed, and registered again with all its
        tokens), as transformers' generate() recomputes its cache. Its adapter's LoRA applies
        from position `lora_from` on (an activated LoRA's activation point; rows before it are
        the base model's, within the same step). With window blocks, `first_blocks` gives each
        kind's first token block its rows bring (a window kind's earlier ones lie outside every
        window from num_cached on: never read); () all 0."""
        check_new_sequence(self, self._seqs, seq_id, token_ids, slot, num_generated,
                           num_cached, lora_from)
        sampling.validate(self.config.vocab_size)
        tables = self.kv_tables.new(seq_id, first_blocks, num_cached)
        prompt_logprobs = None
        if sampling.prompt_logprobs is not None and num_generated == 0:
            if num_cached:
                raise ValueError(f"sequence {seq_id}: its prompt logprobs need its whole prompt "
                                 f"computed, but {num_cached} tokens are cached")
            prompt_logprobs = PromptLogprobs(sampling.prompt_logprobs)
            self._num_prompt_logprobs += 1
        if sampling.grammar is not None and self.tp.is_first:  # (its state: what it generated)
            self._grammar_rows().add(seq_id, sampling.grammar,
                                     token_ids[len(token_ids) - num_generated:])
        switch = self.rope_switch_len
        self._seqs[seq_id] = SequenceState(list(token_ids), num_cached, tables, sampling, slot,
                                       DrawStream(sampling.seed, num_generated, self.device),
                                       0 < switch < len(token_ids), prompt_logprobs, lora_from)
        if self.tp.is_first:
            self.sampler.add(seq_id, list(token_ids), num_generated, sampling)

    def prepare_grammars(self) -> bool:
        """Build the grammar engine's tokenizer now (seconds for a vocabulary of 100k+ tokens)
        rather than on the step thread at the first constrained sequence; False when the model
        has no tokenizer or the engine is not installed."""
        if not self.tokenizer_json:
            return False
        try:
            self._grammar_rows()
        except ValueError:  # (the engine is not installed)
            return False
        return True

    def prepare_grammar(self, grammar: Grammar) -> float:
        """Compile `grammar` for the sequences that will use it (any thread; PrepareGrammar):
        the seconds it took, 0 when compiled already or on a rank that does not sample.
        ValueError when it does not compile, or this executor cannot constrain."""
        if not self.tp.is_first:
            return 0.0
        if not self.tokenizer_json:
            raise ValueError("a grammar needs the model's tokenizer, and this executor has none")
        return self._grammar_rows().compile(grammar)

    def _grammar_rows(self) -> GrammarRows:
        if self._grammars is None:
            self._grammars = GrammarRows(self.tokenizer_json, self.config.vocab_size,
                                         self.config.eos_token_ids, self.device)
        return self._grammars

    def free_sequence(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self.sampler.free(seq_id)
            self._num_prompt_logprobs -= seq.prompt_logprobs is not None
        if self._grammars is not None:
            self._grammars.free(seq_id)

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    @property
    def num_prompt_logprobs(self) -> int:
        """Sequences whose prompt logprobs are being made (their rows need the hidden states)."""
        return self._num_prompt_logprobs

    def free_all(self) -> None:
        """Forget every sequence (the scheduler's stream ended); adapters stay loaded."""
        self._seqs.clear()
        self.sampler.clear()
        self._num_prompt_logprobs = 0
        if self._grammars is not None:
            self._grammars.clear()

    def tokens(self, seq_id: int) -> list[int]:
        """Prompt + sampled tokens of a sequence (a copy)."""
        return list(self._seqs[seq_id].token_ids)

    def step(self, rows: Sequence[Row]) -> list[Sampled]:
        return self.step_with_logits(rows)[0]

    @torch.inference_mode()
    def step_with_logits(self, rows: Sequence[Row]) -> tuple[list[Sampled], torch.Tensor]:
        """Run one step; also return the last-position logits [S, vocab] (fp32) of the sampled
        sequences, row i belonging to the i-th Sampled (on a rank but the first of a
        tensor-parallel group: none, [0, vocab])."""
        check_rows(self, self._seqs, rows)
        self._give_up_pages(rows)
        groups, sample_rows, sampled_seqs = [], [], []
        row = 0
        for r in rows:
            seq = self._seqs[r.seq_id]
            self.kv_tables.extend(seq.tables, r.new_block_ids, r.num_new_by_kind)
            groups.append(RowSpec(seq.num_computed, r.num_tokens, tuple(seq.tables),
                                  seq.is_long))
            row += r.num_tokens
            if seq.num_computed + r.num_tokens == len(seq.token_ids):
                sample_rows.append(row - 1)
                sampled_seqs.append(r.seq_id)
        if not groups:
            return [], torch.empty(0, self.config.vocab_size)
        step_tokens = [t for r in rows for t in self._pending(r)]
        slots = [self._seqs[r.seq_id].slot for r in rows]
        if self._merged is not None:  # its rows: the weights hold their adapter, no LoRA
            slots = [-1 if s == self._merged.slot else s for s in slots]
        row_slots = torch.repeat_interleave(  # [T]
            torch.tensor(slots),
            torch.tensor([r.num_tokens for r in rows]))
        self._before_activation(rows, row_slots)
        bucket = self.graphs.takes(rows, self._seqs) if self.graphs is not None else 0
        if bucket:  # [S, vocab], S = rows (executor/decode_graphs.py)
            self.graph_steps += 1
            logits = self.graphs.run(bucket, step_tokens, [g.start_pos for g in groups],
                                     [g.tables[0] for g in groups], row_slots.tolist())
        else:
            logits, hidden = self.eager_forward(step_tokens, groups, row_slots, sample_rows)
            if self._num_prompt_logprobs:  # (gathers too: every rank makes them, alike)
                self._prompt_logprobs(rows, hidden)
        for r in rows:
            self._seqs[r.seq_id].num_computed += r.num_tokens
        seqs = [self._seqs[s] for s in sampled_seqs]
        token_ids, logprobs, tops = [], [0.0] * len(seqs), [None] * len(seqs)
        if logits is not None:
            grammars = self._grammars if self._grammars else None  # (None: no row has one)
            token_ids, logprobs, tops = self.sampler.sample(
                logits, sampled_seqs, [s.sampling for s in seqs], [s.draws for s in seqs],
                grammars)
            if grammars is not None:
                grammars.advance(sampled_seqs, token_ids)
        else:
            logits = torch.empty(0, self.config.vocab_size)
        token_ids = self.tp.share_tokens(token_ids, len(seqs))  # (rank 0's, on every rank)
        sampled = []
        for seq_id, seq, token, logprob, top in zip(sampled_seqs, seqs, token_ids, logprobs,
                                                     tops):
            seq.token_ids.append(token)
            if seq.prompt_logprobs is not None:
                sampled.append(Sampled(seq_id, token, logprob, top, seq.prompt_logprobs))
                seq.prompt_logprobs = None
                self._num_prompt_logprobs -= 1
            else:
                sampled.append(Sampled(seq_id, token, logprob, top))
        return sampled, logits

    def eager_forward(self, tokens: list[int], groups: list[RowSpec], row_slots: torch.Tensor,
                      sample_rows: list[int]) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The forward of a step's rows, kernel by kernel: the logits [S, vocab] of
        `sample_rows` (None on a rank but the first: rank 0 gathers the vocabulary and samples)
        and the hidden states [T, hidden]. tokens [T]; row_slots [T] (host) each row's slot."""
        meta = StepMetadata.build(groups, kv=self.kv, windows=self.model.windows,
                                  lora=self.lora.prepare(row_slots), sample_rows=sample_rows,
                                  device=self.device, attention=self.attention_backend,
                                  row_slots=row_slots)
        hidden = self.model.hidden_states(torch.tensor(tokens, device=self.device), meta,
                                          self.kv)
        return self.model.logits(hidden.index_select(0, meta.sample_rows)), hidden

    def _before_activation(self, rows: Sequence[Row], row_slots: torch.Tensor) -> None:
        """An activated LoRA's rows before its activation point run as the base model's
        (row_slots [T] -1 there), in place."""
        at = 0
        for r in rows:
            seq = self._seqs[r.seq_id]
            before = min(seq.lora_from - seq.num_computed, r.num_tokens)
            if before > 0:
                row_slots[at:at + before] = -1
            at += r.num_tokens

    def _prompt_logprobs(self, rows: Sequence[Row], hidden: torch.Tensor) -> None:
        """The prompt logprobs this step's rows make, for the sequences that ask for them: row
        positions [start, end) predict tokens start + 1 .. end of the prompt (the last
        position's logits are the first sample's, not a prompt token's)."""
        at = 0
        for r in rows:
            seq = self._seqs[r.seq_id]
            start, at = seq.num_computed, at + r.num_tokens
            if seq.prompt_logprobs is not None:
                end = min(start + r.num_tokens, len(seq.token_ids) - 1)
                if end > start:
                    first = at - r.num_tokens
                    seq.prompt_logprobs.extend(self.model.logits,
                                               hidden[first:first + end - start],
                                               seq.token_ids[start + 1:end + 1])

    def _pending(self, row: Row) -> list[int]:
        seq = self._seqs[row.seq_id]
        return seq.token_ids[seq.num_computed: seq.num_computed + row.num_tokens]

    def _give_up_pages(self, rows: Sequence[Row]) -> None:
        """Slots whose pages the step gives to KV lose them (LoraSlotPool.give_up): the scheduler
        evicted their adapters, and its UnloadAdapter may come after this step."""
        blocks = {b for r in rows for b in r.new_block_ids}
        if self.pool.holders(blocks):
            with self.slot_writes:  # (not beside a load's copy)
                self.pool.give_up(blocks)
