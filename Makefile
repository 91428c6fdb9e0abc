# Two commands a fresh machine needs: `make demo` (the main job) and `make test`.
# Each makes its own venv; torch is pinned to the local CPU wheel by constraints-dev.txt.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: venv system-deps demo test bench clean

$(STAMP): pyproject.toml constraints-dev.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints-dev.txt -e '.[dev]'
	touch $@

venv: $(STAMP)

# Slurm, munge, shellcheck, podman and squashfs tools; only where we are root with apt.
system-deps:
	bash slurm/dev/install-deps.sh

demo: venv
	$(BIN)/python -m enn_cluster.demo

test: venv system-deps
	$(BIN)/python -m pytest -q -ra $(PYTEST_ARGS)

bench: venv
	$(BIN)/python -m bench.run

clean:
	rm -rf $(VENV) build *.egg-info demo-runs
