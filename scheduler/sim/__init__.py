"""The offline simulator and its tools, never imported by serving code:

    simulator.py   discrete-event simulator driving the real scheduler core (`loraplex simulate`)
    config.py      its TOML configuration (SimConfig) and cost model (Cost)
    cost_fit.py    fits the cost model to a scheduler's --timings-out (`loraplex fit-cost`)
    belady.py      offline yardsticks for eviction (Belady, pinned Belady, LRU)
    invariants.py  the core's bookkeeping rules, checked by tests and the simulator's tests
"""
