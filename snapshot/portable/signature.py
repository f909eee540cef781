"""Signed snapshots: the manifest's bytes signed with a key the operator holds, checked by `pull`
and by every restore while a key is configured.

    key = SnapshotKey.from_env(os.environ)        None: nothing signed, nothing required
    configured(key_or_CONFIGURED)                 what a `key=CONFIGURED` argument means
    signature_bytes(key, manifest_bytes)          manifest.sig's content (publish writes it
                                                  beside manifest.json, inside the staging dir)
    check_signature(snapshot_dir, key)            BadSnapshot, one line: unsigned, another key,
                                                  or a manifest that is not what was signed

The manifest lists every file's size and sha256 (chunk digests for big files), so its signature
covers every byte of the snapshot — its compile caches, which Triton and inductor load as code,
included. Without a key a snapshot is trusted on the digests of the manifest it carries, which
prove it intact, not who made it.

Keys (the first variable set wins):

    SNAPFN_SNAPSHOT_KEY=PATH        a key file
    SNAPFN_SNAPSHOT_KEY_VALUE=TEXT  the same bytes, from the environment (what a secret manager
                                    injects into a task or pod)

holding one of: an ed25519 private key (PEM, PKCS#8; signs and verifies), an ed25519 public key
(PEM; verifies only: what restoring hosts should hold), or a shared secret of at least 32 bytes
(HMAC-SHA256; signs and verifies). Wire format of manifest.sig (JSON, under 4 KiB):

    {"format": "snapfn-signature", "version": 1, "scheme": "ed25519" | "hmac-sha256",
     "key_id": "<16 hex: the public key's or the secret's fingerprint>",
     "signature": "<base64 of the signature of manifest.json's exact bytes>"}
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from snapfn.snapshot.errors import BadRequest, BadSnapshot

SIGNATURE = "manifest.sig"
CONFIGURED = object()  # a key argument's default: the configured key, read when it is needed
SIGNATURE_FORMAT = "snapfn-signature"
SCHEMES = ("ed25519", "hmac-sha256")
MAX_SIGNATURE_BYTES = 4096
MAX_KEY_BYTES = 16384
MIN_SECRET_BYTES = 32


@dataclass(frozen=True)
class SnapshotKey:
    """One key: `scheme`, its `key_id`, and what it can do (`can_sign`)."""

    scheme: str
    key_id: str
    _private: Any = None  # ed25519 private key, or the HMAC secret (bytes)
    _public: Any = None  # ed25519 public key

    @property
    def can_sign(self) -> bool:
        return self._private is not None

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> SnapshotKey | None:
        """The configured key, or None; BadRequest, one line, for a key that cannot be used."""
        path = environ.get("SNAPFN_SNAPSHOT_KEY")
        if path:
            return cls.from_bytes(_read_key_file(Path(path)), f"SNAPFN_SNAPSHOT_KEY={path}")
        value = environ.get("SNAPFN_SNAPSHOT_KEY_VALUE")
        if value:
            return cls.from_bytes(value.encode(), "SNAPFN_SNAPSHOT_KEY_VALUE")
        return None

    @classmethod
    def from_bytes(cls, raw: bytes, where: str = "the key") -> SnapshotKey:
        text = raw.strip()
        if text.startswith(b"-----BEGIN"):
            return cls._from_pem(text, where)
        if len(text) < MIN_SECRET_BYTES:
            raise BadRequest(
                f"{where}: a shared secret must hold at least {MIN_SECRET_BYTES} bytes "
                f"(it holds {len(text)}), or be an ed25519 key in PEM"
            )
        key_id = hashlib.sha256(b"snapfn-key-id\0" + text).hexdigest()[:16]
        return cls("hmac-sha256", key_id, _private=bytes(text))

    @classmethod
    def _from_pem(cls, pem: bytes, where: str) -> SnapshotKey:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519

        try:
            if b"PRIVATE KEY" in pem:
                private = serialization.load_pem_private_key(pem, password=None)
                public = private.public_key()
            else:
                private, public = None, serialization.load_pem_public_key(pem)
        except (ValueError, TypeError) as exc:
            raise BadRequest(f"{where}: not a usable PEM key ({exc})") from None
        if not isinstance(public, ed25519.Ed25519PublicKey):
            raise BadRequest(f"{where}: only ed25519 keys sign snapshots")
        raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return cls("ed25519", hashlib.sha256(raw).hexdigest()[:16], private, public)

    def sign(self, message: bytes) -> dict[str, Any]:
        if not self.can_sign:
            raise BadRequest(f"key {self.key_id} is a public key: it verifies, it cannot sign")
        if self.scheme == "ed25519":
            signature = self._private.sign(message)
        else:
            signature = hmac.new(self._private, message, hashlib.sha256).digest()
        return {
            "format": SIGNATURE_FORMAT,
            "version": 1,
            "scheme": self.scheme,
            "key_id": self.key_id,
            "signature": base64.b64encode(signature).decode(),
        }

    def verify(self, message: bytes, doc: Any) -> str | None:
        """None when `doc` is this key's signature of `message`, else why not (one line)."""
        if not isinstance(doc, dict) or doc.get("format") != SIGNATURE_FORMAT:
            return "its manifest.sig is not a snapfn signature"
        if doc.get("scheme") != self.scheme or doc.get("key_id") != self.key_id:
            return (
                f"it is signed by {doc.get('scheme')} key {doc.get('key_id')!r}, "
                f"not by the configured {self.scheme} key {self.key_id!r}"
            )
        try:
            signature = base64.b64decode(str(doc.get("signature")), validate=True)
        except ValueError:
            return "its signature is not base64"
        if self.scheme == "hmac-sha256":
            expected = hmac.new(self._private, message, hashlib.sha256).digest()
            return None if hmac.compare_digest(expected, signature) else _MISMATCH
        from cryptography.exceptions import InvalidSignature

        try:
            self._public.verify(signature, message)
        except InvalidSignature:
            return _MISMATCH
        return None


_MISMATCH = "its manifest is not what the key signed (edited, or signed by another key)"


def configured(key: Any = CONFIGURED) -> SnapshotKey | None:
    """`key` itself, or for CONFIGURED the key the environment configures (read now)."""
    return SnapshotKey.from_env(os.environ) if key is CONFIGURED else key


def signature_bytes(key: SnapshotKey, manifest_bytes: bytes) -> bytes:
    """manifest.sig's content: `key`'s signature of `manifest_bytes`."""
    return json.dumps(key.sign(manifest_bytes)).encode()


def check_signature(snapshot_dir: Path, key: SnapshotKey | None, manifest_bytes: bytes) -> None:
    """With a key configured: BadSnapshot unless manifest.sig is the key's signature of
    `manifest_bytes` (the manifest as read for this restore). Without one: nothing."""
    if key is None:
        return
    where = Path(snapshot_dir)
    doc = read_signature(where)
    if doc is None:
        raise BadSnapshot(f"snapshot {where}: it is not signed, and a snapshot key is configured")
    problem = key.verify(manifest_bytes, doc)
    if problem is not None:
        raise BadSnapshot(f"snapshot {where}: {problem}")


def read_signature(snapshot_dir: Path) -> Any:
    """manifest.sig parsed (bounded; a special file or a symlink is refused), or None when absent."""
    path = Path(snapshot_dir) / SIGNATURE
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(info.st_mode):
        raise BadSnapshot(f"snapshot {snapshot_dir}: {SIGNATURE} is not a regular file")
    if info.st_size > MAX_SIGNATURE_BYTES:
        raise BadSnapshot(f"snapshot {snapshot_dir}: {SIGNATURE} is {info.st_size} bytes")
    return parse_signature(path.read_bytes(), str(snapshot_dir))


def parse_signature(raw: bytes, where: str) -> Any:
    if len(raw) > MAX_SIGNATURE_BYTES:
        raise BadSnapshot(f"snapshot {where}: {SIGNATURE} is {len(raw)} bytes")
    from snapfn.snapshot.portable.format import load_json  # format imports this module

    try:
        return load_json(raw, max_depth=4)  # bounded: a nested document is refused, not recursed
    except ValueError as exc:
        raise BadSnapshot(f"snapshot {where}: {SIGNATURE} is {exc}") from None


def _read_key_file(path: Path) -> bytes:
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_KEY_BYTES:
            raise BadRequest(f"SNAPFN_SNAPSHOT_KEY={path}: not a key file")
        return path.read_bytes()
    except OSError as exc:
        raise BadRequest(f"SNAPFN_SNAPSHOT_KEY={path}: {exc.strerror or exc}") from None
