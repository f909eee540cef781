"""gunicorn settings and hooks for `snapfn serve` (read by `serve.SnapfnServer`).

The CLI (`ServeConfig`) overrides `bind`, `workers`, `threads`, `timeout` and
`graceful_timeout`; everything else is set here. Settings this gunicorn does not know are
skipped, so the file works across gunicorn versions. `worker_class` names gunicorn's class;
`snapfn serve` runs its subclass from `workers.py`, which answers gunicorn's own refusals in JSON.

Hooks, each run with `server` = the arbiter (`arbiter.SnapfnArbiter`) or `worker`, whose
`.app` is the `SnapfnServer`:
- `post_fork`: in the new worker, build its `WorkerRuntime` and start it on a background thread,
  so the worker answers `/health` (503 "starting") at once and serves once the init or restore
  is done. NOTE: CUDA is first touched here, after fork, never in the master.
- `post_worker_init`: in the worker, its app loaded: watch the runtime's start, then mark the
  worker up (the arbiter then replaces it if it exits) or, the start failed, exit with the
  boot-error code (the server stops); a runtime that stops after it was up stops the worker
  (gunicorn starts another).
- `worker_exit`: close the runtime (stop the engine loop, release the model).
- `child_exit`: in the master, mark the worker's live metrics dead (multiprocess mode).
- `when_ready`: print the listening URL (the real port when `--port 0`).
"""

worker_class = "gthread"  # a thread per request; streaming holds its thread until it ends
workers = 1
threads = 32
timeout = 120  # heartbeat of the worker's main loop (request threads do not block it)
graceful_timeout = 30
keepalive = 5
max_requests = 0  # never recycle a worker: a new one would initialise (or restore) again
backlog = 2048
preload_app = False  # each worker builds its app after post_fork built its runtime
accesslog = None
errorlog = "-"
loglevel = "info"
control_socket_disable = True  # no management socket at a host-wide path


def post_fork(server, worker):
    server.app.start_runtime(worker)


def post_worker_init(worker):
    worker.app.watch_start(worker)


def worker_exit(server, worker):
    server.app.close_runtime()


def child_exit(server, worker):
    server.app.worker_gone(worker.pid)


def when_ready(server):
    server.app.announce(server)
