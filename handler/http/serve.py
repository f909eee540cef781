"""`snapfn serve`: the HTTP front door under gunicorn (gthread workers).

    snapfn serve [--model DIR] [--snapshot DIR] | --function module:fn
                 [--host 127.0.0.1] [--port 8000] [--workers 1] [--threads 32] [--api-key KEY]
                 [--idle-timeout SECONDS [--max-instances N] [--target-concurrency N]]

Each gunicorn worker builds its own `WorkerRuntime` after fork (`gunicorn.conf.py`'s
`post_fork`) and starts it in the background; the Flask app (`http.create_app`) answers at once
and holds requests until the runtime is up. Settings: `ServeConfig` defaults, then
`SNAPFN_<FIELD>` environment variables (`SNAPFN_API_KEY` keeps the key out of `ps`), then flags.
The master prints `snapfn serve: listening on http://HOST:PORT` once it is bound.

With `--idle-timeout`, `run` hands over to the scale-to-zero activator (`activator/app.py`) before
anything imports torch: it owns the port and starts instances of this same command (without
`--idle-timeout`) on demand. An instance started by it exits with it (`parent_watch.py`).
"""

from __future__ import annotations

import argparse
import logging
import os
import runpy
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from gunicorn.app.base import BaseApplication

from snapfn.handler.activator.parent_watch import exit_with_parent
from snapfn.handler.function.target_flags import (
    add_engine_arguments,
    add_target_arguments,
    serve_target,
)
from snapfn.handler.http.app import create_app
from snapfn.handler.http.serve_config import ServeConfig

CONF_FILE = Path(__file__).with_name("gunicorn.conf.py")
EMBEDDED_MODEL_NAME = "snapfn-embedded"


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = ServeConfig()
    add_target_arguments(p, "serve")
    net = p.add_argument_group("server")
    net.add_argument("--host", help=f"address to bind (default {d.host})")
    net.add_argument("--port", type=int, help=f"port (default {d.port}; 0 = any free port)")
    net.add_argument("--workers", type=int, help=f"gunicorn workers (default {d.workers})")
    net.add_argument("--threads", type=int, help=f"threads per worker (default {d.threads})")
    net.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (or SNAPFN_API_KEY)")
    net.add_argument("--model-name", help="the model name clients send (default: folder name)")
    net.add_argument("--max-body-bytes", type=int, help=f"default {d.max_body_bytes}")
    net.add_argument("--startup-queue-size", type=int, help=f"default {d.startup_queue_size}")
    net.add_argument("--startup-wait-s", type=float, help=f"default {d.startup_wait_s}")
    add_engine_arguments(p)
    scale = p.add_argument_group("scale to zero (an activator starts instances on demand)")
    scale.add_argument(
        "--idle-timeout",
        type=float,
        metavar="SECONDS",
        help="run the activator: stop an instance idle this long, down to zero",
    )
    scale.add_argument(
        "--max-instances", type=int, help="instances at most (default: one per GPU, 1 on CPU)"
    )
    scale.add_argument(
        "--keeper",
        choices=("on", "off"),
        help="on: run a `snapfn keeper` per GPU beside the instances, so that their tier-1"
        " restores start no CUDA driver and copy the weights at the PCIe rate (default off;"
        " docs/activator.md)",
    )
    scale.add_argument(
        "--target-concurrency",
        type=int,
        help=f"requests in flight per instance before another starts (default "
        f"{d.target_concurrency})",
    )


def preload_for_fork(target: Any, environ=os.environ) -> None:
    """Make the gunicorn master a zygote: import what a worker's init or restore needs, so
    workers forked from it skip those imports (`import torch` above all). The LLM's modules;
    a function's own module (with its --function-dir, or the snapshot's copy, on the path),
    unless its snapshot holds a process image (workers restore that: nothing to import here)
    or SNAPFN_PRELOAD=off. NOTE: nothing here may initialise CUDA: a module that does at import
    is refused, with how to fix it."""
    import importlib

    from snapfn.snapshot.zygote.fork_safety import fork_safety_problem

    if target.kind == "llm":
        from snapfn.handler.llm.recipes.function import ZYGOTE_PRELOAD

        modules, what = ZYGOTE_PRELOAD, "the LLM's modules"
    else:
        modules = _function_preload(target, environ)
        what = f"importing {', '.join(modules)}"
        if not modules:
            return
    for module in modules:
        importlib.import_module(module)
    problem = fork_safety_problem()
    if problem is not None:
        raise RuntimeError(
            f"cannot fork workers safely after {what}: {problem}"
            + (" (or set SNAPFN_PRELOAD=off)" if target.kind == "function" else "")
        )


def _function_preload(target: Any, environ) -> list[str]:
    """The function's module to import in the master (its folder put on the path), or []."""
    from snapfn.handler.api import DEVICE_VARIABLE, parse_function_spec
    from snapfn.handler.function.user_function import (
        SOURCE_DIR,
        function_cache_dir,
        put_on_import_path,
    )
    from snapfn.snapshot.portable import compile_caches
    from snapfn.snapshot.process.snapshot import has_process_image

    snapshot = target.snapshot_dir
    if environ.get("SNAPFN_PRELOAD", "on") == "off" or (snapshot and has_process_image(snapshot)):
        return []
    folder = target.function_dir
    if folder is None and snapshot is not None and (Path(snapshot) / SOURCE_DIR).is_dir():
        folder = Path(snapshot) / SOURCE_DIR
    put_on_import_path(folder)
    # NOTE: what the worker's runtime_env stage sets, set first: the module may read it
    os.environ.setdefault(DEVICE_VARIABLE, target.init_config.device)
    compile_caches.set_environment(
        function_cache_dir(target.function, target.init_config.cache_dir)
    )
    return [parse_function_spec(target.function)[0]]


def run(args: argparse.Namespace) -> int:
    config = serve_config(args, os.environ)
    if config.idle_timeout_s is not None:
        # NOTE: imported here: the activator stays a light process (no torch, no CUDA)
        from snapfn.handler.activator.app import run_activator

        return run_activator(args, config, os.environ)
    if not exit_with_parent(os.environ):
        print("snapfn serve: the activator that started this instance is gone", file=sys.stderr)
        return 1
    target = serve_target(args)
    if config.model_name is None:
        config = replace(config, model_name=default_model_name(target))
    preload_for_fork(target)
    server, master_pid = SnapfnServer(target, config), os.getpid()
    try:
        server.run()
    except SystemExit as exc:  # the arbiter leaves through sys.exit(), 0 on a clean stop
        if os.getpid() != master_pid:
            raise  # NOTE: a forked worker leaving: it must exit, never return into our caller
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


def serve_config(args: argparse.Namespace, environ) -> ServeConfig:
    overrides = {
        name: getattr(args, name)
        for name in ("host", "port", "workers", "threads", "api_key", "model_name")
        + ("max_body_bytes", "startup_queue_size", "startup_wait_s")
        + ("max_instances", "target_concurrency", "keeper")
    }
    overrides["idle_timeout_s"] = args.idle_timeout
    return ServeConfig.from_env(environ, **overrides)


def default_model_name(target: Any) -> str:
    if target.kind == "function":
        return target.function
    if target.model_dir is not None:
        return Path(target.model_dir).resolve().name
    if target.snapshot_dir is not None:
        return Path(target.snapshot_dir).resolve().name
    return EMBEDDED_MODEL_NAME


def bind_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class SnapfnServer(BaseApplication):
    """A gunicorn application: settings from `gunicorn.conf.py` + `ServeConfig`; one runtime
    and one Flask app per worker, built after fork."""

    def __init__(self, target: Any, config: ServeConfig) -> None:
        self.target = target
        self.config = config
        self.runtime = None
        super().__init__(prog="snapfn serve")

    def load_config(self) -> None:
        settings = runpy.run_path(str(CONF_FILE))
        for name, value in settings.items():
            if name in self.cfg.settings:
                self.cfg.set(name, value)
        c = self.config
        self.cfg.set("bind", [bind_address(c.host, c.port)])
        self.cfg.set("workers", c.workers)
        self.cfg.set("threads", c.threads)
        self.cfg.set("timeout", c.worker_timeout_s)
        self.cfg.set("graceful_timeout", c.graceful_timeout_s)

    def load(self):
        assert self.runtime is not None, "post_fork builds the runtime before the app is loaded"
        return create_app(self.runtime, self.config)

    def start_runtime(self, worker: Any) -> None:
        from snapfn.handler.function.runtime import WorkerRuntime

        logger = logging.getLogger("snapfn")
        logger.handlers = list(worker.log.error_log.handlers)
        logger.setLevel(logging.INFO)
        pid = os.getpid()
        self.runtime = WorkerRuntime(
            self.target, log=lambda line: logger.info("[%d] %s", pid, line)
        )
        self.runtime.start(background=True)

    def close_runtime(self) -> None:
        if self.runtime is not None:
            self.runtime.close()

    def announce(self, server: Any) -> None:
        for listener in server.LISTENERS:
            host, port = listener.sock.getsockname()[:2]
            url = f"http://{bind_address(host, port)}"
            c = self.config
            print(
                f"snapfn serve: listening on {url} ({c.workers} worker(s) x {c.threads} "
                f"threads, model {c.model_name!r})",
                flush=True,
            )
