"""The front door's `/metrics` body across workers: a scrape that meets a worker's metrics file
just created (still empty, as prometheus_client's unlocked reads can) reads the files again."""

from __future__ import annotations

import struct
from types import SimpleNamespace

import pytest
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.parser import text_string_to_metric_families

from snapfn.handler.http import metrics
from snapfn.snapshot.stages import Readiness


def front_door(tmp_path) -> metrics.HttpMetrics:
    runtime = SimpleNamespace(readiness=SimpleNamespace(state=Readiness.UP), startup=None)
    return metrics.HttpMetrics(runtime, multiprocess_dir=str(tmp_path))


def counting_scrapes(monkeypatch, after_failure=None) -> list[int]:
    """Every `generate_latest` of a render counted; `after_failure` run where one fails."""
    calls, real = [], metrics.generate_latest

    def scrape(registry):
        calls.append(1)
        try:
            return real(registry)
        except struct.error:
            if after_failure is not None:
                after_failure()
            raise

    monkeypatch.setattr(metrics, "generate_latest", scrape)
    return calls


def test_a_worker_file_sized_after_a_failed_read_is_read_again(tmp_path, monkeypatch):
    created = tmp_path / "counter_4242.db"
    created.write_bytes(b"")  # a worker's file between its creation and its sizing
    calls = counting_scrapes(monkeypatch, lambda: MmapedDict(str(created)).close())
    body, content_type = front_door(tmp_path).render()
    assert len(calls) == 2 and content_type.startswith("text/plain")
    assert list(text_string_to_metric_families(body.decode())) == []  # the sized file is empty


def test_a_file_that_stays_empty_fails_the_scrape_after_its_attempts(tmp_path, monkeypatch):
    (tmp_path / "counter_4242.db").write_bytes(b"")
    calls = counting_scrapes(monkeypatch)
    with pytest.raises(struct.error):
        front_door(tmp_path).render()
    assert len(calls) == metrics.SCRAPE_ATTEMPTS
