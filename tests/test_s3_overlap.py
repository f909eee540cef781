"""A tier-0 restore that follows its pull from the S3 store (store/overlap.py, arrivals.py,
llm/recipes/s3_restore.py), against moto in server mode.

The embedded model's snapshot (two 64 MiB chunks in weights/rank0.bin) restored while it is
pulled answers as a local restore; the streamer reads chunk 0 while the GET of chunk 1 is held
back (a gate, no timing); a chunk tampered in S3 is refused mid-stream, the restore falls back
to a cold init from the named model and the cache holds no snapshot; a pull that failed resumes;
SNAPFN_SNAPSHOT_CACHE_OVERLAP=off pulls whole first, as before.
"""

from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path

import pytest

from snapfn.handler.cli import build_parser, main
from snapfn.handler.function.target_flags import serve_target
from snapfn.handler.llm.embedded import embedded_model_dir
from snapfn.handler.llm.init_config import InitConfig
from snapfn.handler.llm.recipes.function import LLMFunction
from snapfn.handler.llm.recipes.s3_restore import STREAMED, restore_following
from snapfn.snapshot.errors import BadRequest, BadSnapshot
from snapfn.snapshot.runtime import restore
from snapfn.snapshot.store.arrivals import Arrivals
from snapfn.snapshot.store.cache import SnapshotCacheConfig, open_snapshot
from snapfn.snapshot.store.s3 import S3Location
from snapfn.snapshot.store.transfer import push

from moto_server import fake_aws
from s3_clients import RecordingClient

BUCKET = "snapfn-overlap"
WEIGHTS = STREAMED[0]
GATE_S = 120  # how long a held GET waits for the streamer before the test gives up


@pytest.fixture(scope="module")
def aws():
    with fake_aws(BUCKET) as server:
        yield server


@pytest.fixture
def init_config(tmp_path):
    return InitConfig(
        max_num_batched_tokens=64, kv_cache_bytes_cpu=1 << 20, cache_dir=tmp_path / "compile-cache"
    )


@pytest.fixture(scope="module")
def pushed(aws, embedded_snapshot) -> str:
    uri = f"s3://{BUCKET}/snapshots/{uuid.uuid4().hex[:8]}/embedded"
    push(embedded_snapshot, uri, endpoint_url=aws.endpoint_url, log=None)
    return uri


@pytest.fixture(scope="module")
def local_answer(embedded_snapshot, tmp_path_factory):
    """The embedded snapshot restored from local disk: its 4-token greedy answer."""
    cache = tmp_path_factory.mktemp("local-cache")
    config = InitConfig(max_num_batched_tokens=64, kv_cache_bytes_cpu=1 << 20, cache_dir=cache)
    fn, startup = restore(lambda: LLMFunction(config, None), embedded_snapshot, log=None)
    assert startup.ok and startup.tier == "portable"
    answer = fn.generate_one(max_new_tokens=4)
    fn.release()
    return answer


def chunk_offset(snapshot: Path, index: int) -> int:
    entry = json.loads((snapshot / "manifest.json").read_text())["files"][WEIGHTS]
    assert len(entry["chunks"]) >= 2
    return index * entry["chunk_bytes"]


class HeldChunkClient(RecordingClient):
    """Holds the ranged GET of `WEIGHTS` at `offset` until `release` is set (or GATE_S)."""

    def __init__(self, client, offset: int, **kwargs) -> None:
        super().__init__(client, **kwargs)
        self.offset, self.release, self.events = offset, threading.Event(), []

    def get_object(self, **kwargs):
        held = kwargs.get("Range", "").startswith(f"bytes={self.offset}-")
        if held and kwargs["Key"].endswith(WEIGHTS):
            released = self.release.wait(GATE_S)
            self.events.append("last chunk fetched" if released else "gate timed out")
        return super().get_object(**kwargs)


def watch_streamer(pull, client: HeldChunkClient) -> list[tuple[int, int]]:
    """The byte ranges the streamer was let read, in order; reading one before the held chunk
    opens the gate."""
    reads, real = [], pull.waiter

    class Spy:
        def __init__(self, relpath):
            self.inner = real(relpath)

        def wait_for(self, lo, hi):
            waited = self.inner.wait_for(lo, hi)
            reads.append((lo, hi))
            if hi <= client.offset:
                client.events.append(f"streamer read bytes {lo}..{hi}")
                client.release.set()
            return waited

    pull.waiter = Spy
    return reads


def cache_config(tmp_path: Path, **kwargs) -> SnapshotCacheConfig:
    return SnapshotCacheConfig(tmp_path / "cache", **kwargs)


def test_restore_follows_the_pull_and_answers_as_a_local_restore(
    aws, pushed, embedded_snapshot, local_answer, init_config, tmp_path
):
    client = HeldChunkClient(aws.client("s3"), chunk_offset(embedded_snapshot, 1))
    opened = open_snapshot(pushed, cache_config(tmp_path), streamed=STREAMED, client=client)
    assert opened.pull is not None and not (opened.pull.dest / "manifest.json").exists()
    reads = watch_streamer(opened.pull, client)
    fn, startup = restore_following(opened.pull, init_config, None, log=None)
    try:
        assert startup.ok and startup.tier == "portable" and startup.fallbacks == []
        # the streamer read chunk 0 while chunk 1 was held back: download and stream overlapped
        assert client.events[:2] == [
            f"streamer read bytes 0..{client.offset}",
            "last chunk fetched",
        ]
        assert reads[-1][1] == (embedded_snapshot / WEIGHTS).stat().st_size
        assert fn.generate_one(max_new_tokens=4) == local_answer
    finally:
        fn.release()
    names = [s.name for s in startup.stages]
    assert names[:3] == ["runtime_env", "download_files", "validate"] and names[-1] == "download"
    stream = startup.stage("stream_weights").figures
    assert stream["download_wait_s"] >= 0 and pushed in stream["source"]
    download = startup.stage("download").figures
    assert download["overlapped"] and download["bytes"] > 64 << 20
    assert startup.info["snapshot_source"]["pull"] == "published"
    # published whole and atomically: the next resolution is a hit, from local disk
    dest = opened.pull.dest
    assert (dest / "manifest.json").is_file() and sorted(p.name for p in dest.parent.iterdir()) == [
        "embedded"
    ]
    again = open_snapshot(
        pushed, cache_config(tmp_path), streamed=STREAMED, client=aws.client("s3"), log=None
    )
    assert (again.path, again.pull) == (dest, None)


def test_a_chunk_tampered_in_s3_is_refused_mid_stream_and_falls_back(
    aws, pushed, embedded_snapshot, init_config, tmp_path
):
    uri = f"s3://{BUCKET}/snapshots/{uuid.uuid4().hex[:8]}/embedded"
    push(embedded_snapshot, uri, endpoint_url=aws.endpoint_url, log=None)
    offset = chunk_offset(embedded_snapshot, 1)
    data = bytearray((embedded_snapshot / WEIGHTS).read_bytes())
    data[offset + 5] ^= 0x01
    s3 = aws.client("s3")
    s3.put_object(Bucket=BUCKET, Key=S3Location.parse(uri).key(WEIGHTS), Body=bytes(data))

    client = HeldChunkClient(s3, offset)
    opened = open_snapshot(uri, cache_config(tmp_path), streamed=STREAMED, client=client)
    watch_streamer(opened.pull, client)
    named = embedded_model_dir()
    fn, startup = restore_following(opened.pull, init_config, named, log=None)
    fn.release()
    assert startup.tier == "cold (fallback)" and len(startup.fallbacks) == 1
    fallback = startup.fallbacks[0]
    assert fallback["step"] == "stream_weights" and "\n" not in fallback["reason"]
    assert f"{WEIGHTS!r} chunk 1" in fallback["reason"] and "sha256 mismatch" in fallback["reason"]
    assert fallback["reason"].startswith("BadSnapshot: snapshot s3://")
    assert startup.info["snapshot_source"]["pull"].startswith("BadSnapshot")
    # nothing in the cache looks like a snapshot; the pull's staging dir is kept to resume
    entry = opened.pull.dest.parent
    assert not opened.pull.dest.exists() and not list(entry.rglob("manifest.json"))
    assert (opened.pull.files.parent / "journal.jsonl").is_file()


def test_an_interrupted_overlapped_pull_resumes(
    aws, pushed, embedded_snapshot, local_answer, init_config, tmp_path
):
    offset = chunk_offset(embedded_snapshot, 1)

    class LoseChunkOne(RecordingClient):
        def get_object(self, **kwargs):
            if kwargs.get("Range", "").startswith(f"bytes={offset}-"):
                from botocore.exceptions import EndpointConnectionError

                raise EndpointConnectionError(endpoint_url="http://injected-failure")
            return super().get_object(**kwargs)

    config = cache_config(tmp_path)
    opened = open_snapshot(pushed, config, streamed=STREAMED, client=LoseChunkOne(aws.client("s3")))
    fn, startup = restore_following(opened.pull, init_config, embedded_model_dir(), log=None)
    fn.release()
    assert startup.tier == "cold (fallback)" and "chunk 1" in startup.fallbacks[0]["reason"]

    client = RecordingClient(aws.client("s3"))
    opened = open_snapshot(pushed, config, streamed=STREAMED, client=client)
    assert opened.pull is not None  # still a miss: nothing was published
    fn, startup = restore_following(opened.pull, init_config, None, log=None)
    try:
        assert startup.ok and startup.tier == "portable"
        assert fn.generate_one(max_new_tokens=4) == local_answer
    finally:
        fn.release()
    where = S3Location.parse(pushed)
    assert [g[0] for g in client.ranged_gets] == [where.key(WEIGHTS)]  # chunk 1 only
    assert client.ranged_gets[0][1].startswith(f"bytes={offset}-")


def test_the_off_switch_pulls_whole_first(aws, pushed, tmp_path, monkeypatch):
    assert SnapshotCacheConfig.from_env({}).overlap is True
    assert SnapshotCacheConfig.from_env({"SNAPFN_SNAPSHOT_CACHE_OVERLAP": "off"}).overlap is False
    with pytest.raises(BadRequest):
        SnapshotCacheConfig.from_env({"SNAPFN_SNAPSHOT_CACHE_OVERLAP": "maybe"})

    monkeypatch.setenv("AWS_ENDPOINT_URL", aws.endpoint_url)
    monkeypatch.setenv("SNAPFN_SNAPSHOT_CACHE", str(tmp_path / "cache"))
    argv = ["worker", "--queue-url", "http://q", "--snapshot", pushed]
    target = serve_target(build_parser().parse_args(argv))  # on: nothing pulled before the fork
    assert target.snapshot_uri == pushed and target.snapshot_cache.overlap
    assert target.snapshot_dir.parent.parent == tmp_path / "cache"
    assert not target.snapshot_dir.exists()

    monkeypatch.setenv("SNAPFN_SNAPSHOT_CACHE_OVERLAP", "off")
    target = serve_target(build_parser().parse_args(argv))  # off: pulled whole, as before
    assert target.snapshot_uri is None and (target.snapshot_dir / "manifest.json").is_file()
    config = cache_config(tmp_path, overlap=False)
    opened = open_snapshot(pushed, config, streamed=STREAMED, client=aws.client("s3"), log=None)
    assert opened.pull is None and (opened.path / "manifest.json").is_file()


def test_the_worker_runtime_pulls_a_miss_as_it_restores(aws, pushed, tmp_path, monkeypatch):
    from snapfn.handler.function.runtime import WorkerRuntime
    from snapfn.snapshot.stages import Readiness

    monkeypatch.setenv("AWS_ENDPOINT_URL", aws.endpoint_url)
    monkeypatch.setenv("SNAPFN_SNAPSHOT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SNAPFN_CACHE_DIR", str(tmp_path / "compile-cache"))
    argv = ["worker", "--queue-url", "http://q", "--snapshot", pushed, "--kv-cache-mb", "1"]
    runtime = WorkerRuntime(serve_target(build_parser().parse_args(argv)))
    runtime.start(background=False)
    try:
        assert runtime.wait_ready(0) is Readiness.UP, runtime.readiness.reason
        assert runtime.startup.tier == "portable" and runtime.startup.stage("download").ok
        assert (runtime.target.snapshot_dir / "manifest.json").is_file()
    finally:
        runtime.close()


def test_generate_restores_an_s3_miss_as_it_pulls(
    aws, pushed, embedded_snapshot, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("AWS_ENDPOINT_URL", aws.endpoint_url)
    monkeypatch.setenv("SNAPFN_SNAPSHOT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    prompt = ["--prompt", "ROMEO:", "--max-new-tokens", "6", "--json"]
    assert main(["generate", "--snapshot", pushed, *prompt]) == 0
    from_s3 = capsys.readouterr()
    assert "while it is pulled" in from_s3.err and "restore (portable) ok" in from_s3.err
    assert main(["generate", "--snapshot", str(embedded_snapshot), *prompt]) == 0
    assert json.loads(from_s3.out) == json.loads(capsys.readouterr().out)


def test_arrivals_wait_names_the_chunk_when_the_pull_fails():
    files = {"w.bin": {"size": 10, "chunk_bytes": 4, "chunks": ["0" * 64] * 3}, "a": {"size": 0}}
    arrivals = Arrivals("s3://b/p", files)
    arrivals.record("w.bin", 0)
    arrivals.record("a", 0)
    assert arrivals.wait_for("w.bin", 0, 4) >= 0 and arrivals.wait_for("a") >= 0
    arrivals.record("w.bin", 4)
    arrivals.fail("BadSnapshot: object 'p/w.bin' is missing")
    with pytest.raises(BadSnapshot) as info:
        arrivals.wait_for("w.bin", 0, 10)
    assert str(info.value) == (
        "snapshot s3://b/p: 'w.bin' chunk 2 (bytes 8..9) never arrived: "
        "BadSnapshot: object 'p/w.bin' is missing"
    )
    assert arrivals.wait_for("w.bin", 4, 8) >= 0  # what arrived before the failure still reads


def test_generate_falls_back_to_the_named_model_when_the_s3_manifest_is_refused(
    aws, tmp_path, monkeypatch, capsys
):
    """A manifest refused as it is fetched (here: a listed size past any file's) is refused in
    one line, and `--model` is the cold init's source, as for a refusal after the pull; without
    --model the command fails with the refusal."""
    import boto3

    uri = f"s3://{BUCKET}/snapshots/{uuid.uuid4().hex[:8]}/bad"
    doc = {"format_version": 1, "created_at": "x", "compat": {}, "files": {"a": {"size": 10**30}}}
    client = boto3.client("s3", endpoint_url=aws.endpoint_url, region_name="us-east-1")
    key = uri.removeprefix(f"s3://{BUCKET}/") + "/manifest.json"
    client.put_object(Bucket=BUCKET, Key=key, Body=json.dumps(doc).encode())
    monkeypatch.setenv("AWS_ENDPOINT_URL", aws.endpoint_url)
    monkeypatch.setenv("SNAPFN_SNAPSHOT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    prompt = ["--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--json"]
    model = str(embedded_model_dir())
    assert main(["generate", "--snapshot", uri, "--model", model, *prompt]) == 0
    fell_back = capsys.readouterr()
    assert "a cold init from" in fell_back.err and "size" in fell_back.err
    assert main(["generate", "--model", model, *prompt]) == 0
    assert json.loads(fell_back.out) == json.loads(capsys.readouterr().out)
    assert main(["generate", "--snapshot", uri, *prompt]) == 2
    refused = capsys.readouterr().err
    assert "is more than the" in refused and "a cold init" not in refused
