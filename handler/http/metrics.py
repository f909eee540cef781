"""Prometheus metrics of one HTTP worker, in a registry of its own (no process-wide globals).

`HttpMetrics(runtime)` owns a `CollectorRegistry` holding:
- what the front door observes as requests pass (updated by `app.py`):
    snapfn_http_requests_total{endpoint,method,status}      responses sent
    snapfn_http_request_duration_seconds{endpoint}          arrival → response headers
    snapfn_request_queue_seconds{endpoint}                  arrival → handed to the engine
                                                            (start-up wait included)
    snapfn_time_to_first_token_seconds{endpoint}            arrival → first token out of the engine
    snapfn_inter_token_latency_seconds{endpoint}            gaps between successive outputs of a
                                                            request's first choice, as read
    snapfn_e2e_request_latency_seconds{endpoint}            arrival → last token of every choice
    snapfn_prompt_tokens_total / snapfn_generation_tokens_total{endpoint}
    snapfn_generations_in_flight                            generation requests being served
    snapfn_startup_waiters                                  requests waiting for start-up now
    snapfn_startup_rejections_total{reason}                 503s: queue_full, timeout, failed
- what the runtime knows, read at scrape time (`RuntimeCollector`):
    snapfn_readiness{state}                                 1 for the current state, 0 otherwise
    snapfn_startup_seconds{kind,tier}                       total init/restore time
    snapfn_startup_stage_seconds{kind,tier,stage}           each init/restore stage (a restore
                                                            that failed and fell back appears with
                                                            tier "<tier> (failed)")
    snapfn_snapshot_fallbacks_total{from,to,step}           fallbacks taken at start-up
    snapfn_kv_cache_usage_ratio                             share of KV pages in use
    snapfn_engine_requests_total{outcome}                   submitted / finished / cancelled
    snapfn_engine_steps_total
    snapfn_graph_replays_total / snapfn_graph_eager_fallbacks_total
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from snapfn.snapshot.stages import Readiness

LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)  # fmt: skip


class HttpMetrics:
    """The front door's metrics; `render()` is the `/metrics` body and its content type."""

    def __init__(self, runtime: Any) -> None:
        self.registry = CollectorRegistry()
        r, ep = self.registry, ["endpoint"]
        self.requests = Counter(
            "snapfn_http_requests",
            "HTTP responses sent",
            ["endpoint", "method", "status"],
            registry=r,
        )
        self.request_seconds = latency_histogram(
            "snapfn_http_request_duration_seconds", "Arrival to response headers", r
        )
        self.queue_seconds = latency_histogram(
            "snapfn_request_queue_seconds", "Arrival to hand-off to the engine", r
        )
        self.ttft_seconds = latency_histogram(
            "snapfn_time_to_first_token_seconds", "Arrival to first generated token", r
        )
        self.itl_seconds = latency_histogram(
            "snapfn_inter_token_latency_seconds", "Gap between successive outputs of a stream", r
        )
        self.e2e_seconds = latency_histogram(
            "snapfn_e2e_request_latency_seconds", "Arrival to the last generated token", r
        )
        self.prompt_tokens = Counter("snapfn_prompt_tokens", "Prompt tokens", ep, registry=r)
        self.generation_tokens = Counter(
            "snapfn_generation_tokens", "Generated tokens", ep, registry=r
        )
        self.in_flight = Gauge("snapfn_generations_in_flight", "Generations now", registry=r)
        self.startup_waiters = Gauge(
            "snapfn_startup_waiters", "Requests waiting for start-up", registry=r
        )
        self.startup_rejections = Counter(
            "snapfn_startup_rejections", "Requests refused while starting", ["reason"], registry=r
        )
        r.register(RuntimeCollector(runtime))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def latency_histogram(
    name: str, doc: str, registry: CollectorRegistry, labels: tuple[str, ...] = ("endpoint",)
) -> Histogram:
    """A seconds histogram on the shared latency buckets (the activator's too)."""
    return Histogram(name, doc, list(labels), registry=registry, buckets=LATENCY_BUCKETS_S)


class RuntimeCollector(Collector):
    """Reads the runtime's readiness, startup manifest, KV pool and engine counters per scrape."""

    def __init__(self, runtime: Any) -> None:
        self._runtime = runtime

    def collect(self) -> Iterator[Metric]:
        yield self._readiness()
        startup = self._runtime.startup
        if startup is not None:
            yield from startup_metrics(startup.to_json())
        llm = getattr(self._runtime, "llm", None)
        if llm is not None:
            yield from engine_metrics(llm)

    def _readiness(self) -> Metric:
        family = GaugeMetricFamily(
            "snapfn_readiness", "1 for the worker's current state", labels=["state"]
        )
        current = self._runtime.readiness.state
        for state in Readiness:
            family.add_metric([state.value], 1.0 if state is current else 0.0)
        return family


def startup_metrics(manifest: dict[str, Any]) -> Iterator[Metric]:
    """Stage seconds, total seconds and fallbacks of a startup manifest (`to_json()` form)."""
    total = GaugeMetricFamily(
        "snapfn_startup_seconds", "Init or restore time", labels=["kind", "tier"]
    )
    stages = GaugeMetricFamily(
        "snapfn_startup_stage_seconds",
        "Init or restore stage time",
        labels=["kind", "tier", "stage"],
    )
    fallbacks = CounterMetricFamily(
        "snapfn_snapshot_fallbacks", "Start-up fallbacks", labels=["from", "to", "step"]
    )
    failed = manifest.get("info", {}).get("failed_restore")
    for m, tier in (
        (manifest, manifest["tier"]),
        (failed, f"{(failed or {}).get('tier')} (failed)"),
    ):
        if not m:
            continue
        total.add_metric([m["kind"], tier], float(m["total_s"]))
        for stage in m.get("stages", []):
            stages.add_metric([m["kind"], tier, stage["name"]], float(stage["seconds"]))
    for fb in manifest.get("fallbacks", []):
        fallbacks.add_metric([fb["from"], fb["to"], fb["step"]], 1.0)
    yield from (total, stages, fallbacks)


def engine_metrics(llm: Any) -> Iterator[Metric]:
    """KV usage, engine request counters and CUDA-graph counters of an `LLMService`."""
    yield GaugeMetricFamily(
        "snapfn_kv_cache_usage_ratio", "Share of KV cache pages in use", value=llm.kv_usage()
    )
    stats = llm.stats
    requests = CounterMetricFamily(
        "snapfn_engine_requests", "Engine requests by outcome", labels=["outcome"]
    )
    for outcome, value in (
        ("submitted", stats.requests),
        ("finished", stats.finished),
        ("cancelled", stats.cancelled),
    ):
        requests.add_metric([outcome], float(value))
    yield requests
    yield CounterMetricFamily("snapfn_engine_steps", "Engine steps", value=float(stats.steps))
    graphs = getattr(getattr(llm, "engine", None), "graphs", None)
    replays = getattr(getattr(graphs, "stats", None), "replays", 0)
    eager = getattr(getattr(graphs, "stats", None), "eager_fallbacks", 0)
    yield CounterMetricFamily("snapfn_graph_replays", "Decode CUDA graph replays", value=replays)
    yield CounterMetricFamily(
        "snapfn_graph_eager_fallbacks", "Decode steps run eagerly (no graph fit)", value=eager
    )
