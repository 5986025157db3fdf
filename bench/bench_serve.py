"""``lmforge serve`` under load on loopback: every request answered or refused, none lost.

    python bench/bench_serve.py                                   # the pipeline's models
    python bench/bench_serve.py --model sft=models/sft --requests 200 --clients 32

Starts ``lmforge serve`` in its own process, then ``--clients`` threads send
``--requests`` chat requests between them (greedy, ``max_tokens`` 16, the served models
in turn), each on its own connection, none retried. Counts what came back -- answered
(200), refused with 429 (and a ``Retry-After``), anything else, and lost (no answer
within ``--timeout`` s, or the connection dropped) -- and reports requests/s, the p50 and
p99 latency of the answered ones, and the server's resident memory after a warm-up and
after the run (from /proc: it should stay flat). ``--out`` writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

PROMPTS = ["Give the antonym of the adjective \"cold\".", "Name a colour.",
           "What is two plus two?", "Write one sentence about the sea."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    """Resident memory of process ``pid`` in MiB (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def request(port: int, model: str, prompt: str, max_tokens: int, timeout: float
            ) -> tuple[str, float]:
    """One chat request: (outcome, seconds); outcome is the status, or 'lost'."""
    body = json.dumps({"model": model, "temperature": 0, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": prompt}]})
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", body,
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        answer = json.loads(resp.read())
        if resp.status == 429 and resp.getheader("Retry-After") is None:
            return "429 without Retry-After", time.perf_counter() - start
        if resp.status == 200 and "usage" not in answer:
            return "200 without usage", time.perf_counter() - start
        return str(resp.status), time.perf_counter() - start
    except (OSError, http.client.HTTPException, ValueError):
        return "lost", time.perf_counter() - start
    finally:
        conn.close()


def load(port: int, models: list[str], n: int, clients: int, max_tokens: int,
         timeout: float) -> tuple[list[tuple[str, float]], float]:
    """``n`` requests from ``clients`` threads: their (outcome, seconds), and the wall
    time of the whole run."""
    results: list[tuple[str, float]] = []
    lock, next_i = threading.Lock(), iter(range(n))

    def client() -> None:
        while True:
            with lock:
                i = next(next_i, None)
            if i is None:
                return
            got = request(port, models[i % len(models)], PROMPTS[i % len(PROMPTS)],
                          max_tokens, timeout)
            with lock:
                results.append(got)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - start


def served_models(port: int, deadline: float) -> list[str]:
    """The served names, once the server answers (waiting until ``deadline``)."""
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/v1/models")
            return [m["id"] for m in json.loads(conn.getresponse().read())["data"]]
        except OSError:
            time.sleep(0.5)
    raise SystemExit("bench_serve: the server did not start")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", action="append", default=[], help="NAME=PATH, as lmforge serve")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--queue-size", type=int, default=8)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    port = free_port()
    cmd = [sys.executable, "-m", "lmforge.cli", "serve", "--port", str(port),
           "--queue-size", str(args.queue_size), "--log-level", "warning"]
    for spec in args.model:
        cmd += ["--model", spec]
    server = subprocess.Popen(cmd, env={**os.environ, "LMFORGE_API_KEY": ""})
    try:
        models = served_models(port, time.monotonic() + 120)
        load(port, models, 2 * len(models), 1, args.max_tokens, args.timeout)  # warm-up
        rss_before = rss_mib(server.pid)
        results, wall = load(port, models, args.requests, args.clients, args.max_tokens,
                             args.timeout)
        rss_after = rss_mib(server.pid)
    finally:
        server.terminate()
        server.wait(30)
    report(args, models, results, wall, rss_before, rss_after)


def report(args: argparse.Namespace, models: list[str], results: list[tuple[str, float]],
           wall: float, rss_before: float, rss_after: float) -> None:
    """Print the figures (and write them to ``--out``)."""
    counts = Counter(outcome for outcome, _ in results)
    answered = sorted(s for outcome, s in results if outcome == "200")
    q = statistics.quantiles(answered, n=100) if len(answered) >= 2 else [float("nan")] * 99
    figures = {"models": models, "requests": args.requests, "clients": args.clients,
               "max_tokens": args.max_tokens, "queue_size": args.queue_size,
               "outcomes": dict(counts), "unanswered": args.requests - len(results),
               "wall_s": round(wall, 2), "requests_per_s": round(len(results) / wall, 1),
               "answered_per_s": round(len(answered) / wall, 1),
               "p50_s": round(q[49], 3), "p99_s": round(q[98], 3),
               "rss_mib_before": round(rss_before, 1), "rss_mib_after": round(rss_after, 1)}
    print(json.dumps(figures, indent=2))
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2) + "\n")


def markdown(paths: list[Path]) -> str:
    """bench/RESULTS.md's table of committed ``--out`` files, one row each."""
    lines = ["| requests, clients, queue | answered | 429 | other / lost | wall | requests/s "
             "(answered/s) | p50 / p99 of answered | server RSS after warm-up → after |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for path in paths:
        f = json.loads(path.read_text(encoding="utf-8"))
        outcomes = dict(f["outcomes"])
        answered, refused = outcomes.pop("200", 0), outcomes.pop("429", 0)
        lines.append(
            f"| {f['requests']}, {f['clients']}, queue {f['queue_size']} | {answered} | "
            f"{refused} | {sum(outcomes.values())} / {f['unanswered']} | {f['wall_s']:.1f} s | "
            f"{f['requests_per_s']:.1f} ({f['answered_per_s']:.1f}) | {f['p50_s']:.2f} s / "
            f"{f['p99_s']:.2f} s | {f['rss_mib_before']:.1f} → {f['rss_mib_after']:.1f} MiB |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
