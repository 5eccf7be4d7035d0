"""`loraplex budget`: an executor's GPU memory for a model and a traffic mix, before anything
starts.

    loraplex budget --model random:llama-3-8b --gpu-gib 80 --adapter-slots 64 --max-rank 64 \
        --adapter-ranks 8:0.7,16:0.2,64:0.1 --seqs 64 --context 4096

Base weights and the adapter pool's tables are exact (MemoryBudget.estimate: what the executor
allocates, checked against a real runner by the tests). The step workspace is an estimate of the
largest live tensors of one step: one layer's activations at --max-batched-tokens, the K/V a decode
step gathers for attention (every running sequence at --context), and the logits. Decode graphs
(executor/decode_graphs.py) keep the memory of their largest bucket's step beside it, also an
estimate (--no-cuda-graphs, the executor's flag: none; nor where the executor captures none: tensor
parallelism, mixture-of-experts layers, window blocks). The blocks take what is left of --gpu-gib x
--utilization, in blocks of --block-size tokens: the --kv-blocks to start the executor with. KV and
adapters share them: an adapter's weights are in pages, blocks in proportion to its ranks
(common/adapter_pages.py). Then the traffic mix: whether --seqs sequences of --context tokens fit at
once (and if not, how many do), and how many adapters of the --adapter-ranks mix (rank:share, on
every projection) fit beside that KV, against slots padded to the mix's largest rank as vLLM and
LoRAX size them.

With --tensor-parallel N the plan is per GPU: each of the N ranks holds its part of the weights
(executor/tp/shards.py: 1/N of every projection, of the vocabulary, and of the KV heads, which are
whole per rank, so KV heads below N are replicated), its part of every block, and the pool's
tables; the step workspace is rank 0's (it gathers the whole logits).

    loraplex budget --model random:llama-3-70b --gpu-gib 80 --tensor-parallel 4

A quantized base (a folder's quantization_config, or --quantization fp8 | int8 | int4 | nf4 for
the common releases' schemes: FP8 in 128 x 128 blocks, int8 per channel, int4 in groups of 128,
NF4 in blocks of 64) counts its projections at the bytes the executor holds them in
(executor/model/quant.py; the embeddings, lm_head and norms stay at --dtype), and the plan says what
that frees against --dtype weights, in KV tokens and in adapters of the mix.

    loraplex budget --model random:llama-3-70b --gpu-gib 80 --quantization int4

A model with sliding-window layers (Gemma 2 and 3, Mistral 7B v0.1, gpt-oss) keeps their KV only
for the window, in blocks of its own (the executor's window blocks, common/kv_layout.py): a
sequence holds the window layers' KV of at most their window and a row, the global layers' of
its whole context, and the plan says what that saves per sequence and in sequences that fit
(--no-window-blocks: the executor's flag, every layer keeping the whole context).
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import torch

from common.adapter_pages import padded_pages, plan_pages
from common.help_format import HelpFormatter
from common.kv_layout import KVLayout
from common.peft.modules import BLOCK_OF
from executor.decode_graphs import BUCKETS
from executor.lora.slot_pool import page_geometry
from executor.memory_budget import MemoryBudget
from executor.model.config import NAMED_CONFIGS, ModelConfig
from executor.model.quant_config import PRESETS, preset
from executor.tp.shards import Shard

GB = 1e9
MAX_TENSOR_PARALLEL = 16  # the most GPUs `budget` suggests one executor spans


@dataclasses.dataclass(frozen=True)
class Plan:
    config: ModelConfig
    tensor_parallel: int  # GPUs the executor spans; every figure below is one GPU's
    dtype: torch.dtype
    usable_bytes: int  # gpu memory x utilization
    weights_bytes: int
    pool_bytes: int  # the pool's tables (its weights are in pages of the blocks)
    page_bytes: int  # one block: KV of block_size tokens, or one page of an adapter's weights
    mix_pages: float  # pages an adapter of the rank mix takes, on average
    padded_pages: int  # pages a slot padded to the mix's largest rank takes
    # a mixture of experts: pages an adapter of the mix on attention alone takes (the mix's
    # adapters are on every projection, every expert's among them); 0 for a dense model
    attention_pages: float
    workspace_bytes: int  # an estimate: step_bytes + attention's gathered K/V
    graphs_bytes: int  # an estimate: decode graphs' memory pool (decode_graphs_bytes)
    kv_bytes_per_token: int
    block_size: int
    num_kv_blocks: int  # what fits in the rest; < 1 means nothing does
    dense_weights_bytes: int = 0  # the weights with every quantized projection at `dtype`
    layout: KVLayout | None = None  # which KV the layers keep (None: every layer, the whole)

    @property
    def kv_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    def seq_blocks(self, context: int) -> float:
        """A sequence of `context` tokens' KV while it decodes, in blocks of every layer (under
        window blocks, its window layers' at most their window's)."""
        whole = math.ceil(context / self.block_size)
        if self.layout is None or self.layout.is_single:
            return whole
        slots = self.layout.most_blocks(context, self.block_size) * self.layout.layers_per_block
        return slots / self.layout.num_layers


def model_config(model: str) -> ModelConfig:
    """`random:<name>` (a named config) or an HF model directory."""
    if model.startswith("random:"):
        return ModelConfig.named(model.removeprefix("random:"))
    return ModelConfig.from_pretrained(model)


def step_bytes(c: ModelConfig, size: int, *, max_batched_tokens: int, max_num_seqs: int) -> int:
    """The step workspace but attention's gathered K/V (an estimate): one layer's activations
    over the step's tokens (residual, normed input, q|k|v, attention output, gate|up, their
    product, the projection's output) and the fp32 logits of the rows that sample."""
    mlp = max(c.intermediate_size if c.has_dense_mlp else 0,  # (a token's k experts' rows)
              c.num_experts_per_tok * c.moe_intermediate_size)
    per_token = 3 * c.hidden_size + 2 * c.q_size + 2 * c.kv_size + 3 * mlp
    return max_batched_tokens * per_token * size + max_num_seqs * c.vocab_size * 4


def decode_graphs_bytes(local: ModelConfig, size: int, layout: KVLayout,
                        tensor_parallel: int) -> int:
    """What the decode graphs' memory pool keeps (an estimate): the step of their largest
    bucket, whose graph is captured first and whose memory the others reuse, its logits in the
    serving dtype as well as fp32; 0 where the executor captures none (DecodeGraphs.supports)."""
    if tensor_parallel > 1 or local.num_experts or not layout.is_single:
        return 0
    rows = BUCKETS[-1]
    return (step_bytes(local, size, max_batched_tokens=rows, max_num_seqs=rows)
            + rows * local.vocab_size * size)


def plan(config: ModelConfig, *, dtype: torch.dtype, gpu_bytes: float, utilization: float,
         adapter_slots: int, max_rank: int, block_size: int, max_batched_tokens: int,
         max_num_seqs: int, context: int, adapter_ranks: dict[int, float] | None = None,
         tensor_parallel: int = 1, window_blocks: bool = True, cuda_graphs: bool = True) -> Plan:
    """The plan of one GPU (of `tensor_parallel`: rank 0's, the others' the same or less)."""
    size = torch.empty((), dtype=dtype).element_size()
    fixed = MemoryBudget.estimate(config, num_kv_blocks=0, block_size=block_size,
                                  num_slots=adapter_slots, max_rank=max_rank, dtype=dtype,
                                  tensor_parallel=tensor_parallel)
    local = Shard(config, 0, tensor_parallel).config  # a rank's part; all of it at 1
    mix = adapter_ranks or {max_rank: 1.0}
    geometry = page_geometry(local, block_size)  # (a rank's part of each page)
    mix_pages = sum(share * plan_pages(dict.fromkeys(geometry.module_shapes, rank),
                                       geometry).num_pages
                    for rank, share in mix.items()) / sum(mix.values())
    attention = [m for m in geometry.module_shapes if BLOCK_OF.get(m) == "self_attn"]
    attention_pages = sum(share * plan_pages(dict.fromkeys(attention, rank), geometry).num_pages
                          for rank, share in mix.items()) / sum(mix.values()) \
        if config.num_experts else 0.0
    kv_per_token = 2 * local.num_hidden_layers * local.kv_size * size  # every layer's K and V
    gather_per_token = 2 * local.kv_size * size  # one layer's, gathered for attention
    usable = int(gpu_bytes * utilization)
    step = step_bytes(local, size, max_batched_tokens=max_batched_tokens,
                      max_num_seqs=max_num_seqs)
    layout = config.kv_layout(window_blocks)
    graphs = decode_graphs_bytes(local, size, layout, tensor_parallel) if cuda_graphs else 0
    rest = usable - fixed.weights_bytes - fixed.adapter_pool_bytes - step - graphs
    # A decode step gathers the K/V of every running sequence: of all the mix wants, or of all
    # the cache holds when that is less.
    wanted = max_num_seqs * context
    kv_tokens = (rest - wanted * gather_per_token) // kv_per_token
    if kv_tokens < wanted:
        kv_tokens = rest // (kv_per_token + gather_per_token)
    num_blocks = kv_tokens // block_size
    workspace = step + min(wanted, max(num_blocks, 0) * block_size) * gather_per_token
    return Plan(config, tensor_parallel, dtype, usable, fixed.weights_bytes,
                fixed.adapter_pool_bytes, geometry.page_elems * size, mix_pages,
                padded_pages(max(mix), geometry), attention_pages, workspace, graphs,
                kv_per_token, block_size, num_blocks, fixed.dense_weights_bytes, layout)


def format_plan(p: Plan, *, adapter_slots: int, max_rank: int, seqs: int, context: int,
                fewest_gpus: int = 0, cuda_graphs_off: bool = False) -> str:
    """The plan as `loraplex budget` prints it. `fewest_gpus`: when the weights alone are more
    than one GPU holds, the fewest GPUs of a tensor-parallel executor that holds them (0: none
    up to MAX_TENSOR_PARALLEL)."""
    c = p.config
    dtype = str(p.dtype).removeprefix("torch.")
    lines = [
        f"model {c.model_id or '(unnamed)'} in {dtype}: {c.num_hidden_layers} layers, hidden "
        f"{c.hidden_size}, {c.num_attention_heads} heads / {c.num_key_value_heads} KV heads, "
        f"vocab {c.vocab_size}",
        *([f"tensor parallel {p.tensor_parallel}: per GPU, each rank holding 1/"
           f"{p.tensor_parallel} of the weights and its KV heads "
           f"({max(1, c.num_key_value_heads // p.tensor_parallel)} of "
           f"{c.num_key_value_heads})"] if p.tensor_parallel > 1 else []),
        f"  usable GPU memory     {p.usable_bytes / GB:8.2f} GB",
        f"  base weights          {p.weights_bytes / GB:8.2f} GB{_freed(p)}",
        f"  adapter pool tables   {p.pool_bytes / GB:8.2f} GB   ({adapter_slots} slots of rank "
        f"<= {max_rank}; their weights are in pages of the blocks below)",
        f"  step workspace        {p.workspace_bytes / GB:8.2f} GB   (estimate)",
    ]
    if p.graphs_bytes:
        lines.append(f"  decode graphs         {p.graphs_bytes / GB:8.2f} GB   (estimate: the "
                     f"{BUCKETS[-1]}-row bucket's step; --no-cuda-graphs: none)")
    if p.num_kv_blocks < 1 and p.weights_bytes >= p.usable_bytes and p.tensor_parallel == 1:
        gpus = (f"run one executor over {fewest_gpus} GPUs: --tensor-parallel {fewest_gpus} "
                f"(`loraplex budget ... --tensor-parallel {fewest_gpus}` plans each GPU)"
                if fewest_gpus else f"no executor of up to {MAX_TENSOR_PARALLEL} of these GPUs "
                                    "holds them: larger GPUs, or a smaller dtype")
        lines.append(f"  KV cache              does not fit: the weights alone are more than "
                     f"one GPU holds; {gpus}")
        return "\n".join(lines)
    if p.num_kv_blocks < 1:
        rest = p.usable_bytes - p.weights_bytes - p.pool_bytes - p.workspace_bytes \
            - p.graphs_bytes
        one_block = p.block_size * p.kv_bytes_per_token * (1 + 1 / c.num_hidden_layers)
        short = (one_block - rest) / GB
        lines.append(f"  KV cache              does not fit: {short:.2f} GB short "
                     "of a single block (and the K/V a step gathers of it); use fewer or smaller "
                     "adapter slots, a smaller step (--max-batched-tokens, --seqs), a larger "
                     "GPU or more of them (--tensor-parallel)")
        return "\n".join(lines)
    lines.append(
        f"  blocks (KV, adapters) {p.num_kv_blocks * p.block_size * p.kv_bytes_per_token / GB:8.2f}"
        f" GB   ({p.num_kv_blocks:,} blocks of {p.block_size} tokens = {p.kv_tokens:,} tokens, "
        f"{p.kv_bytes_per_token / 1024:.0f} KiB per token; a block is {p.page_bytes / 1e6:.2f} MB "
        "of KV or of an adapter's weights)")
    per_seq = p.seq_blocks(context) * p.block_size  # (KV tokens of every layer)
    need = math.ceil(seqs * per_seq)
    windows = p.layout is not None and not p.layout.is_single
    lines.append(f"start the executor with: --kv-blocks {p.num_kv_blocks} --block-size "
                 f"{p.block_size} --adapter-slots {adapter_slots} --max-rank {max_rank} "
                 f"--dtype {dtype}"
                 + (f" --tensor-parallel {p.tensor_parallel}" if p.tensor_parallel > 1 else "")
                 + ("" if windows or p.layout is None or not c.sliding_window
                    else " --no-window-blocks")
                 + ("" if not cuda_graphs_off else " --no-cuda-graphs"))
    if windows:
        lines.append(_window_saving(p, context))
    if need <= p.kv_tokens:
        verdict = (f"fits: {need:,} of {p.kv_tokens:,} KV tokens "
                   f"({100 * need / p.kv_tokens:.0f}%)")
    else:
        verdict = (f"does NOT fit: {need:,} KV tokens wanted, {p.kv_tokens:,} held; at "
                   f"{context} tokens {int(p.kv_tokens // per_seq)} sequences fit at once (the "
                   "scheduler queues the rest)")
    lines.append(f"traffic: {seqs} sequences of {context} tokens at once {verdict}")
    spare = max(0, p.num_kv_blocks - min(need, p.kv_tokens) // p.block_size)
    paged, padded = int(spare / p.mix_pages), spare // p.padded_pages
    lines.append(f"adapters beside that KV: {paged:,} of the rank mix ({p.mix_pages:.1f} pages, "
                 f"{p.mix_pages * p.page_bytes / 1e6:.1f} MB each on average), against "
                 f"{padded:,} in slots padded to its largest rank ({p.padded_pages} pages each); "
                 f"--adapter-slots {adapter_slots} bounds how many are resident")
    if p.attention_pages:
        lines.append(f"  (a mixture of {c.num_experts} experts: an adapter on every projection "
                     f"adapts each expert, {p.mix_pages / p.attention_pages:.0f}x the pages of "
                     f"one on attention alone; of those {int(spare / p.attention_pages):,} fit, "
                     f"{p.attention_pages * p.page_bytes / 1e6:.1f} MB each)")
    if context > c.max_position_embeddings:
        lines.append(f"warning: --context {context} exceeds the model's max_position_embeddings "
                     f"{c.max_position_embeddings}")
    return "\n".join(lines)


def _window_saving(p: Plan, context: int) -> str:
    """What window blocks save a sequence of `context` tokens, and in sequences that fit."""
    layout, whole = p.layout, math.ceil(context / p.block_size)
    windows = sorted({kind.window for kind in layout.kinds if kind.window is not None})
    global_layers = sum(len(kind.layers) for kind in layout.kinds if kind.window is None)
    held = p.seq_blocks(context)
    return (f"window blocks: {layout.num_layers - global_layers} of {layout.num_layers} layers "
            f"slide over {', '.join(map(str, windows))} keys and keep only that: a sequence of "
            f"{context} tokens holds {held * p.block_size * p.kv_bytes_per_token / 2**20:,.0f} "
            f"MiB of KV ({held * p.block_size:,.0f} tokens of every layer's) against "
            f"{whole * p.block_size * p.kv_bytes_per_token / 2**20:,.0f} MiB "
            f"({100 * (1 - held / whole):.0f}% less); {int(p.num_kv_blocks // held):,} such "
            f"sequences fit in the blocks against {p.num_kv_blocks // whole:,}")


def _freed(p: Plan) -> str:
    """What a quantized base frees against dense weights, in KV tokens and adapters of the mix
    ("" for a dense one)."""
    q = p.config.quantization
    freed = p.dense_weights_bytes - p.weights_bytes
    if q is None or freed <= 0:
        return ""
    dtype = str(p.dtype).removeprefix("torch.")
    schemes = ", ".join(sorted({s.describe() for _, s in q.groups}))
    return (f"   ({schemes}: {freed / GB:.2f} GB freed against {dtype} weights, "
            f"{freed // p.kv_bytes_per_token:,} KV tokens or "
            f"{int(freed / (p.mix_pages * p.page_bytes)):,} adapters of the rank mix)")


def _fewest_gpus(config: ModelConfig, plan_args: dict) -> int:
    """The fewest GPUs (a power of two up to MAX_TENSOR_PARALLEL, that the model splits into)
    of one executor whose every GPU holds its part with a KV block to spare; 0 when none."""
    n = 2
    while n <= MAX_TENSOR_PARALLEL:
        try:
            Shard(config, 0, n)
        except ValueError:
            break
        if plan(config, tensor_parallel=n, **plan_args).num_kv_blocks >= 1:
            return n
        n *= 2
    return 0


def rank_mix(text: str) -> dict[int, float]:
    """"8:0.7,16:0.2,64:0.1" -> {8: 0.7, 16: 0.2, 64: 0.1} (shares need not add up to 1)."""
    try:
        mix = {int(r): float(s) for r, s in (item.split(":") for item in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: use RANK:SHARE,... e.g. 8:0.7,16:0.3") \
            from None
    if not mix or any(r < 1 or s <= 0 for r, s in mix.items()):
        raise argparse.ArgumentTypeError(f"{text!r}: ranks >= 1, shares > 0")
    return mix


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="loraplex budget", description=__doc__,
                                formatter_class=HelpFormatter)
    names = ", ".join(NAMED_CONFIGS)
    p.add_argument("--model", default="random:llama-3-8b",
                   help=f"HF model directory, or random:<name> ({names})")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="the executor's --dtype")
    p.add_argument("--gpu-gib", type=float, default=80.0, help="GPU memory in GiB")
    p.add_argument("--utilization", type=float, default=0.9,
                   help="share of the GPU memory loraplex may take (the rest: CUDA context, "
                        "allocator slack)")
    p.add_argument("--adapter-slots", type=int, default=64, help="the executor's flag")
    p.add_argument("--max-rank", type=int, default=16, help="the executor's flag")
    p.add_argument("--adapter-ranks", type=rank_mix, default=None, metavar="RANK:SHARE,...",
                   help="the adapters' ranks, e.g. 8:0.7,16:0.2,64:0.1 (default: --max-rank)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-batched-tokens", type=int, default=2048,
                   help="tokens per step (the scheduler's flag of the same name)")
    p.add_argument("--seqs", type=int, default=64,
                   help="sequences running at once (the scheduler's --max-num-seqs)")
    p.add_argument("--context", type=int, default=4096,
                   help="tokens per sequence (prompt + output)")
    p.add_argument("--tensor-parallel", type=int, default=1,
                   help="GPUs one executor spans (the executor's flag of the same name): the "
                        "plan is per GPU")
    p.add_argument("--no-window-blocks", action="store_false", dest="window_blocks",
                   help="plan the executor's flag of that name: sliding-window layers keeping "
                        "the whole context's KV, as global layers do")
    p.add_argument("--no-cuda-graphs", action="store_false", dest="cuda_graphs",
                   help="plan the executor's flag of that name: every decode step eager, no "
                        "memory kept for CUDA graphs")
    p.add_argument("--quantization", choices=("none", *PRESETS), default=None,
                   help="the base's projections quantized as the common releases are (fp8: "
                        "128x128 blocks; int8: per channel; int4: groups of 128; nf4: blocks of "
                        "64); default: the model folder's quantization_config, else none")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    for name in ("adapter_slots", "max_rank", "block_size", "max_batched_tokens", "seqs",
                 "context", "tensor_parallel"):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be >= 1, "
                             f"got {getattr(args, name)}")
    if not (args.gpu_gib > 0 and 0 < args.utilization <= 1):
        raise SystemExit(f"error: --gpu-gib must be > 0 and --utilization in (0, 1], got "
                         f"{args.gpu_gib} and {args.utilization}")
    try:
        config = model_config(args.model)
    except (ValueError, OSError) as err:
        raise SystemExit(f"error: --model {args.model}: {err}") from None
    if args.quantization:
        config = config.replace(quantization=None if args.quantization == "none"
                                else preset(args.quantization))
    try:
        Shard(config, 0, args.tensor_parallel)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    plan_args = dict(dtype=getattr(torch, args.dtype), gpu_bytes=args.gpu_gib * 2**30,
                     utilization=args.utilization, adapter_slots=args.adapter_slots,
                     max_rank=args.max_rank, block_size=args.block_size,
                     max_batched_tokens=args.max_batched_tokens, max_num_seqs=args.seqs,
                     context=args.context, adapter_ranks=args.adapter_ranks,
                     window_blocks=args.window_blocks, cuda_graphs=args.cuda_graphs)
    result = plan(config, tensor_parallel=args.tensor_parallel, **plan_args)
    print(format_plan(result, adapter_slots=args.adapter_slots, max_rank=args.max_rank,
                      seqs=args.seqs, context=args.context,
                      cuda_graphs_off=not args.cuda_graphs,
                      fewest_gpus=_fewest_gpus(config, plan_args)
                      if result.num_kv_blocks < 1 else 0))
    if result.num_kv_blocks < 1:
        raise SystemExit(2)
