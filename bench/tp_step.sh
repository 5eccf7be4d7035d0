#!/usr/bin/env bash
# Executor step timing through the tensor-parallel path (issue 34), one command from the
# repository root on a GPU machine:
#     bench/tp_step.sh                  (writes bench/results/tp-step.md)
# 1 rank on a one-GPU machine, and 2, 4, 8 ranks where the machine has the GPUs (one process
# each, NCCL); rank counts beyond the GPUs are listed as not measured. Needs CUDA and torch only
# (no installs); a few minutes, hard-capped at 9m50s. Extra arguments go to bench/tp_step.py
# (e.g. --ranks 1,2); on a CPU machine `PYTHON=.venv/bin/python bench/tp_step.sh --smoke --ranks
# 1,2 --out /tmp/tp.md` checks the script (gloo ranks, the tiny model).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"  # the GPU image: system python with torch + triton
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
timeout -k 10 590 "$PY" -u bench/tp_step.py "$@"
rc=$?
[ $rc -eq 124 ] && echo "tp_step: stopped at the 590 s cap; nothing was written for the ranks it was on"
exit $rc
