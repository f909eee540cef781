"""The worker's regions, made and filled by the restorer while criu restores the worker (CUDA).

A process image holds neither the weights nor the KV pool: the restored worker must map fresh
device memory at its regions' addresses and stream the weights back (on the H200, 8B llama:
remap 0.23 s + stream 0.86 s after criu and the CUDA restore, one H200 run, commit 44f517c). The
restorer — the process that runs `criu restore` — has nothing to do meanwhile, so it does that
work first, in a CUDA context of its own, and hands the memory over:

    helper = PrefetchHelper(prefetch_doc(specs, dir))      beside criu restore: a child process
                                                           (`python -m snapfn.snapshot.keeper.region_fill`)
                                                           that makes and fills them, so the
                                                           restorer itself never holds a CUDA
                                                           context
    resume["regions"] = helper.address                     a unix socket the worker connects to
    the worker: receive() → {"ok", "figures"} + one fd per region (SCM_RIGHTS) → import each
                (cuMemImportFromShareableHandle), map it at its region's address, verify the
                weights on the GPU against the layout's sum64 table → ack()
                (only from a peer of its own user or root: SO_PEERCRED, snapshot/unix_socket.py)
    the helper exits: its mappings, handles and context go; the worker's imports keep the memory
    helper.close()                                         kills it if it is still there

With a keeper on the machine (snapshot/keeper/daemon.py) the same RegionPrefetch runs in the keeper,
whose driver and context are already up: `KeeperPrefetch(address, doc)` takes the helper's place.

A spec (recorded by the worker at checkpoint, in the process manifest's "regions") is
{"name", "address", "nbytes", "device", "fill"}: "fill" is "file" (the region is an image of the
bytes of snapshot file "path" from "offset", 0 when absent, up to the region's size or the file's
end: the LLM's weights in their restore layout, or one run of a function's memory image), "zero"
(the KV pool) or "none" (graph intermediates, rewritten by every replay). Each region is a `cuMemCreate` with
POSIX fd handles. When anything fails, the worker is told why ({"ok": false, "error"}) and
makes and fills its regions itself, as without a prefetch.

Nothing here imports torch: the restorer never does.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from snapfn.snapshot.unix_socket import peer_problem

FILLS = ("file", "zero", "none")
MAX_MESSAGE = 1 << 16  # the hand-over message's bytes (the fds travel beside it)
MAX_REGIONS = 4096  # one fd per region travels in the hand-over
MAX_REGION_BYTES = 1 << 48
MAX_DEVICES = 1024


def _field(doc: Mapping[str, Any], key: str, kind: type, default: Any = None) -> Any:
    """`doc[key]` (or `default` where given and the key is absent), which must be a `kind`
    (an int never a bool)."""
    if key not in doc and default is not None:
        return default
    value = doc[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"a region spec's {key!r} is not a JSON {kind.__name__}: {value!r:.64}")
    return value


@dataclass(frozen=True)
class RegionSpec:
    name: str
    address: int  # the region's device address in the worker (what the worker maps it at)
    nbytes: int
    device: int  # CUDA device ordinal
    fill: str  # "file", "zero" or "none"
    path: str = ""  # "file": the snapshot file, relative to the snapshot directory
    offset: int = 0  # "file": where in it the region's bytes start

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> RegionSpec:
        """ValueError (one line) for anything a restorer must not make: fields of another type
        (numbers are exact JSON integers), an address range outside 64 bits, a size that is
        not a positive 2 MiB multiple or is over `MAX_REGION_BYTES`, a fill not in `FILLS`, a
        "file" region whose path is not a plain path inside the snapshot."""
        if not isinstance(doc, Mapping):
            raise ValueError(f"a region spec is a JSON object, not {type(doc).__name__}")
        try:
            spec = cls(
                name=_field(doc, "name", str),
                address=_field(doc, "address", int),
                nbytes=_field(doc, "nbytes", int),
                device=_field(doc, "device", int, 0),
                fill=_field(doc, "fill", str),
                path=_field(doc, "path", str, ""),
                offset=_field(doc, "offset", int, 0),
            )
        except KeyError as exc:
            raise ValueError(f"a region spec lacks {exc}") from None
        spec._check()
        return spec

    def _check(self) -> None:
        where = f"region {self.name[:64]!r}"
        if not self.name or len(self.name) > 256:
            raise ValueError(f"{where}: its name is empty or longer than 256 characters")
        if self.fill not in FILLS:
            raise ValueError(f"{where}: fill {self.fill[:64]!r} is not one of {FILLS}")
        if self.offset < 0 or self.offset >= 1 << 63:
            raise ValueError(f"{where}: offset {self.offset} is negative or past 2^63")
        if self.nbytes <= 0 or self.nbytes % (2 << 20) or self.nbytes > MAX_REGION_BYTES:
            raise ValueError(
                f"{where}: {self.nbytes} bytes is not a 2 MiB multiple of at most "
                f"{MAX_REGION_BYTES}"
            )
        if self.address <= 0 or self.address + self.nbytes > 1 << 64:
            raise ValueError(f"{where}: address {self.address} is not inside 64 bits")
        if not 0 <= self.device < MAX_DEVICES:
            raise ValueError(f"{where}: device {self.device} is not a CUDA ordinal")
        if self.fill == "file" and (
            not self.path
            or "\0" in self.path
            or Path(self.path).is_absolute()
            or ".." in Path(self.path).parts
        ):
            raise ValueError(f"{where}: file {self.path[:256]!r} is not inside the snapshot")

    @classmethod
    def list_from_json(cls, docs: Any) -> list[RegionSpec]:
        """A process image's "regions": at most `MAX_REGIONS` specs whose address ranges do
        not overlap; ValueError (one line) otherwise."""
        if not isinstance(docs, list):
            raise ValueError(f"the regions are a JSON list, not {type(docs).__name__}")
        if len(docs) > MAX_REGIONS:
            raise ValueError(f"{len(docs)} regions, more than {MAX_REGIONS}")
        specs = sorted((cls.from_json(doc) for doc in docs), key=lambda s: s.address)
        for before, spec in zip(specs, specs[1:], strict=False):
            if spec.address < before.address + before.nbytes:
                raise ValueError(f"region {spec.name!r} overlaps region {before.name!r}")
        return specs

    def to_json(self) -> dict[str, Any]:
        doc = {"name": self.name, "address": self.address, "nbytes": self.nbytes}
        doc.update(device=self.device, fill=self.fill)
        if self.path:
            doc["path"] = self.path
        return {**doc, "offset": self.offset} if self.offset else doc


# ---- the worker's side ---------------------------------------------------------------------------
def receive(address: str, timeout_s: float) -> tuple[dict[str, Any], dict[int, int], socket.socket]:
    """Connect to a RegionPrefetch: (its message, {region address: fd}, the socket to `ack` on).

    Raises OSError / ValueError when the hand-over fails — PermissionError, with the reason,
    when the process listening runs as neither this user nor root; the fds are then already
    closed."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(timeout_s)
    fds: list[int] = []
    deadline = time.monotonic() + timeout_s
    try:
        while True:  # NOTE: the helper may not be listening yet
            try:
                sock.connect(address)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.005)
        untrusted = peer_problem(sock)
        if untrusted is not None:
            raise PermissionError(f"the regions' socket {address} is not trusted: {untrusted}")
        data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 4096)
        message = json.loads(data)
        if not isinstance(message, dict):
            raise ValueError("the hand-over message is not a JSON object")
        addresses = message.get("regions", [])
        if not isinstance(addresses, list) or not all(type(a) is int for a in addresses):
            raise ValueError("the hand-over's regions are not a list of addresses")
        if len(addresses) != len(fds):
            raise ValueError(f"{len(fds)} fds for {len(addresses)} regions")
        return message, dict(zip(addresses, fds, strict=True)), sock
    except BaseException:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        sock.close()
        raise


def ack(sock: socket.socket) -> None:
    """Tell the restorer its fds were imported (it then lets go of its side)."""
    with contextlib.suppress(OSError):
        sock.send(b"mapped")
    sock.close()


def take_regions(
    address: str, timeout_s: float, adopt: Callable[[dict[int, int]], None], figures: dict
) -> bool:
    """The worker's whole hand-over: `receive` the restorer's regions, `adopt(fds)` them (the
    caller maps each at its address; RestoreFailed refuses them), then `ack`. True once they are
    adopted; False, with the reason in `figures["fallback"]` (and the restorer's own figures in
    `figures["restorer"]`), when anything is off — the caller then makes its memory itself."""
    from snapfn.snapshot.errors import RestoreFailed

    try:
        message, fds, sock = receive(address, timeout_s)
    except (OSError, ValueError) as exc:
        figures["fallback"] = f"no regions from the restorer: {type(exc).__name__}: {exc}"
        return False
    try:
        figures["restorer"] = message.get("figures", {})
        if not message.get("ok"):
            figures["fallback"] = f"the restorer failed: {message.get('error')}"
            return False
        try:
            adopt(fds)
        except RestoreFailed as exc:
            figures["fallback"] = str(exc)
            return False
    finally:
        ack(sock)
    return True


# ---- the restorer's side -------------------------------------------------------------------------
def prefetch_doc(
    specs: Sequence[RegionSpec],
    snapshot_dir: Path,
    timeout_s: float,
    num_threads: int = 8,
    read: str = "pread",
    pinned: str = "",
) -> dict[str, Any]:
    """What a RegionPrefetch is made from (region_fill.prefetch_from_doc), listening at a
    socket in a new private directory (mkdtemp: 0700, this user's, an unguessable name): a
    helper's argument, or a keeper's prefetch request."""
    directory = tempfile.mkdtemp(prefix="snapfn-regions-")
    doc = {"snapshot_dir": str(snapshot_dir), "address": os.path.join(directory, "sock")}
    doc.update(specs=[s.to_json() for s in specs], timeout_s=timeout_s)
    return doc | {"num_threads": num_threads, "read": read, "pinned": pinned}


class PrefetchHelper:
    """The child process that runs a RegionPrefetch for one restore: `PrefetchHelper(doc)`
    with a `prefetch_doc`, spawned on a side thread."""

    def __init__(self, doc: Mapping[str, Any]) -> None:
        self.address = str(doc["address"])
        self._dir = os.path.dirname(self.address)
        self.proc: subprocess.Popen | None = None
        self.spawn_error: OSError | None = None
        # NOTE: spawning took 0.075 s of the restore's critical path on the H200 (8B run):
        # it happens on a side thread; the worker retries connecting until it listens
        argv = [sys.executable, "-m", "snapfn.snapshot.keeper.region_fill", json.dumps(doc)]
        self._spawned = threading.Thread(target=self._spawn, args=(argv,), daemon=True)
        self._spawned.start()

    def _spawn(self, argv: list[str]) -> None:
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:  # the worker times out connecting and streams itself
            self.spawn_error = exc

    def wait(self, timeout_s: float | None = None) -> int | None:
        """The helper's exit status (None: it never started)."""
        self._spawned.join()
        return None if self.proc is None else self.proc.wait(timeout_s)

    def close(self) -> None:
        """Kill the helper if it is still there (the worker never came, or the restore failed)
        and remove its socket; a helper that handed over has exited by itself."""
        self._spawned.join()
        if self.proc is not None:
            with contextlib.suppress(OSError):
                self.proc.kill()
            threading.Thread(target=self.proc.wait, daemon=True).start()  # reap it
        shutil.rmtree(self._dir, ignore_errors=True)
