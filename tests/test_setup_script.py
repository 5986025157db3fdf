"""scripts/setup.sh picks the CPU build of torch without a GPU, and says so when it can't;
it installs the rest with uv, and with pip where uv is refused or fails; it byte-compiles
what is installed once, leaving out the packages' own test suites."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

SETUP = Path(__file__).resolve().parents[1] / "scripts" / "setup.sh"


def choose(tmp_path: Path, gpu: bool, **env: str) -> tuple[str, str]:
    """Source setup.sh, run choose_torch; return ("spec|index", stderr)."""
    bin_dir = tmp_path / ("gpu" if gpu else "nogpu")
    bin_dir.mkdir(exist_ok=True)
    if gpu:  # a stand-in nvidia-smi that lists one GPU
        fake = bin_dir / "nvidia-smi"
        fake.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100'\n")
        fake.chmod(0o755)
    path = f"{bin_dir}:{os.environ['PATH']}" if gpu else _path_without_nvidia_smi()
    full = {k: v for k, v in os.environ.items()
            if k not in ("TORCH_SPEC", "TORCH_INDEX", "TORCH_CPU_INDEX")}
    full.update(env, PATH=path)
    proc = subprocess.run(["bash", "-c", f'source "{SETUP}"; choose_torch python3; '
                           'echo "$TORCH_SPEC|$TORCH_INDEX"'],
                          env=full, capture_output=True, text=True, timeout=60, check=True)
    return proc.stdout.strip(), proc.stderr.strip()


def _path_without_nvidia_smi() -> str:
    dirs = os.environ["PATH"].split(os.pathsep)
    return os.pathsep.join(d for d in dirs if not (Path(d) / "nvidia-smi").exists())


@pytest.fixture()
def cpu_index(tmp_path):
    """A local stand-in for PyTorch's CPU index (answers for /torch/)."""
    root = tmp_path / "idx"
    (root / "whl" / "cpu" / "torch").mkdir(parents=True)
    (root / "whl" / "cpu" / "torch" / "index.html").write_text("<html></html>")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **k):
            super().__init__(*a, directory=str(root), **k)

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_without_a_gpu_torch_comes_from_the_cpu_index(tmp_path, cpu_index):
    got, err = choose(tmp_path, gpu=False, TORCH_CPU_INDEX=f"{cpu_index}/whl/cpu")
    assert got == f"torch==2.13.0|{cpu_index}/whl/cpu"
    assert err == ""


def test_an_unreachable_cpu_index_falls_back_with_one_warning(tmp_path, cpu_index):
    for index in (f"{cpu_index}/nothing", "http://127.0.0.1:9/whl/cpu"):  # 404, closed port
        got, err = choose(tmp_path, gpu=False, TORCH_CPU_INDEX=index)
        assert got == "torch==2.13.0|"
        assert len(err.splitlines()) == 1 and "CPU index" in err and "unreachable" in err


def test_a_gpu_or_the_users_choice_skips_the_cpu_index(tmp_path):
    assert choose(tmp_path, gpu=True)[0] == "torch|"
    assert choose(tmp_path, gpu=False, TORCH_SPEC="torch==2.6.0",
                  TORCH_INDEX="https://x/cu124")[0] == "torch==2.6.0|https://x/cu124"
    assert choose(tmp_path, gpu=False, TORCH_INDEX="https://x/cpu")[0] == "torch==2.13.0|https://x/cpu"


def install(tmp_path: Path, fail: str = "", **env: str) -> tuple[list[str], str]:
    """Source setup.sh, run install_lmforge with a stand-in Python that records each
    command and fails the one starting with ``fail``; return (commands, stderr)."""
    log = tmp_path / "calls.log"
    log.unlink(missing_ok=True)
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\necho "$*" >> "{log}"\n'
                    f'case "$*" in "{fail}"*) [ -n "{fail}" ] && exit 1;; esac\nexit 0\n')
    fake.chmod(0o755)
    full = {k: v for k, v in os.environ.items() if k != "INSTALLER"}
    full.update(env)
    proc = subprocess.run(["bash", "-c", f'source "{SETUP}"; install_lmforge "{fake}" ".[dev]"'],
                          env=full, capture_output=True, text=True, timeout=60, check=True)
    return log.read_text().splitlines(), proc.stderr.strip()


def test_the_rest_goes_in_with_uv_and_with_pip_where_uv_is_refused_or_fails(tmp_path):
    calls, err = install(tmp_path)
    assert [c.split()[:3] for c in calls] == [["-m", "pip", "install"], ["-m", "uv", "pip"]]
    assert calls[1].endswith("-e .[dev]") and err == ""

    calls, err = install(tmp_path, fail="-m uv")
    assert calls[-1] == "-m pip install --quiet --no-compile -e .[dev]" and len(calls) == 3
    assert err == "setup: uv failed; installing with pip"

    calls, err = install(tmp_path, fail="-m pip install --quiet uv")
    assert calls[-1] == "-m pip install --quiet --no-compile -e .[dev]" and len(calls) == 2
    assert err == "setup: uv could not be installed; installing with pip"

    calls, err = install(tmp_path, INSTALLER="pip")
    assert calls == ["-m pip install --quiet --no-compile -e .[dev]"] and err == ""


def compile_site(python: str, stamp: Path) -> None:
    subprocess.run(["bash", "-c", f'source "{SETUP}"; compile_site "{python}" "{stamp}"'],
                   capture_output=True, text=True, timeout=120, check=True)


def test_site_packages_are_compiled_once_and_again_when_what_is_installed_changes(tmp_path):
    """A venv of our own (no pip): compiled at the first set-up, not at the next (a
    `make test` runs set-up every time), again once a package is installed."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")],
                   check=True, timeout=120)
    python = str(tmp_path / "venv" / "bin" / "python")
    site = Path(subprocess.run([python, "-c", "import sysconfig; "
                                "print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    for name in ("pkg", "pkg/tests"):
        (site / name).mkdir(parents=True)
        (site / name / "mod.py").write_text("x = 1\n")
    (site / "pkg-1.0.dist-info").mkdir()
    stamp = tmp_path / "compiled"

    def cached(folder: str) -> list[str]:
        return sorted(p.name for p in (site / folder).glob("__pycache__/*.pyc"))

    compile_site(python, stamp)
    assert cached("pkg") == [f"mod.{sys.implementation.cache_tag}.pyc"]
    assert cached("pkg/tests") == []  # a package's own tests: nothing imports them
    assert stamp.read_text() == "pkg-1.0.dist-info\n"

    (site / "pkg" / "new.py").write_text("y = 2\n")  # not installed by pip/uv: no change
    compile_site(python, stamp)
    assert len(cached("pkg")) == 1
    (site / "other-2.0.dist-info").mkdir()  # a package installed: compiled again
    compile_site(python, stamp)
    assert len(cached("pkg")) == 2
    assert stamp.read_text() == "other-2.0.dist-info\npkg-1.0.dist-info\n"
