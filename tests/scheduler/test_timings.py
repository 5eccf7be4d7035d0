"""Fitting the simulator's cost model (scheduler/sim/cost_fit.py) to measured step and load times
(written by scheduler/timings.py)."""

import json
import random
import tomllib

import pytest

from loraplex import cli
from scheduler.sim.config import SimConfig
from scheduler.sim.cost_fit import fit_cost
from scheduler.timings import TimingLog


def synthetic(tmp_path, rng: random.Random, base=0.011, per_token=4e-5, per_adapter=3e-4,
              latency=0.002, bandwidth=5e9, noise=0.0005):
    log = TimingLog(str(tmp_path / "t.jsonl"))
    for _ in range(400):
        tokens, adapters = rng.randint(1, 2048), rng.randint(0, 64)
        log.step("ex0", tokens, adapters, base + per_token * tokens + per_adapter * adapters
                 + rng.gauss(0, noise))
    for _ in range(60):
        size = rng.choice([40, 80, 160]) << 20
        log.load("ex0", size, latency + size / bandwidth + rng.gauss(0, noise / 5))
    log.close()
    return tmp_path / "t.jsonl"


def test_fit_recovers_the_model_behind_noisy_timings(tmp_path):
    path = synthetic(tmp_path, random.Random(0))
    fit = fit_cost(path.read_text().splitlines())
    c = fit.cost
    assert (fit.num_steps, fit.num_loads) == (400, 60)
    assert c.step_base_s == pytest.approx(0.011, rel=0.05)
    assert c.step_per_token_s == pytest.approx(4e-5, rel=0.02)
    assert c.step_per_adapter_s == pytest.approx(3e-4, rel=0.05)
    assert c.load_latency_s == pytest.approx(0.002, abs=3e-4)
    assert c.load_bytes_per_s == pytest.approx(5e9, rel=0.02)
    assert fit.step_r2 > 0.99 and fit.load_r2 > 0.99


def test_terms_the_data_cannot_support_are_dropped_not_negative():
    # One adapter per step throughout (no spread), and a step time that falls with adapters would
    # need a negative coefficient: neither may appear.
    lines = [json.dumps({"step": "e", "tokens": t, "adapters": 1, "seconds": 0.01 + 1e-5 * t})
             for t in range(1, 50)]
    lines += [json.dumps({"load": "e", "bytes": 1 << 20, "seconds": 0.004})] * 3
    c = fit_cost(lines).cost
    assert c.step_per_adapter_s == 0.0
    assert c.step_base_s == pytest.approx(0.01) and c.step_per_token_s == pytest.approx(1e-5)
    assert c.load_latency_s == 0.0 and c.load_bytes_per_s == pytest.approx((1 << 20) / 0.004)
    falling = [json.dumps({"step": "e", "tokens": 10, "adapters": a, "seconds": 0.02 - 1e-4 * a})
               for a in range(1, 20)]
    c = fit_cost(falling).cost
    assert c.step_per_adapter_s == 0.0 and c.step_base_s > 0


def test_bad_lines_name_their_number():
    with pytest.raises(ValueError, match="line 2"):
        fit_cost(['{"step": "e", "tokens": 1, "adapters": 0, "seconds": 0.1}', '{"step": "e"}'])


def test_cli_prints_a_cost_section_the_simulator_reads(tmp_path, capsys):
    path = synthetic(tmp_path, random.Random(1))
    cli.main(["fit-cost", str(path)])
    out = capsys.readouterr().out
    assert "[cost]" in out and "step_per_token_s = 4" in out
    config = SimConfig.from_dict(tomllib.loads(out))
    assert config.cost.load_bytes_per_s == pytest.approx(5e9, rel=0.02)
