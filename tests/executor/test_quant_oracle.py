"""Quantized bases under full-precision adapters (issue 44), one tiny checkpoint per format as
its tools write it (tests/executor/quant_checkpoints.py), two PEFT adapters on it: each adapter
alone and batched beside base rows gives HF + PEFT's greedy tokens and logits within ATOL, and
2 tensor-parallel ranks give TP=1's tokens (logits within TP_ATOL).

The reference: transformers loading the same checkpoint with its own quantizer (compressed-
tensors decompressed, FP8 weight_scale_inv dequantized, bitsandbytes' Linear4bit) or, for GPTQ,
AWQ and fbgemm_fp8 (no CPU loader), the dense model of the weights the encoder's own codes, zeros
and scales make (fbgemm_fp8: with fbgemm's per-row activation quantization, its amax bound, as a
hook on every projection). PEFT adds each adapter in fp32 on the activations the base projection
reads.

Tolerances: loraplex dequantizes every format exactly (the same fp32 products of code, zero and
scale as the reference), so what is left is the order of fp32 sums: ~1e-6 measured, ATOL 1e-4 as
the dense oracles. W8A8 (compressed-tensors FP8_DYNAMIC, static FP8) quantizes each projection's
input to fp8 as compressed-tensors' own fake-quantization does (the reference runs it as a hook
on every projection): a 1e-6 difference in an input can flip one fp8 rounding (a 6% step of that
element), which moved logits by up to 4.4e-3 on a hidden-64 variant of this model (here: 1.5e-6,
no flip), so its logits get W8A8_ATOL = 1e-2; its tokens must still agree. Measured here, every
other format: 1.6e-6 to 2.7e-6. TP_ATOL: partial sums
added by the all-reduce (5e-5, as test_tensor_parallel_oracle).

BNB_EXACT: bitsandbytes' CPU kernel for AVX512-BF16 machines repacks a weight and rounds each
block's absmax to bf16 (logits 4e-3 off the format's own values, measured); the reference turns
it off and runs bitsandbytes' dequantize_4bit (exact fp32, what its CUDA path and transformers'
dequantize compute), which loraplex's dequantized weights equal bit for bit (checked below)."""

from __future__ import annotations

import json
import os
import shutil

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit is defined

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from executor.lora.peft_adapter import parse_peft_adapter  # noqa: E402
from executor.model.quant import Fp8Weight, IntWeight  # noqa: E402
from executor.runner import ModelRunner  # noqa: E402
from tests.executor import quant_checkpoints as qc  # noqa: E402
from tests.oracle import hf_greedy, made_adapters  # noqa: E402
from tests.rank_threads import RankThreads  # noqa: E402
from tests.runner_driver import BLOCK, load_folders, prompts, read_folder, run  # noqa: E402

ATOL, W8A8_ATOL, TP_ATOL = 1e-4, 1e-2, 5e-5
NUM_TOKENS = 6
ADAPTERS = {"attn_r8": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj",
                                                                     "o_proj"]},
            "all_r4": {"r": 4, "lora_alpha": 8, "target_modules": list(qc.PROJECTIONS)}}
CALIBRATION = [3, 17, 99, 250, 7, 512, 64, 33]
FP8 = {"num_bits": 8, "type": "float", "symmetric": True}
FP8_TOKEN = {**FP8, "strategy": "token", "dynamic": True}
FORMATS = {  # name -> (family, checkpoint maker (base, out) -> (folder, dense or None))
    "ct-w4a16-g32-zeros": ("llama", lambda b, o: (qc.compressed_tensors(b, o, "w4", {
        "num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
        "group_size": 32}), None)),
    "ct-w8a16-channel": ("qwen2", lambda b, o: (qc.compressed_tensors(b, o, "w8", {
        "num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}), None)),
    "ct-fp8-dynamic": ("llama", lambda b, o: (qc.compressed_tensors(
        b, o, "fp8dyn", {**FP8, "strategy": "channel"}, FP8_TOKEN), None)),
    "ct-fp8-static": ("llama", lambda b, o: (qc.compressed_tensors(
        b, o, "fp8static", {**FP8, "strategy": "tensor"},
        {**FP8, "strategy": "tensor", "dynamic": False}, CALIBRATION), None)),
    "ct-fp8-block": ("llama", lambda b, o: (qc.compressed_tensors(
        b, o, "fp8block", {**FP8, "strategy": "block", "block_structure": [16, 16]}), None)),
    "fp8-scale-inv": ("qwen3", lambda b, o: (qc.fp8_blocks(b, o), None)),
    "fbgemm-fp8-bound": ("llama", lambda b, o: qc.fbgemm_fp8(b, o, bound=FBGEMM_BOUND)),
    "gptq-int4-act-order": ("qwen2", lambda b, o: qc.gptq(b, o, desc_act=True)),
    "gptq-int8-sym-v2": ("llama", lambda b, o: qc.gptq(b, o, bits=8, group=32, sym=True,
                                                       v1=False)),
    "awq-int4": ("llama", lambda b, o: qc.awq(b, o)),
    "bnb-nf4-double-quant": ("llama", lambda b, o: (qc.bitsandbytes(b, o, "nf4", True), None)),
    "bnb-fp4": ("llama", lambda b, o: (qc.bitsandbytes(b, o, "fp4", False), None)),
}
W8A8 = ("ct-fp8-dynamic", "ct-fp8-static", "fbgemm-fp8-bound")
FBGEMM_BOUND = 0.5  # (below the tiny model's activations' amax: the bound clamps)


def reference(name: str, folder, dense):
    """transformers' model of the checkpoint (see the module docstring)."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig, FineGrainedFP8Config

    if dense is not None:
        model = AutoModelForCausalLM.from_pretrained(dense)
        if name.startswith("fbgemm"):  # (fbgemm's own row quantization, on every projection)
            for path, module in model.named_modules():
                if path.endswith(qc.PROJECTIONS):
                    module.register_forward_pre_hook(
                        lambda m, a: (qc.fbgemm_fake_quantize(a[0], FBGEMM_BOUND),))
        return model
    if name.startswith("ct-"):
        model = AutoModelForCausalLM.from_pretrained(
            folder, quantization_config=CompressedTensorsConfig(run_compressed=False))
        if name in W8A8:
            fake_quantize_inputs(model, folder, name)
        return model
    if name == "fp8-scale-inv":
        return AutoModelForCausalLM.from_pretrained(
            folder, quantization_config=FineGrainedFP8Config(dequantize=True))
    model = AutoModelForCausalLM.from_pretrained(folder, device_map="cpu")
    for module in model.modules():  # (bitsandbytes' Linear4bit)
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False  # (see BNB_EXACT)
    return model


def fake_quantize_inputs(model, folder, name: str) -> None:
    """compressed-tensors' own activation fake-quantization on every projection's input (its
    dynamic per-token scales, or the checkpoint's static input_scale)."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp
    from safetensors.torch import load_file

    dynamic = name == "ct-fp8-dynamic"
    args = QuantizationArgs(**(FP8_TOKEN if dynamic else {**FP8, "strategy": "tensor"}))
    scales = load_file(folder / "model.safetensors")

    def hook(module, inputs, path):
        x = inputs[0]
        if dynamic:
            scale, zero = compute_dynamic_scales_and_zp(x, args, module)
        else:
            scale, zero = scales[f"{path}.input_scale"], None
        return (fake_quantize(x, scale, zero, args),)

    for path, module in model.named_modules():
        if path.endswith(qc.PROJECTIONS):
            module.register_forward_pre_hook(lambda m, a, path=path: hook(m, a, path))


@pytest.fixture(scope="module", params=list(FORMATS))
def quantized(request, tmp_path_factory):
    """(format, checkpoint folder, adapter folders, HF + PEFT with the adapters)."""
    if request.param.startswith("bnb"):
        pytest.importorskip("bitsandbytes")
    if request.param.startswith("ct-"):
        pytest.importorskip("compressed_tensors")
    family, make = FORMATS[request.param]
    out = tmp_path_factory.mktemp(request.param)
    base = qc.base_model(out / "base", family)
    folder, dense = make(base, out)
    hf = made_adapters(reference(request.param, folder, dense).eval(), out, ADAPTERS, seed=31)
    return request.param, folder, {n: out / n for n in ADAPTERS}, hf


def check_bnb_dequantizes_alike(runner: ModelRunner, hf) -> None:
    import bitsandbytes.functional as bnb

    attn = hf.base_model.model.model.layers[0].self_attn
    want = torch.cat([bnb.dequantize_4bit(m.base_layer.weight.data, m.base_layer.weight.quant_state)
                      for m in (attn.q_proj, attn.k_proj, attn.v_proj)])
    assert torch.equal(runner.weights.layers[0].wqkv.dequantize(), want)


def make_runner(folder, adapters, **kw) -> ModelRunner:
    runner = ModelRunner.from_pretrained(folder, num_kv_blocks=512, block_size=BLOCK,
                                         num_slots=len(ADAPTERS), max_rank=16,
                                         lora_backend="torch", **kw)
    return load_folders(runner, list(adapters.values()))


def batch() -> tuple[dict, list]:
    names = ["attn_r8", None, "all_r4", "attn_r8"]
    slots = [list(ADAPTERS).index(n) if n else -1 for n in names]
    return {sid: (p, s) for sid, (p, s) in enumerate(zip(prompts(len(names), 3), slots))}, names


def test_each_format_serves_hf_pefts_tokens_alone_and_batched(quantized):
    name, folder, adapters, hf = quantized
    runner = make_runner(folder, adapters)
    weights = runner.weights.layers[0]
    kind = Fp8Weight if "fp8" in name else IntWeight
    for w in (weights.wqkv, weights.wo, weights.w_gate_up, weights.w_down):
        assert isinstance(w, kind), f"{name}: served as {type(w).__name__}"
    assert runner.weights.num_bytes() < runner.weights.dense_bytes()
    if name.startswith("bnb"):
        check_bnb_dequantizes_alike(runner, hf)
    requests, names = batch()
    batched = run(runner, requests, NUM_TOKENS, chunk=5, admit=len(names))
    atol = W8A8_ATOL if name in W8A8 else ATOL
    for sid, adapter in enumerate(names):
        tokens, logits = hf_greedy(hf, requests[sid][0], NUM_TOKENS, adapter)
        assert batched[sid][0] == tokens, f"{name}: greedy tokens differ for {adapter}"
        torch.testing.assert_close(batched[sid][1], logits, atol=atol, rtol=0)
    alone = run(runner, {2: requests[2]}, NUM_TOKENS)
    assert alone[2][0] == batched[2][0]
    base = hf_greedy(hf, requests[0][0], 1)[1][0]
    assert (batched[0][1][0] - base).abs().max() > 1e-2, "the adapter matters"


def test_the_triton_kernels_take_each_formats_loaded_layout(quantized):
    """The GPU path (interpreter): each loaded weight through its Triton kernel gives the CPU
    path's product (fp32: 2e-5 of the output's max; W8A8 the same, its activations quantized
    alike on both paths)."""
    name, folder, adapters, _ = quantized
    layer = make_runner(folder, {}).weights.layers[1]
    for w in (layer.wqkv, layer.w_down):
        x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(7))
        want = w.linear(x, triton=False)
        got = w.linear(x, triton=True)
        torch.testing.assert_close(got, want, rtol=0, atol=2e-5 * float(want.abs().max()))


def test_a_checkpoint_in_shards_loads_as_in_one_file(quantized, tmp_path):
    """Tensors dealt across two shard files (a projection's codes and scales apart) and an
    index: the same weights."""
    _, folder, _, _ = quantized
    shutil.copytree(folder, tmp_path / "sharded")
    tensors = load_file(folder / "model.safetensors")
    (tmp_path / "sharded" / "model.safetensors").unlink()
    files = {n: f"model-0000{i % 2 + 1}-of-00002.safetensors" for i, n in enumerate(tensors)}
    for shard in set(files.values()):
        save_file({n: t for n, t in tensors.items() if files[n] == shard},
                  tmp_path / "sharded" / shard, metadata={"format": "pt"})
    (tmp_path / "sharded" / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": files}))
    one, two = (make_runner(f, {}).weights.layers[1] for f in (folder, tmp_path / "sharded"))
    for attr in ("wqkv", "wo", "w_gate_up", "w_down"):
        assert torch.equal(getattr(one, attr).dequantize(), getattr(two, attr).dequantize())


def test_two_tensor_parallel_ranks_give_tp1s_tokens(quantized):
    name, folder, adapters, _ = quantized
    ranks = RankThreads(2, lambda tp: make_runner(folder, {}, tp=tp))
    try:
        for slot, path in enumerate(adapters.values()):
            ranks.load_adapter(slot, parse_peft_adapter(*read_folder(path), ranks.config,
                                                        check_base_model=False))
        assert type(ranks.ranks[0].weights.layers[0].w_down) is type(
            make_runner(folder, {}).weights.layers[0].w_down)
        requests, names = batch()
        got = run(ranks, requests, NUM_TOKENS, chunk=5, admit=len(names))
    finally:
        ranks.close()
    want = run(make_runner(folder, adapters), requests, NUM_TOKENS, chunk=5, admit=len(names))
    for sid in requests:
        assert got[sid][0] == want[sid][0], f"{name}: TP=2 tokens differ"
        atol = W8A8_ATOL if name in W8A8 else TP_ATOL
        torch.testing.assert_close(got[sid][1], want[sid][1], atol=atol, rtol=0)

