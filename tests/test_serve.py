"""``lmforge serve`` through the real ``openai`` client, against a server started here
with tiny models: answers equal ``lmforge chat``'s, streams equal whole answers, and bad
input gets the right status and one line (and the server goes on serving)."""

from __future__ import annotations

import http.client
import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from chat_tokenizer import train
from serve_server import RawStream, ThreadServer, raw, wait_for
from test_chat import Q1, Q2, SYSTEM, make_model_dir

import lmforge.serve as server_module
from lmforge import chat as chat_mod
from lmforge.cli import main
from lmforge.finetune.template import generation_prompt
from lmforge.model import generate, load_model
from lmforge.serve.app import ServeSettings
from lmforge.tokenizer import Tokenizer

openai = pytest.importorskip("openai")

KEY = "test-key"
CAP, BODY_CAP = 64, 4096
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def models(chat_tokenizer, tmp_path_factory):
    """A chat model (our markers) and a base model whose tokenizer has none."""
    root = tmp_path_factory.mktemp("serve")
    plain = train(root / "plain.model", reserved=())
    return {"sft": make_model_dir(root / "sft", chat_tokenizer),
            "base": make_model_dir(root / "base", plain)}


@pytest.fixture(scope="module")
def server(models):
    settings = ServeSettings(api_key=KEY, max_body_bytes=BODY_CAP, max_tokens_cap=CAP,
                             queue_size=1)
    srv = ThreadServer(models, settings)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    # No retries: a 429 or a 5xx must show up as it came.
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=30)


def ask(client, **kw):
    kw.setdefault("model", "sft")
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(**kw)


def streamed(create, **kw) -> tuple[str, list]:
    """The concatenated deltas of a streamed answer, and its chunks."""
    chunks = list(create(stream=True, **kw))
    pieces = [c.choices[0].delta.content if hasattr(c.choices[0], "delta")
              else c.choices[0].text for c in chunks]
    return "".join(p or "" for p in pieces), chunks


def still_serving(client) -> None:
    """A good request still gets its answer."""
    assert ask(client, messages=[{"role": "user", "content": Q1}], max_tokens=2).usage


def test_chat_answer_is_lmforge_chats_greedy_answer(server, client, models, capsys):
    main(["chat", "--model", str(models["sft"]), "--system", SYSTEM, "-m", Q1, "-m", Q2,
          "--json", "--max-new-tokens", "12"])
    transcript = json.loads(capsys.readouterr().out)["messages"]
    tok = Tokenizer.load(models["sft"])
    for upto in (2, 4):  # the first reply, then the second after the first exchange
        messages, want = transcript[:upto], transcript[upto]["content"]
        got = ask(client, messages=messages, max_tokens=12)
        assert got.choices[0].message.content == want and got.model == "sft"
        turns = [(m["role"], m["content"]) for m in messages]
        session = chat_mod.ChatSession(load_model(models["sft"])[0], tok, max_new_tokens=12)
        session.system, session.history = SYSTEM, turns[1:-1]
        # The prompt lmforge chat sends: the second leaves the first exchange out (the
        # 64-token context keeps 12 for the reply).
        prompt = session.prompt_ids(turns[-1][1])
        assert (len(prompt) == len(generation_prompt(turns, tok))) == (upto == 2)
        assert session.reply(turns[-1][1]) == want
        assert got.usage.prompt_tokens == len(prompt)
        assert got.usage.completion_tokens == len(session.last_ids)
        end_reached = session.last_ids[-1] in session.stop_ids
        assert got.choices[0].finish_reason == ("stop" if end_reached else "length")
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


def test_streamed_deltas_equal_the_whole_answer(client):
    for kw in ({"messages": [{"role": "user", "content": Q2}], "max_tokens": 20},
               {"messages": [{"role": "user", "content": Q1}], "max_tokens": 20},
               {"messages": [{"role": "user", "content": Q2}], "max_tokens": 20,
                "temperature": 1.0, "top_p": 0.9, "seed": 7}):
        whole = ask(client, **kw)
        text, chunks = streamed(client.chat.completions.create,
                                **{"model": "sft", "temperature": 0, **kw})
        assert text == whole.choices[0].message.content and text
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
        assert chunks[-1].usage == whole.usage  # usage in the last chunk
        assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_sampling_follows_the_seed_as_lmforge_chat_does(client, models):
    messages = [{"role": "user", "content": Q2}]
    a, b, c = (ask(client, messages=messages, max_tokens=20, temperature=1.0, seed=s)
               .choices[0].message.content for s in (5, 5, 6))
    session = chat_mod.ChatSession(load_model(models["sft"])[0], Tokenizer.load(models["sft"]),
                                   max_new_tokens=20, temperature=1.0, seed=5)
    assert a == b == session.reply(Q2) and a != c


def test_completions_continue_the_prompt_and_stop_strings_cut(client, models):
    prompt = "the model reads"
    whole = client.completions.create(model="base", prompt=prompt, max_tokens=20,
                                      temperature=0)
    tok = Tokenizer.load(models["base"])
    ids = list(generate(load_model(models["base"])[0], tok.encode(prompt), 20,
                        eos_id=tok.eos_id))
    assert whole.choices[0].text == tok.decode(ids) and whole.usage.completion_tokens == 20
    assert whole.usage.prompt_tokens == len(tok.encode(prompt))
    assert whole.choices[0].finish_reason == "length"
    text, chunks = streamed(client.completions.create, model="base", prompt=prompt,
                            max_tokens=20, temperature=0)
    assert text == whole.choices[0].text and chunks[-1].usage == whole.usage
    # A stop string from the middle of the answer: the text ends just before it.
    full = whole.choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    cut = full[:full.index(stop)]
    for stream in (False, True):
        if stream:
            got, chunks = streamed(client.completions.create, model="base", prompt=prompt,
                                   max_tokens=20, temperature=0, stop=[stop, "\x00never"])
            finish = chunks[-1].choices[0].finish_reason
        else:
            answer = client.completions.create(model="base", prompt=prompt, max_tokens=20,
                                               temperature=0, stop=[stop, "\x00never"])
            got, finish = answer.choices[0].text, answer.choices[0].finish_reason
        assert (got, finish) == (cut, "stop")


def test_models_lists_what_is_served(client, server):
    assert [m.id for m in client.models.list()] == ["sft", "base"]
    # Beside OpenAI's fields: which models chat (the page offers completions for the rest).
    _, _, body = raw(server.port, "GET", "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert [(m["id"], m["chat"]) for m in body["data"]] == [("sft", True), ("base", False)]
    status, _, body = raw(server.port, "GET", "/v1/models")  # no key
    assert status == 401 and body["error"]["code"] == "invalid_api_key"


def _refused(exc_info, status: int, *words: str) -> str:
    err = exc_info.value
    assert err.status_code == status, err
    message = err.body["message"]
    assert "\n" not in message and all(w in message for w in words), message
    assert set(err.body) == {"message", "type", "param", "code"}
    return message


@pytest.mark.parametrize("case", ["unknown model", "max_tokens past cap", "unsupported field",
                                  "n=2", "body past cap", "wrong key", "no chat format",
                                  "assistant last", "prompt too long"])
def test_bad_requests_get_status_and_one_line(client, server, case):
    messages = [{"role": "user", "content": Q1}]
    bad = {"unknown model": (404, dict(model="../models/sft"), ["'../models/sft'", "sft, base"]),
           "max_tokens past cap": (400, dict(max_tokens=CAP + 1), ["max_tokens", str(CAP)]),
           "unsupported field": (400, dict(frequency_penalty=0.5), ["'frequency_penalty'"]),
           "n=2": (400, dict(n=2), ["n=1"]),
           "body past cap": (413, dict(messages=[{"role": "user", "content": "x" * BODY_CAP}]),
                             [str(BODY_CAP)]),
           "wrong key": (401, {}, ["wrong API key"]),
           "no chat format": (400, dict(model="base"), ["'base'", "/v1/completions"]),
           "assistant last": (400, dict(messages=[*messages, {"role": "assistant",
                                                              "content": "x"}]), ["user"]),
           "prompt too long": (400, dict(messages=[{"role": "user", "content": Q1 * 20}]),
                               ["context"])}
    status, kw, words = bad[case]
    target = client
    if case == "wrong key":
        target = client.with_options(api_key="not-the-key")
    with pytest.raises(openai.APIStatusError) as exc_info:
        ask(target, **{"messages": messages, **kw})
    _refused(exc_info, status, *words)
    still_serving(client)


@pytest.mark.parametrize("case", ["malformed JSON", "missing messages", "not an object",
                                  "declared far past cap", "no route", "missing key"])
def test_bad_raw_requests_get_status_and_one_line(client, server, case):
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    bad = {"malformed JSON": (400, CHAT, b'{"model": "sft", "messages": [', "not valid JSON"),
           "missing messages": (400, CHAT, {"model": "sft"}, "missing required field "
                                "'messages'"),
           "not an object": (400, COMPLETIONS, b"[1, 2]", "a JSON object"),
           "declared far past cap": (413, CHAT, None, "cap"),
           "no route": (404, "/v1/embeddings", {"model": "sft"}, "no route"),
           "missing key": (401, CHAT, {"model": "sft"}, "missing API key")}
    status, path, body, words = bad[case]
    headers = dict(auth)
    if case == "declared far past cap":  # refused from the header, the body never read
        headers["Content-Length"] = str(10 ** 9)
    if case == "missing key":
        del headers["Authorization"]
    got, _, answer = raw(server.port, "POST", path, body, headers)
    assert got == status
    assert words in answer["error"]["message"] and "\n" not in answer["error"]["message"]
    still_serving(client)


def _slow_generate(record: dict, token: int, delay: float):
    """A stand-in for ``generate`` that never stops early: ``token`` every ``delay`` s,
    counting what it yields and whether it was closed."""

    def fake(model, idx, max_new_tokens, **kw):
        try:
            for _ in range(max_new_tokens):
                time.sleep(delay)
                record["yielded"] += 1
                yield token
        finally:
            record["closed"] = True
    return fake


def test_a_client_gone_mid_stream_stops_its_generation(client, server, monkeypatch):
    word = Tokenizer.load(server.models["sft"].path).encode("the")[0]
    record = {"yielded": 0, "closed": False}
    monkeypatch.setattr(chat_mod, "generate", _slow_generate(record, word, 0.02))
    stream = RawStream(server.port, CHAT, {"model": "sft", "stream": True, "max_tokens": CAP,
                                           "messages": [{"role": "user", "content": Q1}]}, KEY)
    assert json.loads(stream.event())["choices"][0]["delta"]["role"] == "assistant"
    assert "the" in json.loads(stream.event())["choices"][0]["delta"]["content"]
    stream.close()
    wait_for(lambda: record["closed"], "the generation to stop")
    assert record["yielded"] < CAP // 2  # stopped within a few tokens of the hang-up
    wait_for(lambda: server.models["sft"].slots.held == 0, "the slot to be freed")
    monkeypatch.undo()
    still_serving(client)


def test_a_client_gone_before_a_whole_answer_stops_its_generation(client, server,
                                                                   monkeypatch):
    """Non-streamed: nothing is written before the answer is whole, so the server asks
    the connection; a hang-up stops the generation and frees the place, also for a
    request still waiting for the model (which must not keep the model afterwards)."""
    word = Tokenizer.load(server.models["sft"].path).encode("the")[0]
    record = {"yielded": 0, "closed": False}
    monkeypatch.setattr(chat_mod, "generate", _slow_generate(record, word, 0.02))
    body = {"model": "sft", "max_tokens": CAP, "messages": [{"role": "user", "content": Q1}]}
    generating = RawStream(server.port, CHAT, body, KEY)
    wait_for(lambda: record["yielded"] > 0, "the generation to start")
    waiting = RawStream(server.port, CHAT, body, KEY)  # queued behind it
    wait_for(lambda: server.models["sft"].slots.held == 2, "the second request to queue")
    waiting.close()
    generating.close()
    wait_for(lambda: record["closed"], "the generation to stop")
    assert record["yielded"] < CAP // 2  # stopped within a poll of the hang-up
    wait_for(lambda: server.models["sft"].slots.held == 0, "both places to be freed")
    monkeypatch.undo()
    still_serving(client)  # the model was given back by the request that never ran


def test_a_full_queue_answers_429_and_frees_up(client, server, monkeypatch):
    word = Tokenizer.load(server.models["sft"].path).encode("the")[0]
    record = {"yielded": 0, "closed": False}
    monkeypatch.setattr(chat_mod, "generate", _slow_generate(record, word, 0.05))
    body = {"model": "sft", "stream": True, "max_tokens": CAP,
            "messages": [{"role": "user", "content": Q1}]}
    first = RawStream(server.port, CHAT, body, KEY)
    first.event(), first.event()  # generating
    second = RawStream(server.port, CHAT, body, KEY)
    second.event()  # its role chunk: queued behind the first
    assert server.models["sft"].slots.held == 2
    status, headers, answer = raw(server.port, "POST", CHAT, {**body, "stream": False},
                                  {"Authorization": f"Bearer {KEY}"})
    assert status == 429 and headers["Retry-After"] == "1"
    assert answer["error"]["code"] == "queue_full" and "busy" in answer["error"]["message"]
    first.close()  # the second gets the model
    assert "the" in json.loads(second.event())["choices"][0]["delta"]["content"]
    second.close()
    wait_for(lambda: server.models["sft"].slots.held == 0, "both slots to be freed")
    monkeypatch.undo()
    still_serving(client)


def test_the_page_is_served_from_the_package_without_a_cdn(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    pages = {}
    for path in ("/", "/page/page.js", "/page/page.css"):  # no key needed for the page
        conn.request("GET", path)
        resp = conn.getresponse()
        pages[path] = (resp.status, resp.headers, resp.read().decode())
    conn.close()
    assert [(s, h["content-type"].split(";")[0]) for s, h, _ in pages.values()] == [
        (200, "text/html"), (200, "text/javascript"), (200, "text/css")]
    html, js = pages["/"][2], pages["/page/page.js"][2]
    assert 'id="prompt"' in html and 'src="/page/page.js"' in html
    assert "script-src 'self'" in pages["/"][1]["content-security-policy"]
    assert not re.search(r"(src|href)=\"(https?:)?//", html)  # nothing from elsewhere
    assert "/v1/chat/completions" in js and "innerHTML" not in js  # answers set as text
    status, _, body = raw(server.port, "GET", "/page/../models.json")
    assert status == 404 and "no route" in body["error"]["message"]


@pytest.mark.skipif(shutil.which("node") is None, reason="no Node.js to run the page script")
@pytest.mark.parametrize("mode", ["chat", "completion"])
def test_the_page_script_streams_each_models_answer(client, server, mode):
    """page.js run by Node against this server (a DOM stand-in, not a browser): each
    ticked model's column shows the answer the API gives, or the API's refusal."""
    page_js = Path(server_module.__file__).parent / "page" / "page.js"
    harness = Path(__file__).parent / "serve_page_harness.js"
    proc = subprocess.run(["node", str(harness), str(page_js), f"http://127.0.0.1:{server.port}",
                           KEY, mode, Q1, "12"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    shown = json.loads(proc.stdout)
    columns = {c["model"]: c for c in shown["columns"]}
    assert list(columns) == ["sft", "base"] and shown["status"] == ""
    for name, column in columns.items():
        if mode == "chat" and name == "base":  # no chat format: the API's one line
            assert column["done"] == "error" and "/v1/completions" in column["answer"]
            continue
        if mode == "chat":
            want = ask(client, model=name, messages=[{"role": "user", "content": Q1}],
                       max_tokens=12)
            text = want.choices[0].message.content
        else:
            want = client.completions.create(model=name, prompt=Q1, max_tokens=12,
                                             temperature=0)
            text = want.choices[0].text
        assert (column["done"], column["answer"]) == ("true", text) and text
        assert column["meta"].startswith(f"{want.choices[0].finish_reason} · "
                                         f"{want.usage.prompt_tokens} prompt + "
                                         f"{want.usage.completion_tokens} completion tokens")
