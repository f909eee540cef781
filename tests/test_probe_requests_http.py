"""Odd requests at the HTTP front door (`handler/http/`), on the embedded model: each is a 4xx in
OpenAI's error shape naming what to fix, or served, and never grows the server's state.
Adversarial ones at the OpenAI endpoints (`handler/http/openai/`, `generation.py`,
`json_io.py`): a 400 whose `param` names the field to fix and whose `code` is the API's, never a
5xx nor an interpreter's own wording."""

from __future__ import annotations

import pytest
from test_http import completion, llm_runtime, sse

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


def error_of(r, status: int = 400) -> dict:
    assert r.status_code == status, r.get_data(as_text=True)[:300]
    return r.json["error"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": [1, 2, 10**9]}, "prompt"),
        ({"prompt": [[1], [2**70]]}, "prompt"),
        ({"prompt": "hi", "logit_bias": {"99999999": 5}}, "logit_bias"),
        ({"prompt": [5], "logit_bias": {"3": 1, "4096": -1}}, "logit_bias"),
    ],
)
def test_token_ids_outside_the_vocabulary_name_their_field(client, body, param):
    error = error_of(completion(client, max_tokens=1, **body))
    assert error["param"] == param and error["code"] == "out_of_range", error
    assert "out of range [0, 4096)" in error["message"]


def test_a_grammar_that_does_not_compile_is_an_invalid_value(client):
    error = error_of(completion(client, prompt="hi", max_tokens=1, guided_regex="(("))
    assert error["param"] == "guided_regex" and error["code"] == "invalid_value", error
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}
    error = error_of(completion(client, prompt="hi", max_tokens=1, response_format=schema))
    assert error["param"] == "response_format" and error["code"] == "invalid_value", error


def test_a_grammar_that_fails_at_its_first_token_names_its_field(client):
    """A regex that compiles but is past the library's lexer limits fails while generating: a
    400 naming the field, whole or streamed."""
    body = {"prompt": "hi", "max_tokens": 4, "guided_regex": "a{1000000}"}
    error = error_of(completion(client, **body))
    assert error["param"] == "guided_regex" and error["code"] == "invalid_value", error
    events = sse(completion(client, stream=True, **body).data)
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["param"] == "guided_regex" and error["code"] == "invalid_value", error


def test_an_integer_too_long_to_convert_is_refused_in_the_clients_terms(client):
    body = '{"prompt": "hi", "max_tokens": ' + "9" * 5000 + "}"
    r = client.post("/v1/completions", data=body, content_type="application/json")
    error = error_of(r)
    assert error["code"] == "invalid_json" and "5000 digits" in error["message"], error
    assert "sys." not in error["message"]


def test_tokenize_refuses_a_prompt_and_messages_together(client):
    body = {"prompt": "hello", "messages": [{"role": "user", "content": "x"}]}
    error = error_of(client.post("/tokenize", json=body))
    assert error["param"] == "prompt" and "not both" in error["message"], error


def test_guided_choice_is_refused_past_the_parsers_row_limit(client):
    """llguidance's parser rows hold 2000 items, one per choice and one more: a longer list
    is refused up front, not failed at its first token with advice about grammars."""
    served = completion(
        client, prompt="hi", max_tokens=4, guided_choice=[f"c{i}" for i in range(1999)]
    )
    assert served.status_code == 200 and served.json["choices"][0]["finish_reason"] == "stop"
    r = completion(client, prompt="hi", max_tokens=4, guided_choice=[f"c{i}" for i in range(2000)])
    error = error_of(r)
    assert error["param"] == "guided_choice" and "1999" in error["message"], error
