"""What every section of the GPU check (bench/gpu_check.py) shares: its options, the device and
model shapes they imply, the report the sections append to, and small timing helpers. Importing it
parses the command line and, for --smoke, switches Triton to its interpreter before any kernel is
defined; import it before torch, triton or the repository's modules.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARGS = argparse.ArgumentParser(description="GPU check of the SGMV LoRA and paged-attention "
                                           "kernels")
ARGS.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (Triton interpreter)")
ARGS.add_argument("--budget-s", type=float, default=420.0, help="stop timing configs after this")
ARGS.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu-check.md"))
OPTS = ARGS.parse_args()
if OPTS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton defines any kernel
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402

if "safetensors" not in sys.modules:
    try:
        import safetensors  # noqa: F401
    except ImportError:  # random weights never read a checkpoint: a stub lets executor import
        sys.modules["safetensors"] = types.SimpleNamespace(safe_open=None)

from common.adapter_pages import plan_pages  # noqa: E402
from executor.model.config import ModelConfig  # noqa: E402
from executor.lora.slot_pool import LoraModuleWeights, LoraWeights, page_geometry  # noqa: E402

DEVICE = "cpu" if OPTS.smoke else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    sys.exit("error: the GPU check needs a CUDA GPU, and this machine's torch sees none "
             f"(torch {torch.__version__}); --smoke runs every section on the CPU")
MODEL = "tiny" if OPTS.smoke else "llama-3-8b"
CFG = ModelConfig.named(MODEL)
TOKENS = (4,) if OPTS.smoke else (1, 16, 64, 256, 2048)
ADAPTERS = (2,) if OPTS.smoke else (1, 8, 32, 64, 128)  # (smoke: one config: the interpreter)
RANKS = (16,) if OPTS.smoke else (8, 16, 64)
START = time.perf_counter()
REPORT: list[str] = []



def bench_ms(fn) -> float:
    """Median ms of fn: do_bench on CUDA (L2 flushed between calls), one wall-clock run on CPU."""
    if DEVICE == "cuda":
        return triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median")
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def section(title: str):
    def wrap(fn):
        def run(*a, **kw):
            print(f"\n== {title} ({time.perf_counter() - START:.0f} s)", flush=True)
            REPORT.append(f"\n## {title}\n")
            try:
                return fn(*a, **kw)
            except Exception:  # noqa: BLE001 (report and go on: the other sections still measure)
                err = traceback.format_exc()
                print(err, flush=True)
                REPORT.append(f"**FAILED**\n\n```\n{err[-3000:]}\n```\n")
            finally:
                write_report()
        return run
    return wrap


def write_report() -> None:
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke)"
    head = [f"# GPU check: SGMV LoRA and paged-attention kernels ({MODEL} shapes)\n",
            (f"Device: {device}; torch {torch.__version__}, triton {triton.__version__}; "
             f"{time.strftime('%Y-%m-%d %H:%M')}; {time.perf_counter() - START:.0f} s.\n")]
    Path(OPTS.out).parent.mkdir(parents=True, exist_ok=True)
    Path(OPTS.out).write_text("\n".join(head + REPORT) + "\n")


def table(header: list[str], rows: list[list]) -> str:
    fmt = [[f"{v:.3g}" if isinstance(v, float) else str(v) for v in r] for r in rows]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in fmt]) + "\n"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def random_adapter(config: ModelConfig, ranks: dict[str, int], seed: int,
                   layers=None) -> LoraWeights:
    """ranks: module -> rank (modules left out are not targeted)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    mods = {}
    for layer in layers if layers is not None else range(config.num_hidden_layers):
        for m, r in ranks.items():
            in_f, out_f = config.module_shape(m)
            a = torch.randn(r, in_f, generator=g, device=DEVICE) * in_f ** -0.5
            b = torch.randn(out_f, r, generator=g, device=DEVICE) * 0.02
            mods[(layer, m)] = LoraModuleWeights(a, b, 2.0)
    return LoraWeights(mods)


BLOCK_SIZE = 16  # KV block size of every pool and runner here (its blocks are adapter pages)


def pages_of(config: ModelConfig, ranks: dict[str, int]) -> int:
    """KV blocks (of BLOCK_SIZE) an adapter of `ranks` (module -> rank) takes as pages."""
    return plan_pages(ranks, page_geometry(config, BLOCK_SIZE)).num_pages
