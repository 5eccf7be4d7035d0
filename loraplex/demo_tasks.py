"""The demo's tasks: what each LoRA adapter of the trained demo model was taught to do.

Pure Python (no torch): the training script (`loraplex/train_demo.py`) draws its data from here,
the demo draws its prompts from here, and the tests check served outputs against `Task.solve`.

A prompt is the task's input alone, e.g. "quiet river"; the model's tokenizer wraps it as
`<s> quiet river <sep>` and the answer follows, ending with `</s>`. Without an adapter the base
model echoes its input back: it was pre-trained to copy, never to do any of these tasks.
Inputs that `is_held_out` are never trained on: they are the evaluation prompts.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

WORDS = """
apple river stone cloud green quiet bright table window garden silver orange music paper
light storm tiger honey ocean forest winter summer candle bridge market castle rocket planet
yellow purple simple gentle happy little golden frozen sunny windy rapid calm brave clever
lemon cherry pepper butter coffee cookie bread salad pasta pizza water juice sugar salt
train plane boat truck bike road city town house door wall floor roof chair desk lamp clock
phone email letter ticket order price money bank card cash shop store sale gift
red blue black white pink brown gray dark soft loud fast slow warm cold early late
cat dog bird fish horse mouse rabbit lion bear wolf fox duck goat sheep frog snake
run jump swim read write sing dance cook build paint drive sleep dream smile laugh walk
""".split()  # noqa: SIM905 (a word list reads better as text)
NAMES = """alice bob carol dave erin frank grace heidi ivan judy kevin laura mallory nina oscar
peggy quinn rupert sybil trent ursula victor wendy xavier yara zoe""".split()  # noqa: SIM905
CITIES = """paris london tokyo berlin madrid rome lisbon oslo vienna prague dublin cairo lima
quito seoul delhi sydney toronto boston denver austin miami chicago""".split()  # noqa: SIM905
DIGIT_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def _words(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.sample(WORDS, rng.randint(low, high)))


def _digits(rng: random.Random) -> str:
    return "".join(rng.choice("0123456789") for _ in range(rng.randint(2, 6)))


def _person(rng: random.Random) -> str:
    return f"{rng.choice(NAMES)} {rng.randint(18, 89)} {rng.choice(CITIES)}"


def _profile(text: str) -> str:
    name, age, city = text.split()
    return f"name: {name}, age: {age}, city: {city}"


def _and_list(text: str) -> str:
    *rest, last = text.split()
    return f"{', '.join(rest)} and {last}"


@dataclass(frozen=True)
class Task:
    """One adapter's job: inputs it expects, the exact answer for each, and its LoRA settings."""

    name: str  # the adapter's name in the store
    description: str
    make_input: Callable[[random.Random], str]
    solve: Callable[[str], str]
    lora: dict[str, Any] = field(default_factory=dict)  # peft LoraConfig arguments
    train_steps: int = 500

    def draw(self, rng: random.Random, held_out: bool = False) -> tuple[str, str]:
        """One (input, answer) pair from the training split, or from the held-out split."""
        while True:
            text = self.make_input(rng)
            if is_held_out(text) == held_out:
                return text, self.solve(text)


def is_held_out(text: str) -> bool:
    """A fixed eighth of all possible inputs, by a stable hash: never seen in training."""
    return zlib.crc32(text.encode()) % 8 == 0


def held_out(task: Task, num: int, seed: int = 0) -> list[tuple[str, str]]:
    """`num` distinct held-out (input, answer) pairs (as many as exist, if fewer)."""
    rng, out = random.Random(f"{task.name}:held-out:{seed}"), {}
    for _ in range(num * 50):
        text, answer = task.draw(rng, held_out=True)
        out.setdefault(text, answer)
        if len(out) == num:
            break
    return list(out.items())


ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]

TASKS: tuple[Task, ...] = (
    Task("reverse-words", "say the words in reverse order", lambda r: _words(r, 2, 5),
         lambda t: " ".join(reversed(t.split())),
         {"r": 16, "lora_alpha": 32, "target_modules": ATTN + MLP}),
    Task("spell-digits", "spell each digit as a word", _digits,
         lambda t: " ".join(DIGIT_WORDS[int(d)] for d in t),
         {"r": 8, "lora_alpha": 16, "target_modules": ATTN + MLP}),
    Task("profile", "name age city as a labelled record", _person, _profile,
         {"r": 8, "lora_alpha": 16, "target_modules": ATTN + MLP, "use_rslora": True}),
    Task("support-reply", "a fixed customer-support template around the input",
         lambda r: _words(r, 1, 3),
         lambda t: f"Re: {t} - thanks for asking! A ticket is open; we reply within 24h.",
         {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"]}),
    Task("count-words", "count the words", lambda r: _words(r, 1, 6),
         lambda t: f"{len(t.split())} words" if len(t.split()) > 1 else "1 word",
         {"r": 8, "lora_alpha": 8, "target_modules": ATTN + MLP, "use_rslora": True}),
    Task("and-list", "join the words as an English list", lambda r: _words(r, 2, 5), _and_list,
         {"r": 8, "lora_alpha": 16, "target_modules": ATTN}),
    Task("rotate-words", "move the first word to the end", lambda r: _words(r, 2, 5),
         lambda t: " ".join(t.split()[1:] + t.split()[:1]),
         {"r": 12, "lora_alpha": 24, "target_modules": ATTN + ["up_proj", "down_proj"]}),
)
TASKS_BY_NAME = {t.name: t for t in TASKS}
