"""``lmforge serve``'s page at ``/`` in a real headless Chromium (Debian's ``chromium``
and ``chromium-driver``, driven by Selenium; scripts/serve_page_shot.py): a prompt typed
and sent, every model's answer shown, each column's text equal to the API's greedy answer
for that model, and a screenshot saved. Skips where no browser is installed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from chat_tokenizer import train
from serve_server import ThreadServer
from test_chat import Q1, make_model_dir

from lmforge.model import load_model, save_model
from lmforge.serve.app import ServeSettings
from lmforge.tokenizer import Tokenizer

openai = pytest.importorskip("openai")

REPO = Path(__file__).resolve().parents[1]
MAX_TOKENS = 12
FIGURES = {"base": {"bpb": 2.5, "tok_s": 3705}, "sft": {"tok_acc": 0.25},
           "dpo": {"reward_acc": 0.75}}


def _shot_module():
    spec = importlib.util.spec_from_file_location("serve_page_shot",
                                                  REPO / "scripts" / "serve_page_shot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


shot = _shot_module()


def perturbed(path: Path, sp: Path) -> Path:
    """The tiny chat model at ``path`` with its LM head nudged, so that its answers
    differ from the unnudged one's (a column showing the wrong model's answer fails)."""
    model, _ = load_model(path)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        head = model.lm_head.weight
        head.add_(torch.randn(head.shape, generator=generator) * head.std())
    tok = Tokenizer.load(sp)
    save_model(model, path, sp, special_ids={"bos": tok.bos_id, "eos": tok.eos_id,
                                             "pad": tok.pad_id, "unk": tok.unk_id},
               tokenizer_sha256=tok.sha256)
    return path


@pytest.fixture(scope="module")
def browser():
    found = shot.find_browser()
    if isinstance(found, str):
        pytest.skip(found)
    drv = shot.open_browser(*found, width=1100, height=800)
    yield drv
    drv.quit()


@pytest.fixture(scope="module")
def pipeline(chat_tokenizer, tmp_path_factory):
    """A pipeline's folder as `lmforge serve` finds it: models/final (no chat markers),
    models/sft and models/dpo (chat), and metrics/headline.json."""
    root = tmp_path_factory.mktemp("browser")
    plain = train(root / "plain.model", reserved=())
    models = {"base": make_model_dir(root / "models/final", plain),
              "sft": make_model_dir(root / "models/sft", chat_tokenizer),
              "dpo": perturbed(make_model_dir(root / "models/dpo", chat_tokenizer),
                               chat_tokenizer)}
    (root / "metrics").mkdir()
    (root / "metrics/headline.json").write_text(json.dumps(FIGURES))
    return root, models


@pytest.fixture(scope="module")
def server(pipeline, browser):  # the browser first: no server started to be skipped
    root, models = pipeline
    srv = ThreadServer(models, ServeSettings(max_tokens_cap=64, queue_size=4), root)
    yield srv
    srv.stop()


def api_answer(client, model: str, mode: str) -> tuple[str, str]:
    """The API's greedy (text, finish_reason) for ``Q1``; in chat, a model without a chat
    format gives the API's refusal as its text and 'error'."""
    if mode == "completion":
        got = client.completions.create(model=model, prompt=Q1, max_tokens=MAX_TOKENS,
                                        temperature=0)
        return got.choices[0].text, got.choices[0].finish_reason
    try:
        got = client.chat.completions.create(model=model, temperature=0,
                                             max_tokens=MAX_TOKENS,
                                             messages=[{"role": "user", "content": Q1}])
    except openai.BadRequestError as e:
        return e.body["message"], "error"
    return got.choices[0].message.content, got.choices[0].finish_reason


def test_the_page_in_chromium_shows_each_models_answer(server, browser, tmp_path):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0,
                           timeout=30)
    names = shot.load_page(browser, f"http://127.0.0.1:{server.port}/")
    assert names == ["base", "sft", "dpo"]
    for mode in ("chat", "completion"):
        shown = shot.ask(browser, Q1, mode, MAX_TOKENS)
        want = {name: api_answer(client, name, mode) for name in names}
        for name, (text, finish) in want.items():
            column = shown[name]
            assert column["answer"] == text and text, (mode, name)
            if finish == "error":  # base has no chat format: the API's one line
                assert column["done"] == "error" and "/v1/completions" in text
                continue
            assert column["done"] == "true"
            assert column["meta"].startswith(f"{finish} · "), (mode, name, column["meta"])
        answers = [want[n][0] for n in names if want[n][1] != "error"]
        assert len(set(answers)) == len(answers), f"{mode}: two models answered alike"
    figures = {name: shown[name]["figures"] for name in names}
    assert figures == {"base": "bpb 2.500 · tok_s 3705", "sft": "tok_acc 0.250",
                       "dpo": "reward_acc 0.750"}
    png = shot.screenshot(browser, tmp_path / "serve_page.png")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width >= 1000 and height >= 500, (width, height)
