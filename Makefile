# gatelens: `make reproduce` (the main job on the default corpus) and `make test`.
# Both create .venv and install everything they need on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
OUT    ?= runs/reproduce
STAMP  := $(VENV)/.gatelens-installed

.PHONY: install reproduce test lint bench browser clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch pinned to the CPU build that lies on disk (an unpinned torch pulls CUDA, GBs)
	$(PY) -m pip install --quiet torch==2.13.0
	# the extras (gatelens[modern]: xlstm, mingru-pytorch, transformers, mambapy;
	# onnx, keras: the file loaders; docs: mkdocs for the site) with torch
	# held at the same pin, so none of them swaps the CPU build for another
	$(PY) -m pip install --quiet -e '.[test,docs,study,modern,onnx,keras]' torch==2.13.0
	touch $(STAMP)

install: $(STAMP)

reproduce: install
	$(VENV)/bin/gatelens reproduce --out $(OUT)

# Headless Chromium for the HTML report's browser test (Debian's package, as root).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

lint: install
	$(VENV)/bin/ruff check src tests benchmarks studies tools docs/hooks docs/tutorials

test: install browser lint
	$(PY) -m pytest

bench: install
	$(PY) benchmarks/bench_train.py
	$(PY) benchmarks/bench_trace.py
	$(PY) benchmarks/bench_analyze.py
	$(PY) benchmarks/bench_study.py
	$(PY) benchmarks/bench_modern.py
	$(PY) benchmarks/bench_patching.py
	$(PY) benchmarks/bench_families_2026.py
	$(PY) benchmarks/bench_real_size.py --layers 2 --windows 2
	$(PY) benchmarks/bench_qr.py
	$(PY) benchmarks/bench_xlstm_stack.py
	$(PY) benchmarks/bench_verify_model.py

clean:
	rm -rf $(VENV) build dist site src/*.egg-info .pytest_cache .ruff_cache
