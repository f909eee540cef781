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


def test_structured_and_prefix_shared_requests_over_two_ranks_match_one_rank(tp_server):
    """A guided request (every rank masks its own logits with its own matcher, advanced by the
    same tokens) and two prompts sharing full KV pages (every rank's prefix cache matches the
    same pages) answer what one rank's engine does."""
    from snapfn.handler.llm.engine.request import SamplingParams
    from snapfn.handler.llm.structured.compiler import GrammarCache
    from snapfn.handler.llm.structured.spec import spec_from_fields
    from snapfn.handler.llm.tokenizer import Tokenizer

    engine, tokenizer = our_engine(tp_server.model), Tokenizer.from_dir(tp_server.model)
    engine.attach_tokenizer(tokenizer, frozenset(tokenizer.eos_token_ids))
    vocab = engine.model.config.vocab_size
    engine.attach_grammars(GrammarCache(tokenizer, vocab, engine.eos_token_ids))
    guide = {"guided_regex": "(yes|no), [0-9]{2}"}
    body = {"model": MODEL, "prompt": "the answer is", "max_tokens": 12, "temperature": 0}
    r = requests.post(f"{tp_server.url}/v1/completions", json={**body, **guide}, timeout=120)
    assert r.status_code == 200, r.text
    params = SamplingParams(max_new_tokens=12, guide=spec_from_fields(guide))
    (want,) = engine.generate([tokenizer.encode("the answer is")], params)
    assert r.json()["choices"][0]["text"] == want.text
    shared = "a long shared system prompt for both ranks, " * 6
    for tail in ("first", "second"):
        ids = _completion(tp_server.url, shared + tail, stream=False, n=4)
        assert ids == greedy_ids(engine, tokenizer.encode(shared + tail), 4), tail
    assert _hit_tokens(tp_server.url) >= 16  # rank 0's: the second prompt found the first's


def _hit_tokens(url: str) -> float:
    import time

    from prometheus_client.parser import text_string_to_metric_families

    deadline, hits = time.monotonic() + 10, 0.0
    while time.monotonic() < deadline:  # the worker copies its engine's counters every second
        text = requests.get(f"{url}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            if family.name == "snapfn_prefix_cache_hit_tokens":
                hits = sum(s.value for s in family.samples if s.name.endswith("_total"))
        if hits:
            break
        time.sleep(0.2)
    return hits
