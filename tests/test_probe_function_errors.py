"""A handler that raises a BaseException that is not an Exception (KeyboardInterrupt,
GeneratorExit, its own BaseException subclass): the caller gets a structured FunctionError and
the worker serves the next request. Left to propagate, such an exception ended the gunicorn
worker's main loop from its request thread and took the whole `snapfn serve` down with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid

import pytest
import requests

from snapfn.handler.api import FunctionError
from snapfn.handler.function.runtime import WorkerRuntime
from snapfn.handler.function.target import ServeTarget

from activator_client import read_listen_url

RAISING = """
class Interrupted(BaseException):
    pass


RAISED = {"keyboard": KeyboardInterrupt, "generator": GeneratorExit, "own": Interrupted}


def handler(event, context):
    if "raise" in event:
        raise RAISED[event["raise"]]("from the handler")
    return {"ok": True}
"""


@pytest.fixture
def raising_fn(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    name = f"fn_{uuid.uuid4().hex[:10]}"
    (tmp_path / f"{name}.py").write_text(RAISING)
    yield f"{name}:handler"
    sys.modules.pop(name, None)


@pytest.mark.parametrize(
    "kind, error_type",
    [("keyboard", "KeyboardInterrupt"), ("generator", "GeneratorExit"), ("own", "Interrupted")],
)
def test_a_base_exception_from_the_handler_is_a_function_error(
    raising_fn, tmp_path, kind, error_type
):
    runtime = WorkerRuntime(
        ServeTarget(kind="function", function=raising_fn, function_dir=tmp_path)
    )
    runtime.start(background=False)
    try:
        with pytest.raises(FunctionError) as info:
            runtime.invoke({"raise": kind})
        assert info.value.error["errorType"] == error_type
        assert info.value.error["errorMessage"] == "from the handler"
        assert [raising_fn.split(":")[0] in line for line in info.value.error["stackTrace"]] == [
            True
        ]  # the handler's frame alone, as for an Exception
        assert runtime.invoke({}) == {"ok": True}
    finally:
        runtime.close()


@pytest.mark.slow
def test_serve_survives_a_handler_raising_keyboard_interrupt(raising_fn, tmp_path):
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "snapfn.handler.cli", "serve", "--port", "0"]
    command += ["--function", raising_fn, "--function-dir", str(tmp_path)]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=log.open("w"),
        text=True,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        url = read_listen_url(proc, "server", lambda: log.read_text()[-3000:], 60)
        for kind in ("keyboard", "generator"):
            r = requests.post(f"{url}/invoke", json={"raise": kind}, timeout=30)
            assert r.status_code == 500, log.read_text()[-3000:]
            assert r.json()["errorMessage"] == "from the handler"
        r = requests.post(f"{url}/invoke", json={}, timeout=30)
        assert (r.status_code, r.json()) == (200, {"ok": True})
        assert proc.poll() is None
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
