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

demo: $(STAMP)
	$(VENV)/bin/loraplex demo

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

protos: $(STAMP)
	$(PY) -m protos.generate

bench: $(STAMP)
	$(PY) bench/serving.py

clean:
	rm -rf $(VENV) .fixtures
