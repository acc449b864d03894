# kvlab: `make run` sets up .venv (once) and runs the main job; `make test` sets up .venv (once) and runs the tests.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup run sweep test test-fast bench docs clean

setup: $(STAMP)

# Re-installs only when requirements.txt changes; safe to run again and again.
$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing requirements.txt into $(VENV) (log: $(VENV)/pip.log)"
	$(PY) -m pip install -r requirements.txt > $(VENV)/pip.log 2>&1 || { tail -n 40 $(VENV)/pip.log; exit 1; }
	$(PY) -c "import torch, transformers, hydra, wandb, pandas, seaborn"
	$(PY) -c "from harness.core.engines import prepare_quanto; prepare_quanto()"
	$(PY) -c "from models.kv_cache.kernels import main; main()"
	touch $(STAMP)

run: $(STAMP)
	$(PY) run.py $(ARGS)

sweep: $(STAMP)
	$(PY) run.py -m cache=concat,prealloc dtype=fp32,fp16 $(ARGS)

# two workers (pytest-xdist), each test file whole on one, so a file's fixtures are built once; WORKERS=0 runs serially
WORKERS ?= 2
XDIST   := $(if $(filter 0,$(WORKERS)),,-n $(WORKERS) --dist loadfile)

# the Slurm tests' cluster (scripts/slurm-up: a single node under SLURM_DIR; installing it needs root); without it
# those tests are skipped and say why, unless KVLAB_REQUIRE_SLURM=1 (CI), where they fail
SLURM_DIR ?= /tmp/kvlab-slurm

# the Slurm tests mostly wait on their jobs: they run in a pytest of their own beside the workers (their log is
# printed after the workers' summary), so the wait overlaps the other tests' work; WORKERS=0 (everything serially)
# or ARGS (a selection) runs one pytest
SLURM_TESTS := tests/experiment/test_slurm.py
test: $(STAMP)
	@conf=$$(scripts/slurm-up $(SLURM_DIR) 2> $(SLURM_DIR).log | sed -n 's/^SLURM_CONF=//p'); \
	if [ -n "$$conf" ]; then echo "make test: Slurm is up (SLURM_CONF=$$conf; scripts/slurm-down $(SLURM_DIR) stops it)"; \
	else echo "make test: Slurm did not come up ($$(tail -n 1 $(SLURM_DIR).log)); its tests will say so"; fi; \
	export SLURM_CONF=$${conf:-$$SLURM_CONF} HF_HUB_OFFLINE=1; \
	if [ "$(WORKERS)" = 0 ] || [ -n "$(strip $(ARGS))" ]; then exec $(PY) -m pytest $(XDIST) $(ARGS); fi; \
	$(PY) -m pytest -p no:cacheprovider $(SLURM_TESTS) $(ARGS) > $(SLURM_DIR).tests.log 2>&1 & slurm=$$!; \
	$(PY) -m pytest $(XDIST) --ignore=$(SLURM_TESTS) $(ARGS); rest=$$?; \
	wait $$slurm; s=$$?; echo "== the Slurm tests ($(SLURM_TESTS)), beside the others:"; cat $(SLURM_DIR).tests.log; \
	if [ $$rest -ne 0 ] && [ $$rest -ne 5 ]; then exit $$rest; fi; \
	if [ $$s -ne 0 ] && [ $$s -ne 5 ]; then exit $$s; fi; \
	[ $$rest -eq 0 ] || [ $$s -eq 0 ]

test-fast: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest $(XDIST) -m "not slow" $(ARGS)

# docs/results.md from the measurements' declarations (a test fails when it is stale)
docs: $(STAMP)
	$(PY) -m harness.measurements --doc docs/results.md

bench: $(STAMP)
	$(PY) -m harness.bench $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
