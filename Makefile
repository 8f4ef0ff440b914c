# Plain entry points. `make test` is what CI runs (.ci/run).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install system-deps test check cpu-seconds docs test-gpu gpu-deps test-cluster demo bench clean mutants

install: $(STAMP)

# Recreated when the dependency list changes. The constraints file pins torch/torchvision
# to the builds on the project machines' local disk, so this installs without downloads. That
# torch is the CUDA build (16 nvidia-* packages): said before it starts, with the way to a CPU
# build (README.md, Install); a torch already in the venv that meets the pin (torch 2.14.1+cpu put
# there first) is left in place by pip (not tried here, where the CUDA build is local).
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c 'import torch; print(f"make install: $(VENV) has torch {torch.__version__}, kept if it meets constraints.txt (torch==2.14.1)")' 2>/dev/null || \
		echo "make install: torch 2.14.1 as constraints.txt pins it, the CUDA build with 16 nvidia-* packages: $(VENV) grows to about 6 GB (6.0 GB, du -sh, 2026-11-26). CPU only: README.md, Install, puts the much smaller CPU build in first."
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev]"
	touch $(STAMP)

# The Debian packages the tests use (Slurm + munge, openssh + pdsh, iproute2): installed when
# missing and root, else named (.ci/system-deps.sh, the one list); what it found is written to
# $(VENV)/.system-deps, which the tests read (tests/system.py): a test skips a tool only where
# it could not be installed, and fails where it was reported installed but is missing.
system-deps: $(STAMP)
	.ci/system-deps.sh $(VENV)/.system-deps

# The docs build first (strict: a broken link, page or docstring reference fails), then the
# tests, the docstring examples and every code block of README.md and docs/ (Sybil, conftest.py;
# the shell commands through tests/test_docs.py).
# TEST_WORKERS pytest processes (pytest-xdist), each test file whole on one of them
# (--dist loadfile: a file's module fixtures -- the shared demo run, the simulated cluster --
# are built once and never run twice at the same time). Most tests wait on their own
# processes (ranks, launchers, timeouts) and use about one core; two workers fill two.
# TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
test: docs system-deps
	$(PY) -c "from distnorm import _cpu_kernels; _cpu_kernels.library()"  # the CPU kernels, built once before the tests, not by several of their processes side by side
	$(PY) -m pytest -q -m "not cluster" $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile) \
		--doctest-modules --ignore=distnorm/train/__main__.py tests distnorm README.md docs $(PYTEST_ARGS)

# The quick tier for the inner loop: the docs build, then every test that stays in the pytest
# process (the maths against the float64 references, conversion, configuration, kernel
# contracts, op counts, docstring and page examples). A test that starts a process -- ranks,
# launchers, CLI runs, DataLoader workers, benchmark scripts -- is marked `processes` or
# `world_size(n)` and left to `make test`; under DISTNORM_TEST_TIER=check one that starts a
# process without the marker fails, naming it (conftest.py). The CPU kernels (a C compiler
# run, once per machine) are built before. Not what CI runs.
check: docs
	$(PY) -c "from distnorm import _cpu_kernels; _cpu_kernels.library()"  # built here: the tier refuses a compiler process
	DISTNORM_TEST_TIER=check $(PY) -m pytest -q -m "not processes and not world_size and not cluster" \
		$(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile) \
		--doctest-modules --ignore=distnorm/train/__main__.py tests distnorm README.md docs $(PYTEST_ARGS)

# CPU seconds (user + system) of `make test` and of every process it starts, counted in a
# cgroup (tests/cpu_seconds.py): they travel between machines and loads better than wall time.
cpu-seconds: $(STAMP) system-deps
	$(PY) tests/cpu_seconds.py --json cpu-seconds.json -- $(MAKE) --no-print-directory test

# The documentation site (MkDocs + Material, API reference from the docstrings) into site/.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet --site-dir site

# Mutation check, not part of `make test` (tests/mutants.py): deliberate one-line bugs, each
# against a README claim, applied one at a time to a temporary copy of the tree; each must make
# its one or two tests fail. MUTANTS_ARGS: e.g. --list, --only ID..., --no-baseline.
mutants: $(STAMP)
	$(PY) tests/mutants.py $(MUTANTS_ARGS)

# Multi-host runs on simulated hosts (network namespaces; needs root): every launch path
# across two hosts, faults across hosts, and what the network costs (tc netem).
test-cluster: $(STAMP) system-deps
	$(PY) -m pytest -q -s -m cluster tests/test_cluster.py $(PYTEST_ARGS)
	$(PY) bench/network.py --json bench/results/network-cpu.json --plot docs/network.png

# On a machine with CUDA, in the time one is lent (bench/gpu_report.py): the CUDA tests only
# (pytest -m cuda; the NCCL ones need 2 GPUs), then the one-GPU step benchmark, eager before
# compiled, ResNet-50 first: ResNet-50, ResNet-18 and EfficientNet-B0 eager; ResNet-50 compiled
# and reduce-overhead (CUDA graphs), local BN, CBN, SyncBatchNorm, POP-Norm in that order; then
# ResNet-18 and EfficientNet-B0 compiled and reduce-overhead (local BN, CBN); each ratio against
# local BN in the same mode, next to its goal, with graph breaks, recompiles and CUDA-graph
# skips. Then, with time left, the host cost, profile, layer and decode benchmarks. A hard budget
# of 470 s, about 8 minutes in all on one H100 / H200: each part stopped at its limit, the step
# parts stop building before it, and what did not fit is listed (the default reaches ResNet-50's
# local BN and CBN compiled; docs/reference/gpu.md says how to run the rest in a second call);
# GPU_REPORT_ARGS=--quick: under 4 (no compile, ResNet-50 only). One report,
# <out>/gpu-<date>.{json,md}, rewritten before and after every part (a killed run keeps what
# finished), with each part's log; <out> is $OUT when set (what a lent machine sends back), else
# bench/results. Skips (does not fake) what the machine lacks, and says why.
# `make test-gpu PY=python3` runs with that interpreter as it is and installs nothing (a bare
# GPU machine without network, Sybil or pytest plugins); without PY=, the venv as for `make test`.
# GPU_REPORT_ARGS: more options of bench/gpu_report.py, e.g. --quick, --only tests step_eager,
# --part-timeout step_compile=300, --budget-s 540, --out DIR.
GPU_PREREQ := $(if $(filter command line,$(origin PY)),,$(STAMP))
test-gpu: $(GPU_PREREQ)
	$(PY) bench/gpu_report.py $(if $(PYTEST_ARGS),--pytest-args='$(PYTEST_ARGS)') $(GPU_REPORT_ARGS)

# The pure-Python packages bench/loader_step.py needs that a lent GPU machine lacks (WebDataset
# and its braceexpand), copied from the venv into .gpu-deps/ (git-ignored): the device call
# carries that folder, and bench/gpu_report.py puts it on PYTHONPATH.
gpu-deps: $(STAMP)
	rm -rf .gpu-deps && mkdir -p .gpu-deps
	$(PY) -c 'import pathlib, shutil, webdataset, braceexpand; [shutil.copytree(pathlib.Path(m.__file__).parent, ".gpu-deps/" + m.__name__) if m.__file__.endswith("__init__.py") else shutil.copy(m.__file__, ".gpu-deps/") for m in (webdataset, braceexpand)]'

# The quick start: digits shards, a 2-process CPU run of configs/demo/digits.yaml through
# launch/torchrun.sh, then plots, then its final top-1 checked against a floor that holds on
# every machine tried (97.50-99.17 % so far; the figure moves with rounding, not the floor).
DEMO_DIR ?= runs/demo
DEMO_MIN_TOP1 ?= 95
demo: $(STAMP)
	$(PY) -m distnorm.data.shards digits data/digits-train --split train --maxcount 256 --quiet
	$(PY) -m distnorm.data.shards digits data/digits-val --split val --maxcount 128 --quiet
	rm -rf $(DEMO_DIR)
	NPROC=2 PYTHON=$(PY) OMP_NUM_THREADS=1 launch/torchrun.sh configs/demo/digits.yaml output.dir=$(DEMO_DIR) output.progress=false
	$(PY) -m distnorm.report $(DEMO_DIR) --out $(DEMO_DIR)/report
	@echo "metrics: $(DEMO_DIR)/metrics.jsonl  plots: $(DEMO_DIR)/report/  checkpoint: $(DEMO_DIR)/checkpoints/"
	@$(PY) -c 'import json, sys; top1 = [r for r in map(json.loads, open("$(DEMO_DIR)/metrics.jsonl")) if r["kind"] == "eval"][-1]["top1"]; \
		print(f"make demo: final top-1 {top1:.2f} % on the 360 validation digits (above $(DEMO_MIN_TOP1) %: checked)" if top1 > $(DEMO_MIN_TOP1) else f"make demo: final top-1 {top1:.2f} %, not above $(DEMO_MIN_TOP1) %: the demo did not learn what it should"); \
		sys.exit(top1 <= $(DEMO_MIN_TOP1))'

bench: $(STAMP)
	$(PY) bench/layers.py --json bench/results/layers.json

clean:
	rm -rf $(VENV) .pytest_cache build site *.egg-info
