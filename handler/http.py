"""The HTTP front door: a Flask app over one `WorkerRuntime` (built by `create_app`, no globals).

Endpoints (the OpenAPI document in `openapi.py` is the reference):
    GET  /health             200 {"status": "up"} | 503 {"status": "starting"|"failed", "reason"}
    GET  /health/generate    a real 1-token generation through the whole path
    GET  /startup            the startup manifest (JSON)
    GET  /v1/models          the one model served
    POST /v1/completions     OpenAI completions   (stream: true → server-sent events)
    POST /v1/chat/completions OpenAI chat completions
    POST /invoke             JSON event → the function → JSON result; a function error is a
                             500 {"errorType", "errorMessage"} with `X-Snapfn-Function-Error`
    GET  /metrics            Prometheus text (`metrics.py`)
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
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

from flask import Flask, Response, g, jsonify, request
from werkzeug.exceptions import HTTPException

from snapfn.snapshot.errors import BadRequest, InitFailed, SnapfnError
from snapfn.snapshot.stages import Readiness

from . import openai_api as oa
from .api import FunctionError
from .metrics import HttpMetrics
from .openapi import openapi_document
from .runtime import NotReady

log = logging.getLogger("snapfn.http")
OPEN_PATHS = frozenset({"/health", "/openapi.json"})
REQUEST_ID_HEADER = "X-Request-Id"
FUNCTION_ERROR_HEADER = "X-Snapfn-Function-Error"


@dataclass(frozen=True)
class ServeConfig:
    """How `snapfn serve` listens and what its app accepts. Built once: `from_env` + CLI flags."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0 = any free port (the printed URL says which)
    workers: int = 1  # each worker initialises (or restores) its own copy: one per GPU
    threads: int = 32  # gthread threads per worker = requests served at once per worker
    worker_timeout_s: int = 120  # gunicorn kills a worker whose main loop is silent this long
    graceful_timeout_s: int = 30
    api_key: str | None = None
    model_name: str | None = None  # the name clients send as "model"; None = from the target
    max_body_bytes: int = 4 << 20
    max_choices: int = 64  # prompts × n per generation request
    startup_queue_size: int = 64  # requests allowed to wait for start-up (0: refuse at once)
    startup_wait_s: float = 300.0
    retry_after_s: int = 5
    invoke_timeout_s: float | None = None  # /invoke deadline; None = the target's own

    def __post_init__(self) -> None:
        positive = ("workers", "threads", "worker_timeout_s", "max_body_bytes", "max_choices")
        for name in positive + ("retry_after_s",):
            if getattr(self, name) < 1:
                raise BadRequest(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.port <= 65535:
            raise BadRequest(f"port must be in [0, 65535], got {self.port}")
        if self.startup_queue_size < 0 or self.startup_wait_s < 0:
            raise BadRequest("startup_queue_size and startup_wait_s must be >= 0")

    @classmethod
    def from_env(cls, environ: Mapping[str, str], **overrides: object) -> ServeConfig:
        """Defaults, then `SNAPFN_<FIELD>` variables (`SNAPFN_API_KEY` …), then overrides."""
        values: dict[str, object] = {}
        for f in fields(cls):
            raw = environ.get(f"SNAPFN_{f.name.upper()}")
            if raw is not None and raw != "":
                values[f.name] = _parse_field(f"SNAPFN_{f.name.upper()}", str(f.type), raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def _parse_field(variable: str, type_name: str, raw: str) -> object:
    kind = int if type_name.startswith("int") else float if type_name.startswith("float") else str
    try:
        return kind(raw)
    except ValueError:
        raise BadRequest(f"{variable}={raw!r} is not a valid {kind.__name__}") from None


class ServiceUnavailable(SnapfnError):
    """The worker cannot serve this request now (starting, start-up queue full, failed)."""

    code = "unavailable"

    def __init__(self, message: str, reason: str, retry_after_s: int | None) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s


class StartupGate:
    """Holds requests until the runtime is up: at most `startup_queue_size` of them wait, each
    at most `startup_wait_s`; the rest get a 503 with Retry-After."""

    def __init__(self, readiness: Any, config: ServeConfig, metrics: HttpMetrics) -> None:
        self._readiness = readiness
        self._config = config
        self._metrics = metrics
        self._waiters = 0
        self._lock = threading.Lock()

    def admit(self) -> None:
        """Return once UP; raise `ServiceUnavailable` when FAILED, full, or still starting."""
        if self._readiness.state is Readiness.UP:
            return
        self._check_failed()
        with self._lock:
            if self._waiters >= self._config.startup_queue_size:
                raise self._refuse("queue_full", "the start-up queue is full")
            self._waiters += 1
            self._metrics.startup_waiters.inc()
        try:
            state = self._readiness.wait_until_settled(self._config.startup_wait_s)
        finally:
            with self._lock:
                self._waiters -= 1
                self._metrics.startup_waiters.dec()
        if state is Readiness.STARTING:
            raise self._refuse("timeout", "the worker is still starting")
        self._check_failed()

    def _check_failed(self) -> None:
        if self._readiness.state is Readiness.FAILED:
            self._metrics.startup_rejections.labels("failed").inc()
            raise ServiceUnavailable(
                f"the worker failed to start: {self._readiness.reason}", "failed", None
            )

    def _refuse(self, reason: str, message: str) -> ServiceUnavailable:
        self._metrics.startup_rejections.labels(reason).inc()
        retry = self._config.retry_after_s
        return ServiceUnavailable(f"{message}; retry in {retry} s", reason, retry)


@dataclass(frozen=True)
class AppState:
    """Everything the views share, reachable as `app.extensions["snapfn"]`."""

    runtime: Any
    config: ServeConfig
    metrics: HttpMetrics
    gate: StartupGate
    limits: oa.Limits
    started_at: int


def create_app(runtime: Any, config: ServeConfig) -> Flask:
    """The Flask app serving `runtime` (a `WorkerRuntime`, started or not) under `config`."""
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = config.max_body_bytes
    app.json.sort_keys = False
    metrics = HttpMetrics(runtime)
    state = AppState(
        runtime=runtime,
        config=config,
        metrics=metrics,
        gate=StartupGate(runtime.readiness, config, metrics),
        limits=oa.Limits(config.model_name or "snapfn", config.max_choices),
        started_at=int(time.time()),
    )
    app.extensions["snapfn"] = state
    _install_hooks(app, state)
    _install_error_handlers(app, config.retry_after_s)
    _install_health_routes(app, state)
    _install_llm_routes(app, state)
    _install_invoke_route(app, state)
    return app


# ---- hooks, auth, errors --------------------------------------------------------------------
def _install_hooks(app: Flask, state: AppState) -> None:
    key = state.config.api_key.encode() if state.config.api_key else None

    @app.before_request
    def arrive() -> Response | None:
        g.arrived_at = time.perf_counter()
        if key is None or request.path in OPEN_PATHS:
            return None
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key):
            return None
        body = oa.error_body(
            "missing or wrong API key: send 'Authorization: Bearer <key>'",
            "invalid_request_error",
            code="invalid_api_key",
        )
        return _json(body, 401, {"WWW-Authenticate": "Bearer"})

    @app.after_request
    def count(response: Response) -> Response:
        endpoint = request.url_rule.rule if request.url_rule is not None else "unmatched"
        m = state.metrics
        m.requests.labels(endpoint, request.method, str(response.status_code)).inc()
        m.request_seconds.labels(endpoint).observe(time.perf_counter() - g.arrived_at)
        return response


def _install_error_handlers(app: Flask, retry_after_s: int) -> None:
    @app.errorhandler(oa.ApiError)
    def api_error(exc: oa.ApiError) -> Response:
        kind = "invalid_request_error"
        return _json(oa.error_body(str(exc), kind, exc.param, exc.api_code), exc.status)

    @app.errorhandler(BadRequest)
    def bad_request(exc: BadRequest) -> Response:
        return _json(oa.error_body(str(exc), "invalid_request_error", code=exc.code), 400)

    @app.errorhandler(ServiceUnavailable)
    def unavailable(exc: ServiceUnavailable) -> Response:
        headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s else {}
        return _json(oa.error_body(str(exc), "service_unavailable", code=exc.reason), 503, headers)

    @app.errorhandler(NotReady)
    def not_ready(exc: NotReady) -> Response:
        headers = {"Retry-After": str(retry_after_s)}
        return _json(oa.error_body(str(exc), "service_unavailable", code=exc.code), 503, headers)

    @app.errorhandler(InitFailed)
    def init_failed(exc: InitFailed) -> Response:
        return _json(oa.error_body(str(exc), "service_unavailable", code=exc.code), 503)

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException) -> Response:
        code = (exc.name or "error").lower().replace(" ", "_")
        body = oa.error_body(exc.description or exc.name, "invalid_request_error", code=code)
        allow = exc.get_response().headers.get("Allow")  # a 405 must say what is allowed
        return _json(body, exc.code, {"Allow": allow} if allow else None)

    @app.errorhandler(Exception)
    def internal_error(exc: Exception) -> Response:
        log.exception("unhandled error serving %s %s", request.method, request.path)
        message = f"internal error ({type(exc).__name__}); the worker is still serving"
        return _json(oa.error_body(message, "server_error", code="internal_error"), 500)


def _json(body: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    response = jsonify(body)
    response.status_code = status
    response.headers.update(headers or {})
    return response


def _json_body() -> Any:
    data = request.get_data()
    if not data.strip():
        raise oa.ApiError("the request body is empty: send a JSON object", code="invalid_json")
    try:
        return json.loads(data, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise oa.ApiError(f"the body is not valid JSON ({exc})", code="invalid_json") from None


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _json_safe(value: Any) -> Any:
    """`value` with NaN/inf floats as null, so the output is strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


# ---- health, startup, metrics, models, openapi ----------------------------------------------
def _install_health_routes(app: Flask, state: AppState) -> None:
    runtime = state.runtime

    @app.get("/health")
    def health() -> Response:
        readiness = runtime.readiness
        body = {"status": readiness.state.value, "reason": readiness.reason or None}
        if readiness.state is Readiness.UP:
            return _json(body)
        retry = state.config.retry_after_s if readiness.state is Readiness.STARTING else None
        return _json(body, 503, {"Retry-After": str(retry)} if retry else None)

    @app.get("/health/generate")
    def health_generate() -> Response:
        state.gate.admit()
        try:
            result = runtime.health_generate()
        except Exception as exc:  # a failed health generation is an unhealthy worker, not a 500
            log.exception("health generation failed")
            return _json({"status": "unhealthy", "reason": f"{type(exc).__name__}: {exc}"}, 503)
        return _json({"status": "up", "result": _json_safe(result)})

    @app.get("/startup")
    def startup() -> Response:
        manifest = runtime.startup
        if manifest is None:
            return _json(
                {"status": runtime.readiness.state.value, "reason": "no manifest yet"}, 503
            )
        return _json(_json_safe(manifest.to_json()))

    @app.get("/metrics")
    def metrics() -> Response:
        body, content_type = state.metrics.render()
        return Response(body, content_type=content_type)

    @app.get("/openapi.json")
    def openapi() -> Response:
        return _json(openapi_document(state.limits.model_name))


# ---- OpenAI-compatible generation -----------------------------------------------------------
def _install_llm_routes(app: Flask, state: AppState) -> None:
    @app.get("/v1/models")
    def models() -> Response:
        card = {"id": state.limits.model_name, "object": "model", "created": state.started_at}
        card["owned_by"] = "snapfn"
        llm = state.runtime.llm
        if llm is not None:
            card["max_model_len"] = llm.max_req_input_len + 1
        return _json({"object": "list", "data": [card]})

    @app.post("/v1/completions")
    def completions() -> Response:
        return _generate(state, "completions", oa.parse_completion)

    @app.post("/v1/chat/completions")
    def chat_completions() -> Response:
        return _generate(state, "chat", oa.parse_chat)


def _generate(state: AppState, endpoint: str, parse: Callable) -> Response:
    parsed = parse(_json_body(), state.limits)
    state.gate.admit()
    llm = state.runtime.llm
    if llm is None:
        raise oa.ApiError(
            "this worker serves a function, not a language model: use POST /invoke",
            code="not_a_language_model",
            status=404,
        )
    prompts = oa.tokenize(parsed, llm.tokenizer, llm.max_req_input_len)
    generation = Generation(state, parsed, llm, prompts, f"/v1/{endpoint}")
    if parsed.stream:
        _send_small_writes_now()
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return Response(EventStream(generation), mimetype="text/event-stream", headers=headers)
    return _json(generation.body())


def _send_small_writes_now() -> None:
    """Turn Nagle's algorithm off for this connection (under gunicorn), so each streamed chunk
    leaves at once instead of waiting for the client's delayed ACK (~40-90 ms per token)."""
    sock = request.environ.get("gunicorn.socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class Generation:
    """The engine streams of one OpenAI request: `n` choices per prompt, read in choice order.

    Choices run concurrently in the engine; their outputs are read one choice after another
    (the later ones are buffered meanwhile). `close()` cancels whatever has not finished.
    """

    def __init__(self, state: AppState, request_: oa.GenerationRequest, llm, prompts, endpoint):
        self.request = request_
        self.endpoint = endpoint
        self._metrics = state.metrics
        self._arrived_at = g.arrived_at
        self._token_text = _token_text(llm.tokenizer)
        prefix = "chatcmpl" if request_.endpoint == "chat" else "cmpl"
        self.meta = oa.ResponseMeta(
            f"{prefix}-{uuid.uuid4().hex}", int(time.time()), request_.model
        )
        self.prompt_lens = [len(p) for p in prompts]
        self.streams = self._submit(llm, prompts)
        self.choices = [oa.Choice(i) for i in range(len(self.streams))]
        self._metrics.queue_seconds.labels(endpoint).observe(time.perf_counter() - self._arrived_at)
        self._metrics.prompt_tokens.labels(endpoint).inc(sum(self.prompt_lens))
        self._metrics.in_flight.inc()
        self._closed = False

    def _submit(self, llm, prompts: list[list[int]]) -> list[Any]:
        streams, n, max_input = [], self.request.n, llm.max_req_input_len
        try:
            for k, ids in enumerate(prompts):
                for j in range(n):
                    params = oa.choice_params(self.request, k * n + j, len(ids), max_input)
                    streams.append(llm.submit(ids, params))
        except BaseException:
            for stream in streams:
                stream.cancel()
            raise
        return streams

    def outputs(self) -> Iterator[tuple[int, Any]]:
        """(choice index, RequestOutput) in choice order; records latency and token metrics."""
        m, ep, last = self._metrics, self.endpoint, None
        for index, stream in enumerate(self.streams):
            for out in stream:
                now = time.perf_counter()
                if last is None:
                    m.ttft_seconds.labels(ep).observe(
                        (stream.first_token_at or now) - self._arrived_at
                    )
                elif index == 0:
                    m.itl_seconds.labels(ep).observe(now - last)
                last = now
                m.generation_tokens.labels(ep).inc(len(out.new_token_ids))
                self.choices[index].add(out)
                yield index, out
        m.e2e_seconds.labels(ep).observe(time.perf_counter() - self._arrived_at)

    def usage(self) -> dict[str, int]:
        return oa.usage(self.prompt_lens, self.choices)

    def body(self) -> dict[str, Any]:
        """Run every choice to the end; the full response object."""
        try:
            for _ in self.outputs():
                pass
        finally:
            self.close()
        return oa.response_body(
            self.request, self.meta, self.choices, self.usage(), self._token_text
        )

    def events(self) -> Iterator[str]:
        """Server-sent events: one chunk per engine output, `[DONE]` last. Closing cancels."""
        req, opened = self.request, set()
        try:
            for index, out in self.outputs():
                if req.endpoint == "chat" and index not in opened:
                    opened.add(index)
                    yield _sse(oa.chunk_body(req, self.meta, index, None, self._token_text))
                yield _sse(oa.chunk_body(req, self.meta, index, out, self._token_text))
            if req.include_usage:
                yield _sse(oa.usage_chunk(req, self.meta, self.usage()))
            yield "data: [DONE]\n\n"
        except Exception as exc:  # headers are sent: the error goes out as an event
            log.exception("generation %s failed mid-stream", self.meta.id)
            yield _sse(
                oa.error_body(f"generation failed: {exc}", "server_error", code="internal_error")
            )
        finally:
            self.close()

    def close(self) -> None:
        """Cancel unfinished choices (frees their KV pages); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._metrics.in_flight.dec()
        for stream in self.streams:
            stream.cancel()


class EventStream:
    """The response body of a streamed generation; `close()` (client gone, or done) cancels it.

    NOTE: a plain generator would not do: closing a generator that never started runs none of
    its code, so a client that left before the first token would leave its choices running.
    """

    def __init__(self, generation: Generation) -> None:
        self._generation = generation
        self._events = generation.events()

    def __iter__(self) -> Iterator[str]:
        return self._events

    def close(self) -> None:
        self._events.close()
        self._generation.close()


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, allow_nan=False)}\n\n"


def _token_text(tokenizer: Any) -> Callable[[int], str]:
    if tokenizer is None:
        return lambda token_id: f"<{token_id}>"
    return lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)


# ---- /invoke --------------------------------------------------------------------------------
def _install_invoke_route(app: Flask, state: AppState) -> None:
    @app.post("/invoke")
    def invoke() -> Response:
        event = _json_body()
        state.gate.admit()
        request_id = _request_id()
        headers = {REQUEST_ID_HEADER: request_id}
        try:
            result = state.runtime.invoke(
                event, timeout_s=state.config.invoke_timeout_s, request_id=request_id
            )
        except FunctionError as exc:
            headers[FUNCTION_ERROR_HEADER] = "Unhandled"
            return _json(_json_safe(exc.error), 500, headers)
        return _result_response(result, headers)


def _request_id() -> str:
    given = request.headers.get(REQUEST_ID_HEADER, "")
    if 0 < len(given) <= 128 and given.isprintable():
        return given
    return uuid.uuid4().hex


def _result_response(result: Any, headers: dict[str, str]) -> Response:
    try:
        body = json.dumps(result, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        headers[FUNCTION_ERROR_HEADER] = "Unhandled"
        error = {"errorType": "Runtime.MarshalError", "errorMessage": f"result is not JSON: {exc}"}
        return _json(error, 500, headers)
    return Response(body, status=200, mimetype="application/json", headers=headers)
