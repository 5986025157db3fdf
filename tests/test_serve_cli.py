"""``lmforge serve`` as a command: the loopback rule, ``--model NAME=PATH``, the default
models, and a real ``lmforge serve`` process answering the ``openai`` client."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from serve_server import raw, wait_for
from test_chat import Q1, make_model_dir

from lmforge.cli import build_parser, main
from lmforge.errors import InputError
from lmforge.serve.cli import is_loopback
from lmforge.serve.models import default_specs, headline_figures, parse_specs


@pytest.mark.parametrize("argv, words", [
    (["--host", "0.0.0.0"], "--host 0.0.0.0 is not loopback; give --api-key"),
    (["--host", "example.org"], "--host example.org is not loopback"),
    (["--queue-size", "-1"], "--queue-size must be at least 0, not -1"),
    (["--max-tokens", "0"], "--max-tokens must be at least 1, not 0"),
    (["--model", "sft"], "expected NAME=PATH"),
    (["--model", "a/b=models/sft"], "no slash"),
    (["--model", "x=/nonexistent/model"], "/nonexistent/model: no such model"),
])
def test_refusals_before_loading_are_one_line(argv, words, capsys, monkeypatch):
    monkeypatch.delenv("LMFORGE_API_KEY", raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(["serve", *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and words in err, err


def test_loopback_and_the_key():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.4")
    args = build_parser(["serve"]).parse_args(["serve", "--host", "0.0.0.0", "--api-key", "k"])
    assert args.api_key == "k" and args.port == 8000 and args.model == []


def test_model_specs_and_the_pipelines_defaults(tmp_path):
    assert parse_specs(["a=x", "b.1:q=y/z"]) == {"a": Path("x"), "b.1:q": Path("y/z")}
    with pytest.raises(InputError, match="given twice"):
        parse_specs(["a=x", "a=y"])
    with pytest.raises(InputError, match="none of models/final, models/sft, models/dpo"):
        default_specs(tmp_path)
    (tmp_path / "models" / "sft").mkdir(parents=True)
    (tmp_path / "models" / "dpo").mkdir()
    assert default_specs(tmp_path) == {"sft": tmp_path / "models/sft",
                                       "dpo": tmp_path / "models/dpo"}
    (tmp_path / "models" / "final").mkdir()  # the pretrained model, as headline.json's base
    assert list(default_specs(tmp_path).items())[0] == ("base", tmp_path / "models/final")


def test_lmforge_serve_process_answers_the_openai_client(chat_tokenizer, tmp_path):
    openai = pytest.importorskip("openai")
    model = make_model_dir(tmp_path / "sft", chat_tokenizer)
    with socket.socket() as s:  # a free port (released for the server to take)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "LMFORGE_API_KEY": "k"}
    proc = subprocess.Popen([sys.executable, "-m", "lmforge.cli", "serve", "--model",
                             f"mine={model}", "--port", str(port), "--log-level", "warning"],
                            env=env, stderr=subprocess.PIPE, text=True)
    try:
        def up() -> bool:
            assert proc.poll() is None, proc.stderr.read()
            try:
                return raw(port, "GET", "/v1/models")[0] == 401  # the key from the env
            except OSError:
                return False
        wait_for(up, "lmforge serve to listen", timeout=60)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k",
                               max_retries=0)
        assert [m.id for m in client.models.list()] == ["mine"]
        answer = client.chat.completions.create(model="mine", temperature=0, max_tokens=12,
                                                messages=[{"role": "user", "content": Q1}])
        assert answer.choices[0].finish_reason == "stop" and answer.usage.completion_tokens < 12
    finally:
        proc.send_signal(signal.SIGINT)  # uvicorn's graceful shutdown
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert f"serve: mine = {model} (chat + completions)" in err


def test_the_pipelines_models_carry_their_headline_figures(tmp_path):
    (tmp_path / "models" / "final").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    assert headline_figures(tmp_path / "models/final", tmp_path) is None  # no figures yet
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics/headline.json").write_text(json.dumps(
        {"base": {"bpb": 2.5}, "sft": {"tok_acc": 0.2}}))
    assert headline_figures(tmp_path / "models/final", tmp_path) == {"bpb": 2.5}
    assert headline_figures(tmp_path / "models/../models/final", tmp_path) == {"bpb": 2.5}
    assert headline_figures(tmp_path / "elsewhere", tmp_path) is None  # not the pipeline's
