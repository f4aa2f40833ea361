# kvstrata: the two commands a newcomer runs are `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
OUT ?= out

.PHONY: venv demo test lint fmt bench clean

$(STAMP): pyproject.toml requirements-dev.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

## Synthesize a scaled-down agentic trace and replay it: kvstrata vs a small GPU-only prefix cache.
demo: venv
	$(VENV)/bin/kvstrata demo --json $(OUT)/demo.json

## Lint, type-check and run the whole test suite (slow end-to-end tests included).
test: venv lint
	$(VENV)/bin/pytest -q

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy .

fmt: venv
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

## Benchmarks: ratios against baselines measured in the same run.
bench: venv
	$(VENV)/bin/kvstrata bench --json $(OUT)/bench.json
	$(VENV)/bin/pytest -q benchmarks --benchmark-only

clean:
	rm -rf $(VENV) $(OUT) .pytest_cache .mypy_cache .ruff_cache
