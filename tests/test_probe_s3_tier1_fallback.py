"""`--snapshot s3://…` of a process snapshot (tier 1), and of a snapshot of several ranks, with a
bad object in the store, against moto in server mode (store/cache.py, llm/recipes/s3_restore.py).

The pull is refused in one line and the start falls back, publishing nothing in the cache: a bad
process image to the portable tier (pulled as it is restored), a bad portable object to a cold
init from the source the snapshot records once its content hash matches (or from `--model`), on
every rank of several; with overlap off, to that cold init. A manifest the configured key did
not sign is refused before anything is pulled and its recorded source is never read: the start
fails, or cold-initialises the model the user named.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from snapfn.handler.cli import build_parser
from snapfn.handler.function.target_flags import serve_target
from snapfn.handler.llm.embedded import embedded_model_dir
from snapfn.handler.llm.init_config import InitConfig
from snapfn.snapshot.portable.signature import SnapshotKey
from snapfn.snapshot.store.s3 import S3Location
from snapfn.snapshot.store.transfer import push

from moto_server import fake_aws

pytestmark = pytest.mark.slow
BUCKET = "snapfn-tier1-fallback"
PROMPT = ["--prompt-ids", "1,2,3,4", "--max-new-tokens", "12", "--ignore-eos", "--json"]
RANKS_PROMPT = ["--prompt-ids", "5,17,3,9,12", "--max-new-tokens", "8", "--json"]
KEY = "k" * 40  # an HMAC snapshot key, as SNAPFN_SNAPSHOT_KEY_VALUE holds it


@pytest.fixture(scope="module")
def aws():
    with fake_aws(BUCKET) as server:
        yield server


@pytest.fixture(scope="module")
def worker_threads():
    """The checkpointed worker computes with as many threads as the processes compared with it
    (conftest sets one): CPU GEMMs split their sums by thread count."""
    import torch

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
        yield


@pytest.fixture(scope="module")
def tier1(criu_config, tests_on_pythonpath, worker_threads, tmp_path_factory) -> Path:
    """A process snapshot of the embedded model, made once."""
    from snapfn.handler.llm.recipes.cli import _init_process

    tmp = tmp_path_factory.mktemp("tier1")
    config = InitConfig(kv_cache_bytes_cpu=32 << 20, cache_dir=tmp / "cache")
    startup = _init_process(config, embedded_model_dir(), tmp / "embedded")
    assert startup.tier == "process", startup.fallbacks
    return tmp / "embedded"


@pytest.fixture(scope="module")
def cold_answer(worker_threads, tmp_path_factory) -> list[int]:
    """The embedded model's tokens from a cold init (`generate --model`)."""
    argv = ["generate", "--model", str(embedded_model_dir()), *PROMPT]
    done = run_cli(*argv, env=base_env(tmp_path_factory.mktemp("cold")))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)["token_ids"]


@pytest.fixture(scope="module")
def two_ranks(tiny_llama_dir, tmp_path_factory) -> Path:
    """A tier-0 snapshot of two CPU ranks (tensor parallel) of the tiny llama, made once."""
    tmp = tmp_path_factory.mktemp("ranks")
    dest = tmp / "ranks"
    argv = ["init", "--model", str(tiny_llama_dir), "--snapshot", str(dest), "--tp-size", "2"]
    done = run_cli(*argv, env=base_env(tmp))
    assert done.returncode == 0, done.stderr[-3000:]
    return dest


@pytest.fixture(scope="module")
def two_rank_answer(two_ranks) -> list[int]:
    """What the two-rank snapshot answers, restored from local disk."""
    argv = ["generate", "--snapshot", str(two_ranks), "--tp-size", "2", *RANKS_PROMPT]
    done = run_cli(*argv, env=base_env(two_ranks.parent))
    assert done.returncode == 0 and "(portable) on cpu" in done.stderr, done.stderr[-3000:]
    return json.loads(done.stdout)["token_ids"]


def base_env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.update(
        SNAPFN_CACHE_DIR=str(tmp / "compile-cache"),
        SNAPFN_SNAPSHOT_CACHE=str(tmp / "cache"),
        XDG_CACHE_HOME=str(tmp / "xdg"),
    )
    return {**env, **extra}


def run_cli(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "snapfn.handler.cli", *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


def generate(aws, uri: str, tmp: Path, *extra: str, **env: str) -> subprocess.CompletedProcess:
    """`snapfn generate --snapshot URI` (no --model unless in `extra`) in a fresh process."""
    environ = base_env(tmp, AWS_ENDPOINT_URL=aws.endpoint_url, **env)
    prompt = [] if "--prompt-ids" in extra else PROMPT
    return run_cli("generate", "--snapshot", uri, *prompt, *extra, env=environ)


def pushed(aws, snapshot: Path, key: SnapshotKey | None = None) -> str:
    """Push `snapshot` (signed with `key`, if given) under a fresh prefix; its URI."""
    uri = f"s3://{BUCKET}/snapshots/{uuid.uuid4().hex[:8]}/{snapshot.name}"
    push(snapshot, uri, endpoint_url=aws.endpoint_url, key=key, log=None)
    return uri


def spoil(aws, uri: str, relpath: str, how: str) -> None:
    """Make one object of a pushed snapshot bad: "flip" a byte (same size), "truncate" it to
    half, or "delete" it."""
    s3, key = aws.client("s3"), S3Location.parse(uri).key(relpath)
    if how == "delete":
        s3.delete_object(Bucket=BUCKET, Key=key)
        return
    data = bytearray(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    if how == "flip":
        data[len(data) // 2] ^= 0x01
    else:
        del data[len(data) // 2 :]
    s3.put_object(Bucket=BUCKET, Key=key, Body=bytes(data))


def listed(snapshot: Path, prefix: str) -> str:
    """The first file the snapshot's manifest lists under `prefix`."""
    files = json.loads((snapshot / "manifest.json").read_text())["files"]
    return next(p for p in sorted(files) if p.startswith(prefix))


def fallbacks(stderr: str) -> list[str]:
    return [line.strip() for line in stderr.splitlines() if line.startswith("  fallback ")]


def published(cache: Path) -> list[Path]:
    """Folders of the cache that look like a snapshot (hold a manifest.json)."""
    return [p.parent for p in cache.rglob("manifest.json")]


@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
def test_a_bad_process_image_object_falls_back_to_the_portable_tier(
    aws, tier1, cold_answer, tmp_path, how
):
    uri, image = pushed(aws, tier1), listed(tier1, "process/")
    spoil(aws, uri, image, how)
    done = generate(aws, uri, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["token_ids"] == cold_answer
    (refused,) = fallbacks(done.stderr)
    assert refused.startswith(
        "fallback process → portable at download: BadSnapshot: snapshot s3://"
    )
    assert image in refused and "restore (portable) ok" in done.stderr
    assert published(tmp_path / "cache") == []  # its portable tier was pulled, not published


@pytest.mark.parametrize(
    ("prefix", "how"), [("weights/", "flip"), ("weights/", "truncate"), ("model/", "delete")]
)
def test_a_bad_portable_object_falls_back_to_a_cold_init_from_the_verified_recorded_source(
    aws, tier1, cold_answer, tmp_path, prefix, how
):
    uri, bad = pushed(aws, tier1), listed(tier1, prefix)
    spoil(aws, uri, bad, how)
    done = generate(aws, uri, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["token_ids"] == cold_answer
    process, portable = fallbacks(done.stderr)
    assert process.startswith("fallback process → portable at download:") and bad in process
    assert portable.startswith("fallback portable → cold at ") and bad in portable
    assert f"falling back to a cold init from {embedded_model_dir()}" in done.stderr
    assert "verify_source" in done.stderr  # its content hash was checked before it served
    assert published(tmp_path / "cache") == []


def test_a_bad_portable_object_falls_back_to_the_named_model(aws, tier1, cold_answer, tmp_path):
    uri = pushed(aws, tier1)
    spoil(aws, uri, listed(tier1, "weights/"), "flip")
    model = embedded_model_dir()
    done = generate(aws, uri, tmp_path, "--model", str(model))
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["token_ids"] == cold_answer
    assert f"falling back to a cold init from {model}" in done.stderr
    assert "verify_source" not in done.stderr  # the user named it: nothing to verify
    assert published(tmp_path / "cache") == []


def test_with_overlap_off_a_bad_object_falls_back_to_a_verified_cold_init(
    aws, tier1, cold_answer, tmp_path
):
    uri, image = pushed(aws, tier1), listed(tier1, "process/")
    spoil(aws, uri, image, "flip")
    done = generate(aws, uri, tmp_path, SNAPFN_SNAPSHOT_CACHE_OVERLAP="off")
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["token_ids"] == cold_answer
    assert image in done.stderr and "sha256 mismatch" in done.stderr  # the pull's refusal
    assert "(cold (fallback))" in done.stderr and "verify_source" in done.stderr
    assert list((tmp_path / "cache").glob(f"*/{tier1.name}")) == []  # the entry: unpublished


def test_a_worker_pulls_a_tier1_miss_itself_and_falls_back_to_the_portable_tier(
    aws, tier1, tmp_path, monkeypatch
):
    from snapfn.handler.function.runtime import WorkerRuntime
    from snapfn.snapshot.stages import Readiness

    uri, image = pushed(aws, tier1), listed(tier1, "process/")
    spoil(aws, uri, image, "flip")
    for name, value in base_env(tmp_path, AWS_ENDPOINT_URL=aws.endpoint_url).items():
        monkeypatch.setenv(name, value)
    argv = ["worker", "--queue-url", "http://q", "--snapshot", uri, "--kv-cache-mb", "32"]
    target = serve_target(build_parser().parse_args(argv))
    assert target.snapshot_uri == uri and not target.snapshot_dir.exists()  # not pulled yet
    runtime = WorkerRuntime(target)
    runtime.start(background=False)
    try:
        assert runtime.wait_ready(0) is Readiness.UP, runtime.readiness.reason
        assert runtime.startup.tier == "portable"
        (fallback,) = runtime.startup.fallbacks
        assert (fallback["from"], fallback["to"], fallback["step"]) == (
            "process",
            "portable",
            "download",
        )
        assert image in fallback["reason"] and "\n" not in fallback["reason"]
        answer = runtime.invoke({"prompt_ids": [1, 2, 3, 4], "max_tokens": 4})
        assert answer["usage"]["completion_tokens"] >= 1
    finally:
        runtime.close()
    assert published(tmp_path / "cache") == []


def test_the_cache_opens_what_is_left_of_a_refused_pull(aws, tier1, tmp_path):
    from snapfn.handler.llm.recipes.s3_restore import STREAMED
    from snapfn.snapshot.store.cache import SnapshotCacheConfig, open_snapshot

    uri, image = pushed(aws, tier1), listed(tier1, "process/")
    spoil(aws, uri, image, "flip")
    config, lines = SnapshotCacheConfig(tmp_path / "cache"), []
    client = aws.client("s3")
    one_rank = open_snapshot(uri, config, streamed=STREAMED, client=client, log=lines.append)
    try:
        assert (
            one_rank.refused.startswith("BadSnapshot: snapshot s3://") and image in one_rank.refused
        )
        assert f"{one_rank.refused}; restoring its portable tier while that is pulled" in lines
        assert one_rank.pull.part and not any(p.startswith("process/") for p in one_rank.pull.part)
        assert "weights/rank0.bin" in one_rank.pull.part and one_rank.path == one_rank.pull.files
    finally:
        assert one_rank.pull.close() is None  # every file of its portable tier verified
    ranks = open_snapshot(uri, config, client=client, log=None)  # nothing streamed: no pull
    assert ranks.pull is None and ranks.refused == one_rank.refused
    assert ranks.path.name == tier1.name and ranks.path.parent.name.startswith(".refused-")
    assert (ranks.path / "manifest.json").read_bytes() == (tier1 / "manifest.json").read_bytes()
    assert published(tmp_path / "cache") == [ranks.path]  # the entry's own folder: none


def test_a_worker_pulls_an_intact_tier1_miss_itself_and_restores_tier_1(
    aws, tier1, tmp_path, monkeypatch
):
    from snapfn.handler.function.runtime import WorkerRuntime
    from snapfn.snapshot.stages import Readiness

    uri = pushed(aws, tier1)
    for name, value in base_env(tmp_path, AWS_ENDPOINT_URL=aws.endpoint_url).items():
        monkeypatch.setenv(name, value)
    argv = ["worker", "--queue-url", "http://q", "--snapshot", uri]
    target = serve_target(build_parser().parse_args(argv))
    assert target.snapshot_uri == uri and not target.snapshot_dir.exists()
    runtime = WorkerRuntime(target)
    runtime.start(background=False)
    try:
        assert runtime.wait_ready(0) is Readiness.UP, runtime.readiness.reason
        assert runtime.startup.tier == "process" and not runtime.startup.fallbacks
    finally:
        runtime.close()
    assert published(tmp_path / "cache") == [target.snapshot_dir]  # pulled whole, published


def test_several_ranks_fall_back_to_a_cold_init_from_the_verified_recorded_source(
    aws, two_ranks, two_rank_answer, tmp_path
):
    uri = pushed(aws, two_ranks)
    spoil(aws, uri, "weights/rank1.bin", "flip")
    done = generate(aws, uri, tmp_path, "--tp-size", "2", *RANKS_PROMPT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["token_ids"] == two_rank_answer
    (refusal,) = [line for line in done.stderr.splitlines() if "rank1.bin" in line]
    assert (
        refusal.startswith("[snapfn] BadSnapshot: snapshot s3://") and "sha256 mismatch" in refusal
    )
    assert "(cold (fallback)) on cpu" in done.stderr and "verify_source" in done.stderr
    assert list((tmp_path / "cache").glob(f"*/{two_ranks.name}")) == []  # the entry: unpublished


def test_a_front_door_of_several_ranks_restores_a_refused_pull_from_its_manifest_alone(
    aws, two_ranks, tmp_path, monkeypatch
):
    uri = pushed(aws, two_ranks)
    spoil(aws, uri, "weights/rank0.bin", "delete")
    for name, value in base_env(tmp_path, AWS_ENDPOINT_URL=aws.endpoint_url).items():
        monkeypatch.setenv(name, value)
    argv = ["worker", "--queue-url", "http://q", "--snapshot", uri, "--tp-size", "2"]
    target = serve_target(build_parser().parse_args(argv))
    folder = target.snapshot_dir
    assert target.snapshot_uri is None and folder.name == two_ranks.name
    assert sorted(p.name for p in folder.iterdir()) == ["manifest.json"]
    assert (folder / "manifest.json").read_bytes() == (two_ranks / "manifest.json").read_bytes()
    assert not (folder.parent.parent / two_ranks.name).exists()  # the entry: unpublished


@pytest.mark.parametrize(
    ("snapshot", "edit"),
    [("tier1", "edited"), ("embedded_snapshot", "edited"), ("embedded_snapshot", "unsigned")],
)
def test_a_manifest_the_key_did_not_sign_is_never_trusted_for_its_recorded_source(
    aws, request, cold_answer, tmp_path, snapshot, edit
):
    local = request.getfixturevalue(snapshot)
    uri = pushed(aws, local, key=SnapshotKey.from_bytes(KEY.encode()))
    where, s3 = S3Location.parse(uri), aws.client("s3")
    if edit == "unsigned":
        s3.delete_object(Bucket=BUCKET, Key=where.key("manifest.sig"))
    else:
        manifest = json.loads((local / "manifest.json").read_text())
        manifest["created_at"] = "edited"  # every digest still right: only the key can tell
        s3.put_object(Bucket=BUCKET, Key=where.key("manifest.json"), Body=json.dumps(manifest))
    done = generate(aws, uri, tmp_path / "unnamed", SNAPFN_SNAPSHOT_KEY_VALUE=KEY)
    assert done.returncode == 2, done.stderr[-3000:]
    reason = "not what the key signed" if edit == "edited" else "it is not signed"
    assert reason in done.stderr and "cold init" not in done.stderr
    model = str(embedded_model_dir())
    named = generate(aws, uri, tmp_path / "named", "--model", model, SNAPFN_SNAPSHOT_KEY_VALUE=KEY)
    assert named.returncode == 0, named.stderr[-3000:]
    assert f"a cold init from {model} instead" in named.stderr and reason in named.stderr
    assert json.loads(named.stdout)["token_ids"] == cold_answer
