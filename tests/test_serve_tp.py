"""`snapfn serve --tp-size 2` under gunicorn: the worker serves as rank 0 and starts rank 1
(`python -m snapfn.handler.llm.follower`), which follows its steps in lock step. Concurrent
completions, streamed and not, and a cancelled stream answer what one rank's engine does;
SIGTERM stops both ranks and leaves no process behind."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from parity import our_engine
from test_serve_e2e import MODEL, Server, greedy_ids, health_statuses, sse_events

pytestmark = pytest.mark.slow
PROMPTS = ["hello world", "the quick brown fox", "a", "tensor parallel ranks in lock step"]


@pytest.fixture(scope="module")
def tp_server(llama_with_tokenizer, tmp_path_factory):
    model = shutil.copytree(llama_with_tokenizer, tmp_path_factory.mktemp("tp") / "tiny")
    workdir = tmp_path_factory.mktemp("tp-server")
    args = ["--model", str(model), "--model-name", MODEL, "--kv-cache-mb", "4", "--tp-size", "2"]
    server = Server(args, workdir)
    assert health_statuses(server.url)[-1] == 200, server.log_path.read_text()[-3000:]
    server.model = model
    yield server
    server.stop()


def _completion(url: str, prompt: str, stream: bool, n: int = 10) -> list[int]:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0,
        "stream": stream,
        "return_token_ids": True,
    }
    r = requests.post(f"{url}/v1/completions", json=body, timeout=120, stream=stream)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["choices"][0]["token_ids"]
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    return [t for e in events[:-1] for t in e["choices"][0]["token_ids"]]


def test_concurrent_completions_over_two_ranks_match_one_rank(tp_server):
    from snapfn.handler.llm.tokenizer import Tokenizer

    engine, tokenizer = our_engine(tp_server.model), Tokenizer.from_dir(tp_server.model)
    jobs = [(p, stream) for p in PROMPTS for stream in (False, True)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: _completion(tp_server.url, *job), jobs))
    for (prompt, _), ids in zip(jobs, got, strict=True):
        assert ids == greedy_ids(engine, tokenizer.encode(prompt), 10), prompt
    log = tp_server.log_path.read_text()
    assert "starting ranks 1-1 of 2" in log and "[snapfn rank 1] health_check" in log


def test_a_cancelled_stream_leaves_both_ranks_serving(tp_server):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 400, "temperature": 0, "stream": True}
    r = requests.post(f"{tp_server.url}/v1/completions", json=body, timeout=60, stream=True)
    assert next(r.iter_lines()).startswith(b"data: ")
    r.close()  # the server cancels it on both ranks
    assert len(_completion(tp_server.url, "hello world", stream=False, n=6)) == 6


def test_a_rank_that_dies_is_reported_on_health(llama_with_tokenizer, tmp_path):
    """Rank 1 killed: rank 0 stops serving, and /health says which rank died and how."""
    import os
    import signal
    import time
    from pathlib import Path

    args = ["--model", str(llama_with_tokenizer), "--kv-cache-mb", "4", "--tp-size", "2"]
    server = Server(args, tmp_path)
    try:
        assert health_statuses(server.url)[-1] == 200, server.log_path.read_text()[-3000:]
        (worker,) = server.workers()
        (rank1,) = [
            int(p) for p in Path(f"/proc/{worker}/task/{worker}/children").read_text().split()
        ]
        os.kill(rank1, signal.SIGKILL)
        deadline, health = time.monotonic() + 30, None
        while time.monotonic() < deadline:
            health = requests.get(f"{server.url}/health", timeout=10)
            if health.status_code != 200:
                break
            time.sleep(0.2)
        assert health.status_code == 503, health.text
        assert f"rank 1 exited with status {-signal.SIGKILL}: the group is down" in health.text
    finally:
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(timeout=40)
    with pytest.raises(ProcessLookupError):
        os.killpg(server.proc.pid, 0)  # nothing of the server left
