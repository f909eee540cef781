"""The identity of the code a process image holds: the sha256 of snapfn's own Python files.

A restored worker runs the code that was in its memory when it was checkpointed, and imports
any module it had not imported yet from the files installed now; the host that drives it runs
the installed files too. Each side must be the other's code, or the two speak different
protocols (a restored worker of other code served its replay check, then never answered). So
`snapfn init --tier process` records `code_fingerprint()` in the manifest's process section,
and a restore whose installed code differs refuses the image in one line (its portable tier
restores instead). It hashes `handler/` and `snapshot/`'s .py files, paths and contents
(~220 files, a few ms), once per process.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

PACKAGES = ("handler", "snapshot")


@functools.cache
def code_fingerprint() -> str:
    root = Path(__file__).resolve().parents[2]  # the folder holding handler/ and snapshot/
    digest = hashlib.sha256()
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()
