"""PEFT module patterns (a target_modules regex, rank_pattern keys) matched with a time bound.

The patterns are the pusher's regexes. One with nested or ambiguous repetition ("(.*.*)*x",
"(a|a)*b") backtracks for longer than anyone waits even against a 30-character module name, and
Python's re holds the GIL meanwhile, which would freeze the whole store. A pattern without
repetition, groups or alternation matches in linear time and is matched here; the others are
matched in a child process, killed after `timeout_s`.
"""

import json
import re
import subprocess
import sys
from collections.abc import Sequence

from loraplex.errors import InvalidArgument

TIMEOUT_S = 2.0  # a child matching a sane pattern is done in ~20 ms
_RISKY = re.compile(r"[*+?{}()|]")
# Reads [patterns, subjects] from stdin; writes, per pattern, the indexes of the subjects it
# matches in full.
_CHILD = """
import json, re, sys
patterns, subjects = json.load(sys.stdin)
json.dump([[j for j, s in enumerate(subjects) if re.fullmatch(p, s)] for p in patterns],
          sys.stdout)
"""


def compile_pattern(pattern: str, what: str) -> re.Pattern:
    """`pattern` compiled; INVALID_ARGUMENT naming `what` when it is not a usable regex."""
    try:
        return re.compile(pattern)
    except (re.error, OverflowError, RecursionError) as exc:
        raise InvalidArgument(f"{what} {pattern!r} is not a valid regex: {exc}") from None


def fullmatches(patterns: Sequence[str], subjects: Sequence[str], what: str, *,
                as_suffix: bool = False, timeout_s: float | None = None) -> list[list[bool]]:
    """matched[i][j]: patterns[i] (compiled already) matches all of subjects[j], or with
    `as_suffix` a whole dotted suffix of it (PEFT's rule for rank_pattern keys: "v_proj" matches
    "model.layers.0.self_attn.v_proj"). INVALID_ARGUMENT naming `what` when matching takes longer
    than `timeout_s` (default TIMEOUT_S)."""
    timeout_s = TIMEOUT_S if timeout_s is None else timeout_s
    full = [rf"(.*\.)?({p})" if as_suffix else p for p in patterns]
    if not any(_RISKY.search(p) for p in patterns):
        return [[re.fullmatch(p, s) is not None for s in subjects] for p in full]
    try:
        child = subprocess.run(
            [sys.executable, "-I", "-S", "-c", _CHILD], input=json.dumps([full, subjects]),
            capture_output=True, text=True, timeout=timeout_s, check=True)
    except subprocess.TimeoutExpired:
        raise InvalidArgument(
            f"{what} {list(patterns)!r} took over {timeout_s:g} s to match {len(subjects)} module "
            "names (nested repetition backtracks for ever); simplify the regex") from None
    matched = [set(row) for row in json.loads(child.stdout)]
    return [[j in row for j in range(len(subjects))] for row in matched]
