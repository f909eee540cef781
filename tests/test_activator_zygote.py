"""The activator's instances fork from a zygote that imported the serve stack and the function's
module once (CUDA untouched): each instance is the zygote's child and its own session, answers
as a fresh one does, and `/metrics` reports its time to the first answer by launch; with
SNAPFN_INSTANCE_ZYGOTE=off instances start as fresh interpreters. Stopping the activator stops
the zygote and every fork."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import requests

from activator_client import Activator

pytestmark = pytest.mark.slow
FUNCTION = """
import os
import sys
import time

IMPORTED_AT = time.time()  # once per zygote, not per instance


def handler(event, context):
    return {"imported_at": IMPORTED_AT, "pid": os.getpid(), "torch": "torch" in sys.modules}
"""
FIRST_ANSWER = "snapfn_activator_first_answer_seconds_count"


def start(folder: Path, **env: str) -> Activator:
    (folder / "imports_fn.py").write_text("import torch  # the import a zygote saves\n" + FUNCTION)
    args = ["--function", "imports_fn:handler", "--function-dir", str(folder)]
    return Activator(args + ["--idle-timeout", "1", "--max-instances", "1"], folder, env=env)


def wait_for_zygote(activator: Activator, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while "instance zygote" not in activator.log_tail():
        assert time.monotonic() < deadline, activator.log_tail()
        time.sleep(0.05)
    assert "ready in" in activator.log_tail(), activator.log_tail()


def ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_instances_are_forks_of_the_zygote_and_report_their_first_answer(tmp_path):
    activator = start(tmp_path)
    try:
        wait_for_zygote(activator)
        answers, zygotes = [], set()
        for _ in range(2):  # a cold start, an idle-out, another cold start
            activator.wait_for_instances(0)
            r = requests.post(f"{activator.url}/invoke", json={}, timeout=120)
            assert r.status_code == 200, (r.text, activator.log_tail())
            (instance,) = activator.instances()
            assert instance["launch"] == "zygote"
            assert os.getpgid(instance["pid"]) == instance["pid"]  # its own session
            zygotes.add(ppid(instance["pid"]))
            answers.append(r.json())
        (zygote,) = zygotes  # both forked by one zygote, which is not the activator
        assert zygote != activator.proc.pid and ppid(zygote) == activator.proc.pid
        # the function's module was imported once, in the zygote, before either instance
        assert answers[0]["imported_at"] == answers[1]["imported_at"]
        assert all(a["torch"] for a in answers) and answers[0]["pid"] != answers[1]["pid"]
        samples = activator.metrics()
        assert samples[(FIRST_ANSWER, (("launch", "zygote"),))] == 2
    finally:
        activator.stop()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{zygote}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{zygote}").exists()  # the zygote went with the activator


def test_without_the_zygote_instances_start_as_fresh_interpreters(tmp_path):
    activator = start(tmp_path, SNAPFN_INSTANCE_ZYGOTE="off")
    try:
        r = requests.post(f"{activator.url}/invoke", json={}, timeout=120)
        assert r.status_code == 200, (r.text, activator.log_tail())
        (instance,) = activator.instances()
        assert instance["launch"] == "exec" and ppid(instance["pid"]) == activator.proc.pid
        samples = activator.metrics()
        assert samples[(FIRST_ANSWER, (("launch", "exec"),))] == 1
    finally:
        activator.stop()
