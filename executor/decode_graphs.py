"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket, checked at start.

A decode step (every row one token of a sequence, every row sampled) of B sequences runs as the
graph captured for the smallest bucket >= B: the forward from token ids to logits, recorded once
over static buffers that each step fills in place (token ids, positions, the slots each row's
K/V goes to, the block tables and context lengths the paged-attention kernel reads, each row's
adapter rank and scale per layer and module). The adapters' pages and page-offset tables, the
KV cache and the weights are the tensors the runner keeps; a graph reads them where they are.
Rows past B (up to the bucket) repeat row 0's token and tables but write their K/V to a scratch
block no sequence is given (ModelRunner's `scratch_block`), and their logits are dropped.

Every row is its own LoRA segment (the fused shrink+expand kernel, kernels/sgmv_fused.py) at
the pool's largest rank tile, ranks above a row's own masked as in any step: the work list has
one fixed shape per bucket. What a graph cannot hold runs eagerly (DecodeGraphs.takes): prefill
chunks, tensor-parallel ranks, mixture-of-experts layers, layers with KV of several kinds
(window blocks), longrope's long factors, a merged adapter, prompt logprobs.

Checked at start (`DecodeGraphs.check`): for every bucket a probe batch (random token ids at
spread positions over free blocks, rows on a random probe adapter and on the base model, one
row short of the bucket so that padding runs too) goes through the eager forward and through
the captured graph; any difference in the logits, or any error while capturing, and the
executor logs it and runs every step eagerly. `capture` is a parameter: CUDA's
(`cuda_capture`), or in tests a stand-in that replays the recorded function (as a graph replays
its kernels over the same buffers), or one that differs.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from executor.lora.slot_pool import LoraModuleWeights, LoraWeights
from executor.lora.triton_backend import TritonBatchMeta, TritonLoraBackend
from executor.model.attention import TritonAttentionMeta
from executor.model.transformer import RowSpec, StepMetadata
from kernels.attention_work import PagedAttentionWork
from kernels.segments import SegmentWork, rank_tile

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# capture(run) -> replay: record `run` (a forward over static buffers, returning its logits
# tensor) and give back a function that runs it again, returning that tensor.
Capture = Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]


def cuda_capture(run: Callable[[], torch.Tensor], pool=None) -> Callable[[], torch.Tensor]:
    """A CUDA graph of `run`, warmed up first on a side stream (Triton compiles its kernels
    outside the capture); `pool`: a memory pool the graphs share (captured largest first, as
    the smaller ones then fit in what the larger ones took)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay


@dataclass
class _Bucket:
    """One bucket's static buffers and its replay: the first B rows of the buffers every
    bucket shares (DecodeGraphs), and its LoRA work list of its own."""

    size: int
    tokens: torch.Tensor  # [B] long
    write_slots: torch.Tensor  # [B] long
    positions: torch.Tensor  # [B] long
    work: PagedAttentionWork  # block_tables [B, width], context_lens [B], ...
    lora: SegmentWork  # items [4, B], ranks / scales [L, M, B]
    meta: StepMetadata
    replay: Callable[[], torch.Tensor] | None = None


class DecodeGraphs:
    """The captured decode graphs of one runner (see the module docstring)."""

    def __init__(self, runner, buckets: Sequence[int] = BUCKETS,
                 capture: Capture = cuda_capture) -> None:
        if runner.scratch_block is None:
            raise ValueError("decode graphs need the runner's scratch block (its padding rows' "
                             "K/V go there)")
        self.runner, self.capture = runner, capture
        self.buckets = tuple(sorted(buckets))
        self._by_size: dict[int, _Bucket] = {}
        # The buffers every bucket's first rows are: [Bmax] and block tables [Bmax, width], a
        # width that holds the model's longest context
        device, most = runner.device, self.buckets[-1]
        self.width = -(-runner.config.max_position_embeddings // runner.kv.block_size)
        scratch = runner.scratch_block
        self._tokens = torch.zeros(most, dtype=torch.long, device=device)
        self._positions = torch.zeros(most, dtype=torch.long, device=device)
        self._write_slots = torch.full((most,), scratch * runner.kv.block_size,
                                       dtype=torch.long, device=device)
        self._tables = torch.full((most, self.width), scratch, dtype=torch.int32, device=device)
        self._context_lens = torch.ones(most, dtype=torch.int32, device=device)
        self._rows = torch.arange(most, dtype=torch.int32, device=device)

    # ----- which steps -----

    @staticmethod
    def supports(runner) -> str:
        """Why this runner's model cannot run decode graphs at all ("" if it can)."""
        if runner.tp.world > 1:
            return "a tensor-parallel rank"
        if runner.config.num_experts:
            return "mixture-of-experts layers"
        if len(runner.model.windows) > 1:
            return "KV of several kinds (window blocks)"
        if not isinstance(runner.lora, TritonLoraBackend):
            return "the torch LoRA backend"
        if runner.attention_backend != "triton":
            return "the torch attention path"
        return ""

    def takes(self, rows, seqs) -> int:
        """The bucket a step of `rows` replays (0: it runs eagerly)."""
        runner = self.runner
        if (len(rows) > self.buckets[-1] or runner.merged_slot is not None
                or runner.num_prompt_logprobs):
            return 0
        longest = self.width * runner.kv.block_size  # (the block tables' width)
        for r in rows:
            seq = seqs[r.seq_id]
            if (r.num_tokens != 1 or seq.is_long or seq.num_computed + 1 != len(seq.token_ids)
                    or seq.num_computed >= longest):
                return 0
        size = next(b for b in self.buckets if b >= len(rows))
        return size if size in self._by_size else 0

    # ----- one step -----

    def run(self, size: int, tokens: list[int], positions: list[int], tables: list[list[int]],
            slots: list[int]) -> torch.Tensor:
        """Logits [len(tokens), vocab] of a decode step: row i has token tokens[i] at position
        positions[i] of a sequence with block table tables[i], on adapter slot slots[i] (-1:
        none); replayed from the bucket `size` (takes())."""
        bucket = self._by_size[size]
        self._fill(bucket, tokens, positions, tables, slots)
        return bucket.replay()[:len(tokens)].clone()

    def _fill(self, bucket: _Bucket, tokens: list[int], positions: list[int],
              tables: list[list[int]], slots: list[int]) -> None:
        runner, n, size = self.runner, len(tokens), bucket.size
        bs, block = runner.kv.block_size, runner.scratch_block
        pad, scratch = size - n, block * bs
        # Only the columns the step's contexts reach: the kernel reads no block past a row's
        # context, whatever an earlier step left beyond it. (One tensor of plain lists: a
        # tensor per row cost ~9 us a row, 2.3 ms a step of 250 rows.)
        seen = [t[: p // bs + 1] for t, p in zip(tables, positions)]
        width = max(map(len, seen))
        table = torch.tensor([t + [block] * (width - len(t)) for t in seen]
                             + [[block] * width] * pad, dtype=torch.int32)
        ctx = [p + 1 for p in positions] + [1] * pad
        write = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions)] + [scratch] * pad
        host_slots = torch.tensor(slots + [-1] * pad)
        on = host_slots >= 0
        index = torch.where(on, host_slots, 0)
        ranks = runner.pool.rank_table[:, index].transpose(1, 2) * on  # [L, M, B]
        scales = runner.pool.scale_table[:, index].transpose(1, 2).float() * on
        bucket.tokens.copy_(torch.tensor(tokens + [tokens[0]] * pad), non_blocking=True)
        bucket.positions.copy_(torch.tensor(positions + [0] * pad), non_blocking=True)
        bucket.write_slots.copy_(torch.tensor(write), non_blocking=True)
        bucket.work.block_tables[:, :width].copy_(table, non_blocking=True)
        bucket.work.context_lens.copy_(torch.tensor(ctx, dtype=torch.int32), non_blocking=True)
        bucket.lora.items[2].copy_(index.int(), non_blocking=True)
        bucket.lora.ranks.copy_(ranks.int(), non_blocking=True)
        bucket.lora.scales.copy_(scales, non_blocking=True)

    # ----- capture and check -----

    def _bucket(self, size: int) -> _Bucket:
        """A bucket's static buffers and metadata (before its capture)."""
        runner = self.runner
        device, pool = runner.device, runner.pool
        tokens, positions = self._tokens[:size], self._positions[:size]
        write_slots, rows = self._write_slots[:size], self._rows[:size]
        work = PagedAttentionWork(
            block_tables=self._tables[:size], context_lens=self._context_lens[:size],
            query_starts=rows, query_lens=torch.ones(size, dtype=torch.int32, device=device),
            max_query_len=1)
        num_layers, _, num_modules = pool.rank_table.shape
        items = torch.stack([rows, rows + 1, torch.zeros_like(rows), rows]).contiguous()
        lora = SegmentWork(items=items,
                           ranks=torch.zeros(num_layers, num_modules, size, dtype=torch.int32,
                                             device=device),
                           scales=torch.zeros(num_layers, num_modules, size,
                                              dtype=torch.float32, device=device),
                           block_m=16, max_ranks=(rank_tile(pool.max_rank),) * num_modules)
        windows = next(iter(runner.model.windows.values()))
        attention = {(0, w): TritonAttentionMeta.build(work, sliding_window=w, device=device)
                     for w in windows}
        meta = StepMetadata(positions=positions, write_slots=(write_slots,), long_rows=None,
                            attention=attention, lora=TritonBatchMeta(lora, is_fused=True),
                            sample_rows=torch.arange(size, device=device))
        return _Bucket(size, tokens, write_slots, positions, work, lora, meta)

    def _forward(self, bucket: _Bucket) -> torch.Tensor:
        model = self.runner.model
        return model.logits(model.hidden_states(bucket.tokens, bucket.meta, self.runner.kv))

    @classmethod
    def check(cls, runner, buckets: Sequence[int] = BUCKETS, capture: Capture = cuda_capture,
              seed: int = 0) -> tuple[DecodeGraphs | None, str]:
        """Capture every bucket and check it against the eager forward on a probe batch (the
        module docstring): (the graphs, "") or (None, why not, as logged) when the model cannot
        run them, a capture failed or a graph's logits differ from the eager ones. Needs an idle
        runner: no sequence registered, no adapter in the probe's slot."""
        why = cls.supports(runner)
        if why:
            log.info("decode graphs off: %s", why)
            return None, why
        fits = tuple(b for b in sorted(buckets) if 2 * b <= runner.num_kv_blocks)
        if len(fits) < len(buckets):
            log.info("decode graphs: buckets %s only (the KV blocks hold no larger probe)",
                     list(fits))
        if not fits:
            return None, "the KV blocks hold no probe batch"
        if capture is cuda_capture:  # (one memory pool for every bucket's graph)
            capture = functools.partial(cuda_capture, pool=torch.cuda.graph_pool_handle())
        graphs = cls(runner, fits, capture)
        probe = graphs._load_probe_adapter(seed)
        try:
            for size in reversed(graphs.buckets):  # (largest first: see cuda_capture)
                bucket = graphs._bucket(size)
                try:
                    bucket.replay = capture(lambda b=bucket: graphs._forward(b))
                except Exception as err:  # (any failure to capture: eager serving still works)
                    why = f"capturing the {size}-row bucket failed: {err}"
                    log.warning("decode graphs off: %s", why)
                    return None, why
                graphs._by_size[size] = bucket
                differ = graphs._probe(bucket, probe, seed + size)
                if differ:
                    why = (f"the {size}-row bucket's graph differs from the eager forward on the "
                           f"probe batch ({differ})")
                    log.warning("decode graphs off: %s; every step runs eagerly", why)
                    return None, why
        finally:
            graphs._unload_probe_adapter(probe)
        log.info("decode graphs on: buckets %s, each equal to the eager forward on a probe",
                 list(graphs.buckets))
        return graphs, ""

    def _probe(self, bucket: _Bucket, slot: int | None, seed: int) -> str:
        """Run a probe of bucket.size - 1 rows (size 1: 1) both ways: "" when the logits are
        equal, else how they differ."""
        runner = self.runner
        bs = runner.kv.block_size
        n = max(1, bucket.size - 1)
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, runner.config.vocab_size, (n,), generator=g).tolist()
        positions = [int(p) for p in torch.randint(0, 2 * bs, (n,), generator=g)]
        tables = [[2 * i, 2 * i + 1] for i in range(n)]
        slots = [slot if slot is not None and i % 2 == 0 else -1 for i in range(n)]
        graph = self.run(bucket.size, tokens, positions, tables, slots)
        # The eager forward of the very batch the graph runs, its padding rows as rows: the
        # same matmul shapes (a 3-row matmul may round otherwise than a 4-row one, graph or no)
        pad = bucket.size - n
        scratch = [self.runner.scratch_block]
        eager = self._eager(tokens + tokens[:1] * pad, positions + [0] * pad,
                            tables + [scratch] * pad, slots + [-1] * pad)[:n]
        if torch.equal(eager, graph):
            return ""
        return (f"largest difference {(eager - graph).abs().max().item():.3g} over "
                f"{n} rows")

    def _eager(self, tokens, positions, tables, slots) -> torch.Tensor:
        """The runner's eager forward of the same decode rows."""
        groups = [RowSpec(p, 1, (t,)) for p, t in zip(positions, tables)]
        return self.runner.eager_forward(tokens, groups, torch.tensor(slots),
                                         list(range(len(tokens))))[0]

    def _load_probe_adapter(self, seed: int) -> int | None:
        """A random adapter on every module in the last slot, pages in the highest free
        blocks (above the probe's): the slot, or None when the pool has none free."""
        runner = self.runner
        slot = runner.pool.num_slots - 1
        if slot < 0 or runner.pool.is_loaded(slot):
            return None
        g = torch.Generator().manual_seed(seed)
        rank = min(16, runner.pool.max_rank)
        c = runner.shard.config
        modules = {}
        for layer in range(c.num_hidden_layers):
            for m in c.lora_modules:
                in_f, out_f = c.module_shape(m)
                modules[(layer, m)] = LoraModuleWeights(
                    torch.randn(rank, in_f, generator=g) * 0.1,
                    torch.randn(out_f, rank, generator=g) * 0.1, 0.5)
        try:
            runner.load_adapter(slot, LoraWeights(modules))
        except ValueError:  # (its pages do not fit beside the probe's blocks)
            return None
        return slot

    def _unload_probe_adapter(self, slot: int | None) -> None:
        if slot is not None:
            self.runner.pool.clear(slot)
