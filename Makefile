# Two entry points: `make run` (the app on the default model) and `make test` (the suite's fast tier); `make docs`
# builds the site.  Both create .venv, install torch 2.13.0 first (a looser pin would pull CUDA wheels), then the project.
# The suite's tiers (tests/conftest.py marks them): `make test` the fast one, `make test-slow` the rest, `make test-all`
# both; PYTEST_ARGS adds pytest options (CI: --durations=25).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODEL ?= smollm2-135m

PYTEST_ARGS ?=
# --capture=sys: a native library that ends the process (ld.so, Qt) leaves its last words in the log
PYTEST := QT_QPA_PLATFORM=offscreen $(BIN)/python -m pytest -q -p no:cacheprovider --capture=sys $(PYTEST_ARGS)

.PHONY: run chat test test-slow test-all screenshots docs installer clean

$(STAMP): pyproject.toml setup.py engine/kernels/ggml_matmul.cpp engine/kernels/tile_kernels.inc
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[export,gui,test,docs,installer]"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/fleetgui

chat: $(STAMP)
	$(BIN)/fleet up --model $(MODEL) --local

test: $(STAMP)
	$(PYTEST) -m "not slow" tests

test-slow: $(STAMP)
	$(PYTEST) -m slow tests

test-all: $(STAMP)
	$(PYTEST) tests

screenshots: $(STAMP)
	QT_QPA_PLATFORM=offscreen $(BIN)/python -m pytest -q -p no:cacheprovider tests/test_gui_*.py --screenshots docs/screenshots

docs: $(STAMP)
	$(BIN)/mkdocs build --strict

installer: $(STAMP)
	$(BIN)/pyinstaller --noconfirm --distpath dist --workpath build/pyinstaller installer/fleetshard.spec

clean:
	rm -rf $(VENV) dist build site
