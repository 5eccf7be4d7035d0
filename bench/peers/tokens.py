"""Greedy tokens compared across engines for bench/peers/run.py.

A row's results: {engine: [(seconds, tokens per request, ...), ...] one per round}.
Every round of an engine should give the same tokens (greedy); across engines, request by
request, all 32 of them.
"""

from __future__ import annotations

import itertools

import serving


def all_equal(per_engine: dict[str, list], names: list[str]) -> bool:
    """Whether every round of every engine gave the same tokens for every request."""
    outputs = [r[1] for name in names for r in per_engine[name]]
    return all(tokens == outputs[0] for tokens in outputs)


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    """The 1-based position of the first new token where two outputs part; None if equal."""
    for position, (a, b) in enumerate(itertools.zip_longest(ours, theirs), start=1):
        if a != b:
            return position
    return None


def pair_cell(ours: list[list[int]], theirs: list[list[int]]) -> str:
    """'64/64', or '61/64; the others part at tokens 9, 17, 30'."""
    parts = [first_difference(a, b) for a, b in zip(ours, theirs)]
    cell = f"{parts.count(None)}/{len(parts)}"
    differ = sorted(p for p in parts if p is not None)
    if differ:
        cell += "; the others part at token" + ("s " if len(differ) > 1 else " ")
        cell += ", ".join(map(str, differ))
    return cell


def pairs_table(results: dict, counts: list[int], names: list[str]) -> list[str]:
    """Per row and pair of engines, the requests whose tokens are all equal (median rounds);
    a last column names any engine whose rounds did not all give the same tokens."""
    pairs = list(itertools.combinations(names, 2))
    lines = ["| distinct adapters | " + " | ".join(f"{a} = {b}" for a, b in pairs)
             + " | engines whose rounds differ |", "|---:" + "|:---" * (len(pairs) + 1) + "|"]
    for n in counts:
        tokens = {name: serving.median_round(results[n][name])[1] for name in names}
        unsteady = [name for name in names if not all_equal(results[n], [name])]
        lines.append(f"| {n or 'none (base)'} | " + " | ".join(
            pair_cell(tokens[a], tokens[b]) for a, b in pairs)
            + f" | {', '.join(unsteady) or 'none'} |")
    return lines
