# kvlab: `make run` sets up .venv (once) and runs the main job; `make test` sets up .venv (once) and runs the tests.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup run sweep test test-fast bench docs clean llamacpp

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

# llama.cpp, the peer engine (engine=llamacpp): llama-cpp-python built from source with this machine's compiler
# (CPU only, -march=native; about 4 minutes on 2 cores, docs/testing.md), once; `make test` builds it first,
# `make run` does not need it
LLAMACPP := $(VENV)/.llamacpp

llamacpp: $(LLAMACPP)

$(LLAMACPP): requirements-llamacpp.txt $(STAMP)
	@echo "building llama-cpp-python from source (once; log: $(VENV)/llamacpp.log)"
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_BLAS=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
		$(PY) -m pip install -r requirements-llamacpp.txt > $(VENV)/llamacpp.log 2>&1 || { tail -n 40 $(VENV)/llamacpp.log; exit 1; }
	$(PY) -c "from harness.core.llamacpp import available; assert available()"
	touch $(LLAMACPP)

run: $(STAMP)
	$(PY) run.py $(ARGS)

sweep: $(STAMP)
	$(PY) run.py -m cache=concat,prealloc dtype=fp32,fp16 $(ARGS)

# two workers (pytest-xdist), each test file whole on one, so a file's fixtures are built once; WORKERS=0 runs serially
WORKERS ?= 2
XDIST   := $(if $(filter 0,$(WORKERS)),,-n $(WORKERS) --dist loadfile)
# every worker imports every test file, and pytest rewrites each one's asserts: about 10 s of a worker's start when
# nothing is compiled. Where the environment says not to write bytecode (PYTHONDONTWRITEBYTECODE), the tests write it
# anyway (into __pycache__ beside the sources, which .gitignore leaves out), so the next run, and every run.py a test
# starts, reads it back (docs/testing.md)
PYCACHE := env PYTHONDONTWRITEBYTECODE=

# the Slurm tests' cluster (scripts/slurm-up: a single node under SLURM_DIR; installing it needs root); without it
# those tests are skipped and say why, unless KVLAB_REQUIRE_SLURM=1 (CI), where they fail
SLURM_DIR ?= /tmp/kvlab-slurm

test: $(STAMP) $(LLAMACPP)
	@conf=$$(scripts/slurm-up $(SLURM_DIR) 2> $(SLURM_DIR).log | sed -n 's/^SLURM_CONF=//p'); \
	if [ -n "$$conf" ]; then echo "make test: Slurm is up (SLURM_CONF=$$conf; scripts/slurm-down $(SLURM_DIR) stops it)"; \
	else echo "make test: Slurm did not come up ($$(tail -n 1 $(SLURM_DIR).log)); its tests will say so"; fi; \
	SLURM_CONF=$${conf:-$$SLURM_CONF} HF_HUB_OFFLINE=1 $(PYCACHE) $(PY) -m pytest $(XDIST) $(ARGS)

test-fast: $(STAMP) $(LLAMACPP)
	HF_HUB_OFFLINE=1 $(PYCACHE) $(PY) -m pytest $(XDIST) -m "not slow" $(ARGS)

# docs/results.md from the measurements' declarations (a test fails when it is stale)
docs: $(STAMP)
	$(PY) -m harness.measurements --doc docs/results.md

bench: $(STAMP)
	$(PY) -m harness.bench $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
