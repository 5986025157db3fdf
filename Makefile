# Two commands on a fresh machine:
#   make demo   set up .venv and run the whole pipeline on the demo corpus (dvc repro)
#   make test   set up .venv and run the test suite (ruff + pytest)
VENV := .venv
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: setup demo test lint docs

setup:
	scripts/setup.sh

demo: setup
	dvc repro
	@echo
	@python -m lmforge.summary
	@python scripts/demo_pictures.py
	@python scripts/demo_docs.py
	@echo "Headline metrics: dvc metrics show (detail: metrics/*.json, *.md); samples: metrics/samples.md, metrics/post_samples.md; lm-eval: metrics/harness.md; curves: dvc plots show; chat: lmforge chat"
	@echo "MLflow UI: mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlflow.db  (then open http://127.0.0.1:5000)"

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

