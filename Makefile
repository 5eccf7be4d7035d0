# The two commands a newcomer needs: `make demo` (the main job) and `make test`.
# Each creates .venv on first use and installs everything from this repository's own files.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test protos bench clean

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

clean:
	rm -rf $(VENV) .fixtures
