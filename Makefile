# Two commands for a fresh machine: `make demo` (main job on real data) and `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast install clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,mlflow]'
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/cxr-hfl simulate --method ohfl --sites 6 --scheme width --out runs/demo --overwrite

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

# development: every test that runs no simulator job and needs no real images, stopping at the first failure
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -x -m "not slow and not realdata" tests

clean:
	rm -rf runs .pytest_cache
