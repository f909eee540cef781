"""End to end: `snapfn serve` under gunicorn in a subprocess, on a free localhost port, over HTTP.

Servers: the tiny llama (token parity with `Engine.generate`, streamed and not, metrics,
disconnect cancellation, requests sent while it starts); the same with two workers set through
`GUNICORN_CMD_ARGS` (metrics summed across workers, an access log, a chunked body over the limit
refused with 413); a user function whose init hook takes 2 s (health 503 → 200
deterministically, requests held through start-up, function errors). Each server is stopped
with SIGTERM and must exit 0 leaving no process behind. A server whose start fails says why on
`/health`, then exits with gunicorn's boot-error code (3).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from snapfn.handler.llm.engine.request import SamplingParams

from activator_client import read_listen_url
from parity import our_engine

pytestmark = pytest.mark.slow
MODEL = "tiny"
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
SLOW_FUNCTION = """
import time
from snapfn.handler.api import init

@init
def slow_start():
    time.sleep(2.0)

def handler(event, context):
    if event.get("fail"):
        raise ValueError("asked to fail")
    return {"echo": event, "request_id": context.request_id}
"""
NUM_EARLY_REQUESTS = 8


SERVE = [sys.executable, "-m", "snapfn.handler.cli", "serve"]


class Server:
    """A `snapfn serve` subprocess in its own session; `url` once it printed where it listens."""

    def __init__(self, args: list[str], workdir: Path, **env_vars: str) -> None:
        env = {**os.environ, "XDG_CACHE_HOME": str(workdir / "cache"), "OMP_NUM_THREADS": "1"}
        env.pop("SNAPFN_API_KEY", None)
        env.update(env_vars)
        self.log_path = workdir / "server.log"
        self.proc = subprocess.Popen(
            [*SERVE, "--host", "127.0.0.1", "--port", "0", "--threads", "16", *args],
            stdout=subprocess.PIPE,
            stderr=self.log_path.open("w"),
            text=True,
            env=env,
            start_new_session=True,  # its own process group: the orphan check looks there
        )
        self.url = self._read_url(timeout_s=60)

    def _read_url(self, timeout_s: float) -> str:
        tail = lambda: self.log_path.read_text()[-3000:]  # noqa: E731
        return read_listen_url(self.proc, "server", tail, timeout_s)

    def workers(self) -> list[int]:
        pid = self.proc.pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return [int(c) for c in children]

    def stop(self) -> None:
        """SIGTERM: gunicorn drains, workers close their runtimes, everything exits."""
        workers = self.workers()
        assert workers, "gunicorn has no worker"
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=40)
        assert code == 0, self.log_path.read_text()[-3000:]
        with pytest.raises(ProcessLookupError):
            os.killpg(self.proc.pid, 0)  # no process left in the server's group
        assert not [w for w in workers if Path(f"/proc/{w}").exists()]


def health_statuses(url: str, timeout_s: float = 60) -> list[int]:
    """Poll /health until it answers 200; every status seen, in order."""
    seen, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen.append(requests.get(f"{url}/health", timeout=30).status_code)
        if seen[-1] == 200:
            break
        time.sleep(0.02)
    return seen


def early_requests(url: str, path: str, bodies: list[dict]) -> list[requests.Response]:
    """Send `bodies` concurrently right away (while the worker is starting)."""
    with ThreadPoolExecutor(len(bodies)) as pool:
        futures = [pool.submit(requests.post, f"{url}{path}", json=b, timeout=60) for b in bodies]
        return [f.result() for f in futures]


def sse_events(response: requests.Response) -> list:
    events = []
    for line in response.iter_lines(decode_unicode=True):
        if line.startswith("data: "):
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def metric_samples(url: str) -> dict:
    text = requests.get(f"{url}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


# ---- the LLM server -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(llama_with_tokenizer, tmp_path_factory):
    d = shutil.copytree(llama_with_tokenizer, tmp_path_factory.mktemp("e2e") / "tiny")
    (d / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return d


@pytest.fixture(scope="module")
def llm_server(model_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("llm-server")
    server = Server(
        ["--model", str(model_dir), "--model-name", MODEL, "--kv-cache-mb", "4"], workdir
    )
    bodies = [
        {"model": MODEL, "prompt": "hello", "max_tokens": 4, "temperature": 0}
        for _ in range(NUM_EARLY_REQUESTS)
    ]
    with ThreadPoolExecutor(2) as pool:
        early = pool.submit(early_requests, server.url, "/v1/completions", bodies)
        health = pool.submit(health_statuses, server.url)
        server.early, server.health = early.result(), health.result()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def engine(model_dir):
    return our_engine(model_dir)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from snapfn.handler.llm.tokenizer import Tokenizer

    return Tokenizer.from_dir(model_dir)


def greedy_ids(engine, prompt_ids: list[int], n: int) -> list[int]:
    params = SamplingParams(max_new_tokens=n, temperature=0.0)
    return list(engine.generate([prompt_ids], params)[0].token_ids)


def test_health_ends_up_and_early_requests_are_all_answered(llm_server):
    assert llm_server.health[-1] == 200
    assert set(llm_server.health) <= {503, 200}
    assert [r.status_code for r in llm_server.early] == [200] * NUM_EARLY_REQUESTS
    texts = {r.json()["choices"][0]["text"] for r in llm_server.early}
    assert len(texts) == 1  # greedy: every early request got the same answer


@pytest.mark.parametrize("stream", [False, True])
def test_completion_tokens_match_engine_greedy(llm_server, engine, tokenizer, stream):
    body = {
        "model": MODEL,
        "prompt": "hello world",
        "max_tokens": 10,
        "temperature": 0,
        "stream": stream,
        "return_token_ids": True,
    }
    r = requests.post(f"{llm_server.url}/v1/completions", json=body, timeout=60, stream=stream)
    assert r.status_code == 200
    if stream:
        events = sse_events(r)
        assert events[-1] == "[DONE]"
        ids = [t for e in events[:-1] for t in e["choices"][0]["token_ids"]]
    else:
        ids = r.json()["choices"][0]["token_ids"]
    assert ids == greedy_ids(engine, tokenizer.encode("hello world"), 10)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_tokens_match_engine_greedy(llm_server, engine, tokenizer, stream):
    messages = [{"role": "user", "content": "hello"}]
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 8,
        "temperature": 0,
        "stream": stream,
        "return_token_ids": True,
    }
    r = requests.post(f"{llm_server.url}/v1/chat/completions", json=body, timeout=60, stream=stream)
    assert r.status_code == 200
    if stream:
        events = sse_events(r)
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        ids = [t for e in events[:-1] for t in e["choices"][0]["token_ids"]]
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    else:
        ids = r.json()["choices"][0]["token_ids"]
        text = r.json()["choices"][0]["message"]["content"]
    prompt = tokenizer.encode(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True),
        add_special_tokens=False,
    )
    expected = greedy_ids(engine, prompt, 8)
    assert ids == expected and text == tokenizer.decode(expected)


def test_disconnect_cancels_generation_over_http(llm_server):
    before = metric_samples(llm_server.url)
    cancelled = ("snapfn_engine_requests_total", (("outcome", "cancelled"),))
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 480, "temperature": 0, "stream": True}
    r = requests.post(f"{llm_server.url}/v1/completions", json=body, timeout=60, stream=True)
    assert next(r.iter_lines()).startswith(b"data: ")
    r.close()
    deadline, samples = time.monotonic() + 20, before
    while time.monotonic() < deadline:
        samples = metric_samples(llm_server.url)
        if samples[cancelled] > before[cancelled]:
            break
        time.sleep(0.05)
    assert samples[cancelled] == before[cancelled] + 1
    assert samples[("snapfn_kv_cache_usage_ratio", ())] == 0.0


def test_metrics_parse_with_the_prometheus_parser(llm_server):
    samples = metric_samples(llm_server.url)
    assert samples[("snapfn_readiness", (("state", "up"),))] == 1.0
    ok = (("endpoint", "/v1/completions"), ("method", "POST"), ("status", "200"))
    assert samples[("snapfn_http_requests_total", ok)] >= NUM_EARLY_REQUESTS
    assert any(name == "snapfn_startup_stage_seconds" for name, _ in samples)


# ---- two workers, set through GUNICORN_CMD_ARGS ---------------------------------------------
@pytest.fixture(scope="module")
def two_workers(model_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("two-workers")
    args = ["--model", str(model_dir), "--model-name", MODEL, "--kv-cache-mb", "4"]
    server = Server(
        [*args, "--max-body-bytes", "100000"],
        workdir,
        GUNICORN_CMD_ARGS=f"--workers 2 --access-logfile {workdir / 'access.log'}",
    )
    server.access_log = workdir / "access.log"
    assert health_statuses(server.url)[-1] == 200
    yield server
    server.stop()


def test_gunicorn_cmd_args_are_honoured(two_workers):
    assert len(two_workers.workers()) == 2
    requests.get(f"{two_workers.url}/v1/models", timeout=30)
    deadline = time.monotonic() + 10
    while (
        not two_workers.access_log.exists()
        or "GET /v1/models" not in two_workers.access_log.read_text()
    ):
        assert time.monotonic() < deadline, "no access log line"
        time.sleep(0.1)


def test_metrics_sum_every_worker(two_workers):
    url, n = two_workers.url, 24
    ok = (
        "snapfn_http_requests_total",
        (("endpoint", "/v1/models"), ("method", "GET"), ("status", "200")),
    )
    before = metric_samples(url).get(ok, 0.0)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: requests.get(f"{url}/v1/models", timeout=30), range(n)))
    up = ("snapfn_readiness", (("state", "up"),))
    deadline = time.monotonic() + 10  # each worker copies its readiness in once a second
    while metric_samples(url).get(up) != 2.0:
        assert time.monotonic() < deadline, "the two workers' readiness never summed to 2"
        time.sleep(0.2)
    for _ in range(6):  # whichever worker answers the scrape, every worker's counts
        samples = metric_samples(url)
        assert samples[ok] == before + n
    text = requests.get(f"{url}/metrics", timeout=10).text
    assert "_created" not in text
    pids = {dict(labels).get("pid") for name, labels in samples if name == "snapfn_startup_seconds"}
    assert len(pids) == 2  # one start-up per worker


def test_a_chunked_body_over_the_limit_is_413(two_workers):
    def body():
        yield b'{"prompt": "'
        for _ in range(200):
            yield b"x" * 1000
        yield b'"}'

    r = requests.post(
        f"{two_workers.url}/v1/completions",
        data=body(),
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_entity_too_large"
    small = requests.post(
        f"{two_workers.url}/v1/completions",
        data=iter([b'{"prompt": "hello", ', b'"max_tokens": 2}']),
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert small.status_code == 200, small.text


# ---- a start that fails ---------------------------------------------------------------------
def test_a_failed_start_says_why_then_exits_non_zero(tmp_path):
    server = Server(
        ["--model", str(tmp_path / "no-such-model")], tmp_path, SNAPFN_FAILED_START_EXIT_S="3"
    )
    deadline, body = time.monotonic() + 30, None
    while time.monotonic() < deadline:
        r = requests.get(f"{server.url}/health", timeout=10)
        if r.json()["status"] == "failed":
            body = r.json()
            break
        time.sleep(0.05)
    assert body is not None and r.status_code == 503 and body["reason"]
    code = server.proc.wait(timeout=60)
    assert code == 3, server.log_path.read_text()[-3000:]
    assert "start failed" in server.log_path.read_text()


# ---- the function server --------------------------------------------------------------------
@pytest.fixture(scope="module")
def function_server(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("fn-server")
    (workdir / "slow_fn.py").write_text(SLOW_FUNCTION)
    server = Server(["--function", "slow_fn:handler", "--function-dir", str(workdir)], workdir)
    bodies = [{"i": i} for i in range(NUM_EARLY_REQUESTS)]
    with ThreadPoolExecutor(2) as pool:
        early = pool.submit(early_requests, server.url, "/invoke", bodies)
        health = pool.submit(health_statuses, server.url)
        server.early, server.health = early.result(), health.result()
    yield server
    server.stop()


def test_function_health_goes_503_then_200(function_server):
    health = function_server.health
    assert health[0] == 503 and health[-1] == 200
    assert set(health) == {503, 200}


def test_function_requests_sent_while_starting_are_all_answered(function_server):
    assert [r.status_code for r in function_server.early] == [200] * NUM_EARLY_REQUESTS
    assert [r.json()["echo"] for r in function_server.early] == [
        {"i": i} for i in range(NUM_EARLY_REQUESTS)
    ]


def test_function_error_is_a_structured_500(function_server):
    r = requests.post(f"{function_server.url}/invoke", json={"fail": True}, timeout=30)
    assert r.status_code == 500 and r.headers["X-Snapfn-Function-Error"] == "Unhandled"
    assert r.json()["errorType"] == "ValueError"
    assert requests.post(f"{function_server.url}/invoke", json={}, timeout=30).status_code == 200
