# kernel-ladder — the README's commands. `make lab` opens the course; `make test` runs every test.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# With no NVIDIA GPU, the CPU build of torch: from PyTorch's CPU wheel index where it answers, else from
# the default index (which may hold only a CUDA build: setup says which build it got, and its size).
TORCH_CPU ?= torch==2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_PIP_FLAGS ?=
# The notebooks' kernel: the name and display name their metadata carries (utils.notebooks.KERNEL_NAME).
KERNEL_NAME := kernel-ladder
KERNEL_DISPLAY := Python 3 (kernel-ladder)
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
STAMP := $(VENV)/.setup-done
LAB_STAMP := $(VENV)/.lab-done
PYTEST_FLAGS ?=

.PHONY: setup lab test test-fast report notebooks gpu-check lint format clean help

help:
	@echo "make lab        set up, then open the course in JupyterLab"
	@echo "make test       set up, then run every test (kernels, utils, solutions, notebooks)"
	@echo "make report     set up, then run every ladder step, the host-overhead table, chapter 13's C++ CPU ladder (timed and counted), the collectives (chapter 11), the training run (chapter 12) and the sm_90 instruction-level view into docs/results.md"
	@echo "make notebooks  run every chapter notebook in both modes, save the learner-mode outputs"
	@echo "make gpu-check  on a GPU machine, with its own python3: correctness at real sizes + timings"
	@echo "                (quick round by default; FULL=1: every timing and autotune candidate; BUDGET_S=seconds)"
	@echo "                (PROFILE=1: also a torch.profiler trace of a training step under \$$OUT/profile)"
	@echo "make lint       ruff"

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if ! $(PY) -c "import torch" >/dev/null 2>&1; then \
	  if [ -n "$(HAS_GPU)" ]; then echo "setup: NVIDIA GPU found: installing torch with CUDA"; $(PY) -m pip install -q torch; \
	  elif [ -z "$(TORCH_PIP_FLAGS)" ] && $(PY) -c "import urllib.request as u; u.urlopen('$(TORCH_CPU_INDEX)/torch/', timeout=5)" >/dev/null 2>&1; then \
	    echo "setup: no NVIDIA GPU: installing $(TORCH_CPU) from PyTorch's CPU wheel index"; \
	    $(PY) -m pip install -q --index-url "$(TORCH_CPU_INDEX)" "$(TORCH_CPU)"; \
	  else echo "setup: no NVIDIA GPU, PyTorch's CPU wheel index not reachable: installing $(TORCH_CPU) from the default index"; \
	    $(PY) -m pip install -q $(TORCH_PIP_FLAGS) "$(TORCH_CPU)"; fi; \
	  $(PY) -m utils.setup_report torch; \
	fi
	$(PY) -m pip install -q -e ".[dev]"
	@# The optional C++ extension (kernel_ladder.native), compiled once into its cache where a compiler is.
	@if command -v g++ >/dev/null 2>&1; then \
	  echo "setup: g++ found: building the optional C++ extension kernel_ladder.native (the Triton ops remain the default)"; \
	  $(PY) -m kernel_ladder.native build || echo "setup: kernel_ladder.native did not build (optional: the Triton ops need none of it)"; \
	else echo "setup: no g++: skipping the optional C++ extension kernel_ladder.native (the Triton ops remain the default)"; fi
	@# utils/, solutions/ and bench/ are the course's, not the wheel's: make them importable from any folder.
	@$(PY) -c "import pathlib, sysconfig; pathlib.Path(sysconfig.get_paths()['purelib'], 'kernel_ladder_course.pth').write_text(str(pathlib.Path.cwd()) + '\n')"
	@cd / && $(abspath $(PY)) -m utils.setup_report imports "$(CURDIR)"
	@$(PY) -m ipykernel install --sys-prefix --name $(KERNEL_NAME) --display-name "$(KERNEL_DISPLAY)" >/dev/null
	@touch $(STAMP)
	@echo "setup: done ($$($(PY) -c 'import kernel_ladder.runtime as r; print(r.describe())'))"

$(LAB_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[dev,lab]"
	@touch $(LAB_STAMP)

# The lessons count traffic with the tracer, which sees Triton launches in the interpreter only: on a
# GPU machine the course still opens in interpreter mode unless LAB_INTERPRET=0 (compiled, timed).
LAB_INTERPRET ?= 1
# Jupyter refuses to run as root (containers, CI boxes) unless told; extra flags go in LAB_FLAGS.
LAB_FLAGS ?= $(if $(filter 0,$(shell id -u)),--allow-root,)
# Lab serves the whole repository (the lessons send the learner to solutions/, kernels/ and docs/)
# and opens on the first chapter.
LAB_START ?= $(firstword $(sort $(wildcard chapters/*/*.ipynb)))
lab: $(LAB_STAMP)
	KERNEL_LADDER_INTERPRET=$(LAB_INTERPRET) $(VENV)/bin/jupyter lab --ServerApp.root_dir="$(CURDIR)" \
	  --LabApp.default_url="/lab/tree/$(LAB_START)" $(LAB_FLAGS)

# Every test (compiled on a GPU machine) in two processes (pytest-xdist), and every chapter notebook
# twice: nbval runs it in learner mode against its committed outputs (utils/nbval_plugin.py: the learner's
# environment, rounding residues; all cells of a notebook on one worker, hence --dist loadfile), and
# tests/test_notebooks.py runs it in solution mode (every check solved, everything else as committed).
# TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest tests chapters --nbval -p utils.nbval_plugin -n $(TEST_WORKERS) --dist loadfile --timeout=900 -p no:cacheprovider $(PYTEST_FLAGS)

test-fast: setup
	$(PY) -m pytest tests -x -q -m "not slow" $(PYTEST_FLAGS)

report: setup
	$(PY) -m bench
	$(PY) -m bench.overhead
	$(PY) -m bench.ch13_below_triton
	$(PY) -m bench.ch11_distributed
	$(PY) -m bench.ch12_train
	$(PY) -m utils.isa_report

# Each notebook in solution mode (every check solved), then in learner mode (none solved, everything else
# the same); the learner-mode run is saved: what a learner sees on first open.
notebooks: setup
	$(PY) -m utils.notebooks execute chapters

# Runs with the GPU machine's own python3 (no venv, nothing installed): the repository on PYTHONPATH.
# The quick round by default: every op checked at real sizes, the headline timings, each autotuned kernel tuned
# over its first candidate only, no new entry started after BUDGET_S seconds (default 450). FULL=1: every timing
# (torch.compile included) over every candidate, no budget unless BUDGET_S is set.
# PROFILE=1 adds a torch.profiler trace of a training step under $$OUT/profile (bench.profile_step).
PROFILE ?= 0
FULL ?= 0
BUDGET_S ?=
gpu-check:
	PYTHONPATH=$(CURDIR) python3 -m bench.gpu_check $(if $(filter 1,$(FULL)),,--quick) \
	  $(if $(BUDGET_S),--budget-s $(BUDGET_S),) $(if $(filter 1,$(PROFILE)),--profile,)

lint: setup
	$(VENV)/bin/ruff check .

format: setup
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
