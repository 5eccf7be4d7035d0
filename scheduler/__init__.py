"""The scheduler service: per-tenant queues, fair admission, adapter residency and routing across
a pool's executors (core.py over its managers: placement.py, admission.py, merging.py, and the
residency/ and steps/ wings), driven by engine.py and served by service.py; the offline simulator
and its tools live in scheduler/sim/."""
