# Two entry points, each creating .venv on first use:
#   make book   set up, then execute every chapter on CPU (gloo) and build the HTML book in _build/html
#   make test   set up, then run the whole test suite (launcher, lessons, and the book build)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup book test bench clean

setup: $(STAMP)

# Reinstall when the pins change. torch is pinned exactly (see requirements.txt for why).
$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -r requirements.txt
	$(BIN)/python -c "import torch, torchvision, lessonlib; print('torch', torch.__version__, '| torchvision', torchvision.__version__)"
	touch $(STAMP)

book: $(STAMP)
	$(BIN)/jupyter-book build book -W -n --keep-going

test: $(STAMP)
	$(BIN)/python -m pytest tests

bench: $(STAMP)
	$(BIN)/python benchmarks/launch_overhead.py
	$(BIN)/python benchmarks/collectives.py

clean:
	rm -rf _build
