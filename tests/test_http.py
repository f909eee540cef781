"""The HTTP front door (`handler/http/app.py`) through Flask's test client, on a real WorkerRuntime.

Covers every endpoint, the start-up gate (`startup_gate.py`: wait, queue bound, timeout, failed
start), every bad-input class (`openai/schema.py`, `openai/parse.py`, `openai/params.py`: 4xx
with an OpenAI error body naming the field and a stable code, `json_io.py`), auth,
client-disconnect cancellation (`generation.py`: KV pages freed), the catch-all 500, and greedy
parity with `Engine.generate`.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from snapfn.handler.function.runtime import WorkerRuntime
from snapfn.handler.function.target import ServeTarget
from snapfn.handler.http.api_key import api_key_bytes, refusal
from snapfn.handler.http.app import create_app
from snapfn.handler.http.metrics import startup_metrics
from snapfn.handler.http.serve_config import ServeConfig
from snapfn.handler.llm.engine.request import SamplingParams
from snapfn.handler.llm.init_config import InitConfig
from snapfn.snapshot.stages import Readiness

from parity import our_engine

MODEL = "tiny"
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
FAILING_FUNCTION = """
def handler(event, context):
    if event.get("fail"):
        raise ValueError("asked to fail")
    return {"echo": event, "request_id": context.request_id}
"""


# ---- fixtures -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_model_dir(llama_with_tokenizer, tmp_path_factory):
    d = shutil.copytree(llama_with_tokenizer, tmp_path_factory.mktemp("chat") / "tiny")
    (d / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return d


def llm_runtime(model_dir: Path, cache_dir: Path, **init) -> WorkerRuntime:
    config = InitConfig(kv_cache_bytes_cpu=4 << 20, cache_dir=cache_dir, **init)
    return WorkerRuntime(ServeTarget(model_dir=model_dir, init_config=config))


@pytest.fixture(scope="module")
def runtime(chat_model_dir, tmp_path_factory):
    rt = llm_runtime(chat_model_dir, tmp_path_factory.mktemp("cache"))
    rt.start(background=False)
    assert rt.readiness.state is Readiness.UP, rt.readiness.reason
    yield rt
    rt.close()


@pytest.fixture(scope="module")
def client(runtime):
    return create_app(runtime, ServeConfig(model_name=MODEL)).test_client()


@pytest.fixture(scope="module")
def engine(chat_model_dir):
    return our_engine(chat_model_dir)


@pytest.fixture(scope="module")
def tokenizer(runtime):
    return runtime.llm.tokenizer


def greedy_ids(engine, prompt_ids: list[int], n: int) -> list[int]:
    params = SamplingParams(max_new_tokens=n, temperature=0.0)
    return list(engine.generate([prompt_ids], params)[0].token_ids)


def sse(data: bytes) -> list:
    """The `data:` payloads of a server-sent-event body, JSON-decoded except `[DONE]`."""
    events = [line[6:] for line in data.decode().split("\n\n") if line.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def completion(client, **body):
    return client.post("/v1/completions", json={"model": MODEL, **body})


def chat(client, **body):
    return client.post("/v1/chat/completions", json={"model": MODEL, **body})


def wait_for(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


# ---- health, startup, models, openapi -------------------------------------------------------
def test_health_up_and_startup_manifest(client):
    r = client.get("/health")
    assert r.status_code == 200 and r.json == {"status": "up", "reason": None}
    manifest = client.get("/startup").json
    assert manifest["kind"] == "init" and manifest["ok"]
    assert [s["name"] for s in manifest["stages"]][-1] == "health_check"


def test_health_generate_runs_a_real_token(client):
    r = client.get("/health/generate")
    assert r.status_code == 200
    assert r.json["status"] == "up" and isinstance(r.json["result"]["token"], int)


def test_models_and_openapi(client, runtime):
    models = client.get("/v1/models").json
    assert models["data"][0]["id"] == MODEL
    assert models["data"][0]["max_model_len"] == runtime.llm.max_req_input_len + 1
    spec = client.get("/openapi.json").json
    assert spec["openapi"].startswith("3.")
    assert {"/v1/completions", "/v1/chat/completions", "/invoke", "/health"} <= set(spec["paths"])
    assert "alternatives" in spec["info"]["description"]
    card = client.get(f"/v1/models/{MODEL}")
    assert card.status_code == 200 and card.json == models["data"][0]
    r = client.get("/v1/models/gpt-4")
    assert r.status_code == 404 and r.json["error"]["code"] == "model_not_found"
    assert client.get("/version").json["version"]


def test_health_is_503_while_starting_then_200(chat_model_dir, tmp_path):
    rt = llm_runtime(chat_model_dir, tmp_path)
    c = create_app(rt, ServeConfig(model_name=MODEL, retry_after_s=7)).test_client()
    r = c.get("/health")
    assert r.status_code == 503 and r.json["status"] == "starting"
    assert r.headers["Retry-After"] == "7"
    assert c.get("/startup").status_code == 503
    rt.start(background=False)
    try:
        assert c.get("/health").status_code == 200
    finally:
        rt.close()


def test_failed_start_is_503_with_the_reason(tmp_path):
    rt = llm_runtime(tmp_path / "no-such-model", tmp_path)
    rt.start(background=False)
    c = create_app(rt, ServeConfig(model_name=MODEL)).test_client()
    r = c.get("/health")
    assert r.status_code == 503 and r.json["status"] == "failed" and r.json["reason"]
    assert "Retry-After" not in r.headers
    r = completion(c, prompt="hello")
    assert r.status_code == 503 and r.json["error"]["code"] == "failed"
    assert "failed to start" in r.json["error"]["message"]
    assert c.get("/startup").json["ok"] is False


# ---- the start-up gate ----------------------------------------------------------------------
def test_requests_during_startup_wait_then_all_answered(chat_model_dir, tmp_path):
    rt = llm_runtime(chat_model_dir, tmp_path)
    app = create_app(rt, ServeConfig(model_name=MODEL, startup_queue_size=3))
    gate, results = app.extensions["snapfn"].gate, []

    def call():
        r = completion(app.test_client(), prompt="hello", max_tokens=3, temperature=0)
        results.append(r.status_code)

    waiters = [threading.Thread(target=call) for _ in range(3)]
    for t in waiters:
        t.start()
    assert wait_for(lambda: gate._waiters == 3)
    r = completion(app.test_client(), prompt="hello")  # the 4th: beyond the bound
    assert r.status_code == 503 and r.json["error"]["code"] == "queue_full"
    assert int(r.headers["Retry-After"]) > 0
    rt.start()
    for t in waiters:
        t.join(30)
    rt.close()
    assert results == [200, 200, 200]


def test_startup_wait_is_bounded_in_time(chat_model_dir, tmp_path):
    rt = llm_runtime(chat_model_dir, tmp_path)  # never started
    c = create_app(rt, ServeConfig(model_name=MODEL, startup_wait_s=0.2)).test_client()
    t0 = time.monotonic()
    r = c.post("/invoke", json={"prompt": "hello"})
    assert r.status_code == 503 and r.json["error"]["code"] == "timeout"
    assert "Retry-After" in r.headers and time.monotonic() - t0 < 5


# ---- completions ----------------------------------------------------------------------------
def test_completion_matches_engine_greedy(client, engine, tokenizer):
    r = completion(
        client, prompt="hello world", max_tokens=12, temperature=0, return_token_ids=True
    )
    assert r.status_code == 200
    body = r.json
    ids = tokenizer.encode("hello world")
    expected = greedy_ids(engine, ids, 12)
    (choice,) = body["choices"]
    assert choice["token_ids"] == expected
    assert choice["text"] == tokenizer.decode(expected)
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": 12,
        "total_tokens": len(ids) + 12,
    }


def test_streamed_completion_matches_and_ends_with_done(client, engine, tokenizer):
    r = completion(
        client,
        prompt="hello",
        max_tokens=9,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        return_token_ids=True,
    )
    assert r.status_code == 200 and r.mimetype == "text/event-stream"
    events = sse(r.data)
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 9
    assert all(c["usage"] is None for c in chunks)
    ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert ids == greedy_ids(engine, tokenizer.encode("hello"), 9)
    assert "".join(c["choices"][0]["text"] for c in chunks) == tokenizer.decode(ids)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"


def test_prompt_token_ids_and_batches(client, engine):
    r = completion(
        client, prompt=[[5, 6, 7], [8, 9]], max_tokens=4, temperature=0, n=2, return_token_ids=True
    )
    choices = r.json["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert choices[0]["token_ids"] == choices[1]["token_ids"] == greedy_ids(engine, [5, 6, 7], 4)
    assert choices[2]["token_ids"] == greedy_ids(engine, [8, 9], 4)
    assert r.json["usage"]["prompt_tokens"] == 5


def test_n_choices_with_a_seed_sample_with_seed_plus_i(client):
    body = dict(prompt="hello", max_tokens=8, temperature=1.0, seed=100, return_token_ids=True)
    several = completion(client, n=3, **body).json["choices"]
    singles = [completion(client, **{**body, "seed": 100 + i}).json["choices"][0] for i in range(3)]
    assert [c["token_ids"] for c in several] == [c["token_ids"] for c in singles]
    assert len({tuple(c["token_ids"]) for c in several}) > 1  # different seeds, different samples


def test_stop_string_cuts_the_text(client, tokenizer):
    full = completion(client, prompt="hello", max_tokens=16, temperature=0).json["choices"][0]
    text = full["text"]
    stop = next(text[i : i + 2] for i in range(3, len(text) - 2) if text[i : i + 2].strip())
    cut = completion(client, prompt="hello", max_tokens=16, temperature=0, stop=[stop, "zzz"])
    choice = cut.json["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == text[: text.index(stop)]


def test_stop_token_ids_end_a_choice(client):
    body = dict(prompt="hello", max_tokens=12, temperature=0, return_token_ids=True)
    ids = completion(client, **body).json["choices"][0]["token_ids"]
    stop_id = ids[4]
    choice = completion(client, stop_token_ids=[stop_id], **body).json["choices"][0]
    assert choice["token_ids"] == ids[: ids.index(stop_id) + 1]
    assert choice["finish_reason"] == "stop"
    # the stop token's own text is not in the choice's text (vLLM's rule), the rest is
    before = completion(client, **{**body, "max_tokens": ids.index(stop_id)}).json["choices"][0]
    assert choice["text"] == before["text"]
    streamed = sse(completion(client, stop_token_ids=[stop_id], stream=True, **body).data)
    assert "".join(c["choices"][0]["text"] for c in streamed[:-1]) == before["text"]


def test_a_tiny_temperature_is_greedy_and_harms_no_other_request(client):
    body = dict(prompt="hello", max_tokens=40, temperature=0, return_token_ids=True)
    results = {}

    def victim():
        results["victim"] = completion(client, **body)

    thread = threading.Thread(target=victim)
    thread.start()
    tiny = completion(client, **{**body, "temperature": 1e-300})
    thread.join(30)
    assert tiny.status_code == 200 and results["victim"].status_code == 200
    assert tiny.json["choices"][0]["token_ids"] == results["victim"].json["choices"][0]["token_ids"]


def test_chosen_token_logprobs(client):
    choice = completion(client, prompt="hello", max_tokens=5, temperature=0, logprobs=0).json
    lp = choice["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == 5
    assert all(v <= 0 for v in lp["token_logprobs"]) and lp["top_logprobs"] is None
    r = chat(client, messages=[{"role": "user", "content": "hi"}], max_tokens=3, logprobs=True)
    content = r.json["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(c["top_logprobs"] == [] for c in content)


# ---- chat -----------------------------------------------------------------------------------
def chat_prompt_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def test_chat_matches_engine_greedy(client, engine, tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    r = chat(client, messages=messages, max_tokens=10, temperature=0, return_token_ids=True)
    assert r.status_code == 200 and r.json["object"] == "chat.completion"
    choice = r.json["choices"][0]
    expected = greedy_ids(engine, chat_prompt_ids(tokenizer, messages), 10)
    assert choice["token_ids"] == expected
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == tokenizer.decode(expected)


def test_streamed_chat_matches(client, engine, tokenizer):
    messages = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    r = chat(
        client,
        messages=messages,
        max_tokens=7,
        temperature=0,
        stream=True,
        n=2,
        return_token_ids=True,
    )
    events = sse(r.data)
    assert events[-1] == "[DONE]"
    expected = greedy_ids(
        engine, chat_prompt_ids(tokenizer, [{"role": "user", "content": "hello"}]), 7
    )
    for index in (0, 1):
        mine = [e["choices"][0] for e in events[:-1] if e["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert [t for c in mine for t in c["token_ids"]] == expected
        assert mine[-1]["finish_reason"] == "length"
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])


def test_chat_default_max_tokens_fills_the_context(chat_model_dir, tmp_path):
    rt = llm_runtime(chat_model_dir, tmp_path, max_model_len=40)
    rt.start(background=False)
    try:
        c = create_app(rt, ServeConfig(model_name=MODEL)).test_client()
        r = chat(c, messages=[{"role": "user", "content": "hi"}], temperature=0)
        usage = r.json["usage"]
        assert r.json["choices"][0]["finish_reason"] == "length"
        assert usage["total_tokens"] == 40
    finally:
        rt.close()


@pytest.mark.parametrize(("limits", "generated"), [((3, 10), 3), ((10, 3), 10), ((None, 3), 3)])
def test_chat_max_completion_tokens_wins_over_max_tokens(client, limits, generated):
    max_completion_tokens, max_tokens = limits
    r = chat(
        client,
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=max_completion_tokens,
        max_tokens=max_tokens,
        ignore_eos=True,
    )
    assert r.status_code == 200 and r.json["usage"]["completion_tokens"] == generated


# ---- bad input ------------------------------------------------------------------------------
BAD_COMPLETIONS = [
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens", 400),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", 400),
    ({"prompt": "x", "temperature": True}, "temperature", 400),
    ({"prompt": "x", "temperature": 3}, "temperature", 400),
    ({"prompt": "x", "temperature": 10**400}, "temperature", 400),
    ({"prompt": "x", "top_p": 0}, "top_p", 400),
    ({"prompt": "x", "top_p": 1.5}, "top_p", 400),
    ({"prompt": "x", "n": 0}, "n", 400),
    ({"prompt": "x", "n": 1.5}, "n", 400),
    ({"prompt": "x", "n": 100}, "n", 400),  # more than max_choices
    ({"prompt": "x", "seed": -1}, "seed", 400),
    ({"prompt": "x", "stop": [""]}, "stop", 400),
    ({"prompt": "x", "stop": ["a"] * 17}, "stop", 400),
    ({"prompt": "x", "stop": 5}, "stop", 400),
    ({"prompt": "x", "stop_token_ids": [-3]}, "stop_token_ids", 400),
    ({"prompt": "x", "logprobs": 21}, "logprobs", 400),
    ({"prompt": "x", "echo": 1}, "echo", 400),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty", 400),
    ({"prompt": "x", "frequency_penalty": "1"}, "frequency_penalty", 400),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", 400),
    ({"prompt": "x", "logit_bias": {"five": 1}}, "logit_bias", 400),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias", 400),
    ({"prompt": "x", "suffix": "end"}, "suffix", 400),
    ({"prompt": "x", "best_of": 3}, "best_of", 400),
    ({"prompt": "x", "stream": "yes"}, "stream", 400),
    ({"prompt": 5}, "prompt", 400),
    ({"prompt": []}, "prompt", 400),
    ({"prompt": [1, "a"]}, "prompt", 400),
    ({"prompt": [-1]}, "prompt", 400),
    ({"prompt": ""}, "prompt", 400),
    ({}, "prompt", 400),
    ({"prompt": "x", "model": "gpt-4"}, "model", 404),
    ({"prompt": "x", "model": 5}, "model", 400),
]


@pytest.mark.parametrize(("body", "param", "status"), BAD_COMPLETIONS)
def test_bad_completion_is_a_4xx_naming_the_field(client, body, param, status):
    r = client.post("/v1/completions", json={"model": MODEL, **body})
    assert r.status_code == status, r.json
    error = r.json["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"] and error["code"]


BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    (
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
        "top_logprobs",
    ),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    (
        {
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema"},
        },
        "response_format",
    ),
    (
        {
            "messages": [{"role": "user", "content": "x"}],
            "guided_choice": ["a"],
            "guided_regex": "a",
        },
        "guided_choice",
    ),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
    ({}, "messages"),
]


@pytest.mark.parametrize(("body", "param"), BAD_CHATS)
def test_bad_chat_is_a_400_naming_the_field(client, body, param):
    r = client.post("/v1/chat/completions", json={"model": MODEL, **body})
    assert r.status_code == 400, r.json
    assert r.json["error"]["param"] == param


USER = [{"role": "user", "content": "x"}]


def test_structured_output_on_both_endpoints(client):
    import jsonschema

    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 9}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema, "strict": True}}
    r = chat(client, messages=USER, max_tokens=32, temperature=0, response_format=fmt)
    assert r.status_code == 200, r.json
    choice = r.json["choices"][0]
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    assert choice["finish_reason"] == "stop"
    r = completion(client, prompt="x", max_tokens=8, guided_choice=["hello", "world"], seed=3)
    assert r.status_code == 200 and r.json["choices"][0]["text"] in ("hello", "world")


def test_a_structured_spec_that_does_not_compile_is_a_400_saying_so(client):
    r = completion(client, prompt="x", guided_regex="(unclosed")
    assert r.status_code == 400 and "the regex does not compile" in r.json["error"]["message"]
    assert r.json["error"]["param"] == "guided_regex"
    metrics = client.get("/metrics").get_data(as_text=True)
    assert 'snapfn_grammar_cache_lookups_total{result="miss"}' in metrics
    assert "snapfn_grammar_compile_seconds_total" in metrics


ERROR_CODES = [  # path, body, param, code, what the message says
    ("completions", {"promt": "x"}, "prompt", "missing_field", "unknown fields, ignored: 'promt'"),
    ("completions", {"prompt": "x", "n": True}, "n", "invalid_type", "got True"),
    ("completions", {"prompt": "x", "top_p": 0}, "top_p", "out_of_range", "greater than 0"),
    ("completions", {"prompt": [[1], [2, -1]]}, "prompt", "out_of_range", "'prompt[1][1]'"),
    ("completions", {"prompt": "x", "suffix": "y"}, "suffix", "unsupported", "insertion"),
    (
        "chat/completions",
        {"messages": USER, "top_logprobs": 1},
        "top_logprobs",
        "invalid_value",
        "logprobs",
    ),
    ("chat/completions", {"messages": USER, "tools": [{}]}, "tools", "unsupported", "tool"),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        "messages[0].content",
        "missing_field",
        "'messages[0].content[0].text' is required",
    ),
    (
        "chat/completions",
        {"messages": [{"role": "user"}]},
        "messages[0].content",
        "missing_field",
        "only an assistant's",
    ),
]


@pytest.mark.parametrize(("path", "body", "param", "code", "says"), ERROR_CODES)
def test_validation_errors_carry_a_stable_code_and_say_where(client, path, body, param, code, says):
    r = client.post(f"/v1/{path}", json={"model": MODEL, **body})
    assert r.status_code == 400, r.json
    error = r.json["error"]
    assert (error["param"], error["code"]) == (param, code)
    assert says in error["message"]


def test_null_is_a_field_left_out(client):
    body = dict(prompt="hello", max_tokens=3, temperature=0, return_token_ids=True)
    nulls = dict.fromkeys(("n", "stop", "seed", "top_p", "stream", "stream_options", "user"))
    plain = completion(client, **body)
    assert plain.status_code == 200
    with_nulls = completion(client, **body, **nulls)
    assert with_nulls.json["choices"] == plain.json["choices"]
    r = chat(client, messages=[{"role": "assistant", "content": None}, *USER], max_tokens=1)
    assert r.status_code == 200, r.json


@pytest.mark.parametrize(
    "data",
    [b"{bad json", b"", b"[1, 2]", b'"text"', b"\xff\xfe\x00", b'{"prompt": NaN}', b"[" * 100000],
)
def test_malformed_bodies_are_400(client, data):
    r = client.post("/v1/completions", data=data, content_type="application/json")
    assert r.status_code == 400
    assert r.json["error"]["code"] in ("invalid_json", "invalid_body", "invalid_unicode")


def test_prompt_longer_than_max_req_input_len_is_refused(client, runtime):
    limit = runtime.llm.max_req_input_len
    r = completion(client, prompt=[1] * (limit + 1))
    assert r.status_code == 400 and r.json["error"]["code"] == "context_length_exceeded"
    assert str(limit) in r.json["error"]["message"]
    assert completion(client, prompt=[1] * limit, max_tokens=1).status_code == 200


def test_token_ids_outside_the_vocabulary_are_400(client):
    r = completion(client, prompt=[10**6])
    assert r.status_code == 400 and "out of range" in r.json["error"]["message"]


def test_body_over_the_limit_is_413(runtime):
    c = create_app(runtime, ServeConfig(model_name=MODEL, max_body_bytes=1000)).test_client()
    r = completion(c, prompt="x" * 2000)
    assert r.status_code == 413 and r.json["error"]["type"] == "invalid_request_error"
    assert completion(c, prompt="hello", max_tokens=1).status_code == 200


def test_unknown_paths_and_methods_are_json_errors(client):
    r = client.get("/v2/nothing")
    assert r.status_code == 404 and r.json["error"]["code"] == "not_found"
    r = client.get("/v1/completions")
    assert r.status_code == 405 and "error" in r.json and "POST" in r.headers["Allow"]


def test_a_crashing_handler_is_a_500_and_the_worker_keeps_serving(runtime, monkeypatch):
    c = create_app(runtime, ServeConfig(model_name=MODEL)).test_client()
    monkeypatch.setattr(runtime, "invoke", lambda *a, **k: 1 / 0)
    r = c.post("/invoke", json={"prompt": "hello"})
    assert r.status_code == 500 and r.json["error"]["type"] == "server_error"
    monkeypatch.undo()
    assert c.post("/invoke", json={"prompt": "hello", "max_tokens": 2}).status_code == 200


# ---- front-door conventions (vLLM's and SGLang's) -------------------------------------------
def test_model_may_be_left_out(client):
    r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
    assert r.status_code == 200 and r.json["model"] == MODEL
    r = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1})
    assert r.status_code == 200 and r.json["model"] == MODEL


def test_unknown_fields_are_ignored_with_a_warning(client, caplog):
    body = dict(prompt="hello", max_tokens=3, temperature=0, return_token_ids=True)
    plain = completion(client, **body).json["choices"]
    with caplog.at_level("WARNING", logger="snapfn.http"):
        r = completion(client, **body, bogus=1, chat_template_kwargs={}, logit_bias=None)
        streamed = completion(client, **body, stream=True, stream_options={"x": 1})
    assert r.status_code == 200 and r.json["choices"] == plain and streamed.status_code == 200
    unknown = [rec.message for rec in caplog.records if "unknown request fields" in rec.message]
    assert all(name in unknown[0] for name in ("'bogus'", "'chat_template_kwargs'"))
    assert "'stream_options.x'" in unknown[1] and len(unknown) == 2


def test_stream_options_need_stream(client):
    r = completion(client, prompt="hi", max_tokens=1, stream_options={"include_usage": True})
    assert r.status_code == 400 and r.json["error"]["param"] == "stream_options"
    r = chat(client, messages=USER, max_tokens=1, stream=False, stream_options={})
    assert r.status_code == 400 and "'stream': true" in r.json["error"]["message"]


def test_penalties_and_biases_are_those_of_the_engine(client, engine, tokenizer):
    body = dict(prompt="hello", max_tokens=12, temperature=0, return_token_ids=True)
    shaped = dict(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.3)
    r = completion(client, **body, **shaped, logit_bias={"7": 2.5})
    assert r.status_code == 200, r.json
    params = SamplingParams(max_new_tokens=12, **shaped, logit_bias=((7, 2.5),))
    expected = engine.generate([tokenizer.encode("hello")], params)[0].token_ids
    assert r.json["choices"][0]["token_ids"] == list(expected)
    assert list(expected) != greedy_ids(engine, tokenizer.encode("hello"), 12)
    r = completion(client, **body, logit_bias={"100000": 1})
    assert r.status_code == 400 and "logit_bias" in r.json["error"]["message"]


def test_completion_top_logprobs(client):
    r = completion(client, prompt="hello", max_tokens=4, temperature=0, logprobs=3)
    lp = r.json["choices"][0]["logprobs"]
    assert len(lp["top_logprobs"]) == 4
    for token, value, top in zip(
        lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True
    ):
        # alternatives that read the same share one key (OpenAI's shape): at most 3 + the chosen
        assert 1 <= len(top) <= 4 and top[token] == value == max(top.values())


def test_chat_top_logprobs(client):
    r = chat(client, messages=USER, max_tokens=3, temperature=0, logprobs=True, top_logprobs=20)
    content = r.json["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    for entry in content:
        alternatives = entry["top_logprobs"]
        assert len(alternatives) == 20
        assert alternatives[0]["token"] == entry["token"]
        assert [a["logprob"] for a in alternatives] == sorted(
            (a["logprob"] for a in alternatives), reverse=True
        )
        assert all(a["bytes"] == list(a["token"].encode()) for a in alternatives)


def test_echo_puts_the_prompt_first(client, tokenizer):
    body = dict(prompt="hello world", max_tokens=3, temperature=0)
    plain = completion(client, **body).json["choices"][0]["text"]
    echoed = completion(client, **body, echo=True).json["choices"][0]
    assert echoed["text"] == "hello world" + plain and echoed["logprobs"] is None
    scored = completion(client, **body, echo=True, logprobs=2).json["choices"][0]["logprobs"]
    prompt_ids = tokenizer.encode("hello world")
    assert len(scored["tokens"]) == len(prompt_ids) + 3
    assert scored["token_logprobs"][0] is None and scored["top_logprobs"][0] is None
    assert all(v <= 0 for v in scored["token_logprobs"][1:])
    assert all(top for top in scored["top_logprobs"][1:])
    # each offset indexes the text, where the prompt's special tokens (bos) write nothing
    scored_text = completion(client, **body, echo=True, logprobs=0).json["choices"][0]["text"]
    for token_id, offset in zip(prompt_ids, scored["text_offset"], strict=False):
        shown = tokenizer.decode([token_id], skip_special_tokens=True)
        assert scored_text[offset : offset + len(shown)] == shown
    assert scored["text_offset"][len(prompt_ids)] == len("hello world")
    events = sse(completion(client, **body, echo=True, stream=True).data)
    assert events[0]["choices"][0]["text"].startswith("hello world")
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "hello world" + plain
    ids = completion(client, prompt=[5, 6], max_tokens=1, echo=True).json["choices"][0]
    assert ids["text"].startswith(tokenizer.decode([5, 6], skip_special_tokens=False))


def test_tokenize_and_detokenize(client, tokenizer, runtime):
    r = client.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True})
    ids = tokenizer.encode("hello world")
    assert r.status_code == 200 and r.json["tokens"] == ids and r.json["count"] == len(ids)
    assert r.json["max_model_len"] == runtime.llm.max_req_input_len + 1
    assert "".join(r.json["token_strs"]) == tokenizer.decode(ids, skip_special_tokens=False)
    r = client.post("/tokenize", json={"model": MODEL, "messages": USER})
    assert r.json["tokens"] == chat_prompt_ids(tokenizer, USER)
    assert r.json["token_strs"] is None
    r = client.post("/detokenize", json={"tokens": ids})
    assert r.status_code == 200 and r.json == {"prompt": "hello world"}
    for path, body, param in [
        ("/detokenize", {"tokens": [10**6]}, "tokens"),
        ("/detokenize", {"tokens": "hello"}, "tokens"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "x", "model": "gpt-4"}, "model"),
        ("/tokenize", {"prompt": "x" * 10**6}, "prompt"),
    ]:
        r = client.post(path, json=body)
        assert r.status_code in (400, 404) and r.json["error"]["param"] == param, r.json


# ---- bounded requests -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),
        ("/v1/completions", {"prompt": ["ok", "\udfff"]}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud83d"}]}, "messages"),
        ("/v1/completions", {"prompt": "x", "user": "\ud800"}, "user"),
        ("/v1/completions", {"prompt": "x", "\ud800": 1}, None),
        ("/invoke", {"prompt": "\ud800"}, "prompt"),
        ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ],
)
def test_lone_surrogates_are_a_400(client, path, body, param):
    data = json.dumps(body).encode()  # ensure_ascii: the surrogates go as \\uXXXX escapes
    r = client.post(path, data=data, content_type="application/json")
    assert r.status_code == 400, r.json
    assert r.json["error"]["code"] == "invalid_unicode" and r.json["error"]["param"] == param


def test_a_valid_surrogate_pair_is_text(client):
    data = b'{"prompt": "\\ud83d\\ude00", "max_tokens": 1}'
    r = client.post("/v1/completions", data=data, content_type="application/json")
    assert r.status_code == 200, r.json


def test_oversized_prompts_are_refused_before_they_are_encoded(client, tokenizer, monkeypatch):
    limit = tokenizer.max_prompt_chars(
        client.application.extensions["snapfn"].runtime.llm.max_req_input_len
    )
    encoded = []
    real_encode = tokenizer.encode
    monkeypatch.setattr(
        tokenizer, "encode", lambda text, **kw: encoded.append(len(text)) or real_encode(text, **kw)
    )
    for path, body in [
        ("/v1/completions", {"prompt": "x" * (limit + 1)}),
        ("/v1/completions", {"prompt": ["hi", "x" * ((4 << 20) - 1000)]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * (limit + 1)}]}),
        ("/tokenize", {"prompt": "x" * (limit + 1)}),
    ]:
        t0 = time.perf_counter()
        r = client.post(path, json=body)
        assert r.status_code == 400 and r.json["error"]["code"] == "context_length_exceeded"
        assert str(limit) in r.json["error"]["message"] and time.perf_counter() - t0 < 2
    assert all(n <= limit for n in encoded)
    fits = completion(client, prompt="hello " * 3, max_tokens=1)
    assert fits.status_code == 200
    for event in (
        {"prompt": "x" * (limit + 1)},
        {"messages": [{"role": "user", "content": "y" * (limit + 1)}]},
    ):
        r = client.post("/invoke", json=event)
        assert r.status_code == 400 and "characters" in r.json["error"]["message"]
    assert all(n <= limit for n in encoded)


# ---- cancellation ---------------------------------------------------------------------------
def test_client_disconnect_cancels_and_frees_kv_pages(client, runtime):
    stats, before = runtime.llm.stats, runtime.llm.stats.cancelled
    r = completion(client, prompt="hello", max_tokens=400, temperature=0, stream=True)
    first = next(iter(r.response))
    assert first.startswith(b"data: ")
    assert runtime.llm.kv_usage() > 0
    r.close()  # what the server does when the client's socket goes away
    assert wait_for(lambda: runtime.llm.kv_usage() == 0.0)
    assert stats.cancelled == before + 1


def test_disconnect_before_the_first_token_cancels_too(client, runtime):
    before = runtime.llm.stats.cancelled
    r = completion(client, prompt="hello", max_tokens=400, n=2, stream=True)
    r.close()
    assert wait_for(lambda: runtime.llm.kv_usage() == 0.0)
    assert runtime.llm.stats.cancelled == before + 2


# ---- /invoke --------------------------------------------------------------------------------
def test_invoke_llm_event(client, engine, tokenizer):
    r = client.post(
        "/invoke", json={"prompt": "hello", "max_tokens": 4}, headers={"X-Request-Id": "abc"}
    )
    assert r.status_code == 200 and r.headers["X-Request-Id"] == "abc"
    assert r.json["token_ids"] == greedy_ids(engine, tokenizer.encode("hello"), 4)
    r = client.post("/invoke", json={"prompt": "hello", "bogus": 1})
    assert r.status_code == 400 and "bogus" in r.json["error"]["message"]
    assert client.post("/invoke", json=[1, 2]).status_code == 400


@pytest.mark.parametrize("field", ["temperature", "top_p"])
def test_invoke_an_integer_too_large_for_a_float_is_a_400(client, field):
    body = f'{{"prompt": "hi", "max_tokens": 2, "{field}": {"9" * 400}}}'
    r = client.post("/invoke", data=body, content_type="application/json")
    assert r.status_code == 400 and r.json["error"]["code"] == "bad_request"
    assert r.json["error"]["message"].startswith(f"{field} must be float")


@pytest.fixture(scope="module")
def function_client(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fn")
    (folder / "http_test_fn.py").write_text(FAILING_FUNCTION)
    target = ServeTarget(kind="function", function="http_test_fn:handler", function_dir=folder)
    rt = WorkerRuntime(target)
    rt.start(background=False)
    yield create_app(rt, ServeConfig(model_name="fn")).test_client()
    rt.close()


def test_invoke_function_result_and_error(function_client):
    r = function_client.post("/invoke", json={"a": 1})
    assert r.status_code == 200 and r.json["echo"] == {"a": 1}
    r = function_client.post("/invoke", json={"fail": True})
    assert r.status_code == 500 and r.headers["X-Snapfn-Function-Error"] == "Unhandled"
    assert r.json["errorType"] == "ValueError" and r.json["errorMessage"] == "asked to fail"
    health = function_client.get("/health/generate").json["result"]  # a real call, event {}
    assert health["ok"] is True and health["result"]["echo"] == {}


def test_function_errors_as_lambda_answers_them(function_client):
    runtime = function_client.application.extensions["snapfn"].runtime
    c = create_app(runtime, ServeConfig(model_name="fn", function_errors="lambda")).test_client()
    r = c.post("/invoke", json={"fail": True})
    assert r.status_code == 200 and r.headers["X-Amz-Function-Error"] == "Unhandled"
    assert r.headers["X-Snapfn-Function-Error"] == "Unhandled"
    assert r.json["errorType"] == "ValueError"
    r = c.post("/invoke", json={"a": 1})
    assert r.status_code == 200 and "X-Amz-Function-Error" not in r.headers


def test_a_function_worker_has_no_openai_endpoints(function_client):
    r = function_client.post("/v1/completions", json={"model": "fn", "prompt": "x"})
    assert r.status_code == 404 and r.json["error"]["code"] == "not_a_language_model"


# ---- auth -----------------------------------------------------------------------------------
def test_bearer_auth(runtime):
    c = create_app(runtime, ServeConfig(model_name=MODEL, api_key="s3cret")).test_client()
    assert c.get("/health").status_code == 200
    assert c.get("/openapi.json").status_code == 200
    r = c.get("/v1/models")
    assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
    assert r.json["error"]["code"] == "invalid_api_key"
    assert c.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert c.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200


@pytest.mark.parametrize("key", ["sekrit-ké", "sekrit-€"])
def test_a_non_ascii_key_matches_its_utf8_bytes(runtime, key):
    c = create_app(runtime, ServeConfig(model_name=MODEL, api_key=key)).test_client()
    as_wsgi = key.encode().decode("latin-1")  # what a WSGI server makes of the UTF-8 bytes
    assert c.get("/v1/models", headers={"Authorization": f"Bearer {as_wsgi}"}).status_code == 200
    assert c.get("/v1/models", headers={"Authorization": "Bearer sekrit-k?"}).status_code == 401
    key_bytes = api_key_bytes(key)
    assert refusal(key_bytes, "/v1/models", f"Bearer {key}") is None  # aiohttp decodes UTF-8
    assert refusal(key_bytes, "/v1/models", "Bearer sekrit-k\udce9") is not None


# ---- metrics and config ---------------------------------------------------------------------
def test_metrics_parse_and_count(client):
    completion(client, prompt="hello", max_tokens=3, temperature=0, stream=True).get_data()
    completion(client, prompt="hello", max_tokens=3, temperature=0)
    text = client.get("/metrics").get_data(as_text=True)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "snapfn_http_requests",
        "snapfn_time_to_first_token_seconds",
        "snapfn_inter_token_latency_seconds",
        "snapfn_e2e_request_latency_seconds",
        "snapfn_request_queue_seconds",
        "snapfn_prompt_tokens",
        "snapfn_generation_tokens",
        "snapfn_kv_cache_usage_ratio",
        "snapfn_startup_stage_seconds",
        "snapfn_readiness",
        "snapfn_graph_eager_fallbacks",
        "snapfn_graph_prefill_replays",
        "snapfn_snapshot_fallbacks",
    ):
        assert name in families, name
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in families.values()
        for s in f.samples
    }
    ok = ("endpoint", "/v1/completions"), ("method", "POST"), ("status", "200")
    assert samples[("snapfn_http_requests_total", ok)] >= 2
    ttft = ("snapfn_time_to_first_token_seconds_count", (("endpoint", "/v1/completions"),))
    assert samples[ttft] >= 2
    assert samples[("snapfn_readiness", (("state", "up"),))] == 1.0
    stages = [s.labels["stage"] for s in families["snapfn_startup_stage_seconds"].samples]
    assert "load_weights" in stages
    assert "_created" not in text


def test_metrics_count_prefix_cache_hits(client):
    prompt = "the same long system prompt, " * 12  # several full KV pages
    for tail in ("first question", "second question"):
        completion(client, prompt=prompt + tail, max_tokens=1, temperature=0)

    def hit_tokens() -> float:
        text = client.get("/metrics").get_data(as_text=True)
        for family in text_string_to_metric_families(text):
            if family.name == "snapfn_prefix_cache_hit_tokens":
                return sum(s.value for s in family.samples if s.name.endswith("_total"))
        return 0.0

    assert wait_for(lambda: hit_tokens() >= 16)


def test_startup_metrics_label_stages_by_kind_and_tier_and_count_fallbacks():
    failed = {
        "kind": "restore",
        "tier": "portable",
        "total_s": 0.5,
        "stages": [
            {"name": "validate", "seconds": 0.1},
            {"name": "stream_weights", "seconds": 0.4},
        ],
    }
    manifest = {
        "kind": "init",
        "tier": "cold (fallback)",
        "total_s": 3.0,
        "stages": [{"name": "load_weights", "seconds": 2.0}],
        "fallbacks": [
            {
                "from": "portable",
                "to": "cold",
                "step": "stream_weights",
                "reason": "BadSnapshot: chunk 3",
            }
        ],
        "info": {"failed_restore": failed},
    }
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in startup_metrics(manifest)
        for s in family.samples
    }
    stage = "snapfn_startup_stage_seconds"
    assert (
        samples[(stage, (("kind", "init"), ("stage", "load_weights"), ("tier", "cold (fallback)")))]
        == 2.0
    )
    assert (
        samples[
            (
                stage,
                (("kind", "restore"), ("stage", "stream_weights"), ("tier", "portable (failed)")),
            )
        ]
        == 0.4
    )
    fallback = (("from", "portable"), ("step", "stream_weights"), ("to", "cold"))
    assert samples[("snapfn_snapshot_fallbacks_total", fallback)] == 1.0
    assert (
        samples[("snapfn_startup_seconds", (("kind", "init"), ("tier", "cold (fallback)")))] == 3.0
    )


def test_a_long_context_models_prompt_is_refused_by_a_prefix_before_it_is_encoded_whole():
    """Where the bound by length is loose (a long context, long vocabulary entries), a prefix
    of the prompt already holding too many tokens refuses it: the whole is never encoded."""
    from snapfn.handler.http.openai.parse import PROBE_CHARS_PER_TOKEN, encode_bounded
    from snapfn.handler.http.openai.request import ApiError

    class WordTokenizer:
        encoded: list[int] = []

        def max_prompt_chars(self, max_tokens):
            return max_tokens * 1000  # allows far longer texts than can fit

        def encode(self, text, add_special_tokens=True):
            self.encoded.append(len(text))
            return text.split()

    words = WordTokenizer()
    max_tokens = 100
    long_text = "ab " * (max_tokens * 50)  # 5000 tokens, 15000 characters
    with pytest.raises(ApiError, match="already hold") as refused:
        encode_bounded(words, long_text, max_tokens, "prompt")
    assert refused.value.api_code == "context_length_exceeded"
    assert words.encoded == [max_tokens * PROBE_CHARS_PER_TOKEN]  # the prefix only
    fits = "ab " * 90
    assert len(encode_bounded(words, fits, max_tokens, "prompt")) == 90
    wide = "abcdefghijklmnop " * 60  # longer than the prefix, few tokens: encoded whole
    assert len(encode_bounded(words, wide, max_tokens, "prompt")) == 60
