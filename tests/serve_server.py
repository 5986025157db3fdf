"""A ``lmforge serve`` app on a free loopback port, in a thread of the test process (so a
test can watch its queues and patch its generation), and raw HTTP helpers for what the
``openai`` client would not send (malformed JSON, a client that hangs up mid-stream)."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from email.message import Message
from pathlib import Path

import uvicorn

from lmforge.serve.app import ServeSettings, create_app
from lmforge.serve.models import load_models


class ThreadServer:
    """uvicorn serving ``models`` ({name: path}) with ``settings`` until ``stop``;
    ``root`` is the pipeline's folder its headline figures are read from."""

    def __init__(self, models: dict[str, Path], settings: ServeSettings,
                 root: Path = Path(".")) -> None:
        self.models = load_models(models, "cpu", settings.queue_size, root)
        self.app = create_app(self.models, settings)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))  # a free port, held from here on: no race for it
        self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, "the server to start")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.app.state.executor.shutdown(wait=False)


def wait_for(condition, what: str, timeout: float = 10.0) -> None:
    """Poll ``condition`` until it holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def raw(port: int, method: str, path: str, body: bytes | dict | None = None,
        headers: dict[str, str] | None = None) -> tuple[int, Message, dict]:
    """(status, headers, JSON body) of one plain HTTP request."""
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.headers, json.loads(resp.read())  # headers: any case
    finally:
        conn.close()


class RawStream:
    """A streamed request on a bare socket: read events one at a time, hang up at will."""

    def __init__(self, port: int, path: str, body: dict, key: str | None = None) -> None:
        data = json.dumps(body).encode()
        auth = f"Authorization: Bearer {key}\r\n" if key else ""
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                          f"\r\n{auth}Content-Length: {len(data)}\r\n\r\n".encode() + data)
        self.buffer = b""

    def event(self) -> str:
        """The next ``data: ...`` payload (the HTTP head and chunk sizes skipped)."""
        while True:
            start = self.buffer.find(b"data: ")
            end = self.buffer.find(b"\n\n", start)
            if start >= 0 and end >= 0:
                payload = self.buffer[start + 6:end].decode()
                self.buffer = self.buffer[end + 2:]
                return payload
            piece = self.sock.recv(65536)
            if not piece:
                raise AssertionError(f"the stream ended: {self.buffer[-200:]!r}")
            self.buffer += piece

    def close(self) -> None:
        self.sock.close()
