# `make run` and `make test` are the only commands a fresh machine needs; both run `make setup`.
VENV := .venv
STAMP := $(VENV)/.installed
# Prefer a working python3.12 (the GPU machine's version), else python3.
PYTHON := $(shell for p in python3.12 $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3; do \
            $$p -c 'import sys; assert sys.version_info >= (3, 11)' >/dev/null 2>&1 && { echo $$p; break; }; done)

.PHONY: setup run test clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -n "$(PYTHON)" || { echo "error: no python >= 3.11 found; install python3.12"; exit 2; }
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

run: setup
	$(VENV)/bin/python -m experiments.speedup $(ARGS)

# Two pytest workers (pytest-xdist), one per core of the CI machine; a test file stays on one.
test: setup
	$(VENV)/bin/python -m pytest -n 2 --dist loadfile $(ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache .cache
