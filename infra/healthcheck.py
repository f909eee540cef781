"""Container health check for `snapfn serve` (the image's HEALTHCHECK, the ECS task's too).

    python3 infra/healthcheck.py [--ready]

Asks `GET /health` on this container (port `SNAPFN_PORT`, default 8000) and exits 0 or 1:
- default (liveness): healthy while the worker is up (200) or still starting (503
  {"status": "starting"}): a restore or cold init that takes minutes is not a broken container;
  unhealthy once start-up failed (503 {"status": "failed"}) or when nothing answers;
- `--ready`: healthy only when up (200), as a load balancer or readiness probe wants.

Standard library only: it runs in the image's Python without importing snapfn.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request

TIMEOUT_S = 4.0


def health_url(environ: dict[str, str]) -> str:
    return f"http://127.0.0.1:{environ.get('SNAPFN_PORT') or '8000'}/health"


def check(url: str, ready: bool) -> tuple[bool, str]:
    """(healthy, one-line reason) for the /health endpoint at `url`."""
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            return True, f"{response.status} up"
    except urllib.error.HTTPError as exc:
        status = _status_field(exc.read())
        if exc.code == 503 and status == "starting" and not ready:
            return True, "503 starting"
        return False, f"{exc.code} {status or 'no status'}"
    except (OSError, ValueError) as exc:
        return False, f"no answer from {url}: {exc}"


def _status_field(body: bytes) -> str | None:
    try:
        status = json.loads(body).get("status")
    except (ValueError, AttributeError):
        return None
    return status if isinstance(status, str) else None


def main(argv: list[str], environ: dict[str, str]) -> int:
    healthy, reason = check(health_url(environ), ready="--ready" in argv)
    print(reason)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], dict(os.environ)))
