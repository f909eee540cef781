"""snapfn's small error vocabulary: a few exception types, each with a stable code.

Every error raised on purpose by snapfn is one of these, so callers (CLI, HTTP, queue worker)
can map it to an exit status or an HTTP status without parsing messages. Messages are one line
(`one_line`), so they fit a log line or an HTTP header as they are.
"""


class SnapfnError(Exception):
    """Base class. `code` is stable and machine-readable; the message says what to fix."""

    code = "snapfn_error"


class BadRequest(SnapfnError):
    """The caller asked for something invalid (prompt too long, bad sampling value, …)."""

    code = "bad_request"


class UnsupportedModel(SnapfnError):
    """The checkpoint's architecture or an option in its config.json is not supported."""

    code = "unsupported_model"


class CheckpointError(SnapfnError):
    """The checkpoint is malformed or its tensors do not cover the model (coverage check)."""

    code = "bad_checkpoint"


class BadSnapshot(SnapfnError):
    """A snapshot failed a check (checksum, truncation, format version, table bounds)."""

    code = "bad_snapshot"


class IncompatibleSnapshot(SnapfnError):
    """A snapshot was written for another GPU, driver, library version or world size."""

    code = "incompatible_snapshot"


class RestoreFailed(SnapfnError):
    """Restoring from a snapshot failed part way; the runtime falls back one tier."""

    code = "restore_failed"


class InitFailed(SnapfnError):
    """The init phase failed; the function never became ready."""

    code = "init_failed"


class RankFailed(SnapfnError):
    """A rank of a tensor- or expert-parallel group died: the group is down."""

    code = "rank_failed"


def one_line(message: str) -> str:
    """`message` with its line breaks turned into spaces: every snapfn error reads as one line."""
    return " ".join(message.splitlines())


def bad_snapshot(root: object, reason: str) -> BadSnapshot:
    """BadSnapshot("snapshot <root>: <reason>"), on one line."""
    return BadSnapshot(one_line(f"snapshot {root}: {reason}"))
