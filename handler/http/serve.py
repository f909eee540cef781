"""`snapfn serve`: the HTTP front door under gunicorn (gthread workers).

    snapfn serve [--model DIR] [--snapshot DIR] | --function module:fn
                 [--host 127.0.0.1] [--port 8000] [--workers 1] [--threads 32] [--api-key KEY]
                 [--idle-timeout SECONDS [--max-instances N] [--target-concurrency N]]

Each gunicorn worker builds its own `WorkerRuntime` after fork (`gunicorn.conf.py`'s
`post_fork`) and starts it in the background; the Flask app (`http.create_app`) answers at once
and holds requests until the runtime is up. Settings: `ServeConfig` defaults, then
`SNAPFN_<FIELD>` environment variables (`SNAPFN_API_KEY` keeps the key out of `ps`), then flags.
gunicorn's own settings: `gunicorn.conf.py`, then those `ServeConfig` sets (bind, workers,
threads, timeouts, `--access-log`), then `GUNICORN_CMD_ARGS` (gunicorn's command-line syntax),
then the snapfn flags given on the command line (as gunicorn ranks its command line above
`GUNICORN_CMD_ARGS`). `--preload` cannot work (workers build their runtimes after fork): refused.
The worker class chosen runs as its subclass in `workers.py` (sync, gthread), so that the
requests gunicorn itself refuses (a malformed or over-long request line, too many or too large
header fields …) are answered in JSON, as every error of the app is.
The master prints `snapfn serve: listening on http://HOST:PORT` once it is bound.

A worker whose start fails (`runtime.fatal` set: no trustworthy source left to start from;
or any other failure, which a worker never retries either) answers `/health` with 503 and the
reason for `failed_start_exit_s`, logs the reason in one line, then exits with gunicorn's
boot-error code: the arbiter stops every worker and `snapfn serve` exits with that code (3), for
an orchestrator to restart it, rather than serving 503 for good. A worker that was up (booted,
its runtime up) and then exits, whatever its code, is replaced by another, as gunicorn replaces
any dead worker: the arbiter is `arbiter.SnapfnArbiter`, which tells the two apart. A worker
whose runtime stopped after it was up (`runtime.stopped`: its restored worker process or a rank
died, or a function's handler overran its time limit) logs why in one line, answers 503
"stopped" for `STOPPED_EXIT_S` (the request in flight gets its answer), then stops as on
SIGTERM (requests in flight finish, up to gunicorn's `graceful_timeout`): gunicorn starts
another worker, which starts (or restores) again.
A request's headers and body must arrive within `receive_timeout_s` (`receive_deadline.py`).

Metrics: the master makes a folder for prometheus_client's multiprocess mode (or takes
`PROMETHEUS_MULTIPROC_DIR`), before anything imports prometheus_client, so that `/metrics`
sums every worker's (`metrics.py`); a worker that exits is marked dead (`child_exit`), and a
folder the master made is removed when it exits.

With `--idle-timeout`, `run` hands over to the scale-to-zero activator (`activator/app.py`) before
anything imports torch: it owns the port and starts instances of this same command (without
`--idle-timeout`) on demand. An instance started by it exits with it (`parent_watch.py`).
"""

from __future__ import annotations

import argparse
import logging
import os
import runpy
import shlex
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Mapping
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
from snapfn.handler.http.arbiter import SnapfnArbiter
from snapfn.handler.http.serve_config import FUNCTION_ERRORS, ServeConfig
from snapfn.handler.http.workers import json_error_worker
from snapfn.snapshot.errors import BadRequest

CONF_FILE = Path(__file__).with_name("gunicorn.conf.py")
EMBEDDED_MODEL_NAME = "snapfn-embedded"
MULTIPROC_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"
WORKER_BOOT_ERROR = 3  # gunicorn's: the arbiter halts on it from a worker never up
STOPPED_EXIT_S = 1.0  # a worker whose runtime stopped answers 503 "stopped" this long, then exits
# ServeConfig field → the gunicorn setting it sets (`SnapfnServer.load_config`)
FLAG_SETTINGS = {
    "host": "bind",
    "port": "bind",
    "workers": "workers",
    "threads": "threads",
    "access_log": "accesslog",
}


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
    net.add_argument(
        "--receive-timeout-s",
        type=float,
        help="a request's headers and body must arrive within this, else a 408 (default "
        f"{d.receive_timeout_s})",
    )
    net.add_argument(
        "--failed-start-exit-s",
        type=float,
        help="how long a worker whose start failed answers /health (503, the reason) before "
        f"the server exits non-zero (default {d.failed_start_exit_s})",
    )
    net.add_argument(
        "--function-errors",
        choices=FUNCTION_ERRORS,
        help="a function's error on /invoke: http = a 500, lambda = a 200 with "
        f"X-Amz-Function-Error, as Lambda's Invoke API (default {d.function_errors})",
    )
    net.add_argument(
        "--access-log",
        metavar="FILE|-",
        help="write gunicorn's access log to FILE ('-': stdout; default off; also "
        "GUNICORN_CMD_ARGS='--access-logfile FILE')",
    )
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

    from snapfn.snapshot.zygote.fork_safety import fork_safety_problem, preload_modules

    if target.kind == "llm":
        from snapfn.handler.llm.recipes.function import ZYGOTE_PRELOAD

        modules, what = ZYGOTE_PRELOAD, "the LLM's modules"
    else:
        modules = _function_preload(target, environ)
        what = f"importing {', '.join(modules)}"
        if not modules:
            return
    preload_modules(modules)
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
    # NOTE: before anything imports prometheus_client (the target's modules may): it picks
    # its multiprocess mode from the environment once, at import
    metrics_dir, made = multiprocess_metrics_dir(os.environ)
    master_pid = os.getpid()
    try:
        target = serve_target(args)
        if config.model_name is None:
            config = replace(config, model_name=default_model_name(target))
        preload_for_fork(target)
        given = frozenset(FLAG_SETTINGS[n] for n in FLAG_SETTINGS if getattr(args, n) is not None)
        return _serve(SnapfnServer(target, config, metrics_dir, os.environ, given))
    finally:
        # NOTE: a worker leaving through sys.exit() passes here too: the folder is the master's
        if made and os.getpid() == master_pid:
            shutil.rmtree(metrics_dir, ignore_errors=True)


def _serve(server: SnapfnServer) -> int:
    master_pid = os.getpid()
    try:
        server.run()
    except SystemExit as exc:  # the arbiter leaves through sys.exit(), 0 on a clean stop
        if os.getpid() != master_pid:
            raise  # NOTE: a forked worker leaving: it must exit, never return into our caller
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


def multiprocess_metrics_dir(environ: Any) -> tuple[str | None, bool]:
    """(the folder every worker's metrics meet in, whether it was made here), put in
    `environ` for prometheus_client; (None, False) where prometheus_client was imported
    already in single-process mode (metrics are then each worker's own)."""
    given = environ.get(MULTIPROC_VARIABLE)
    values = sys.modules.get("prometheus_client.values")
    if values is not None and given is None:
        logging.getLogger("snapfn").warning(
            "prometheus_client was imported before snapfn serve could switch on its "
            "multiprocess mode: /metrics shows the answering worker's metrics only"
        )
        return None, False
    if given:
        Path(given).mkdir(parents=True, exist_ok=True)
        for stale in Path(given).glob("*.db"):  # a previous server's, as prometheus advises
            stale.unlink()
        return given, False
    made = tempfile.mkdtemp(prefix="snapfn-metrics-")
    environ[MULTIPROC_VARIABLE] = made
    return made, True


def serve_config(args: argparse.Namespace, environ) -> ServeConfig:
    overrides = {
        name: getattr(args, name)
        for name in ("host", "port", "workers", "threads", "api_key", "model_name")
        + ("max_body_bytes", "startup_queue_size", "startup_wait_s", "receive_timeout_s")
        + ("max_instances", "target_concurrency", "keeper")
        + ("function_errors", "access_log", "failed_start_exit_s")
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
    """A gunicorn application: settings from `gunicorn.conf.py`, `ServeConfig`,
    `GUNICORN_CMD_ARGS` and the flags given (`given`: the gunicorn settings they set); one
    runtime and one Flask app per worker, built after fork."""

    def __init__(
        self,
        target: Any,
        config: ServeConfig,
        metrics_dir: str | None = None,
        environ: Mapping[str, str] | None = None,
        given: frozenset[str] = frozenset(),
    ) -> None:
        self.target = target
        self.config = config
        self.metrics_dir = metrics_dir
        self.environ = {} if environ is None else environ
        self.given = given
        self.runtime = None
        self._closing = threading.Event()  # set in a worker as it stops (`close_runtime`)
        super().__init__(prog="snapfn serve")

    def run(self) -> None:
        """gunicorn's `BaseApplication.run`, under `SnapfnArbiter`."""
        try:
            SnapfnArbiter(self).run()
        except RuntimeError as exc:
            print(f"\nError: {exc}\n", file=sys.stderr, flush=True)
            sys.exit(1)

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
        if c.access_log is not None:
            self.cfg.set("accesslog", c.access_log)
        for name, value in self._env_settings().items():
            if name not in self.given:
                self.cfg.set(name, value)
        # NOTE: last: the worker class (and threads, which turn sync into gthread) is settled
        self.cfg.set("worker_class", json_error_worker(self.cfg))

    def _env_settings(self) -> dict[str, Any]:
        """The gunicorn settings `GUNICORN_CMD_ARGS` gives, parsed by gunicorn's own parser."""
        raw = self.environ.get("GUNICORN_CMD_ARGS", "")
        if not raw.strip():
            return {}
        try:
            parsed = self.cfg.parser().parse_args(shlex.split(raw))
        except (SystemExit, ValueError) as exc:
            raise BadRequest(f"GUNICORN_CMD_ARGS={raw!r} is not valid ({exc})") from None
        settings = {k.lower(): v for k, v in vars(parsed).items() if v is not None and k != "args"}
        if settings.get("preload_app"):
            raise BadRequest(
                "GUNICORN_CMD_ARGS: --preload cannot work with snapfn serve (each worker "
                "builds its runtime after fork); drop it"
            )
        return settings

    def load(self):
        # NOTE: imported in the worker: the app's modules import prometheus_client, which
        # must see the multiprocess folder the master set first (`run`)
        from snapfn.handler.http.app import create_app

        assert self.runtime is not None, "post_fork builds the runtime before the app is loaded"
        app = create_app(self.runtime, self.config, self.metrics_dir)
        if self.metrics_dir is not None:  # every worker's values reach the files, scraped or not
            copier = app.extensions["snapfn"].metrics.runtime
            threading.Thread(
                target=copier.refresh_until,
                args=(self._closing,),
                name="snapfn-metrics",
                daemon=True,
            ).start()
        return app

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

    def watch_start(self, worker: Any) -> None:
        """In a worker gunicorn has booted (its app loaded): wait for the runtime's start on
        a thread, which marks the worker up (`arbiter.UpMark`) and, should the runtime stop
        later, stops the worker (`_exit_runtime_stopped`), or exits (`_exit_start_failed`)."""
        watch = threading.Thread(
            target=self._settle_start,
            args=(worker, logging.getLogger("snapfn")),
            name="snapfn-start-watch",
            daemon=True,
        )
        watch.start()

    def _settle_start(self, worker: Any, logger: logging.Logger) -> None:
        from snapfn.snapshot.stages import Readiness

        if self.runtime.wait_ready() is Readiness.UP:
            mark = getattr(worker, "up_mark", None)  # None: a worker class without one
            if mark is not None:
                mark.set()
            self.runtime.wait_stopped()
            if not self._closing.is_set():  # closed as the worker stops: nothing to do
                self._exit_runtime_stopped(logger)
        elif not self._closing.is_set():  # closed as the worker stops: not a failed start
            self._exit_start_failed(logger)

    def _exit_runtime_stopped(self, logger: logging.Logger) -> None:
        """In a worker whose runtime stopped after it was up: answer 503 "stopped" a while,
        then stop as on SIGTERM, for gunicorn to start another worker (see the module doc)."""
        logger.error(
            "[%d] the runtime stopped (%s); this worker exits in %g s and gunicorn starts "
            "another, which starts again",
            os.getpid(),
            self.runtime.readiness.reason,
            STOPPED_EXIT_S,
        )
        if self._closing.wait(STOPPED_EXIT_S):
            return  # stopping already
        os.kill(os.getpid(), signal.SIGTERM)  # gunicorn's graceful stop of this worker

    def _exit_start_failed(self, logger: logging.Logger) -> None:
        """In a worker whose start failed: answer /health with the reason a while, then exit
        with gunicorn's boot-error code, which stops the server (see the module doc)."""
        delay = self.config.failed_start_exit_s
        fatal = getattr(self.runtime, "fatal", None)  # nothing trustworthy to start from
        logger.error(
            "[%d] start failed%s: %s; exiting in %g s (code %d) so that the server stops and "
            "an orchestrator restarts it",
            os.getpid(),
            " (no trustworthy source)" if fatal is not None else "",
            self.runtime.readiness.reason,
            delay,
            WORKER_BOOT_ERROR,
        )
        if self._closing.wait(delay):
            return  # stopped meanwhile (SIGTERM): leave as gunicorn does
        for handler in logger.handlers:
            handler.flush()
        # NOTE: from a side thread, sys.exit would end only this thread; the runtime holds
        # nothing a failed start did not already release
        os._exit(WORKER_BOOT_ERROR)

    def close_runtime(self) -> None:
        self._closing.set()
        if self.runtime is not None:
            self.runtime.close()

    def worker_gone(self, pid: int) -> None:
        """In the master: a worker exited; its live gauges leave `/metrics`."""
        if self.metrics_dir is not None:
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(pid, self.metrics_dir)

    def announce(self, server: Any) -> None:
        for listener in server.LISTENERS:
            host, port = listener.sock.getsockname()[:2]
            url = f"http://{bind_address(host, port)}"
            print(
                f"snapfn serve: listening on {url} ({self.cfg.workers} worker(s) x "
                f"{self.cfg.threads} threads, model {self.config.model_name!r})",
                flush=True,
            )
