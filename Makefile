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

# Tests run in parallel, one pytest worker per CPU plus one, up to 4: ranks spend part of their time
# waiting (on each other, on the short timeouts the pitfalls show), and the spare worker fills it. On
# CI's 2 cores, sampled every 15 s, both were 190-200% busy but for the last two minutes. And
# the book test (one long test, which itself executes two chapters at a time: BOOK_JOBS) runs beside the
# lessons instead of after them. JOBS=1 runs the tests serially.
JOBS ?= $(shell n=$$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2); n=$$((n + 1)); [ $$n -gt 4 ] && n=4; echo $$n)

test: $(STAMP)
	$(BIN)/python -m pytest -n $(JOBS) tests

bench: $(STAMP)
	$(BIN)/python benchmarks/launch_overhead.py
	$(BIN)/python benchmarks/collectives.py
	$(BIN)/python benchmarks/amp.py

clean:
	rm -rf _build
