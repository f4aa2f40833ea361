# kvstrata: the two commands a newcomer runs are `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
CORE := $(VENV)/.core-stamp
VLLM := $(VENV)/.vllm-stamp
OUT ?= out
# The repository root is the package `kvstrata`; type checkers and editors read it through this
# link (a directory in which `kvstrata` names the root), see [tool.mypy] / [tool.pyright].
TYPECHECK := .typecheck/kvstrata

.PHONY: venv venv-vllm demo test lint fmt bench gpu-wheels clean

# Mooncake's client needs Debian's RDMA/NUMA libraries even for TCP (installed when we are root).
SYSLIBS := libibverbs1 librdmacm1 libnuma1

$(CORE): pyproject.toml requirements-dev.txt core/_native.c  # the C source: pip install -e . rebuilds kvstrata._native
	@if ! ldconfig -p | grep -q 'libibverbs.so.1 '; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get install -y -q $(SYSLIBS) >/dev/null 2>&1 || \
	    (apt-get update -q >/dev/null && apt-get install -y -q $(SYSLIBS) >/dev/null); \
	  else echo "note: install $(SYSLIBS) for the mooncake tier (its tests skip without them)"; fi; \
	fi
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(CORE)

# vLLM (CPU build) for the end-to-end connector tests: a few GB, so only `make test` pulls it in.
# `kvstrata experiment serve` puts HAProxy in front of its `vllm serve` fleet (nginx: the alternative).
LBS := haproxy nginx

$(VLLM): $(CORE) requirements-vllm.txt
	@if ! command -v haproxy >/dev/null && [ ! -x /usr/sbin/haproxy ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get install -y -q $(LBS) >/dev/null 2>&1 || \
	    (apt-get update -q >/dev/null && apt-get install -y -q $(LBS) >/dev/null); \
	  else echo "note: install $(LBS) for kvstrata experiment serve (its test skips without haproxy)"; fi; \
	fi
	$(PY) -m pip install --quiet -r requirements-vllm.txt
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(VLLM)

$(TYPECHECK):
	mkdir -p $(dir $(TYPECHECK))
	ln -sfn .. $(TYPECHECK)

venv: $(CORE) $(TYPECHECK)
venv-vllm: $(VLLM) $(TYPECHECK)

## Synthesize a scaled-down agentic trace and replay it: kvstrata vs a small GPU-only prefix cache.
demo: venv
	$(VENV)/bin/kvstrata demo --json $(OUT)/demo.json

## Lint, type-check and run the whole test suite (slow end-to-end tests on real vLLM included).
test: venv-vllm lint
	$(VENV)/bin/pytest -q

## mypy checks the package (as kvstrata.*, through $(TYPECHECK)), tests/ and benchmarks/.
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

fmt: venv
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

## Benchmarks: ratios against baselines measured in the same run.
bench: venv
	$(VENV)/bin/kvstrata bench --json $(OUT)/bench.json
	$(VENV)/bin/pytest -q benchmarks --benchmark-only

## Wheels the GPU machine lacks (no registry there; CUDA torch, numpy, xxhash, click, rich, fsspec are
## already there), for cp312 x86_64, into .whl/ (carried by the device tool; tests/gpu/run.sh installs them).
GPU_WHEELS ?= lmdb blake3 pydantic pydantic-core annotated-types typing-inspection kvikio-cu13 libkvikio-cu13
GPU_PLATFORMS := $(foreach n,28 27 24 17,--platform manylinux_2_$(n)_x86_64) --platform manylinux2014_x86_64
gpu-wheels:
	mkdir -p .whl
	python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  $(GPU_PLATFORMS) -d .whl $(GPU_WHEELS)

clean:
	rm -rf $(VENV) $(OUT) .pytest_cache .mypy_cache .ruff_cache .typecheck build dist
