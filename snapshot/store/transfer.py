"""The S3 snapshot store: push a published snapshot to `s3://bucket/prefix`, pull one back.

    push(snapshot_dir, "s3://bucket/prefix")   verify, upload the files, the manifest last
    pull("s3://bucket/prefix", dest)           manifest first, ranged GETs, verify, publish

Layout in the bucket: `PREFIX/<relpath>` per file and `PREFIX/manifest.json`, byte for byte the
local snapshot's (s3.py).

`push` refuses a snapshot that fails `validate_snapshot(verify="full")`. It deletes the prefix's
manifest first, uploads every file (multipart above `multipart_bytes`, parts uploaded in
parallel threads, through boto3's transfer manager) and puts manifest.json last: a prefix whose
upload is partial or still running has no manifest, so it never looks like a snapshot.

`pull` fetches the manifest (a larger object than `format.MAX_MANIFEST_BYTES` is refused, read
no further) and shape-checks it (`format.parse_manifest`), then fetches every chunk
(a file without chunk digests: the whole file) with a ranged GET in `num_threads` threads,
written by pwrite into a staging sibling of `dest` and checked against its sha256 before it is
journaled (pull_staging.py: a rerun after an interruption fetches only what is not journaled).
Whole-file sha256s are checked, manifest.json is written last, the directory passes
`validate_snapshot`, and only then is it installed at `dest` with the publish code's atomic
replace. Any refusal (a manifest that does not parse, a missing object, an object of another
size, bytes that do not match) is a one-line BadSnapshot, and `dest` is left as it was.
A `dest` that already holds this exact manifest (and passes the size checks) is not fetched.

A restore may follow a pull (store/overlap.py): with `arrivals` (store/arrivals.py) every
range is recorded there once it is verified, fdatasync'ed and journaled (those an earlier run
journaled, at the start), the files named in `last` are fetched after every other file, each
in file order, and `before_publish` is called once every check has passed, before manifest.json
is written and the directory installed (the follower stops reading from the staging paths).
manifest.sig, when the snapshot has one, is written into the staging dir at the start.

A pull of a `part` (some of the manifest's files: a process snapshot's portable tier, restored
after the whole snapshot's pull was refused) fetches and verifies only those files into the
staging dir, through the same journal, and publishes nothing: no manifest.json is written, the
staging dir stays, and a later pull of the whole snapshot resumes from it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from snapfn.snapshot.errors import BadRequest, SnapfnError, bad_snapshot, one_line
from snapfn.snapshot.portable.digests import DigestRange, digest_ranges, run_parallel
from snapfn.snapshot.portable.format import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    check_listing,
    parse_manifest,
    validate_snapshot,
    verify_ranges,
)
from snapfn.snapshot.portable.publish import check_replaceable, install_snapshot, write_durably
from snapfn.snapshot.portable.signature import (
    CONFIGURED,
    SIGNATURE,
    configured,
    signature_bytes,
)
from snapfn.snapshot.stages import Log, stderr_log
from snapfn.snapshot.store.arrivals import Arrivals
from snapfn.snapshot.store.pull_staging import PullStaging
from snapfn.snapshot.store.s3 import (
    S3Location,
    TransferProgress,
    format_bytes,
    make_s3_client,
    read_range_into,
    s3_refusal,
)

__all__ = [
    "DEFAULT_MULTIPART_BYTES",
    "DEFAULT_NUM_THREADS",
    "fetch_manifest",
    "fetch_ranges",
    "fetch_signature",
    "pull",
    "push",
]

DEFAULT_NUM_THREADS = 16
DEFAULT_MULTIPART_BYTES = 64 << 20  # files above this go up in parts of this size


def push(
    snapshot_dir: str | os.PathLike[str],
    uri: str,
    *,
    endpoint_url: str | None = None,
    client: Any = None,
    num_threads: int = DEFAULT_NUM_THREADS,
    multipart_bytes: int = DEFAULT_MULTIPART_BYTES,
    log: Log | None = stderr_log,
    key: Any = CONFIGURED,
) -> dict[str, Any]:
    """Upload the snapshot at `snapshot_dir` to `uri`, its signature then its manifest last;
    return its manifest. With a snapshot key (`key`, by default the configured one:
    portable/signature.py) an unsigned snapshot is signed as it goes up, and a signed one must
    be that key's."""
    from boto3.s3.transfer import TransferConfig

    root, where = Path(snapshot_dir), S3Location.parse(uri)
    manifest = validate_snapshot(root, None, verify="full", num_threads=num_threads)
    raw = (root / MANIFEST).read_bytes()
    if parse_manifest(root, raw) != manifest:
        raise bad_snapshot(root, f"{MANIFEST} changed while it was verified (republished?)")
    signature = _signature_to_push(root, raw, configured(key))
    client = client or make_s3_client(endpoint_url, num_threads)
    files = manifest["files"]
    progress = TransferProgress(f"push {where}", sum(e["size"] for e in files.values()), log)
    config = TransferConfig(
        multipart_threshold=multipart_bytes,
        multipart_chunksize=multipart_bytes,
        max_concurrency=num_threads,
    )
    # NOTE: the old manifest goes first and the new one last, so between the two the prefix
    # holds no snapshot at all, never a manifest beside files it does not describe.
    _s3_call(where, MANIFEST, client.delete_object, Bucket=where.bucket, Key=where.key(MANIFEST))
    _s3_call(where, SIGNATURE, client.delete_object, Bucket=where.bucket, Key=where.key(SIGNATURE))
    _upload_files(client, where, root, sorted(files), config, progress)
    if signature is not None:  # NOTE: before the manifest: a snapshot there is signed already
        key_name = where.key(SIGNATURE)
        _s3_call(
            where, SIGNATURE, client.put_object, Bucket=where.bucket, Key=key_name, Body=signature
        )
    _s3_call(
        where, MANIFEST, client.put_object, Bucket=where.bucket, Key=where.key(MANIFEST), Body=raw
    )
    if log is not None:
        log(
            f"pushed {root} to {where}: {len(files)} files, {format_bytes(progress.done_bytes)} "
            f"in {progress.elapsed_s():.1f} s ({progress.rate()})"
        )
    return manifest


def fetch_manifest(client: Any, where: S3Location) -> bytes:
    """The bytes of `where`'s manifest.json, of which at most MAX_MANIFEST_BYTES + 1 are read:
    BadSnapshot for a larger one, and for a missing one (the upload is partial)."""
    from botocore.exceptions import BotoCoreError, ClientError

    key = where.key(MANIFEST)
    try:
        body = client.get_object(Bucket=where.bucket, Key=key)["Body"]
        with body:  # NOTE: closed, not drained, where the object is larger than the limit
            raw = _read_at_most(body, MAX_MANIFEST_BYTES + 1)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") == "NoSuchKey":
            reason = f"{MANIFEST} is missing (an incomplete upload, or not a snapshot)"
            raise bad_snapshot(where, reason) from None
        raise s3_refusal(where, key, exc) from None
    except BotoCoreError as exc:
        raise s3_refusal(where, key, exc) from None
    if len(raw) > MAX_MANIFEST_BYTES:
        reason = f"{MANIFEST} is more than the {MAX_MANIFEST_BYTES} bytes allowed"
        raise bad_snapshot(where, reason)
    return raw


def _read_at_most(body: Any, max_bytes: int) -> bytes:
    """The first `max_bytes` bytes of a streamed object's body (all of it, if shorter)."""
    pieces, total = [], 0
    while total < max_bytes and (piece := body.read(min(1 << 20, max_bytes - total))):
        pieces.append(piece)
        total += len(piece)
    return b"".join(pieces)


def pull(
    uri: str,
    dest: str | os.PathLike[str],
    *,
    endpoint_url: str | None = None,
    client: Any = None,
    num_threads: int = DEFAULT_NUM_THREADS,
    manifest_bytes: bytes | None = None,
    log: Log | None = stderr_log,
    key: Any = CONFIGURED,
    arrivals: Arrivals | None = None,
    last: Collection[str] = (),
    before_publish: Callable[[], None] | None = None,
    part: Collection[str] | None = None,
) -> Path:
    """Fetch the snapshot at `uri` into `dest`, verified, resumable, published atomically.

    `manifest_bytes`: the manifest.json already fetched from `uri` (the cache has it). With a
    snapshot key (`key`, by default the configured one: portable/signature.py) the manifest's
    signature is checked before any of its digests is trusted. `arrivals`, `last` and
    `before_publish`: for a restore that follows the pull (module docstring). `part`: fetch
    and verify only these files, publish nothing, and return the staging folder they are in.
    """
    where, dest = S3Location.parse(uri), Path(dest).absolute()
    client = client or make_s3_client(endpoint_url, num_threads)
    raw = manifest_bytes if manifest_bytes is not None else fetch_manifest(client, where)
    signature = fetch_signature(client, where, raw, configured(key))
    manifest = parse_manifest(where, raw)
    if part is None and _already_there(dest, raw) and _same_signature(dest, signature):
        if log is not None:
            log(f"{dest} already holds {where} (same manifest): nothing to fetch")
        return dest
    if os.path.lexists(dest):  # NOTE: refused before fetching, not after
        try:
            check_replaceable(dest)
        except FileExistsError:
            raise BadRequest(
                f"refusing to pull into {dest}: it exists and holds no snapshot"
            ) from None
    with PullStaging(dest, hashlib.sha256(raw).hexdigest()) as staging:
        _write_signature(staging.files, signature)
        fetched = sorted(manifest["files"] if part is None else part)
        fetch = _Fetch(client, where, manifest, num_threads, log, arrivals, last)
        progress, num_skipped = fetch.files(staging, fetched)
        # NOTE: every chunk and unchunked file was checked as it arrived; what is left is the
        # whole-file sha256 of chunked files, and the listing (nothing missing, nothing extra)
        verify_ranges(staging.files, _whole_file_ranges(manifest, fetched), num_threads, where)
        check_listing(staging.files, manifest["files"])
        if before_publish is not None:
            before_publish()
        if part is None:
            write_durably(staging.files / MANIFEST, raw)  # staging removed any earlier one
            install_snapshot(staging.files, dest)
            staging.remove()
    if log is not None:
        resumed = f"; {num_skipped} ranges verified by an earlier run" if num_skipped else ""
        what = f"{where} into {dest}" if part is None else f"part of {where} into {staging.files}"
        log(
            f"pulled {what}: {len(fetched)} files, "
            f"{format_bytes(progress.done_bytes)} fetched in {progress.elapsed_s():.1f} s "
            f"({progress.rate()}){resumed}"
        )
    return dest if part is None else staging.files


def _signature_to_push(root: Path, raw: bytes, key: Any) -> bytes | None:
    """manifest.sig's bytes to upload: the snapshot's own (checked against `key` when there is
    one), or `key`'s signature of a snapshot that has none; None for an unsigned snapshot with
    no key."""
    from snapfn.snapshot.portable.signature import check_signature, read_signature

    if read_signature(root) is not None:
        check_signature(root, key, raw)
        return (root / SIGNATURE).read_bytes()
    if key is None:
        return None
    if not key.can_sign:
        raise BadRequest(
            f"{root} is not signed and the configured key {key.key_id} is a public key: sign it"
            " where the private key is (snapfn init or push with SNAPFN_SNAPSHOT_KEY)"
        )
    return signature_bytes(key, raw)


def fetch_signature(client: Any, where: S3Location, raw: bytes, key: Any) -> bytes | None:
    """The snapshot's manifest.sig (None when it has none), checked against `key` when one is
    configured: BadSnapshot, one line, before anything else is fetched."""
    from botocore.exceptions import BotoCoreError, ClientError

    from snapfn.snapshot.portable.signature import MAX_SIGNATURE_BYTES, parse_signature

    name = where.key(SIGNATURE)
    try:
        body = client.get_object(Bucket=where.bucket, Key=name)["Body"]
        signature = body.read(MAX_SIGNATURE_BYTES + 1)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") != "NoSuchKey":
            raise s3_refusal(where, name, exc) from None
        signature = None
    except BotoCoreError as exc:
        raise s3_refusal(where, name, exc) from None
    if key is not None:
        if signature is None:
            raise bad_snapshot(where, "it is not signed, and a snapshot key is configured")
        problem = key.verify(raw, parse_signature(signature, str(where)))
        if problem is not None:
            raise bad_snapshot(where, problem)
    return signature


def _same_signature(dest: Path, signature: bytes | None) -> bool:
    path = dest / SIGNATURE
    try:
        return path.read_bytes() == signature if signature is not None else not path.exists()
    except OSError:
        return False


def _upload_files(client, where: S3Location, root: Path, relpaths, config, progress) -> None:
    from boto3.s3.transfer import ProgressCallbackInvoker, create_transfer_manager

    subscribers = [ProgressCallbackInvoker(progress.add)]
    with create_transfer_manager(client, config) as manager:
        uploads = [
            (
                relpath,
                manager.upload(
                    str(root / relpath), where.bucket, where.key(relpath), subscribers=subscribers
                ),
            )
            for relpath in relpaths
        ]
        for relpath, upload in uploads:
            _s3_call(where, relpath, upload.result)


def _s3_call(where: S3Location, relpath: str, call, **kwargs) -> Any:
    """`call(**kwargs)`, a failed S3 request becoming a one-line error naming the object."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return call(**kwargs)
    except (BotoCoreError, ClientError) as exc:
        code = getattr(exc, "response", {}).get("Error", {}).get("Code")
        if code == "NoSuchBucket":
            raise BadRequest(f"push to {where}: bucket {where.bucket!r} does not exist") from None
        raise SnapfnError(one_line(f"push to {where}: {relpath!r} failed: {exc}")) from None


def _write_signature(files: Path, signature: bytes | None) -> None:
    """manifest.sig into the staging dir (a dir without manifest.json is no snapshot yet)."""
    path = files / SIGNATURE
    if signature is not None:
        write_durably(path, signature)
    elif path.exists():
        path.unlink()  # an earlier run's, of a snapshot no longer signed


class _Fetch:
    """One pull's ranged GETs: every range not journaled yet, fetched, verified, journaled."""

    def __init__(self, client, where, manifest, num_threads, log, arrivals, last) -> None:
        self.client, self.where, self.files_of = client, where, manifest["files"]
        self.num_threads, self.log, self.arrivals, self.last = num_threads, log, arrivals, last

    def files(self, staging: PullStaging, fetched: list[str]) -> tuple[TransferProgress, int]:
        """Fetch and verify every range of `fetched` not journaled yet (every listed file is
        made at its size); (progress, ranges skipped)."""
        files = self.files_of
        ranges = _fetch_order(
            [r for relpath in fetched for r in fetch_ranges(relpath, files[relpath])], self.last
        )
        verified = staging.verified()
        todo = [r for r in ranges if _journal_key(r) not in verified]
        progress = TransferProgress(f"pull {self.where}", sum(r.length for r in todo), self.log)
        fds = {}
        try:
            for relpath in sorted(files):
                try:
                    fds[relpath] = staging.open_file(relpath, files[relpath]["size"])
                except OSError as e:  # e.g. the manifest lists both "a" and "a/b"
                    reason = f"cannot create {relpath!r}: {e.strerror}"
                    raise bad_snapshot(self.where, reason) from None
            self._arrived([r for r in ranges if _journal_key(r) in verified])
            run_parallel(
                lambda r: self.one(r, fds[r.relpath], staging, progress), todo, self.num_threads
            )
            for fd in fds.values():
                os.fsync(fd)
        finally:
            for fd in fds.values():
                os.close(fd)
        return progress, len(ranges) - len(todo)

    def one(self, r: DigestRange, fd: int, staging: PullStaging, progress) -> None:
        key, size = self.where.key(r.relpath), self.files_of[r.relpath]["size"]
        if r.length:
            got = read_range_into(
                self.client, self.where, key, (r.offset, r.length, size), fd, progress
            )
        else:
            got = hashlib.sha256(b"").hexdigest()
        if got != r.sha256:
            raise bad_snapshot(
                self.where,
                f"object {key!r}: {r.describe()} sha256 mismatch "
                f"(expected {r.sha256[:16]}.., got {got[:16]}..)",
            )
        os.fdatasync(fd)
        staging.record(_journal_key(r))
        self._arrived([r])

    def _arrived(self, ranges: list[DigestRange]) -> None:
        for r in ranges if self.arrivals is not None else ():
            self.arrivals.record(r.relpath, r.offset)


def _fetch_order(ranges: list[DigestRange], last: Collection[str]) -> list[DigestRange]:
    """Every other file's ranges first, then those of `last` (each in file order)."""
    return sorted(ranges, key=lambda r: (r.relpath in last, r.relpath, r.offset))


def fetch_ranges(relpath: str, entry: dict[str, Any]) -> list[DigestRange]:
    """What one GET fetches and checks: each chunk, or the whole of a file without chunks."""
    ranges = digest_ranges(relpath, entry)
    if "chunks" in entry:
        return [r for r in ranges if not r.whole_file]
    (whole,) = ranges
    return [DigestRange(relpath, True, 0, 0, entry["size"], whole.sha256)]


def _journal_key(r: DigestRange) -> tuple[str, int, int, str]:
    return (r.relpath, r.offset, r.length, r.sha256)


def _whole_file_ranges(manifest: dict[str, Any], relpaths: list[str]) -> list[DigestRange]:
    """The whole-file sha256 of each chunked file of `relpaths` that records one as well."""
    files = manifest["files"]
    return [
        r
        for relpath in relpaths
        if "chunks" in files[relpath]
        for r in digest_ranges(relpath, files[relpath])
        if r.whole_file
    ]


def _already_there(dest: Path, raw: bytes) -> bool:
    try:
        if (dest / MANIFEST).read_bytes() != raw:
            return False
        validate_snapshot(dest, None, verify="sizes")
    except (OSError, SnapfnError):
        return False
    return True
