"""Prometheus metrics of the scale-to-zero activator, in a registry of its own.

`ActivatorMetrics` holds what the activator observes (updated by `pool.py` and
`proxy.py`):
    snapfn_activator_cold_starts_total                     instances started
    snapfn_activator_cold_start_seconds                    instance spawned → up (`/health` 200),
                                                           as the activator saw it
    snapfn_activator_restore_seconds{kind,tier}            the instance's own init or restore
                                                           time (`total_s` of its `/startup`)
    snapfn_activator_hold_seconds                          time requests waited for an instance
    snapfn_activator_held_requests                         requests waiting for one now
    snapfn_activator_rejections_total{reason}              queue_full, timeout (504),
                                                           start_failed, shutting_down
    snapfn_activator_instance_exits_total{reason}          idle, crash, failed_start, shutdown
    snapfn_activator_proxied_requests_total{status}        responses relayed from instances
                                                           (502: the instance broke off)
    snapfn_activator_broken_streams_total                  responses cut after their headers
and, read from the pool at scrape time (`PoolCollector`):
    snapfn_activator_instances{state}                      starting, up, stopping
    snapfn_startup_seconds / snapfn_startup_stage_seconds  the last cold start's startup
    snapfn_snapshot_fallbacks_total                        manifest (same names as `metrics.py`)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from snapfn.handler.activator.instance import InstanceState
from snapfn.handler.http.metrics import WithoutCreated, latency_histogram, startup_metrics

# every state a live instance can be in (an exited one is no longer in the pool)
INSTANCE_STATES = tuple(s.value for s in InstanceState if s is not InstanceState.EXITED)


class ActivatorMetrics:
    """The activator's metrics; `watch(pool)` adds the pool's state, `render()` the body."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.cold_starts = Counter("snapfn_activator_cold_starts", "Instances started", registry=r)
        self.cold_start_seconds = latency_histogram(
            "snapfn_activator_cold_start_seconds",
            "Instance spawned to up, as the activator saw it",
            r,
            labels=(),
        )
        self.first_answer_seconds = latency_histogram(
            "snapfn_activator_first_answer_seconds",
            "Instance spawned to its first answer relayed, by how it was launched (zygote: a"
            " fork of the instances' zygote; exec: a fresh interpreter)",
            r,
            labels=("launch",),
        )
        self.restore_seconds = latency_histogram(
            "snapfn_activator_restore_seconds",
            "Init or restore time an instance reported, by tier",
            r,
            labels=("kind", "tier"),
        )
        self.hold_seconds = latency_histogram(
            "snapfn_activator_hold_seconds",
            "Time a request waited for an instance to come up",
            r,
            labels=(),
        )
        self.held = Gauge(
            "snapfn_activator_held_requests", "Requests waiting for an instance now", registry=r
        )
        self.rejections = Counter(
            "snapfn_activator_rejections", "Requests refused by reason", ["reason"], registry=r
        )
        self.exits = Counter(
            "snapfn_activator_instance_exits", "Instances gone, by reason", ["reason"], registry=r
        )
        self.proxied = Counter(
            "snapfn_activator_proxied_requests", "Responses relayed", ["status"], registry=r
        )
        self.broken_streams = Counter(
            "snapfn_activator_broken_streams", "Responses cut after their headers", registry=r
        )

    def watch(self, pool: Any) -> None:
        self.registry.register(PoolCollector(pool))

    def render(self) -> tuple[bytes, str]:
        """The text exposition, less the `_created` series (as the front door's)."""
        out = CollectorRegistry(auto_describe=True)
        out.register(WithoutCreated(self.registry))
        return generate_latest(out), CONTENT_TYPE_LATEST


class PoolCollector(Collector):
    """Instances by state and the last cold start's manifest, read per scrape."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "snapfn_activator_instances", "Instances by state", labels=["state"]
        )
        counts = self._pool.count_by_state()
        for state in INSTANCE_STATES:
            family.add_metric([state], float(counts.get(state, 0)))
        yield family
        manifest = self._pool.last_startup_manifest()
        if manifest is not None:
            yield from startup_metrics(manifest)
