# The three commands: `make demo`, `make test` and `make lab`. Each creates .venv when it is missing.
# For the edit-test loop: `make check` (lint, types and the tests that need no server or
# cluster: a few minutes), `make lint`, `make docs`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  ?= $(VENV)/.installed
EXTRAS := mpi,torch,tensorflow,notebook,dashboard,hpo,hep,postgresql,test,lint,docs
# What `make check` leaves to `make test`: the tests that start MPI jobs or engines, a
# SLURM, a PostgreSQL server or a browser, and the slow ones (markers in pyproject.toml).
FAST   := not mpi and not slurm and not postgres and not browser and not slow
# Warnings are errors; -n (nitpicky) would also flag every type in a signature that
# autodoc cannot link, which the API reference does not aim for.
SPHINX := $(BIN)/sphinx-build -W --keep-going -q -b html

.PHONY: demo test check lint docs lab install clean bench device-wheels bytecode

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml requirements/cpu.txt
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements/cpu.txt
	$(BIN)/python -m pip install --quiet -c requirements/cpu.txt -e ".[$(EXTRAS)]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m nbdist.demo

# The README's and CI's test command. The fast tests run on every core (pytest-xdist): each
# is one process's work. The others run one at a time: each starts MPI jobs, engines or
# servers, and several at once would slow each other past their deadlines; yet much of
# their time a core is idle, waiting on those. Three things that have no tight deadlines
# run beside them and print when all are done; the command fails if any failed: lint,
# types and the docs site at idle priority (SCHED_IDLE: only on a core nothing else wants;
# nice 19 where that is refused), and the GPU check's CPU dry run (BESIDE_TESTS: its own
# virtual environment and runs, each step with a deadline many times its length) at nice 10,
# which leaves it a share of a busy machine rather than none.
IDLE := $(shell chrt --idle 0 true >/dev/null 2>&1 && echo "chrt --idle 0" || echo "nice -n 19")
BESIDE_TESTS := tests/test_device_check.py
test: bytecode
	$(BIN)/python -m pytest -q -n auto -m "$(FAST)"
	@checks=$$(mktemp); beside=$$(mktemp); \
	$(IDLE) $(MAKE) --no-print-directory -j2 --output-sync=target lint docs >$$checks 2>&1 & lint_pid=$$!; \
	nice -n 10 $(BIN)/python -m pytest -q -p no:cacheprovider $(BESIDE_TESTS) >$$beside 2>&1 & beside_pid=$$!; \
	$(BIN)/python -m pytest -q -m "not ($(FAST))" $(addprefix --ignore=,$(BESIDE_TESTS)); tests=$$?; \
	wait $$beside_pid; beside_tests=$$?; echo "== $(BESIDE_TESTS) (beside the tests):"; cat $$beside; \
	wait $$lint_pid; lint=$$?; echo "== lint, types and docs (beside the tests):"; cat $$checks; \
	rm -f $$checks $$beside; [ $$tests -eq 0 ] && [ $$beside_tests -eq 0 ] && [ $$lint -eq 0 ]

check: lint bytecode
	$(BIN)/python -m pytest -q -n auto -m "$(FAST)"

# Every rank, engine and CLI call imports nbdist afresh: compiled once here, not in each of
# them (PYTHONDONTWRITEBYTECODE, set on some machines, keeps Python from caching it itself).
bytecode: $(STAMP)
	$(BIN)/python -m compileall -q nbdist

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy nbdist

# The docs site, offline, into docs/_build/html (open docs/_build/html/index.html).
docs: $(STAMP)
	$(SPHINX) docs docs/_build/html

# JupyterLab on the tutorials, on loopback with Jupyter's token (it prints the URL).
# Jupyter refuses root without --allow-root (containers, CI boxes run as root).
lab: $(STAMP)
	$(BIN)/jupyter lab --notebook-dir=notebooks --ServerApp.ip=127.0.0.1 $(if $(filter 0,$(shell id -u)),--allow-root)

bench: $(STAMP)
	$(BIN)/python bench/allreduce_vs_ddp.py
	$(BIN)/python bench/master_throughput.py
	$(BIN)/python bench/overhead.py
	$(BIN)/python bench/dashboard_overhead.py
	$(BIN)/python bench/keras_overhead.py
	$(BIN)/python bench/sync_batchnorm.py
	$(BIN)/python bench/compression.py
	$(BIN)/python bench/pipeline.py
	$(BIN)/python bench/hpo_parallel.py
	$(BIN)/python bench/faults.py
	$(BIN)/python bench/convergence.py --quick
	$(BIN)/python bench/noise_scale.py

# What bench/device_check.sh installs on a GPU node that has no network (requirements/device.txt).
DEVICE_WHEELS := .device-wheels
# setuptools builds the wheel through ./build and keeps what it copied there: a module
# deleted since the last wheel would ride along in the next, so build/ goes before and after.
device-wheels: $(STAMP)
	rm -rf $(DEVICE_WHEELS) build && mkdir -p $(DEVICE_WHEELS)
	$(BIN)/python -m pip wheel --quiet --no-deps --no-build-isolation -w $(DEVICE_WHEELS) .
	rm -rf build
	$(BIN)/python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d $(DEVICE_WHEELS) -r requirements/device.txt
	@ls $(DEVICE_WHEELS)

clean:
	rm -rf $(VENV) runs .pytest_cache docs/_build $(DEVICE_WHEELS) build
