# Two commands on a fresh machine:
#   make demo   set up .venv and run the whole pipeline on the demo corpus (dvc repro)
#   make test   set up .venv and run the test suite (ruff + pytest)
VENV := .venv
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
SHELL := /bin/bash
STAGE_TIMES := .dvc/tmp/stage_times.txt

.PHONY: setup demo test lint docs

setup:
	scripts/setup.sh

# dvc repro's output passes through scripts/stage_clock.py, which times each stage; the
# table is printed last (PYTHONUNBUFFERED: the stages' logs still arrive line by line).
demo: setup
	set -o pipefail; PYTHONUNBUFFERED=1 dvc repro 2>&1 | python scripts/stage_clock.py --out $(STAGE_TIMES)
	@echo
	@python -m lmforge.summary
	@python scripts/demo_pictures.py
	@python scripts/demo_docs.py
	@echo "Headline metrics: dvc metrics show (detail: metrics/*.json, *.md); samples: metrics/samples.md, metrics/post_samples.md; lm-eval: metrics/harness.md; curves: dvc plots show; chat: lmforge chat"
	@echo "MLflow UI: mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlflow.db  (then open http://127.0.0.1:5000)"
	@cat $(STAGE_TIMES)

# One pytest worker per core (pytest-xdist), a test file to a worker: a file's module
# fixtures (a reproduced pipeline, a queue of experiments) are built once. Half the
# suite's time is subprocesses that leave a core idle (DVC stages with one torch
# thread, process start-up, polling), so two workers on two cores finish in ~0.6x.
test: setup
	ruff check .
	pytest -q -n auto --dist loadfile --no-loadscope-reorder --durations=10

lint:
	ruff check .

# The README's pictures and the demo figures in README.md and docs/, from metrics/ and plots/.
docs: setup
	python scripts/demo_pictures.py
	python scripts/demo_docs.py

