# Two commands on a fresh machine:
#   make demo   set up .venv and run the whole pipeline on the demo corpus (dvc repro)
#   make test   set up .venv and run the test suite (ruff + pytest)
VENV := .venv
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: setup demo test lint

setup:
	scripts/setup.sh

demo: setup
	dvc repro
	@echo
	@python -m lmforge.summary
	@echo "All metrics: dvc metrics show; samples: metrics/samples.md, metrics/post_samples.md; lm-eval: metrics/harness.md; curves: dvc plots show; chat: lmforge chat"
	@echo "MLflow UI: mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlflow.db  (then open http://127.0.0.1:5000)"

test: setup
	ruff check .
	pytest -q

lint:
	ruff check .

