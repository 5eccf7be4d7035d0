"""Drive a ModelRunner as a stand-in scheduler would: a runner with the fixture adapters in its
slots, random prompts, and `run`, which steps requests to completion (chunked prefill, reused
block ids) and returns each one's tokens and logits."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from common.sampling import SamplingParams
from executor.lora.peft_adapter import parse_peft_adapter
from executor.runner import ModelRunner, Row, Sampled

BLOCK, MAX_RANK = 4, 32


def read_adapter(fx, name: str) -> tuple[str, bytes]:
    """(adapter_config.json text, weights file bytes) of a fixture adapter."""
    return read_folder(fx["adapters"][name]["path"])


def read_folder(path: str | Path) -> tuple[str, bytes]:
    """(adapter_config.json text, weights file bytes) of a PEFT adapter folder."""
    path = Path(path)
    weights = path / "adapter_model.safetensors"
    weights = weights if weights.exists() else path / "adapter_model.bin"
    return (path / "adapter_config.json").read_text(), weights.read_bytes()


def make_runner(fx, **kw) -> ModelRunner:
    args = {"num_kv_blocks": 2048,  # (its adapters' pages among them)
            "block_size": BLOCK, "num_slots": len(fx["valid"]), "max_rank": MAX_RANK}
    runner = ModelRunner.from_pretrained(fx["model_dir"], **{**args, **kw})
    for slot, name in enumerate(fx["valid"][: runner.pool.num_slots]):
        runner.load_adapter(slot, parse_peft_adapter(*read_adapter(fx, name), runner.config))
    return runner


def load_folders(runner: ModelRunner, folders: list[Path]) -> ModelRunner:
    """The PEFT adapters of `folders` in slots 0, 1, ... (the base named by any path)."""
    for slot, folder in enumerate(folders):
        runner.load_adapter(slot, parse_peft_adapter(*read_folder(folder), runner.config,
                                                     max_rank=runner.pool.max_rank,
                                                     check_base_model=False))
    return runner


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 1024) for _ in range(rng.randint(3, 21))] for _ in range(n)]


class Driver:
    """A stand-in scheduler: shuffled (reused) block ids, chunked prefill, rows sorted by slot;
    on a longrope model, a sequence that outgrows the switch is recomputed from all its tokens
    (as scheduler/steps/longrope.py has it); with window blocks (ModelRunner.kv_layout), each
    kind's tables, a window kind's token blocks given back (and reused) once behind the window
    of a sequence's next row."""

    def __init__(self, runner: ModelRunner, seed: int = 0):
        self.runner, self.free = runner, runner.free_blocks()  # (not its adapters' pages)
        random.Random(seed).shuffle(self.free)
        self.state: dict[int, dict] = {}
        self.samples: dict[int, list[Sampled]] = {}  # every sample of each sequence, in order
        self.num_recomputed = 0  # sequences recomputed past the longrope switch
        self.most_held: dict[int, int] = {}  # seq_id -> the most blocks its tables held

    def add(self, seq_id, prompt, slot, sampling: SamplingParams | None = None,
            num_generated: int = 0, lora_from: int = 0):
        """`lora_from`: an activated LoRA's activation point (ModelRunner.add_sequence)."""
        sampling = sampling or SamplingParams()
        self.runner.add_sequence(seq_id, prompt, sampling, slot, num_generated,
                                 lora_from=lora_from)
        self.state[seq_id] = {"computed": 0, "total": len(prompt), "slot": slot,
                              "sampling": sampling, "generated": num_generated,
                              "lora_from": lora_from,
                              "tables": [[] for _ in self.runner.kv_layout.kinds]}
        self.most_held.setdefault(seq_id, 0)

    def step(self, chunk: int) -> dict[int, tuple[int, torch.Tensor]]:
        rows = []
        for sid, st in sorted(self.state.items(), key=lambda item: item[1]["slot"]):
            n = min(chunk, st["total"] - st["computed"])
            rows.append(self._row(sid, st, n))
        sampled, logits = self.runner.step_with_logits(rows)
        for r in rows:
            self.state[r.seq_id]["computed"] += r.num_tokens
        switch = self.runner.rope_switch_len
        for s in sampled:
            st = self.state[s.seq_id]
            st["total"] += 1
            st["generated"] += 1
            self.samples.setdefault(s.seq_id, []).append(s)
            if st["total"] == switch + 1 and switch:  # (it outgrew the switch just now)
                self.recompute(s.seq_id)
        return {s.seq_id: (s.token_id, logits[i]) for i, s in enumerate(sampled)}

    def recompute(self, seq_id) -> None:
        """Free a sequence and register it again with all its tokens (fresh blocks)."""
        tokens = self.runner.tokens(seq_id)
        st = self.state[seq_id]
        self.finish(seq_id)
        self.add(seq_id, tokens, st["slot"], st["sampling"], st["generated"], st["lora_from"])
        self.num_recomputed += 1

    def _row(self, seq_id: int, st: dict, n: int) -> Row:
        """seq_id's next row of n tokens: each kind's blocks behind the row's window back, and
        the token blocks it needs taken (one block per column each)."""
        kinds, block_size = self.runner.kv_layout.kinds, self.runner.kv.block_size
        counts, new = [], []
        for kind, table in zip(kinds, st["tables"]):
            for i in range(kind.first_needed(st["computed"], block_size)):
                if table[i] is not None:
                    self.free += table[i]
                    table[i] = None
            need = -(-(st["computed"] + n) // block_size) - len(table)
            taken = [tuple(self.free.pop() for _ in range(kind.columns)) for _ in range(need)]
            table += taken
            counts.append(need * kind.columns)
            new += [b for entry in taken for b in entry]
        held = sum(len(e) for table in st["tables"] for e in table if e is not None)
        self.most_held[seq_id] = max(self.most_held[seq_id], held)
        return Row(seq_id, n, tuple(new), tuple(counts) if len(kinds) > 1 else ())

    def finish(self, seq_id: int) -> None:
        self.runner.free_sequence(seq_id)
        self.free += [b for table in self.state.pop(seq_id)["tables"] for e in table
                      if e is not None for b in e]


def run(runner, requests: dict, num_tokens: int, chunk: int = 8, admit: int = 100, seed: int = 0,
        samples: dict | None = None, most_held: dict | None = None):
    """requests: seq_id -> (prompt, slot[, sampling[, lora_from]]) -> seq_id -> (tokens,
    logits [n, vocab]);
    `samples`, when given, gets each sequence's Sampled records (logprobs, alternatives);
    `most_held`, the most blocks each sequence's tables held at once."""
    driver, pending = Driver(runner, seed), list(requests.items())
    driver.samples = driver.samples if samples is None else samples
    driver.most_held = driver.most_held if most_held is None else most_held
    out = {sid: ([], []) for sid in requests}
    while pending or driver.state:
        for sid, req in pending[:admit]:
            prompt, slot, *rest = req  # ([sampling[, lora_from]])
            driver.add(sid, prompt, slot, *rest[:1], lora_from=rest[1] if len(rest) > 1 else 0)
        pending = pending[admit:]
        for sid, (token, logits) in driver.step(chunk).items():
            out[sid][0].append(token)
            out[sid][1].append(logits)
            if len(out[sid][0]) == num_tokens:
                driver.finish(sid)
    return {sid: (tokens, torch.stack(logits)) for sid, (tokens, logits) in out.items()}
