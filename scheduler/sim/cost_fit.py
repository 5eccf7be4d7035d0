"""Fitting the simulator's cost model to a real pool's measured step and load times.

    loraplex serve scheduler ... --timings-out timings.jsonl   (scheduler/timings.py writes it)
    loraplex fit-cost timings.jsonl                             (prints a [cost] section)

The fit is ordinary least squares of the simulator's model (sim/config.py, Cost):

    step seconds = step_base_s + step_per_token_s * T + step_per_adapter_s * D
    load seconds = load_latency_s + B / load_bytes_per_s

A term the data cannot separate (e.g. every step with one adapter) or that comes out negative is
dropped and the rest refit, so every coefficient is >= 0. Loads of a single size cannot separate
latency from bandwidth: all of it is put on bandwidth (load time then scales with size).
"""

import json
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from scheduler.sim.config import Cost


@dataclass(frozen=True)
class Fit:
    cost: Cost
    num_steps: int
    num_loads: int
    step_r2: float  # share of step-time variance the model explains (nan: too few steps)
    load_r2: float


def fit_cost(lines: Iterable[str]) -> Fit:
    """Fit the cost model to timing lines (scheduler/timings.py); fields without data keep
    Cost's defaults."""
    steps, loads = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            if "step" in r:
                steps.append((float(r["tokens"]), float(r["adapters"]), float(r["seconds"])))
            elif "load" in r:
                loads.append((float(r["bytes"]), float(r["seconds"])))
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"timing line {number} is not a step or load record: "
                             f"{err}") from None
    default = Cost()
    step_coef, step_r2 = _nonnegative_lstsq(steps, (default.step_base_s, default.step_per_token_s,
                                                    default.step_per_adapter_s))
    if len({num_bytes for num_bytes, _ in loads}) == 1:
        total_seconds, total_bytes = sum(s for _, s in loads), sum(b for b, _ in loads)
        load_coef, load_r2 = [0.0, total_seconds / total_bytes], float("nan")
    else:
        load_coef, load_r2 = _nonnegative_lstsq(loads, (default.load_latency_s,
                                                        1 / default.load_bytes_per_s))
    per_byte = load_coef[1]
    cost = Cost(step_base_s=step_coef[0], step_per_token_s=step_coef[1],
                step_per_adapter_s=step_coef[2], load_latency_s=load_coef[0],
                load_bytes_per_s=1 / per_byte if per_byte > 0 else float("inf"))
    return Fit(cost, len(steps), len(loads), step_r2, load_r2)


def _nonnegative_lstsq(rows: list[tuple[float, ...]],
                       default: tuple[float, ...]) -> tuple[list[float], float]:
    """Least squares of the last column on an intercept and the other columns, every coefficient
    >= 0 and terms without spread in the data dropped; `default` when there are no rows."""
    if not rows:
        return list(default), float("nan")
    data = np.asarray(rows, dtype=np.float64)
    y = data[:, -1]
    x = np.column_stack([np.ones(len(data)), data[:, :-1]])
    active = [0] + [j for j in range(1, x.shape[1]) if np.ptp(x[:, j]) > 0]
    while True:
        coef = np.zeros(x.shape[1])
        coef[active] = np.linalg.lstsq(x[:, active], y, rcond=None)[0]
        negative = [j for j in active if coef[j] < 0]
        if not negative:
            break
        active.remove(min(negative, key=lambda j: coef[j]))
        if not active:
            coef[:] = 0.0
            break
    residual = y - x @ coef
    spread = float(np.sum((y - y.mean()) ** 2))
    is_fitted = spread > 0 and len(y) > x.shape[1]
    r2 = 1 - float(residual @ residual) / spread if is_fitted else float("nan")
    return coef.tolist(), r2


def format_fit(fit: Fit, sources: list[str]) -> str:
    c = fit.cost
    return "\n".join([
        (f"# fitted from {fit.num_steps:,} steps (R^2 {fit.step_r2:.3f}) and "
         f"{fit.num_loads:,} loads (R^2 {fit.load_r2:.3f}) in {', '.join(sources)}"),
        "[cost]",
        f"step_base_s = {c.step_base_s:.6g}",
        f"step_per_token_s = {c.step_per_token_s:.6g}",
        f"step_per_adapter_s = {c.step_per_adapter_s:.6g}",
        f"load_latency_s = {c.load_latency_s:.6g}",
        f"load_bytes_per_s = {c.load_bytes_per_s:.6g}",
    ])
