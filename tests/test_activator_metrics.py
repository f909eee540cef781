"""handler/activator/metrics.py: the activator's exposition, without `_created` series (as the
front door's), with what it observed."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from snapfn.handler.activator.metrics import ActivatorMetrics


def test_the_exposition_has_no_created_series_and_counts_what_happened():
    metrics = ActivatorMetrics()
    metrics.cold_starts.inc()
    text, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    samples = {
        s.name: s.value for f in text_string_to_metric_families(text.decode()) for s in f.samples
    }
    assert samples["snapfn_activator_cold_starts_total"] == 1.0
    assert not [name for name in samples if name.endswith("_created")]
