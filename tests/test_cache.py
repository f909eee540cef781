"""The local snapshot cache, and `--snapshot s3://…` in serve, worker and generate.

Against moto in server mode: an s3:// snapshot is pulled once per manifest, then hit; least
recently used entries are evicted to fit the bound; the front doors turn the URI into the
cached folder (the embedded model's snapshot restores from it and generates as from the
original).
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest

from snapfn.handler.cli import build_parser, main
from snapfn.handler.function.target_flags import serve_target
from snapfn.handler.http.serve import default_model_name
from snapfn.snapshot.errors import BadRequest
from snapfn.snapshot.store.cache import (
    DEFAULT_MAX_BYTES,
    SnapshotCacheConfig,
    cached_snapshot,
    parse_byte_count,
)
from snapfn.snapshot.store.transfer import push

from moto_server import fake_aws
from s3_clients import RecordingClient
from snapshot_samples import write_snapshot

BUCKET = "snapfn-cache"


@pytest.fixture(scope="module")
def aws():
    with fake_aws(BUCKET) as server:
        yield server


def pushed(aws, tmp_path: Path, marker: str, uri: str | None = None) -> str:
    """Push a sample snapshot carrying `marker`; its URI (a fresh one unless given)."""
    uri = uri or f"s3://{BUCKET}/snapshots/{uuid.uuid4().hex[:8]}/{marker}"
    snapshot = write_snapshot(tmp_path / f"local-{uuid.uuid4().hex[:8]}", marker=marker)
    push(snapshot, uri, endpoint_url=aws.endpoint_url, log=None)
    return uri


def marker_of(path: Path) -> str:
    return json.loads((path / "manifest.json").read_text())["marker"]


def resolve(aws, uri: str, config: SnapshotCacheConfig, log=None) -> tuple[Path, int]:
    """(cached path, ranged GETs it took)."""
    client = RecordingClient(aws.client("s3"))
    path = cached_snapshot(uri, config, client=client, log=log)
    return path, len(client.ranged_gets)


def test_pulls_once_then_hits(aws, tmp_path):
    uri, config = pushed(aws, tmp_path, "one"), SnapshotCacheConfig(tmp_path / "cache")
    path, num_gets = resolve(aws, uri, config)
    assert num_gets > 0 and marker_of(path) == "one"
    assert path.name == "one" and path.parent.parent == config.root
    lines = []
    again, num_gets = resolve(aws, uri, config, log=lines.append)
    assert (again, num_gets) == (path, 0)
    assert lines == [f"snapshot cache hit: {uri} is at {path}"]


def test_a_new_push_under_the_same_uri_is_a_new_entry(aws, tmp_path):
    uri, config = pushed(aws, tmp_path, "first"), SnapshotCacheConfig(tmp_path / "cache")
    first, _ = resolve(aws, uri, config)
    pushed(aws, tmp_path, "second", uri=uri)
    second, num_gets = resolve(aws, uri, config)
    assert second != first and num_gets > 0
    assert (marker_of(first), marker_of(second)) == ("first", "second")


def test_least_recently_used_entries_are_evicted(aws, tmp_path):
    a, b, c = (pushed(aws, tmp_path, m) for m in "abc")
    probe, _ = resolve(aws, a, SnapshotCacheConfig(tmp_path / "probe"))
    entry_bytes = sum(p.stat().st_size for p in probe.rglob("*") if p.is_file())
    config = SnapshotCacheConfig(tmp_path / "cache", max_bytes=2 * entry_bytes + entry_bytes // 2)
    path_a, _ = resolve(aws, a, config)
    path_b, _ = resolve(aws, b, config)
    assert resolve(aws, a, config) == (path_a, 0)  # a is now used more recently than b
    lines = []
    path_c, _ = resolve(aws, c, config, log=lines.append)
    assert path_a.is_dir() and path_c.is_dir() and not path_b.parent.exists()
    assert any(f"evicted {path_b.parent}" in line for line in lines)
    path_b, num_gets = resolve(aws, b, config)  # pulled again; a is the least recent now
    assert num_gets > 0 and not path_a.parent.exists() and path_c.is_dir()


def test_a_snapshot_over_the_bound_is_still_pulled_with_a_warning(aws, tmp_path):
    uri, lines = pushed(aws, tmp_path, "big"), []
    path, _ = resolve(aws, uri, SnapshotCacheConfig(tmp_path / "cache", 1000), log=lines.append)
    assert marker_of(path) == "big"
    assert any("the snapshot alone does not fit" in line for line in lines)


def test_settings_from_env_and_flags(tmp_path):
    env = {"HOME": "/home/u"}
    assert SnapshotCacheConfig.from_env(env) == SnapshotCacheConfig(
        Path("/home/u/.cache/snapfn/snapshots"), DEFAULT_MAX_BYTES
    )
    env |= {"XDG_CACHE_HOME": "/x", "SNAPFN_SNAPSHOT_CACHE_MAX_BYTES": "20G"}
    assert SnapshotCacheConfig.from_env(env) == SnapshotCacheConfig(
        Path("/x/snapfn/snapshots"), 20 << 30
    )
    env["SNAPFN_SNAPSHOT_CACHE"] = str(tmp_path)
    assert SnapshotCacheConfig.from_env(env, max_bytes="512MiB").max_bytes == 512 << 20
    assert SnapshotCacheConfig.from_env(env).root == tmp_path
    assert [parse_byte_count(v) for v in ("1048576", "64K", "3 GB", "1t")] == [
        1 << 20,
        64 << 10,
        3 << 30,
        1 << 40,
    ]
    for bad in ("", "1.5G", "12X", "-3"):
        with pytest.raises(BadRequest):
            parse_byte_count(bad)
    with pytest.raises(BadRequest):
        SnapshotCacheConfig(tmp_path, max_bytes=0)


def test_front_doors_take_an_s3_snapshot(aws, embedded_snapshot, tmp_path, monkeypatch, capsys):
    uri = f"s3://{BUCKET}/models/{uuid.uuid4().hex[:8]}/embedded"
    push(embedded_snapshot, uri, endpoint_url=aws.endpoint_url, log=None)
    monkeypatch.setenv("AWS_ENDPOINT_URL", aws.endpoint_url)
    monkeypatch.setenv("SNAPFN_SNAPSHOT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    # pulled whole before the fork (a miss restored as it pulls: test_s3_overlap.py)
    monkeypatch.setenv("SNAPFN_SNAPSHOT_CACHE_OVERLAP", "off")

    serve = serve_target(build_parser().parse_args(["serve", "--snapshot", uri]))
    assert serve.snapshot_dir.parent.parent == tmp_path / "cache"
    assert default_model_name(serve) == "embedded"
    local = {
        p.relative_to(embedded_snapshot): p.read_bytes()
        for p in embedded_snapshot.rglob("*")
        if p.is_file()
    }
    assert {
        p.relative_to(serve.snapshot_dir): p.read_bytes()
        for p in serve.snapshot_dir.rglob("*")
        if p.is_file()
    } == local
    argv = ["worker", "--queue-url", "http://q", "--snapshot", uri, "--cache-max-bytes", "1G"]
    assert serve_target(build_parser().parse_args(argv)).snapshot_dir == serve.snapshot_dir
    assert "snapshot cache hit" in capsys.readouterr().err

    prompt = ["--prompt", "ROMEO:", "--max-new-tokens", "6", "--json"]
    assert main(["generate", "--snapshot", uri, *prompt]) == 0
    from_s3 = capsys.readouterr()
    assert "snapshot cache hit" in from_s3.err and "restore (portable) ok" in from_s3.err
    assert main(["generate", "--snapshot", str(embedded_snapshot), *prompt]) == 0
    assert json.loads(from_s3.out) == json.loads(capsys.readouterr().out)
    assert sorted(os.listdir(tmp_path / "cache")) == [".lock", serve.snapshot_dir.parent.name]
