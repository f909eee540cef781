"""The HTTP front door: a Flask app over one `WorkerRuntime` (built by `create_app`, no globals).

Endpoints (the OpenAPI document in `openapi.py` is the reference):
    GET  /health             200 {"status": "up"} | 503 {"status": "starting"|"failed", "reason"}
    GET  /health/generate    a real 1-token generation through the whole path
    GET  /startup            the startup manifest (JSON)
    GET  /version            {"version": snapfn's}
    GET  /v1/models          the one model served; /v1/models/{id} its card (404 for another)
    POST /v1/completions     OpenAI completions   (stream: true → server-sent events)
    POST /v1/chat/completions OpenAI chat completions
    POST /tokenize           text or chat messages → token ids (vLLM's shapes, `tokenization.py`)
    POST /detokenize         token ids → text
    POST /invoke             JSON event → the function → JSON result; a function error is a
                             500 {"errorType", "errorMessage"} with `X-Snapfn-Function-Error`,
                             or with `function_errors="lambda"` (`--function-errors lambda`)
                             a 200 with `X-Amz-Function-Error: Unhandled`, as Lambda's Invoke
                             API answers (both headers are set either way)
    GET  /metrics            Prometheus text (`metrics.py`), every gunicorn worker's together
    GET  /openapi.json       the OpenAPI 3 document

Contracts:
- While the runtime is STARTING, requests that need it wait, at most `startup_queue_size` of
  them, each at most `startup_wait_s`; beyond that, or once it FAILED, they get a 503 (with
  `Retry-After` while starting). No request is dropped without an answer.
- Every error is JSON: OpenAI's `{"error": {"message", "type", "param", "code"}}`; bad input is
  a 4xx that names the field to fix; anything unexpected is a logged 500, never a dead worker.
- A streamed generation whose client goes away is cancelled (the response iterator's `close()`
  cancels its engine streams), which frees its KV pages.
- With an API key configured, every endpoint but `/health` and `/openapi.json` needs
  `Authorization: Bearer <key>` (compared in constant time).

This module holds `create_app` (its settings: `serve_config.ServeConfig`), auth, per-request
metrics and the routes; they lean on `startup_gate` (the wait for start-up), `json_io` (JSON
bodies, the error handlers), `openai/parse` (parsing against the request models of
`openai/schema`) and `generation` (the streaming driver).
"""

from __future__ import annotations

import json
import logging
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flask import Flask, Response, g, request

from snapfn.handler.api import FunctionError
from snapfn.handler.http.api_key import UNAUTHORIZED_HEADERS, api_key_bytes, refusal
from snapfn.handler.http.generation import EventStream, Generation
from snapfn.handler.http.json_io import (
    install_error_handlers,
    json_response,
    json_safe,
    read_json_body,
)
from snapfn.handler.http.metrics import HttpMetrics
from snapfn.handler.http.openai import parse as openai_api
from snapfn.handler.http.openai.params import check_model
from snapfn.handler.http.openai.request import ApiError, Limits
from snapfn.handler.http.openai.tokenization import detokenize_body, tokenize_body
from snapfn.handler.http.serve_config import ServeConfig
from snapfn.handler.http.startup_gate import StartupGate
from snapfn.handler.version import snapfn_version
from snapfn.snapshot.stages import Readiness

log = logging.getLogger("snapfn.http")
REQUEST_ID_HEADER = "X-Request-Id"
FUNCTION_ERROR_HEADER = "X-Snapfn-Function-Error"
LAMBDA_FUNCTION_ERROR_HEADER = "X-Amz-Function-Error"
# the methods counted by name; any other is "other", so a client cannot grow the metrics
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})


@dataclass(frozen=True)
class AppState:
    """Everything the views share, reachable as `app.extensions["snapfn"]`."""

    runtime: Any
    config: ServeConfig
    metrics: HttpMetrics
    gate: StartupGate
    limits: Limits
    started_at: int


def create_app(runtime: Any, config: ServeConfig, metrics_dir: str | None = None) -> Flask:
    """The Flask app serving `runtime` (a `WorkerRuntime`, started or not) under `config`;
    `metrics_dir`: where every worker's metrics meet (`metrics.py`), None for this app's own."""
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = config.max_body_bytes
    app.json.sort_keys = False
    metrics = HttpMetrics(runtime, metrics_dir)
    state = AppState(
        runtime=runtime,
        config=config,
        metrics=metrics,
        gate=StartupGate(runtime, config, metrics),
        limits=Limits(config.model_name or "snapfn", config.max_choices),
        started_at=int(time.time()),
    )
    app.extensions["snapfn"] = state
    _install_hooks(app, state)
    install_error_handlers(app, config.retry_after_s)
    _install_health_routes(app, state)
    _install_llm_routes(app, state)
    _install_invoke_route(app, state)
    return app


def _install_hooks(app: Flask, state: AppState) -> None:
    key = api_key_bytes(state.config.api_key)

    @app.before_request
    def arrive() -> Response | None:
        g.arrived_at = time.perf_counter()
        body = refusal(key, request.path, request.headers.get("Authorization", ""))
        return None if body is None else json_response(body, 401, UNAUTHORIZED_HEADERS)

    @app.after_request
    def count(response: Response) -> Response:
        endpoint = request.url_rule.rule if request.url_rule is not None else "unmatched"
        method = request.method if request.method in HTTP_METHODS else "other"
        m = state.metrics
        m.requests.labels(endpoint, method, str(response.status_code)).inc()
        m.request_seconds.labels(endpoint).observe(time.perf_counter() - g.arrived_at)
        return response


# ---- health, startup, metrics, models, openapi ----------------------------------------------
def _install_health_routes(app: Flask, state: AppState) -> None:
    # NOTE: imported as a worker builds its app, not with this module: it loads the request
    # models (pydantic), which `snapfn --help` and the activator (importing this module
    # through serve.py) never need, and which a worker's first request should not wait for.
    from snapfn.handler.http.openapi import openapi_document

    runtime = state.runtime

    @app.get("/health")
    def health() -> Response:
        readiness = runtime.readiness
        body = {"status": readiness.state.value, "reason": readiness.reason or None}
        if readiness.state is Readiness.UP:
            return json_response(body)
        retry = state.config.retry_after_s if readiness.state is Readiness.STARTING else None
        return json_response(body, 503, {"Retry-After": str(retry)} if retry else None)

    @app.get("/health/generate")
    def health_generate() -> Response:
        state.gate.admit()
        try:
            result = runtime.health_generate()
        except Exception as exc:  # a failed health generation is an unhealthy worker, not a 500
            log.exception("health generation failed")
            return json_response(
                {"status": "unhealthy", "reason": f"{type(exc).__name__}: {exc}"}, 503
            )
        return json_response({"status": "up", "result": json_safe(result)})

    @app.get("/startup")
    def startup() -> Response:
        manifest = runtime.startup
        if manifest is None:
            return json_response(
                {"status": runtime.readiness.state.value, "reason": "no manifest yet"}, 503
            )
        return json_response(json_safe(manifest.to_json()))

    @app.get("/metrics")
    def metrics() -> Response:
        body, content_type = state.metrics.render()
        return Response(body, content_type=content_type)

    @app.get("/openapi.json")
    def openapi() -> Response:
        return json_response(openapi_document(state.limits.model_name))

    @app.get("/version")
    def version() -> Response:
        return json_response({"version": snapfn_version()})


# ---- OpenAI-compatible generation -----------------------------------------------------------
def _install_llm_routes(app: Flask, state: AppState) -> None:
    @app.get("/v1/models")
    def models() -> Response:
        return json_response({"object": "list", "data": [_model_card(state)]})

    @app.get("/v1/models/<path:model_id>")
    def model(model_id: str) -> Response:
        check_model(model_id, state.limits)
        return json_response(_model_card(state))

    @app.post("/tokenize")
    def tokenize() -> Response:
        body = read_json_body()
        llm = _language_model(state)
        return json_response(
            tokenize_body(body, state.limits, llm.tokenizer, llm.max_req_input_len)
        )

    @app.post("/detokenize")
    def detokenize() -> Response:
        body = read_json_body()
        llm = _language_model(state)
        return json_response(
            detokenize_body(body, state.limits, llm.tokenizer, llm.max_req_input_len)
        )

    @app.post("/v1/completions")
    def completions() -> Response:
        return _generate(state, "completions", openai_api.parse_completion)

    @app.post("/v1/chat/completions")
    def chat_completions() -> Response:
        return _generate(state, "chat", openai_api.parse_chat)


def _model_card(state: AppState) -> dict[str, Any]:
    card = {"id": state.limits.model_name, "object": "model", "created": state.started_at}
    card["owned_by"] = "snapfn"
    llm = state.runtime.llm
    if llm is not None:
        card["max_model_len"] = llm.max_req_input_len + 1
    return card


def _language_model(state: AppState) -> Any:
    """The runtime's `LLMService`, once started (404 on a function's worker)."""
    state.gate.admit()
    llm = state.runtime.llm
    if llm is None:
        raise ApiError(
            "this worker serves a function, not a language model: use POST /invoke",
            code="not_a_language_model",
            status=404,
        )
    return llm


def _generate(state: AppState, endpoint: str, parse: Callable) -> Response:
    parsed = parse(read_json_body(), state.limits)
    llm = _language_model(state)
    prompts = openai_api.tokenize(parsed, llm.tokenizer, llm.max_req_input_len)
    generation = Generation(
        parsed, llm, prompts, f"/v1/{endpoint}", metrics=state.metrics, arrived_at=g.arrived_at
    )
    if parsed.stream:
        _send_small_writes_now()
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return Response(EventStream(generation), mimetype="text/event-stream", headers=headers)
    return json_response(generation.body())


def _send_small_writes_now() -> None:
    """Turn Nagle's algorithm off for this connection (under gunicorn), so each streamed chunk
    leaves at once instead of waiting for the client's delayed ACK (~40-90 ms per token)."""
    sock = request.environ.get("gunicorn.socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# ---- /invoke --------------------------------------------------------------------------------
def _install_invoke_route(app: Flask, state: AppState) -> None:
    @app.post("/invoke")
    def invoke() -> Response:
        event = read_json_body()
        state.gate.admit()
        request_id = _request_id()
        headers = {REQUEST_ID_HEADER: request_id}
        try:
            result = state.runtime.invoke(
                event, timeout_s=state.config.invoke_timeout_s, request_id=request_id
            )
        except FunctionError as exc:
            return _function_error(state.config, json_safe(exc.error), headers)
        return _result_response(state.config, result, headers)


def _request_id() -> str:
    given = request.headers.get(REQUEST_ID_HEADER, "")
    if 0 < len(given) <= 128 and given.isprintable():
        return given
    return uuid.uuid4().hex


def _function_error(config: ServeConfig, error: Any, headers: dict[str, str]) -> Response:
    """A function's error: a 500, or as Lambda's Invoke API answers one (a 200)."""
    headers[FUNCTION_ERROR_HEADER] = headers[LAMBDA_FUNCTION_ERROR_HEADER] = "Unhandled"
    return json_response(error, 200 if config.function_errors == "lambda" else 500, headers)


def _result_response(config: ServeConfig, result: Any, headers: dict[str, str]) -> Response:
    try:
        body = json.dumps(result, ensure_ascii=False, allow_nan=False).encode()
    except (TypeError, ValueError, UnicodeEncodeError) as exc:
        error = {"errorType": "Runtime.MarshalError", "errorMessage": f"result is not JSON: {exc}"}
        return _function_error(config, error, headers)
    return Response(body, status=200, mimetype="application/json", headers=headers)
