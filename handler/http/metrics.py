"""Prometheus metrics of the HTTP front door, in a registry of each app's own (no globals).

`HttpMetrics(runtime, multiprocess_dir)` owns a `CollectorRegistry` holding:
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
    snapfn_startup_rejections_total{reason}                 503s: queue_full, timeout, failed,
                                                            stopped
- what the runtime knows, copied in from it (`RuntimeMetrics.refresh`) when `/metrics` is read
  and, in a gunicorn worker, every `REFRESH_INTERVAL_S` (`refresh_until`, started by `serve.py`),
  so that a worker no scrape reaches still reports:
    snapfn_readiness{state}                                 workers in each state (1 or 0 for one)
    snapfn_startup_seconds{kind,tier}                       total init/restore time
    snapfn_startup_stage_seconds{kind,tier,stage}           each init/restore stage (a restore
                                                            that failed and fell back appears with
                                                            tier "<tier> (failed)")
    snapfn_snapshot_fallbacks_total{from,to,step}           fallbacks taken at start-up
    snapfn_kv_cache_usage_ratio                             share of KV pages in use (the fullest
                                                            worker's)
    snapfn_engine_requests_total{outcome}                   submitted / finished / cancelled /
                                                            failed
    snapfn_engine_steps_total
    snapfn_engine_preemptions_total                         running requests whose KV pages were
                                                            taken back for others' (recomputed)
    snapfn_graph_replays_total / snapfn_graph_eager_fallbacks_total
    snapfn_graph_prefill_replays_total                      of the replays, short prefills run a
                                                            row a token (engine.py)
    snapfn_prefix_cache_queried_tokens_total                prompt tokens the prefix cache was
    snapfn_prefix_cache_hit_tokens_total                    asked for / found (prefill skipped)
    snapfn_prefix_cache_pages                               KV pages it names (workers summed)
    snapfn_spec_draft_tokens_total                          speculative decoding: MTP drafts
    snapfn_spec_accepted_tokens_total                       verified / kept (acceptance: kept over
                                                            verified)
    snapfn_grammar_cache_lookups_total{result}              structured-output compile cache: hit
                                                            (compiled before) or miss (compiled)
    snapfn_grammar_compile_seconds_total                    grammar compiles, those at start-up too

Several gunicorn workers (`snapfn serve --workers N`): each worker's values live in files under
`multiprocess_dir` (prometheus_client's multiprocess mode, which `serve.py` switches on before
prometheus_client is imported), and `/metrics`, whichever worker answers, is every worker's
together: counters and histograms summed, gauges of live workers summed (in flight, waiters,
readiness), their maximum (KV usage) or one series per worker with a `pid` label (start-up
times). Without one (a single process, tests) the registry is read directly. Either way no
`_created` series is sent (they are start times that every scrape would carry).
"""

from __future__ import annotations

import logging
import struct
import threading
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

SCRAPE_ATTEMPTS = 3  # reads of the workers' files a scrape makes before it fails

LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)  # fmt: skip
log = logging.getLogger("snapfn.http")
PREFIX_QUERIED = (
    "Prompt tokens the prefix cache was asked for (full pages, the last token left out)"
)
PREFIX_HITS = "Prompt tokens found in the prefix cache (their prefill skipped)"
PREFIX_PAGES = "KV pages the prefix cache names (held by requests or idle)"
SPEC_DRAFTS = "MTP draft tokens verified by speculative decoding"
SPEC_ACCEPTED = "MTP draft tokens kept (accepted) by speculative decoding"
PREEMPTIONS = "Running requests preempted: their KV pages taken back, their tokens recomputed"
PREFILL_REPLAYS = "Short prefills run by replaying a decode graph, a row a token"
GRAMMAR_LOOKUPS = "Structured-output compile cache lookups by result (hit, miss)"
GRAMMAR_COMPILE = "Seconds spent compiling grammars (start-up's included)"
REFRESH_INTERVAL_S = 1.0  # a gunicorn worker copies its runtime's values in this often


class HttpMetrics:
    """The front door's metrics; `render()` is the `/metrics` body and its content type."""

    def __init__(self, runtime: Any, multiprocess_dir: str | None = None) -> None:
        self.registry = CollectorRegistry()
        self.multiprocess_dir = multiprocess_dir
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
        self.in_flight = Gauge(
            "snapfn_generations_in_flight",
            "Generations now",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.startup_waiters = Gauge(
            "snapfn_startup_waiters",
            "Requests waiting for start-up",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.startup_rejections = Counter(
            "snapfn_startup_rejections", "Requests refused while starting", ["reason"], registry=r
        )
        self.runtime = RuntimeMetrics(runtime, r)

    def render(self) -> tuple[bytes, str]:
        """The exposition: every worker's (multiprocess) or this registry's, no `_created`."""
        self.runtime.refresh()
        source: Any = self.registry
        if self.multiprocess_dir is not None:
            from prometheus_client.multiprocess import MultiProcessCollector

            source = CollectorRegistry()
            MultiProcessCollector(source, path=self.multiprocess_dir)
        out = CollectorRegistry(auto_describe=False)
        out.register(WithoutCreated(source))
        for _ in range(SCRAPE_ATTEMPTS - 1):
            try:
                return generate_latest(out), CONTENT_TYPE_LATEST
            except struct.error:
                # NOTE: prometheus_client reads every worker's file without a lock: one that a
                # worker has just created is still empty (its size is set right after), and
                # its first 4 bytes do not unpack. Each attempt reads the files afresh.
                continue
        return generate_latest(out), CONTENT_TYPE_LATEST


def latency_histogram(
    name: str, doc: str, registry: CollectorRegistry, labels: tuple[str, ...] = ("endpoint",)
) -> Histogram:
    """A seconds histogram on the shared latency buckets (the activator's too)."""
    return Histogram(name, doc, list(labels), registry=registry, buckets=LATENCY_BUCKETS_S)


class WithoutCreated(Collector):
    """`source`'s metrics less their `_created` samples."""

    def __init__(self, source: Any) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        for family in self._source.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


class RuntimeMetrics:
    """The runtime's readiness, startup manifest, KV pool and engine counters, copied into
    metrics of the registry by `refresh()` (so that, in multiprocess mode, every worker's
    values reach the files whichever worker is scraped). Counters grow by what the runtime's
    totals grew since the last copy."""

    def __init__(self, runtime: Any, registry: CollectorRegistry) -> None:
        self._runtime = runtime
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, tuple[str, ...]], float] = {}
        r = registry
        self.readiness = Gauge(
            "snapfn_readiness",
            "Workers in each state",
            ["state"],
            registry=r,
            multiprocess_mode="livesum",
        )
        kinds = ["kind", "tier"]
        self.gauges = {
            "snapfn_startup_seconds": Gauge(
                "snapfn_startup_seconds",
                "Init or restore time",
                kinds,
                registry=r,
                multiprocess_mode="liveall",
            ),
            "snapfn_startup_stage_seconds": Gauge(
                "snapfn_startup_stage_seconds",
                "Init or restore stage time",
                [*kinds, "stage"],
                registry=r,
                multiprocess_mode="liveall",
            ),
            "snapfn_kv_cache_usage_ratio": Gauge(
                "snapfn_kv_cache_usage_ratio",
                "Share of KV cache pages in use",
                registry=r,
                multiprocess_mode="livemax",
            ),
            "snapfn_prefix_cache_pages": Gauge(
                "snapfn_prefix_cache_pages", PREFIX_PAGES, registry=r, multiprocess_mode="livesum"
            ),
        }
        self.counters = {
            name: Counter(name, doc, labels, registry=r)
            for name, doc, labels in (
                ("snapfn_snapshot_fallbacks", "Start-up fallbacks", ["from", "to", "step"]),
                ("snapfn_engine_requests", "Engine requests by outcome", ["outcome"]),
                ("snapfn_engine_steps", "Engine steps", []),
                ("snapfn_engine_preemptions", PREEMPTIONS, []),
                ("snapfn_graph_replays", "Decode CUDA graph replays", []),
                ("snapfn_graph_eager_fallbacks", "Decode steps run eagerly (no graph fit)", []),
                ("snapfn_graph_prefill_replays", PREFILL_REPLAYS, []),
                ("snapfn_prefix_cache_queried_tokens", PREFIX_QUERIED, []),
                ("snapfn_prefix_cache_hit_tokens", PREFIX_HITS, []),
                ("snapfn_spec_draft_tokens", SPEC_DRAFTS, []),
                ("snapfn_spec_accepted_tokens", SPEC_ACCEPTED, []),
                ("snapfn_grammar_cache_lookups", GRAMMAR_LOOKUPS, ["result"]),
                ("snapfn_grammar_compile_seconds", GRAMMAR_COMPILE, []),
            )
        }

    def refresh_until(self, stop: threading.Event, interval_s: float = REFRESH_INTERVAL_S) -> None:
        """`refresh()` every `interval_s` until `stop` is set (a worker's side thread)."""
        while not stop.wait(interval_s):
            try:
                self.refresh()
            except Exception:  # a failed copy must not end the copying; the next one retries
                log.exception("copying the runtime's metrics failed")

    def refresh(self) -> None:
        with self._lock:
            current = self._runtime.readiness.state
            for state in Readiness:
                self.readiness.labels(state.value).set(1.0 if state is current else 0.0)
            families = []
            if self._runtime.startup is not None:
                families += startup_metrics(self._runtime.startup.to_json())
            llm = getattr(self._runtime, "llm", None)
            if llm is not None:
                families += engine_metrics(llm)
                families += grammar_metrics(llm)
            for family in families:
                self._copy(family)

    def _copy(self, family: Metric) -> None:
        totals: dict[tuple[str, ...], float] = {}
        for sample in family.samples:
            labels = tuple(sample.labels.values())
            totals[labels] = totals.get(labels, 0.0) + sample.value
        for labels, value in totals.items():
            if family.name in self.gauges:
                gauge = self.gauges[family.name]
                (gauge.labels(*labels) if labels else gauge).set(value)
                continue
            counter = self.counters[family.name]
            child = counter.labels(*labels) if labels else counter  # shown at 0 too
            grown = value - self._seen.get((family.name, labels), 0.0)
            if grown > 0:
                child.inc(grown)
                self._seen[(family.name, labels)] = value


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
        ("failed", getattr(stats, "failed", 0)),
    ):
        requests.add_metric([outcome], float(value))
    yield requests
    yield CounterMetricFamily("snapfn_engine_steps", "Engine steps", value=float(stats.steps))
    if hasattr(llm, "preemptions"):
        yield CounterMetricFamily(
            "snapfn_engine_preemptions", PREEMPTIONS, value=float(llm.preemptions())
        )
    graphs = getattr(getattr(llm, "engine", None), "graph_stats", None)
    replays = getattr(graphs, "replays", 0)
    eager = getattr(graphs, "eager_fallbacks", 0)
    yield CounterMetricFamily("snapfn_graph_replays", "Decode CUDA graph replays", value=replays)
    yield CounterMetricFamily(
        "snapfn_graph_eager_fallbacks", "Decode steps run eagerly (no graph fit)", value=eager
    )
    yield CounterMetricFamily(
        "snapfn_graph_prefill_replays",
        PREFILL_REPLAYS,
        value=getattr(graphs, "prefill_replays", 0),
    )
    prefix = llm.prefix_cache_stats() if hasattr(llm, "prefix_cache_stats") else None
    if prefix is not None:
        yield CounterMetricFamily(
            "snapfn_prefix_cache_queried_tokens", PREFIX_QUERIED, value=prefix["queried_tokens"]
        )
        yield CounterMetricFamily(
            "snapfn_prefix_cache_hit_tokens", PREFIX_HITS, value=prefix["hit_tokens"]
        )
        yield GaugeMetricFamily(
            "snapfn_prefix_cache_pages", PREFIX_PAGES, value=prefix["cached_pages"]
        )
    spec = llm.spec_stats() if hasattr(llm, "spec_stats") else None
    if spec is not None:
        yield CounterMetricFamily(
            "snapfn_spec_draft_tokens", SPEC_DRAFTS, value=spec["draft_tokens"]
        )
        yield CounterMetricFamily(
            "snapfn_spec_accepted_tokens", SPEC_ACCEPTED, value=spec["accepted_tokens"]
        )


def grammar_metrics(llm: Any) -> Iterator[Metric]:
    """The structured-output compile cache's counters (`structured/compiler.py`) of an
    `LLMService` whose engine runs here; none without one."""
    cache = getattr(getattr(llm, "engine", None), "grammars", None)
    if cache is None:
        return
    stats = cache.stats()
    lookups = CounterMetricFamily(
        "snapfn_grammar_cache_lookups", GRAMMAR_LOOKUPS, labels=["result"]
    )
    lookups.add_metric(["hit"], float(stats["hits"]))
    lookups.add_metric(["miss"], float(stats["misses"]))
    yield lookups
    yield CounterMetricFamily(
        "snapfn_grammar_compile_seconds", GRAMMAR_COMPILE, value=stats["compile_s"]
    )
