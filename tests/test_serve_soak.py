"""Soak: `snapfn serve` (the embedded model, one worker) under a steady stream of hostile and
abandoned requests, while its worker's resident memory is sampled.

For `SOAK_S` seconds, `CLIENTS` threads send, in turn: a prompt just under the 4 MiB body limit
(refused by its length before any encoding: 400 context_length_exceeded), the same as a chat
message, a chunked body over the limit (413), a prompt holding a lone surrogate (400
invalid_unicode), a streamed completion abandoned after its first chunk (cancelled, KV freed),
and a plain completion (200). Every answer must be the expected status, none a 5xx. The
worker's RSS, sampled twice a second, must be flat once warm: the growth from the end of the
warm-up to the end, and over the second half alone, stays under `MAX_GROWTH_MB`. The figures
are printed (`pytest -s`) and kept in the test's report.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import requests

from test_serve_e2e import Server, health_statuses

pytestmark = pytest.mark.slow

SOAK_S = 40.0
WARMUP_S = 8.0
CLIENTS = 4
MAX_GROWTH_MB = 48.0
BODY_LIMIT = 4 << 20


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def oversized_completion() -> bytes:
    head, tail = b'{"prompt": "', b'", "max_tokens": 4}'
    return head + b"a" * (BODY_LIMIT - len(head) - len(tail) - 16) + tail


def oversized_chat() -> bytes:
    head = b'{"messages": [{"role": "user", "content": "'
    tail = b'"}], "max_tokens": 4}'
    return head + b"b " * ((BODY_LIMIT - len(head) - len(tail) - 16) // 2) + tail


def chunks_over_the_limit():
    yield b'{"prompt": "'
    for _ in range(BODY_LIMIT // (1 << 16) + 2):
        yield b"c" * (1 << 16)
    yield b'"}'


class Client(threading.Thread):
    """Sends the request mix round after round until `stop`, counting (kind, status)."""

    def __init__(self, url: str, stop: threading.Event, bodies: dict[str, bytes]) -> None:
        super().__init__(daemon=True)
        self.url, self.stop, self.bodies = url, stop, bodies
        self.seen: Counter[tuple[str, int]] = Counter()
        self.session = requests.Session()

    def post(self, kind: str, path: str, **kw) -> None:
        headers = {"Content-Type": "application/json"}
        r = self.session.post(f"{self.url}{path}", headers=headers, timeout=60, **kw)
        self.seen[(kind, r.status_code)] += 1
        r.close()

    def abandoned_stream(self) -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 200, "stream": True, "ignore_eos": True}
        r = self.session.post(f"{self.url}/v1/completions", json=body, stream=True, timeout=60)
        first = next(r.iter_lines())
        self.seen[("abandoned", r.status_code if first.startswith(b"data: ") else -1)] += 1
        r.close()  # the server sees the client go: the generation is cancelled

    def run(self) -> None:
        while not self.stop.is_set():
            self.post("oversized", "/v1/completions", data=self.bodies["completion"])
            self.post("oversized_chat", "/v1/chat/completions", data=self.bodies["chat"])
            self.post("chunked", "/v1/completions", data=chunks_over_the_limit())
            self.post("surrogate", "/v1/completions", data=b'{"prompt": "a\\ud800"}')
            self.abandoned_stream()
            self.post("plain", "/v1/completions", data=b'{"prompt": "Once", "max_tokens": 4}')


EXPECTED = {
    "oversized": 400,
    "oversized_chat": 400,
    "chunked": 413,
    "surrogate": 400,
    "abandoned": 200,
    "plain": 200,
}


def test_worker_memory_stays_flat_under_oversized_and_cancelled_requests(tmp_path):
    server = Server(["--threads", "8"], tmp_path)
    try:
        assert health_statuses(server.url)[-1] == 200
        (worker,) = server.workers()
        bodies = {"completion": oversized_completion(), "chat": oversized_chat()}
        stop, samples = threading.Event(), []
        clients = [Client(server.url, stop, bodies) for _ in range(CLIENTS)]
        t0 = time.monotonic()
        for c in clients:
            c.start()
        while time.monotonic() - t0 < SOAK_S:
            samples.append((time.monotonic() - t0, rss_mb(worker)))
            time.sleep(0.5)
        stop.set()
        for c in clients:
            c.join(60)
        seen = sum((c.seen for c in clients), Counter())
        metrics = requests.get(f"{server.url}/metrics", timeout=30).text
    finally:
        server.stop()

    warm = [mb for t, mb in samples if t >= WARMUP_S]
    half = [mb for t, mb in samples if t >= WARMUP_S + (SOAK_S - WARMUP_S) / 2]
    start_mb, end_mb = statistics.median(warm[:4]), statistics.median(warm[-4:])
    report = {
        "requests": {f"{k} {s}": n for (k, s), n in sorted(seen.items())},
        "rss_mb_first": round(samples[0][1], 1),
        "rss_mb_after_warmup": round(start_mb, 1),
        "rss_mb_end": round(end_mb, 1),
        "rss_mb_peak": round(max(mb for _, mb in samples), 1),
        "growth_mb_after_warmup": round(end_mb - start_mb, 1),
        "growth_mb_second_half": round(
            statistics.median(half[-4:]) - statistics.median(half[:4]), 1
        ),
    }
    print("\nsoak:", json.dumps(report))
    unexpected = {k: n for k, n in seen.items() if EXPECTED[k[0]] != k[1]}
    assert not unexpected, report
    assert all(seen[(kind, status)] >= 3 for kind, status in EXPECTED.items()), report
    assert report["growth_mb_after_warmup"] < MAX_GROWTH_MB, report
    assert report["growth_mb_second_half"] < MAX_GROWTH_MB / 2, report
    cancelled = [line for line in metrics.splitlines() if 'outcome="cancelled"' in line]
    assert cancelled and float(cancelled[0].split()[-1]) >= seen[("abandoned", 200)] * 0.9
