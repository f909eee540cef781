"""Odd requests at the HTTP front door (`handler/http/`), on the embedded model: each is a 4xx in
OpenAI's error shape naming what to fix, or served, and never grows the server's state."""

from __future__ import annotations

import pytest
from test_http import completion, llm_runtime

from snapfn.handler.http.app import create_app
from snapfn.handler.http.serve_config import ServeConfig
from snapfn.handler.llm.embedded import embedded_model_dir
from snapfn.snapshot.stages import Readiness

MODEL = "tiny"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    runtime = llm_runtime(embedded_model_dir(), tmp_path_factory.mktemp("cache"))
    runtime.start(background=False)
    assert runtime.readiness.state is Readiness.UP, runtime.readiness.reason
    yield create_app(runtime, ServeConfig(model_name=MODEL)).test_client()
    runtime.close()


def test_unknown_methods_share_one_metrics_label(client):
    for method in ("FOOBAR", "BREWCOFFEE", "PROPFIND"):
        r = client.open("/health", method=method)
        assert r.status_code == 405 and r.json["error"]["code"] == "method_not_allowed"
    text = client.get("/metrics").get_data(as_text=True)
    assert 'method="FOOBAR"' not in text and 'method="PROPFIND"' not in text
    assert 'endpoint="unmatched",method="other",status="405"} 3.0' in text


def test_a_string_too_long_is_an_invalid_value(client):
    schema = {"type": "json_schema", "json_schema": {"name": "x" * 65, "schema": {}}}
    r = completion(client, prompt="hi", max_tokens=1, response_format=schema)
    assert r.status_code == 400 and r.json["error"]["code"] == "invalid_value", r.json


def test_tokenize_takes_null_messages_as_left_out(client):
    r = client.post("/tokenize", json={"prompt": "hello", "messages": None})
    assert r.status_code == 200, r.json
    assert r.json["tokens"] == client.post("/tokenize", json={"prompt": "hello"}).json["tokens"]


def test_invoke_takes_a_null_prompt_field_as_left_out(client):
    both_given = client.post("/invoke", json={"prompt": "hi", "prompt_ids": [1, 2]})
    assert both_given.status_code == 400 and "exactly one" in both_given.json["error"]["message"]
    for body in ({"prompt": "hi", "prompt_ids": None}, {"prompt_ids": [1, 2], "messages": None}):
        r = client.post("/invoke", json={**body, "max_tokens": 2})
        assert r.status_code == 200, r.json
        assert len(r.json["token_ids"]) == 2
    r = client.post("/invoke", json={"prompt": None})
    assert r.status_code == 400 and "got none" in r.json["error"]["message"]


def test_a_stream_whose_grammar_fails_ends_with_its_error_then_done(client):
    """A request's own failure mid-stream (a grammar past the library's limits, which compiles
    and then fails at its first token) is an invalid_request_error event, then `[DONE]`."""
    from test_http import sse

    r = completion(client, prompt="hi", max_tokens=4, stream=True, guided_regex="(a{1000}){1000}")
    assert r.status_code == 200, r.data[:300]
    events = sse(r.data)
    assert events[-1] == "[DONE]", events[-3:]
    error = events[-2]["error"]
    assert (
        error["type"] == "invalid_request_error" and "structured output failed" in error["message"]
    )
    followed = completion(client, prompt="hi", max_tokens=2)
    assert followed.status_code == 200
