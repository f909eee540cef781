"""The S3 snapshot store against a real local endpoint (moto in server mode, boto3 unmodified).

A real snapshot of the embedded model (conftest's `embedded_snapshot`) makes the round trip (multipart upload, ranged GETs,
restore); the small sample snapshot (5 chunks of 1 KiB in one file) drives the resume,
corruption and partial-upload cases. Also the `snapfn push` / `snapfn pull` commands.
The local cache and the front doors' `--snapshot s3://…`: test_cache.py.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from snapfn.handler.cli import main
from snapfn.handler.llm.init_config import InitConfig
from snapfn.handler.llm.recipes.function import LLMFunction
from snapfn.snapshot.errors import BadSnapshot, IncompatibleSnapshot, SnapfnError
from snapfn.snapshot.portable.format import validate_snapshot
from snapfn.snapshot.runtime import restore
from snapfn.snapshot.store.s3 import S3Location, TransferProgress
from snapfn.snapshot.store.transfer import pull, push

from moto_server import fake_aws
from s3_clients import RecordingClient
from snapshot_samples import BIG, CHUNK, flip_bit, siblings, write_snapshot

BUCKET = "snapfn-store"
NUM_SAMPLE_RANGES = 7  # tokenizer.json, weights/table.json, weights/big.bin's 5 chunks


@pytest.fixture(scope="module")
def aws():
    with fake_aws(BUCKET) as server:
        yield server


@pytest.fixture
def s3(aws):
    return aws.client("s3")


def fresh_uri() -> str:
    return f"s3://{BUCKET}/snapshots/{uuid.uuid4().hex[:12]}"


def files_of(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def refused(exc_type, fn, *args, **kwargs) -> str:
    with pytest.raises(exc_type) as info:
        fn(*args, **kwargs)
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.fixture
def init_config(tmp_path):
    return InitConfig(
        max_num_batched_tokens=64, kv_cache_bytes_cpu=1 << 20, cache_dir=tmp_path / "compile-cache"
    )


@pytest.fixture
def sample(tmp_path, aws):
    """(local sample snapshot, its URI after a push)."""
    snapshot, uri = write_snapshot(tmp_path / "sample"), fresh_uri()
    push(snapshot, uri, endpoint_url=aws.endpoint_url, log=None)
    return snapshot, uri


# ---- round trip ------------------------------------------------------------------------------
def test_round_trip_is_byte_identical_and_restores(
    aws, s3, embedded_snapshot, init_config, tmp_path
):
    uri, lines = fresh_uri(), []
    push(
        embedded_snapshot,
        uri,
        endpoint_url=aws.endpoint_url,
        multipart_bytes=16 << 20,
        log=lines.append,
    )
    where = S3Location.parse(uri)
    part = s3.head_object(Bucket=BUCKET, Key=where.key("weights/rank0.bin"), PartNumber=1)
    size = (embedded_snapshot / "weights" / "rank0.bin").stat().st_size
    assert size > 64 << 20 and part["PartsCount"] == -(-size // (16 << 20))  # multipart upload
    assert part["ContentLength"] == 16 << 20
    assert "pushed" in lines[-1] and "/s)" in lines[-1]

    dest = pull(uri, tmp_path / "pulled", endpoint_url=aws.endpoint_url, log=lines.append)
    assert files_of(dest) == files_of(embedded_snapshot)  # manifest.json included
    assert siblings(dest) == ["pulled"]  # no staging dir left behind
    assert "pulled" in lines[-1] and "fetched" in lines[-1]

    # no model folder: a restore that failed any check could not fall back, it would raise
    fn, startup = restore(lambda: LLMFunction(init_config, None), dest, log=None)
    assert startup.ok and startup.tier == "portable" and startup.fallbacks == []
    assert startup.stage("health_check").ok  # replayed the token and logprob recorded at init
    fn.release()


def test_pull_of_what_dest_already_holds_fetches_nothing(aws, sample, tmp_path):
    _, uri = sample
    pull(uri, tmp_path / "d", endpoint_url=aws.endpoint_url, log=None)
    client = RecordingClient(aws.client("s3"))
    lines = []
    pull(uri, tmp_path / "d", client=client, log=lines.append)
    assert client.ranged_gets == [] and "nothing to fetch" in lines[-1]


def test_progress_reports_bytes_and_rate():
    lines = []
    progress = TransferProgress("pull s3://b/p", 4096, lines.append, interval_s=0.0)
    progress.add(1024)
    assert lines == [lines[0]] and lines[0].startswith(
        "pull s3://b/p: 1.0 KiB of 4.0 KiB (25%) at "
    )
    assert lines[0].endswith("/s")
    quiet = TransferProgress("pull", 4096, lines.append, interval_s=3600.0)
    quiet.add(1024)
    assert len(lines) == 1


# ---- resume ----------------------------------------------------------------------------------
def test_interrupted_pull_resumes_and_fetches_only_what_is_missing(aws, sample, tmp_path):
    snapshot, uri = sample
    dest = tmp_path / "dest"
    broken = RecordingClient(aws.client("s3"), fail_gets_after=3)
    message = refused(BadSnapshot, pull, uri, dest, client=broken, num_threads=3, log=None)
    assert "EndpointConnectionError" in message and broken.failed_gets > 0
    assert not dest.exists()
    (staging,) = [tmp_path / n for n in siblings(dest) if n.startswith(".dest.pull-")]
    journal = (staging / "journal.jsonl").read_text().splitlines()
    assert len(journal) == 3  # every range fetched before the failure, and only those
    with open(staging / "journal.jsonl", "a") as f:
        f.write('{"relpath": "weights/bi')  # a run killed mid-line leaves a torn line

    resumed = RecordingClient(aws.client("s3"))
    lines = []
    pull(uri, dest, client=resumed, num_threads=3, log=lines.append)
    assert len(resumed.ranged_gets) == NUM_SAMPLE_RANGES - 3
    assert set(resumed.ranged_gets).isdisjoint(broken.ranged_gets)
    assert len(set(resumed.ranged_gets) | set(broken.ranged_gets)) == NUM_SAMPLE_RANGES
    assert "3 ranges verified by an earlier run" in lines[-1]
    assert files_of(dest) == files_of(snapshot)
    assert siblings(dest) == ["dest", "sample"]


# ---- refusals --------------------------------------------------------------------------------
def test_corrupted_object_is_refused_and_the_old_snapshot_stays(aws, s3, sample, tmp_path):
    _, uri = sample
    where = S3Location.parse(uri)
    corrupt = bytearray(BIG)
    corrupt[2 * CHUNK + 5] ^= 0x01
    s3.put_object(Bucket=BUCKET, Key=where.key("weights/big.bin"), Body=bytes(corrupt))
    old = write_snapshot(tmp_path / "dest", marker="old")
    before = files_of(old)
    message = refused(BadSnapshot, pull, uri, old, endpoint_url=aws.endpoint_url, log=None)
    assert "'weights/big.bin' chunk 2 (bytes 2048..3071) sha256 mismatch" in message
    assert message.startswith(f"snapshot {uri}: ")
    assert files_of(old) == before
    validate_snapshot(old, verify="full")


def test_object_of_another_size_is_refused(aws, s3, sample, tmp_path):
    _, uri = sample
    key = S3Location.parse(uri).key("weights/big.bin")
    s3.put_object(Bucket=BUCKET, Key=key, Body=BIG[:-1])
    message = refused(
        BadSnapshot, pull, uri, tmp_path / "d", endpoint_url=aws.endpoint_url, log=None
    )
    assert f"object {key!r} has {len(BIG) - 1} bytes, the manifest says {len(BIG)}" in message
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize(
    "manifest, exc_type, reason",
    [
        (b"{not json", BadSnapshot, "manifest.json is not valid JSON"),
        ({"files": {"../escape": {"size": 1, "sha256": "0" * 64}}}, BadSnapshot, "escapes"),
        ({"format_version": 99}, IncompatibleSnapshot, "format_version is 99"),
        (
            {"files": {"tokenizer.json": {"size": 10**30, "sha256": "0" * 64}}},
            BadSnapshot,
            f"lists 'tokenizer.json': size {10**30} is more than the 1125899906842624 bytes",
        ),
    ],
)
def test_manifest_that_does_not_verify_is_refused(
    aws, s3, sample, tmp_path, manifest, exc_type, reason
):
    snapshot, uri = sample
    if isinstance(manifest, dict):
        manifest = json.dumps({**json.loads((snapshot / "manifest.json").read_bytes()), **manifest})
    s3.put_object(Bucket=BUCKET, Key=S3Location.parse(uri).key("manifest.json"), Body=manifest)
    message = refused(exc_type, pull, uri, tmp_path / "d", endpoint_url=aws.endpoint_url, log=None)
    assert reason in message
    assert siblings(tmp_path / "d") == ["sample"]  # nothing written, not even a staging dir


class BodyCountingClient:
    """A client whose get_object bodies count the bytes read from them."""

    def __init__(self, client) -> None:
        self.client, self.bytes_read = client, 0

    def get_object(self, **kwargs):
        response = self.client.get_object(**kwargs)
        body, read = response["Body"], response["Body"].read

        def counted(*args):
            data = read(*args)
            self.bytes_read += len(data)
            return data

        body.read = counted
        return response

    def __getattr__(self, name):
        return getattr(self.client, name)


def test_a_manifest_past_the_limit_is_refused_without_reading_it_whole(
    aws, s3, sample, tmp_path, monkeypatch
):
    _, uri = sample
    monkeypatch.setattr("snapfn.snapshot.store.transfer.MAX_MANIFEST_BYTES", 4096)
    key = S3Location.parse(uri).key("manifest.json")
    s3.put_object(Bucket=BUCKET, Key=key, Body=b" " * (1 << 20))
    client = BodyCountingClient(aws.client("s3"))
    message = refused(BadSnapshot, pull, uri, tmp_path / "d", client=client, log=None)
    assert message == f"snapshot {uri}: manifest.json is more than the 4096 bytes allowed"
    assert client.bytes_read <= 4097


def test_whole_file_sha256_is_checked_beside_the_chunks(aws, s3, sample, tmp_path):
    snapshot, uri = sample
    manifest = json.loads((snapshot / "manifest.json").read_bytes())
    manifest["files"]["weights/big.bin"]["sha256"] = "0" * 64  # the chunks still match
    key = S3Location.parse(uri).key("manifest.json")
    s3.put_object(Bucket=BUCKET, Key=key, Body=json.dumps(manifest))
    message = refused(
        BadSnapshot, pull, uri, tmp_path / "d", endpoint_url=aws.endpoint_url, log=None
    )
    assert "'weights/big.bin' sha256 mismatch (expected 0000000000000000.." in message
    assert not (tmp_path / "d").exists()


def test_upload_without_manifest_is_refused(aws, s3, sample, tmp_path):
    snapshot, uri = sample
    s3.delete_object(Bucket=BUCKET, Key=S3Location.parse(uri).key("manifest.json"))
    message = refused(
        BadSnapshot, pull, uri, tmp_path / "d", endpoint_url=aws.endpoint_url, log=None
    )
    assert "manifest.json is missing (an incomplete upload, or not a snapshot)" in message


def test_failed_push_over_a_snapshot_leaves_no_manifest(aws, sample, tmp_path):
    _, uri = sample  # a complete snapshot is there; a second push breaks off part way
    newer = write_snapshot(tmp_path / "newer", marker="newer")
    client = RecordingClient(aws.client("s3"), fail_put_suffix="tokenizer.json")
    message = refused(SnapfnError, push, newer, uri, client=client, log=None)
    assert "'tokenizer.json' failed" in message
    message = refused(
        BadSnapshot, pull, uri, tmp_path / "d", endpoint_url=aws.endpoint_url, log=None
    )
    assert "manifest.json is missing" in message


def test_push_refuses_a_snapshot_that_fails_verification(aws, s3, tmp_path):
    snapshot, uri = write_snapshot(tmp_path / "snap"), fresh_uri()
    flip_bit(snapshot / "weights" / "big.bin", 4000)
    message = refused(BadSnapshot, push, snapshot, uri, endpoint_url=aws.endpoint_url, log=None)
    assert "'weights/big.bin' chunk 3" in message
    listed = s3.list_objects_v2(Bucket=BUCKET, Prefix=S3Location.parse(uri).prefix)
    assert listed["KeyCount"] == 0


# ---- the commands ----------------------------------------------------------------------------
def test_push_and_pull_commands(aws, tmp_path, capsys, monkeypatch):
    snapshot, uri = write_snapshot(tmp_path / "snap"), fresh_uri()
    assert main(["push", str(snapshot), uri, "--endpoint-url", aws.endpoint_url]) == 0
    assert capsys.readouterr().out == f"snapshot pushed to {uri}\n"
    monkeypatch.setenv("AWS_ENDPOINT_URL", aws.endpoint_url)  # the endpoint without the flag
    assert main(["pull", uri, str(tmp_path / "out"), "--threads", "2"]) == 0
    assert capsys.readouterr().out == f"snapshot pulled into {tmp_path / 'out'}\n"
    assert files_of(tmp_path / "out") == files_of(snapshot)


def test_commands_exit_2_with_a_one_line_reason(aws, sample, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", aws.endpoint_url)
    assert main(["pull", fresh_uri(), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("snapfn pull: error [bad_snapshot]: snapshot s3://")
    assert main(["push", str(tmp_path), "s3:/not-a-uri"]) == 2
    assert (
        "error [bad_request]: 's3:/not-a-uri' is not an s3://bucket/prefix URI"
        in capsys.readouterr().err
    )
    assert main(["pull", sample[1], str(tmp_path)]) == 2  # tmp_path holds sample/
    assert (
        f"refusing to pull into {tmp_path}: it exists and holds no snapshot"
        in capsys.readouterr().err
    )
    assert main(["push", str(tmp_path), fresh_uri()]) == 2
    assert "manifest.json is missing (incomplete or not a snapshot)" in capsys.readouterr().err
    snapshot, missing = write_snapshot(tmp_path / "snap"), f"s3://no-such-{uuid.uuid4().hex[:8]}/x"
    assert main(["push", str(snapshot), missing]) == 2
    assert f"error [bad_request]: push to {missing}: bucket" in capsys.readouterr().err


def test_uri_parsing():
    assert S3Location.parse("s3://b/a/b/") == S3Location("b", "a/b")
    assert str(S3Location.parse("s3://b")) == "s3://b" and S3Location.parse("s3://b").name == "b"
    assert S3Location.parse("s3://b/x/y").key("m.json") == "x/y/m.json"
    for bad in ("s3://", "s3:///x", "http://b/x", "s3://b/a//c", "s3://b/../c"):
        with pytest.raises(SnapfnError):
            S3Location.parse(bad)


# ---- signed snapshots ----------------------------------------------------------------------------
def ed25519_keys():
    """(a private key that signs, its public key that only verifies), as SnapshotKeys."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    from snapfn.snapshot.portable.signature import SnapshotKey

    private = ed25519.Ed25519PrivateKey.generate()
    pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public = private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return SnapshotKey.from_bytes(pem), SnapshotKey.from_bytes(public)


def test_push_signs_and_pull_checks_the_signature_before_fetching_a_file(aws, tmp_path):
    signer, verifier = ed25519_keys()
    snapshot, uri = write_snapshot(tmp_path / "plain"), fresh_uri()
    push(snapshot, uri, endpoint_url=aws.endpoint_url, key=signer, log=None)
    dest = pull(uri, tmp_path / "pulled", endpoint_url=aws.endpoint_url, key=verifier, log=None)
    assert (dest / "manifest.sig").is_file()
    validate_snapshot(dest, key=verifier)  # the signature travels with the pulled snapshot
    stranger, _ = ed25519_keys()
    client = RecordingClient(aws.client("s3"))
    with pytest.raises(BadSnapshot, match="not by the configured ed25519 key"):
        pull(uri, tmp_path / "refused", client=client, key=stranger, log=None)
    assert client.ranged_gets == [] and not (tmp_path / "refused").exists()
    with pytest.raises(BadSnapshot, match="not by the configured ed25519 key"):
        validate_snapshot(dest, key=stranger)


def test_an_unsigned_snapshot_is_refused_wherever_a_key_is_configured(aws, sample, tmp_path):
    snapshot, uri = sample
    _, verifier = ed25519_keys()
    with pytest.raises(BadSnapshot, match="it is not signed, and a snapshot key is configured"):
        pull(uri, tmp_path / "p", endpoint_url=aws.endpoint_url, key=verifier, log=None)
    with pytest.raises(BadSnapshot, match="it is not signed"):
        validate_snapshot(snapshot, key=verifier)
    with pytest.raises(SnapfnError, match="public key"):  # a public key cannot sign it on push
        push(snapshot, fresh_uri(), endpoint_url=aws.endpoint_url, key=verifier, log=None)


def test_a_signed_manifest_edited_and_rehashed_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("SNAPFN_SNAPSHOT_KEY_VALUE", "x" * 40)  # what a writer signs with
    signed = write_snapshot(tmp_path / "signed")  # SnapshotWriter signs with the configured key
    assert (signed / "manifest.sig").is_file()
    validate_snapshot(signed)  # the configured key checks its own signature
    manifest = json.loads((signed / "manifest.json").read_text())
    manifest["marker"] = "changed"  # a consistent edit: every digest still right
    (signed / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BadSnapshot, match="not what the key signed"):
        validate_snapshot(signed)


def test_a_restore_refuses_an_unsigned_snapshot_and_falls_back_to_the_named_model(
    embedded_snapshot, init_config, monkeypatch
):
    from snapfn.handler.llm.embedded import embedded_model_dir

    monkeypatch.setenv("SNAPFN_SNAPSHOT_KEY_VALUE", "y" * 40)
    fn, startup = restore(
        lambda: LLMFunction(init_config, embedded_model_dir()),
        embedded_snapshot,
        rewrite_on_fallback=False,
        log=None,
    )
    try:
        assert startup.tier == "cold (fallback)"
        (fallback,) = startup.fallbacks
        assert fallback["step"] == "validate" and "not signed" in fallback["reason"]
    finally:
        fn.release()
