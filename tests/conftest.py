"""Fixtures shared across test modules.

MLflow is off in the suite unless a test turns it on (``LMFORGE_TRACKING``): its start-up
costs seconds in every stage process, and only the tests that check what is tracked need
it (they set ``LMFORGE_TRACKING=on``: demo_repo.stage_env(tracking=True),
test_train_loop.tracked_env). ``LMFORGE_TRACKING=on pytest`` tracks in every test.

One OpenMP thread per process unless set otherwise: ``make test`` runs a pytest worker per
core, so a second intra-op thread in each only oversubscribes the cores, and its spin-waits
cost CPU the other worker needs (the in-process tests took 10-17 % longer with two).
A test that needs two threads sets them (``train.num_threads``: torch.set_num_threads).
"""

from __future__ import annotations

import os
import shutil

import pytest
from filelock import FileLock

os.environ.setdefault("LMFORGE_TRACKING", "off")
# Before torch is imported (libgomp reads it once); the stages the tests start inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def ray_cluster():
    """A real Ray instance on this machine (2 CPUs), started once for the session.

    Ray's own advice for tests: start-up takes seconds, so share one instance; there is
    no local mode any more, so tasks run in real worker processes. ``address="local"``:
    a new instance of its own, always. Without an address ``ray.init`` joins any Ray
    already running on the machine, such as the multi-node tests' clusters in the other
    pytest worker, and then refuses ``num_cpus`` (seen: 5 errors at set-up).
    """
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=True,
                 configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def demo_data_repo(tmp_path_factory, worker_id):
    """A git+DVC repo with the pipeline, tiny params and a demo slice, its data stages
    (ingest to shards) reproduced once for the whole run: the end-to-end tests copy it
    (demo_repo.copy_repo) rather than each rebuilding the same data. Returns the
    template's path and DVC's output.

    Under pytest-xdist the first worker to ask builds it (a file lock) in the run's
    shared temp directory, and the others use that one: each build is ~15 s of CPU.
    """
    from demo_repo import DEMO, build_data_repo, stage_env

    if not DEMO.is_dir():
        pytest.fail("the demo corpus data/raw/demo is missing from the repository")
    if worker_id == "master":  # no xdist: this process is the only user
        root = tmp_path_factory.mktemp("demo_data")
        return root, build_data_repo(root, stage_env())
    shared = tmp_path_factory.getbasetemp().parent  # one per run, beside the workers' own
    root, log = shared / "demo_data", shared / "demo_data.out"
    with FileLock(str(shared / "demo_data.lock")):
        if not log.is_file():  # written last: a repo half built by a failed worker is redone
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            log.write_text(build_data_repo(root, stage_env()), encoding="utf-8")
    return root, log.read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def chat_tokenizer(tmp_path_factory):
    """The tiny sentencepiece model with the chat markers reserved (chat_tokenizer.train),
    trained once for the session; tests read it and never write it."""
    from chat_tokenizer import train

    return train(tmp_path_factory.mktemp("chat_tokenizer") / "tokenizer.model")


def pytest_collection_modifyitems(config, items) -> None:
    """The slow modules (whole pipelines, multi-process training) first, in their order.

    `make test` hands whole files to pytest-xdist workers (--dist loadfile,
    --no-loadscope-reorder keeps this order): the longest files start at once and the
    many short ones fill the gaps at the end, rather than a long file starting last and
    running alone while the other workers sit idle.
    """
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
