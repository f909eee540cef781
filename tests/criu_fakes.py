"""A stand-in criu executable for tests of the wrapper and of doctor."""


def fake_criu(tmp_path, body: str):
    """An executable standing in for criu; `body` is shell run after the version answer."""
    path = tmp_path / "criu"
    path.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = --version ]; then echo "Version: ${FAKE_VERSION:-4.1.1}"; exit 0; fi\n' + body
    )
    path.chmod(0o755)
    return path
