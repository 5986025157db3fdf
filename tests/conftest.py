"""Fixtures shared across test modules."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    """A real Ray instance on this machine (2 CPUs), started once for the session.

    Ray's own advice for tests: start-up takes seconds, so share one instance; there is
    no local mode any more, so tasks run in real worker processes.
    """
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True,
                 configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def demo_data_repo(tmp_path_factory):
    """A git+DVC repo with the pipeline, tiny params and a demo slice, its data stages
    (ingest to shards) reproduced once for the session: the end-to-end tests copy it
    (demo_repo.copy_repo) rather than each rebuilding the same data. Returns the
    template's path and DVC's output."""
    from demo_repo import DEMO, build_data_repo, stage_env

    if not DEMO.is_dir():
        pytest.fail("the demo corpus data/raw/demo is missing from the repository")
    root = tmp_path_factory.mktemp("demo_data")
    return root, build_data_repo(root, stage_env())


@pytest.fixture(scope="session")
def chat_tokenizer(tmp_path_factory):
    """The tiny sentencepiece model with the chat markers reserved (chat_tokenizer.train),
    trained once for the session; tests read it and never write it."""
    from chat_tokenizer import train

    return train(tmp_path_factory.mktemp("chat_tokenizer") / "tokenizer.model")
