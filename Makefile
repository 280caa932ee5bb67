# Three entry points, each creating .venv on first use:
#   make book   set up, then execute every chapter on CPU (gloo) and build the HTML book in _build/html
#   make lab    set up, then open JupyterLab on book/ with the course's kernel, to run chapters cell by cell
#   make test   set up, then run the whole test suite (launcher, lessons, the book build, the browser test)
#   make unit   set up, then run only the unit tier: the tests that start no process, in seconds
#   make book-record  build the book, then rewrite lessonlib/book/launches.json from what it ran
#   make gpu-check  the templates, chapter 15's classes and chapter 8's AMP on this machine's GPUs (no setup)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup book book-record lab test unit bench gpu-check format clean
# The kernel every chapter names in its metadata (kernelspec.name), so Jupyter and VS Code pick .venv's
# Python. Registered inside .venv (--sys-prefix): nothing is written outside the checkout (ipykernel
# leaves an empty tmp*_kernels folder in TMPDIR, so it gets a TMPDIR of its own, removed after).
KERNEL := dp-course

setup: $(STAMP)

# Reinstall when the pins change. torch is pinned exactly (see requirements.txt for why).
$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -r requirements.txt
	$(BIN)/python -c "import torch, torchvision, lessonlib; print('torch', torch.__version__, '| torchvision', torchvision.__version__)"
	t=$$(mktemp -d) && TMPDIR=$$t $(BIN)/python -m ipykernel install --sys-prefix --name $(KERNEL) \
		--display-name "Python (dp-course .venv)" >/dev/null; s=$$?; rm -rf $$t; exit $$s
	touch $(STAMP)

# JupyterLab on 127.0.0.1 (it prints the URL with its token), opened on the chapters. As root (a
# container), Jupyter refuses to start without --allow-root.
lab: $(STAMP)
	$(BIN)/jupyter lab --ip=127.0.0.1 --ServerApp.root_dir=. --FileContentsManager.preferred_dir=book \
		$(if $(filter 0,$(shell id -u)),--allow-root)

book: $(STAMP)
	$(BIN)/jupyter-book build book -W -n --keep-going

# The runs the tests leave to the book (lessonlib/book/launches.json) from what this build ran
# (_build/lessonlib-launches.jsonl): the chapters it executed are recorded anew, the others (their cache
# fresh) keep their entries. `make clean book-record` records every chapter from scratch.
book-record: book
	$(BIN)/python -m lessonlib.book.launchrecord _build/lessonlib-launches.jsonl

# Tests run in parallel, one pytest worker per CPU plus two, up to 4: ranks spend part of their time
# waiting (on each other, on the short timeouts the pitfalls show), and the spare workers fill it. The
# book test (one long test, which itself executes chapters side by side: BOOK_JOBS) runs beside the
# lessons instead of after them. The browser tests (tests/test_browser.py) open the pages that the book
# test built: --dist loadgroup keeps the tests of xdist group "book" on one worker, one after the other,
# so the book is executed and built once. JOBS=1 runs the tests serially. The 15 slowest tests are listed
# at the end (--durations), so that drift in CI's time shows where it comes from.
JOBS ?= $(shell n=$$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2); n=$$((n + 2)); [ $$n -gt 4 ] && n=4; echo $$n)

test: $(STAMP)
	$(BIN)/python -m pytest -n $(JOBS) --dist loadgroup --durations=15 tests

# The tests marked `unit` (pyproject.toml): no process started, no network. Run it while editing; the
# whole suite (make test) is what CI runs.
unit: $(STAMP)
	$(BIN)/python -m pytest -m unit -q tests

# hosts_bandwidth.py needs root (network namespaces); without it, it says why and exits 77 (skipped).
bench: $(STAMP)
	$(BIN)/python benchmarks/launch_overhead.py
	$(BIN)/python benchmarks/collectives.py
	$(BIN)/python benchmarks/amp.py
	$(BIN)/python benchmarks/sharding.py
	$(BIN)/python benchmarks/build_ddp.py
	$(BIN)/python benchmarks/build_sharding.py
	$(BIN)/python benchmarks/hosts_bandwidth.py || test $$? -eq 77

# What the course's takeaways do on real GPUs (lessonlib/gpucheck.py): skipped, with the reason, without one.
# No setup: a lent GPU machine has its own torch (maybe older than the pin) and none of requirements.txt,
# so it runs with .venv's Python when there is one, else python3. GPU_CHECK_ARGS: e.g. --save FILE, --only NAME.
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
gpu-check:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) -m lessonlib.gpucheck $(GPU_CHECK_ARGS)

# Format and lint-fix everything ruff covers (pyproject.toml [tool.ruff]); tests/test_style.py checks it.
format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf _build
