# The three commands: `make demo`, `make test` and `make lab`. Each creates .venv when it is missing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
EXTRAS := mpi,torch,tensorflow,notebook,dashboard,hpo,hep,postgresql,test

.PHONY: demo test lab install clean bench device-wheels

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

# What bench/device_check.sh installs on a GPU node that has no network (requirements/device.txt).
DEVICE_WHEELS := .device-wheels
device-wheels: $(STAMP)
	rm -rf $(DEVICE_WHEELS) && mkdir -p $(DEVICE_WHEELS)
	$(BIN)/python -m pip wheel --quiet --no-deps --no-build-isolation -w $(DEVICE_WHEELS) .
	$(BIN)/python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d $(DEVICE_WHEELS) -r requirements/device.txt
	@ls $(DEVICE_WHEELS)

clean:
	rm -rf $(VENV) runs .pytest_cache $(DEVICE_WHEELS)
