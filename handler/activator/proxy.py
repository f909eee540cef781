"""Relay one request through the activator to an instance, streaming the response back.

Contract (`relay(request, pool, session, metrics)`):
- The body is read first (at most `max_body_bytes`: 413 beyond; one still arriving at the
  receive deadline: 408, `connection.py`), then the pool picks an instance, holding the request
  while none is up (`pool`: 503 / 504 as JSON).
- Method, path, query, body and end-to-end headers go to the instance (`X-Forwarded-For`
  added). A header whose name holds `_` is dropped, as the instance's gunicorn drops it from a
  client: from the activator, a forwarder it trusts on loopback, it would take `SCRIPT_NAME` as
  a prefix to cut off the path, and judge (the API key, the route) another path than the
  activator did. The instance's status, headers (plus `X-Snapfn-Instance: <id>`) and body come
  back as they arrive, chunk by chunk, so server-sent events stream through unbuffered.
- The instance failing before its response headers (it crashed or was killed) is a 502 JSON
  error `instance_failed`. Once headers are out the status cannot change: an event stream gets
  a final `data: {"error": …}` event, any other body is cut (the connection is closed), and
  `snapfn_activator_broken_streams_total` counts it.
- A client that goes away (a write fails, or aiohttp cancels the handler) closes the instance
  connection too, so the instance sees the disconnect (and cancels a streamed generation).
"""

from __future__ import annotations

import contextlib
import json
import logging

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from snapfn.handler.activator.instance import Instance
from snapfn.handler.activator.metrics import ActivatorMetrics
from snapfn.handler.activator.pool import InstancePool
from snapfn.handler.http.openai.shapes import error_body

log = logging.getLogger("snapfn.activator")
INSTANCE_HEADER = "X-Snapfn-Instance"
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te"}
    | {"trailer", "trailers", "transfer-encoding", "upgrade", "host", "content-length"}
)
NOT_RELAYED_BACK = HOP_BY_HOP | {"date", "server"}  # aiohttp sets its own


class ClientGone(Exception):
    """The client closed its connection while the response streamed."""


class UpstreamBroken(Exception):
    """The instance's connection failed while its response streamed."""


async def relay(
    request: web.Request,
    pool: InstancePool,
    session: aiohttp.ClientSession,
    metrics: ActivatorMetrics,
) -> web.StreamResponse:
    body = await request.read()
    instance = await pool.acquire()
    try:
        return await _relay_to(instance, request, body, session, metrics)
    finally:
        pool.release(instance)


async def _relay_to(
    instance: Instance,
    request: web.Request,
    body: bytes,
    session: aiohttp.ClientSession,
    metrics: ActivatorMetrics,
) -> web.StreamResponse:
    # NOTE: a multidict: a header the client repeats goes on with every value, in order
    headers = CIMultiDict((k, v) for k, v in request.headers.items() if _relayed_header(k))
    forwarded = ", ".join(request.headers.getall("X-Forwarded-For", []))
    peer = request.remote or "unknown"
    headers["X-Forwarded-For"] = f"{forwarded}, {peer}" if forwarded else peer
    url = f"{instance.url}{request.rel_url}"
    response: web.StreamResponse | None = None
    try:
        async with session.request(
            request.method, url, headers=headers, data=body, allow_redirects=False
        ) as upstream:
            response = _response_for(upstream, instance)
            try:
                await response.prepare(request)
            except ConnectionError:
                raise ClientGone() from None
            await _copy_body(upstream, response)
    except (aiohttp.ClientError, TimeoutError, UpstreamBroken) as exc:
        reason = str(exc.__cause__ or exc) or type(exc).__name__
        if response is None:
            metrics.proxied.labels("502").inc()
            return _instance_failed(instance, reason)
        metrics.broken_streams.inc()
        return await _break_off(request, response, instance, reason)
    except ClientGone:
        return response
    metrics.proxied.labels(str(response.status)).inc()
    return response


def _relayed_header(name: str) -> bool:
    return name.lower() not in HOP_BY_HOP and "_" not in name


def _response_for(upstream: aiohttp.ClientResponse, instance: Instance) -> web.StreamResponse:
    response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
    for name, value in upstream.headers.items():
        if name.lower() not in NOT_RELAYED_BACK:
            response.headers.add(name, value)
    response.headers[INSTANCE_HEADER] = str(instance.id)
    if upstream.content_length is not None:
        response.content_length = upstream.content_length
    return response


async def _copy_body(upstream: aiohttp.ClientResponse, response: web.StreamResponse) -> None:
    """Each chunk as it arrives (SSE events stay events), until the instance's body ends."""
    while True:
        try:
            chunk = await upstream.content.readany()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise UpstreamBroken() from exc
        if not chunk:
            return
        try:
            await response.write(chunk)
        except ConnectionError:
            upstream.close()  # NOTE: closes the instance connection: it sees the client go
            raise ClientGone() from None


def _instance_failed(instance: Instance, reason: str) -> web.Response:
    message = (
        f"instance {instance.id} failed while serving this request ({reason}); "
        "it is being replaced, retry"
    )
    body = error_body(message, "server_error", code="instance_failed")
    return web.json_response(body, status=502, headers={INSTANCE_HEADER: str(instance.id)})


async def _break_off(
    request: web.Request, response: web.StreamResponse, instance: Instance, reason: str
) -> web.StreamResponse:
    log.warning("instance %d broke off a response to %s: %s", instance.id, request.path, reason)
    if response.content_type == "text/event-stream":
        error = error_body(
            f"instance {instance.id} failed mid-stream ({reason}); the stream is incomplete",
            "server_error",
            code="instance_failed",
        )
        with contextlib.suppress(ConnectionError):  # the client is gone too: nothing to tell
            await response.write(f"data: {json.dumps(error)}\n\n".encode())
        return response
    if request.transport is not None:
        request.transport.close()  # a cut body must not look complete
    return response
