"""PEFT module patterns (a target_modules regex, rank_pattern keys) matched with a time bound.

The patterns are the pusher's regexes. One with nested or ambiguous repetition ("(.*.*)*x",
"(a|a)*b") backtracks for longer than anyone waits even against a 30-character module name, and
Python's re holds the GIL meanwhile, which would freeze the whole store. A pattern without
repetition, groups or alternation matches in linear time and is matched here; the others are
matched in a child process that times its own matching: over MATCH_BUDGET_S is refused (every
executor matches the same patterns at every load of the adapter, in its step process), and a
child still running after `timeout_s` (its start included) is killed.
"""

import json
import re
import subprocess
import sys
from collections.abc import Sequence

from common.errors import InvalidArgument

TIMEOUT_S = 5.0  # a child matching a sane pattern is done in ~20 ms, its start included
MATCH_BUDGET_S = 0.1  # the matching itself: a sane pattern takes microseconds
_RISKY = re.compile(r"[*+?{}()|]")
# Reads [patterns, subjects] from stdin; writes, per pattern, the indexes of the subjects it
# matches in full.
_CHILD = """
import json, re, sys, time
patterns, subjects = json.load(sys.stdin)
start = time.perf_counter()
matched = [[j for j, s in enumerate(subjects) if re.fullmatch(p, s)] for p in patterns]
json.dump({"matched": matched, "seconds": time.perf_counter() - start}, sys.stdout)
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
    for pattern, wrapped in zip(patterns, full):  # wrapped, "(?i)v_proj" no longer compiles
        if wrapped != pattern:
            compile_pattern(wrapped, f"{what} {pattern!r}, matched as")
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
    except subprocess.CalledProcessError as err:
        last = (err.stderr or "").strip().splitlines()[-1:] or [f"exit status {err.returncode}"]
        raise InvalidArgument(
            f"{what} {list(patterns)!r} could not be matched: {last[0]}") from None
    result = json.loads(child.stdout)
    if result["seconds"] > MATCH_BUDGET_S:
        raise InvalidArgument(
            f"{what} {list(patterns)!r} took {result['seconds']:.2f} s to match {len(subjects)} "
            f"module names (over {MATCH_BUDGET_S:g} s; executors match them at every load); "
            "simplify the regex")
    matched = [set(row) for row in result["matched"]]
    return [[j in row for j in range(len(subjects))] for row in matched]
