"""The instances' zygote imports this module: doing so imports what an instance's `snapfn serve`
would import before it forks its workers — the serve stack (but not prometheus_client: it picks
its multiprocess mode at import, from the instance's own folder), and the target's modules as the
gunicorn master preloads them (`serve.preload_for_fork`: the LLM's, or the function's own
module) — for the serve flags in SNAPFN_INSTANCE_ARGV. Nothing here initialises CUDA (the
zygote refuses to serve if anything did). Importing it elsewhere, without that variable, only
imports the serve stack.

NOTE: importing this module has effects by design: it is a zygote's preload list
(handler/activator/instance_zygote.py), which names modules to import.
"""

from __future__ import annotations

import json
import os

import flask  # noqa: F401  (the app's framework; the app module itself imports prometheus_client)

from snapfn.handler.cli import build_parser
from snapfn.handler.http import serve


def _preload() -> None:
    raw = os.environ.get("SNAPFN_INSTANCE_ARGV")
    if not raw:
        return
    args = build_parser().parse_args(json.loads(raw))
    if args.snapshot is not None and "://" in str(args.snapshot):
        args.snapshot = None  # NOTE: not pulled here; each instance pulls (or finds it cached)
    serve.preload_for_fork(serve.serve_target(args))


_preload()
