"""Entry points of the DVC stages: ``python -m stages.<name>`` (see dvc.yaml)."""
