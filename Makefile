# The three commands: `make demo`, `make test` and `make lab`. Each creates .venv when it is missing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
EXTRAS := mpi,torch,tensorflow,notebook,dashboard,hpo,hep,postgresql,test

.PHONY: demo test lab install clean bench

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

test: $(STAMP)
	$(BIN)/python -m pytest -q

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

clean:
	rm -rf $(VENV) runs .pytest_cache
