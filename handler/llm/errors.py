"""The error vocabulary lives on the ground floor (`snapfn.snapshot.errors`); re-exported here."""

from snapfn.snapshot.errors import (  # noqa: F401
    BadRequest,
    BadSnapshot,
    CheckpointError,
    IncompatibleSnapshot,
    InitFailed,
    RestoreFailed,
    SnapfnError,
    UnsupportedModel,
)
