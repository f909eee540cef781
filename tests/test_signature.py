"""snapshot/portable/signature.py: snapshot keys (ed25519 private or public, HMAC secrets), the
signature of a manifest, and every way a signature check refuses."""

from __future__ import annotations

import os

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from snapfn.snapshot.errors import BadRequest, BadSnapshot
from snapfn.snapshot.portable.signature import (
    SIGNATURE,
    SnapshotKey,
    check_signature,
    read_signature,
    signature_bytes,
)

MANIFEST = b'{"format_version": 1, "files": {"weights/rank0.bin": {"size": 1}}}\n'


def pems() -> tuple[bytes, bytes]:
    private = ed25519.Ed25519PrivateKey.generate()
    private_pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public_pem = private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return private_pem, public_pem


@pytest.mark.parametrize("scheme", ["ed25519", "hmac-sha256"])
def test_a_signed_manifest_checks_and_any_change_is_refused(scheme, tmp_path):
    private_pem, public_pem = pems()
    signer = SnapshotKey.from_bytes(
        private_pem if scheme == "ed25519" else os.urandom(32).hex().encode()
    )
    verifier = SnapshotKey.from_bytes(public_pem) if scheme == "ed25519" else signer
    assert signer.scheme == verifier.scheme == scheme and signer.key_id == verifier.key_id
    (tmp_path / SIGNATURE).write_bytes(signature_bytes(signer, MANIFEST))
    check_signature(tmp_path, verifier, MANIFEST)
    edited = MANIFEST.replace(b'"size": 1', b'"size": 2')
    with pytest.raises(BadSnapshot, match="not what the key signed"):
        check_signature(tmp_path, verifier, edited)


def test_another_key_and_no_signature_are_refused_by_name(tmp_path):
    a, b = SnapshotKey.from_bytes(pems()[0]), SnapshotKey.from_bytes(pems()[0])
    with pytest.raises(BadSnapshot, match="it is not signed, and a snapshot key is configured"):
        check_signature(tmp_path, a, MANIFEST)
    (tmp_path / SIGNATURE).write_bytes(signature_bytes(a, MANIFEST))
    with pytest.raises(BadSnapshot, match=f"not by the configured ed25519 key '{b.key_id}'"):
        check_signature(tmp_path, b, MANIFEST)
    check_signature(tmp_path, None, MANIFEST)  # no key configured: nothing is required


def test_keys_that_cannot_serve_are_refused_with_what_to_fix(tmp_path):
    with pytest.raises(BadRequest, match="at least 32 bytes"):
        SnapshotKey.from_bytes(b"short secret")
    with pytest.raises(BadRequest, match="not a usable PEM key"):
        SnapshotKey.from_bytes(b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n")
    public = SnapshotKey.from_bytes(pems()[1])
    assert not public.can_sign
    with pytest.raises(BadRequest, match="cannot sign"):
        public.sign(MANIFEST)
    with pytest.raises(BadRequest, match="No such file"):
        SnapshotKey.from_env({"SNAPFN_SNAPSHOT_KEY": str(tmp_path / "missing.pem")})


def test_the_key_comes_from_a_file_first_then_the_environment(tmp_path):
    private_pem, _ = pems()
    (tmp_path / "key.pem").write_bytes(private_pem)
    secret = "x" * 40
    from_file = SnapshotKey.from_env(
        {"SNAPFN_SNAPSHOT_KEY": str(tmp_path / "key.pem"), "SNAPFN_SNAPSHOT_KEY_VALUE": secret}
    )
    assert from_file.scheme == "ed25519"
    assert SnapshotKey.from_env({"SNAPFN_SNAPSHOT_KEY_VALUE": secret}).scheme == "hmac-sha256"
    assert SnapshotKey.from_env({}) is None


def test_a_signature_file_that_is_not_one_is_refused_before_it_is_read(tmp_path):
    key = SnapshotKey.from_bytes(b"s" * 32)
    os.mkfifo(tmp_path / SIGNATURE)  # a FIFO would block a reader forever
    with pytest.raises(BadSnapshot, match="not a regular file"):
        read_signature(tmp_path)
    os.unlink(tmp_path / SIGNATURE)
    (tmp_path / SIGNATURE).write_bytes(b"{" * 5000)
    with pytest.raises(BadSnapshot, match="5000 bytes"):
        check_signature(tmp_path, key, MANIFEST)
    (tmp_path / SIGNATURE).write_bytes(b"[1, 2]")
    with pytest.raises(BadSnapshot, match="not a snapfn signature"):
        check_signature(tmp_path, key, MANIFEST)
    nested = b'{"format": "snapfn-signature", "key_id": ' + b"[" * 1500 + b"]" * 1500 + b"}"
    (tmp_path / SIGNATURE).write_bytes(nested)  # under the size bound, past the parser's depth
    with pytest.raises(BadSnapshot, match="nested more than") as refused:
        check_signature(tmp_path, key, MANIFEST)
    assert "\n" not in str(refused.value)
