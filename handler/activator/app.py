"""The scale-to-zero activator: `snapfn serve --idle-timeout SECONDS [--max-instances N]`.

A light process (no torch, no CUDA: nothing here imports them) owns the port. The first
request starts an *instance* (`snapfn serve` on a private loopback port, forked from the
instances' zygote that imported the serve stack and the target once (instance_zygote.py), restoring
from the snapshot) and is held until it is up; later ones go to the up instance with the fewest
outstanding requests; more instances start under load (up to `--max-instances`, one per GPU by
default, each pinned with `CUDA_VISIBLE_DEVICES`); an instance idle for `--idle-timeout` seconds
is stopped with its whole process group, down to zero. `docs/activator.md` has the details.

Endpoints answered here (all others are relayed to an instance, see `proxy.py`):
    GET /health        200 {"status": "up", "instances": {state: count}} (zero instances is up)
    GET /startup       the activator's settings, every instance (state, pid, GPU, URL,
                       outstanding, tier), cold starts so far, the last cold start's tier and
                       stage timings
    GET /metrics       Prometheus text (`metrics.py`)
    GET /openapi.json  the instances' OpenAPI document, made here from the model name they serve
                       (`plan.model_name`; relayed where only an instance knows that name)
Errors are JSON in OpenAI's shape (`http/openai/shapes.error_body`), those of aiohttp's parser
and of a request that does not arrive in time included (`connection.py`). With an API key set,
every path but `/health` and `/openapi.json` needs `Authorization: Bearer <key>`, checked here
as the instance checks it (the same `http/api_key.refusal`, a repeated header joined with ","
as gunicorn joins it), so that a request an instance would refuse never starts one.

Why aiohttp: the activator mostly *holds* connections (requests waiting for a restore, streams
being relayed). On one event loop a held request costs a coroutine, not a thread, so the hold
queue's bound is the only limit (a thread pool would need as many threads as held requests and
streams, and would stop answering even the 503s once full), every routing decision is atomic
without locks, and streaming a response chunk by chunk is a plain read/write loop.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import signal
from argparse import Namespace
from collections.abc import Mapping
from typing import Any

import aiohttp
from aiohttp import web

from snapfn.handler.activator.connection import ActivatorRunner
from snapfn.handler.activator.instance import Instance
from snapfn.handler.activator.instance_zygote import fork_instance, start_zygote
from snapfn.handler.activator.keepers import Keepers
from snapfn.handler.activator.metrics import ActivatorMetrics
from snapfn.handler.activator.plan import ActivatorPlan
from snapfn.handler.activator.pool import InstancePool, Unavailable
from snapfn.handler.activator.proxy import relay
from snapfn.handler.http.api_key import UNAUTHORIZED_HEADERS, api_key_bytes, refusal
from snapfn.handler.http.openai.shapes import error_body
from snapfn.handler.http.receive_deadline import ReceiveTimeout
from snapfn.handler.http.serve_config import ServeConfig

log = logging.getLogger("snapfn.activator")
NOT_SENT_BY_DEFAULT = ("Accept", "Accept-Encoding", "Content-Type", "User-Agent")
OWN_PATHS = ("/health", "/startup", "/metrics")  # answered by the activator, any method
OPENAPI_PATH = "/openapi.json"  # answered by the activator where it knows the model name


def run_activator(args: Namespace, config: ServeConfig, environ: Mapping[str, str]) -> int:
    """`snapfn serve --idle-timeout …`: serve until SIGTERM or SIGINT, then stop every instance."""
    plan = ActivatorPlan.build(args, config, environ)
    logging.basicConfig(
        level=logging.INFO, format="[%(asctime)s] [%(process)d] [%(levelname)s] %(message)s"
    )
    return asyncio.run(serve_activator(plan, config))


async def serve_activator(plan: ActivatorPlan, config: ServeConfig) -> int:
    metrics = ActivatorMetrics()
    keepers = Keepers(plan)
    keepers.start()  # NOTE: before the pool: the first instance's restore can use them
    # NOTE: made beside the first requests: an instance launched before it is ready starts as
    # a fresh interpreter
    zygote = asyncio.create_task(asyncio.to_thread(start_zygote, plan))
    try:
        async with _instance_session() as session:
            launcher = _launcher(plan, config, session, zygote)
            pool = InstancePool(plan, config, metrics, launcher)
            metrics.watch(pool)
            app = create_activator_app(pool, plan, config, metrics, session, keepers)
            runner = activator_runner(app, config.receive_timeout_s)
            await runner.setup()
            await web.TCPSite(runner, config.host, config.port, backlog=2048).start()
            pool.start()
            _announce(runner, plan, config)
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            await stop.wait()
            log.info("stopping: %d instance(s) to stop", sum(pool.count_by_state().values()))
            await pool.close()
            await runner.cleanup()
    finally:
        made = _ready(zygote)
        if made is not None:
            made.close()  # NOTE: after the instances, its forks
        # NOTE: one still importing is not waited for: it exits when its owner's pipe closes
        for gpu, code in keepers.exited().items():
            log.warning("keeper for GPU %s had exited (%s) before the stop", gpu, code)
        keepers.stop()  # NOTE: after the instances: none is restoring through them any more
    return 0


def activator_runner(
    app: web.Application, receive_timeout_s: float = ServeConfig.receive_timeout_s
) -> web.AppRunner:
    """The app's runner (`connection.ActivatorRunner`: handlers cancelled when their client goes
    away, malformed requests answered in JSON, a deadline on receiving each request)."""
    return ActivatorRunner(app, receive_timeout_s)


def _ready(zygote: asyncio.Task) -> Any:
    """The instances' zygote once it is up, else None (still starting, or it could not)."""
    if not zygote.done() or zygote.cancelled() or zygote.exception() is not None:
        return None
    return zygote.result()


def _instance_session() -> aiohttp.ClientSession:
    """The one client session to every instance: no pool limit, no cookies kept between
    clients, bodies passed through as they are (no decompression, no headers added)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
        cookie_jar=aiohttp.DummyCookieJar(),
        auto_decompress=False,
        skip_auto_headers=NOT_SENT_BY_DEFAULT,
    )


def _launcher(
    plan: ActivatorPlan, config: ServeConfig, session: aiohttp.ClientSession, zygote: asyncio.Task
):
    parent_pid = os.getpid()

    def launch(instance_id: int, gpu: str | None) -> Instance:
        forks = _ready(zygote)
        # NOTE: a fork's parent is the zygote: its parent-death signal follows that
        env = plan.instance_env(gpu, forks.pid if forks is not None else parent_pid)
        argv, grace_s = plan.instance_argv, config.graceful_timeout_s
        spawn = functools.partial(fork_instance, forks, argv, env) if forks is not None else None
        return Instance(instance_id, gpu, argv, env, session, grace_s, plan.api_key, spawn)

    return launch


def _announce(runner: web.AppRunner, plan: ActivatorPlan, config: ServeConfig) -> None:
    host, port = runner.addresses[0][:2]
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    gpus = ",".join(plan.gpu_ids) or "none"
    print(
        f"snapfn serve: listening on http://{where} (activator: up to {plan.max_instances} "
        f"instance(s), idle timeout {config.idle_timeout_s:g} s, GPUs {gpus})",
        flush=True,
    )


def create_activator_app(
    pool: InstancePool,
    plan: ActivatorPlan,
    config: ServeConfig,
    metrics: ActivatorMetrics,
    session: aiohttp.ClientSession,
    keepers: Keepers | None = None,
) -> web.Application:
    app = web.Application(
        client_max_size=config.max_body_bytes, middlewares=[_json_errors, _auth(config)]
    )

    async def health(request: web.Request) -> web.Response:
        body = {"status": "stopping" if pool.closing else "up"}
        body["instances"] = pool.count_by_state()
        return web.json_response(body, status=503 if pool.closing else 200)

    async def startup(request: web.Request) -> web.Response:
        settings = _settings(plan, config)
        if keepers is not None and plan.keeper_dir:
            gone = keepers.exited()
            settings["keepers"] = {
                gpu: "running" if gpu not in gone else f"exited {gone[gpu]}" for gpu in plan.gpu_ids
            }
        return web.json_response({"activator": settings, **pool.describe()})

    async def metrics_text(request: web.Request) -> web.Response:
        body, content_type = metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    own_paths = OWN_PATHS
    if plan.model_name is not None:
        own_paths += (OPENAPI_PATH,)
        app.router.add_get(OPENAPI_PATH, OpenApiDocument(plan.model_name).answer)

    async def relayed(request: web.Request) -> web.StreamResponse:
        if request.path in own_paths:  # another method: answered here, never starts an instance
            raise web.HTTPMethodNotAllowed(request.method, ["GET", "HEAD"])
        return await relay(request, pool, session, metrics)

    app.router.add_get("/health", health)
    app.router.add_get("/startup", startup)
    app.router.add_get("/metrics", metrics_text)
    app.router.add_route("*", "/{path:.*}", relayed)
    return app


class OpenApiDocument:
    """The instances' `/openapi.json`, made here: it depends only on the model name, and a
    client reading it must start no instance (it is open without the API key). Made at the
    first request, in a thread: it imports pydantic and the request models (about 0.15 s and
    10 MB), which the activator otherwise never needs."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self._body: bytes | None = None

    async def answer(self, request: web.Request) -> web.Response:
        if self._body is None:
            self._body = await asyncio.to_thread(openapi_json, self.model_name)
        return web.Response(body=self._body, content_type="application/json")


def openapi_json(model_name: str) -> bytes:
    # NOTE: imported here: pydantic and the request models stay out of the activator until asked
    from snapfn.handler.http.openapi import openapi_document

    return json.dumps(openapi_document(model_name)).encode()


def _settings(plan: ActivatorPlan, config: ServeConfig) -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "idle_timeout_s": config.idle_timeout_s,
        "max_instances": plan.max_instances,
        "target_concurrency": config.target_concurrency,
        "gpus": list(plan.gpu_ids),
        "hold_queue_size": config.startup_queue_size,
        "hold_wait_s": config.startup_wait_s,
        "receive_timeout_s": config.receive_timeout_s,
    }


def _auth(config: ServeConfig):
    key = api_key_bytes(config.api_key)

    @web.middleware
    async def check_key(request: web.Request, handler):
        # NOTE: a repeated header joined as gunicorn joins it for the instance's app
        authorization = ",".join(request.headers.getall("Authorization", []))
        body = refusal(key, request.path, authorization)
        if body is None:
            return await handler(request)
        return web.json_response(body, status=401, headers=UNAUTHORIZED_HEADERS)

    return check_key


@web.middleware
async def _json_errors(request: web.Request, handler):
    try:
        return await handler(request)
    except Unavailable as exc:
        headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s else None
        kind = "timeout" if exc.status == 504 else "service_unavailable"
        body = error_body(str(exc), kind, code=exc.reason)
        return web.json_response(body, status=exc.status, headers=headers)
    except ReceiveTimeout as exc:  # the body is late (`connection.py`): the rest is not read
        body = error_body(str(exc), "invalid_request_error", code=exc.code)
        response = web.json_response(body, status=408)
        response.force_close()
        return response
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = (exc.reason or "error").lower().replace(" ", "_")
        body = error_body(exc.text or exc.reason, "invalid_request_error", code=code)
        return web.json_response(body, status=exc.status)
    except Exception as exc:
        log.exception("unhandled error serving %s %s", request.method, request.path)
        message = f"internal error in the activator ({type(exc).__name__})"
        body = error_body(message, "server_error", code="internal_error")
        return web.json_response(body, status=500)
