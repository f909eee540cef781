"""User functions through a process snapshot (tier 1, CPU): hooks around the checkpoint, each
restored copy unique, errors in Lambda's shape, and a cold init when the image is refused.
Skips with criu's reason where criu cannot run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from snapfn.handler.api import FunctionError
from snapfn.handler.function.runtime import WorkerRuntime
from snapfn.handler.function.target import ServeTarget
from snapfn.snapshot.stages import Readiness

REPO = Path(__file__).resolve().parent.parent
HELLO = "examples.hello:handler"


pytestmark = pytest.mark.usefixtures("criu_config")


def init(spec: str, dest: Path, folder: Path) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "snapfn.handler.cli", "init", "--function", spec]
    argv += ["--function-dir", str(folder), "--snapshot", str(dest)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def hello_snapshot(tmp_path_factory):
    dest = tmp_path_factory.mktemp("fn") / "hello"
    done = init(HELLO, dest, REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "snapshot (process)" in done.stdout
    return dest


def start(snapshot: Path, spec: str = HELLO, folder: Path = REPO) -> WorkerRuntime:
    target = ServeTarget(kind="function", function=spec, function_dir=folder, snapshot_dir=snapshot)
    runtime = WorkerRuntime(target)
    runtime.start(background=False)
    assert runtime.readiness.state is Readiness.UP, runtime.readiness.reason
    return runtime


def test_restored_copies_run_after_restore_hooks_and_differ(hello_snapshot):
    first, second = start(hello_snapshot), start(hello_snapshot)
    try:
        assert first.startup.tier == second.startup.tier == "process"
        a, b = first.invoke({"name": "Ada"}), second.invoke({"name": "Bob"})
        assert a["message"] == "Hello, Ada!" and b["message"] == "Hello, Bob!"
        assert a["restores"] == b["restores"] == 1  # the after-restore hook ran once in each
        assert a["instance"] != b["instance"]  # …and gave each copy its own identity
        hooks = first.startup.stage("worker.after_restore").figures["hooks"]
        assert short(hooks) == ["Greeter.new_identity", "count_restore"]  # registration order
    finally:
        first.close()
        second.close()


def test_hooks_run_in_lambda_order_around_the_checkpoint(tmp_path):
    done = init("example_function:handler", tmp_path / "snap", REPO / "tests")
    assert done.returncode == 0, done.stderr[-2000:]
    import json

    manifest = json.loads((tmp_path / "snap" / "manifest.json").read_text())
    assert short(manifest["process"]["hooks"]) == ["close_last", "Recorder.note", "close_first"]
    runtime = start(tmp_path / "snap", "example_function:handler", REPO / "tests")
    try:
        hooks = runtime.startup.stage("worker.after_restore").figures["hooks"]
        assert short(hooks) == ["reopen_first", "Recorder.note", "Recorder.note"]
        assert runtime.invoke({"key": "two"})["value"] == 2  # state built at init survived
        with pytest.raises(FunctionError) as info:
            runtime.invoke({"fail": "on purpose"})
        assert info.value.error["errorType"] == "ValueError"
        assert "asked to fail: on purpose" in info.value.error["errorMessage"]
    finally:
        runtime.close()


def short(names: list[str]) -> list[str]:
    return [name.partition(":")[2] for name in names]


def test_a_refused_image_falls_back_to_a_cold_init(hello_snapshot, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(hello_snapshot, broken)
    pages = next((broken / "process").glob("pages-*.img"))
    pages.write_bytes(pages.read_bytes()[:-4096])  # truncated: its size no longer matches
    runtime = start(broken)
    try:
        assert runtime.startup.tier == "cold (fallback)"
        steps = [(f["from"], f["to"], f["step"]) for f in runtime.startup.fallbacks]
        # the damaged image fails the whole snapshot's size check: tier 0 is refused too
        assert steps == [("process", "portable", "validate"), ("portable", "cold", "validate")]
        assert runtime.invoke({"name": "Cy"})["restores"] == 0  # a cold init, no restore
    finally:
        runtime.close()


def test_a_snapshot_of_another_function_is_not_served(hello_snapshot):
    runtime = start(hello_snapshot, "example_function:handler", REPO / "tests")
    try:
        assert runtime.startup.tier == "cold (fallback)"
        assert "holds function 'examples.hello:handler'" in runtime.startup.fallbacks[0]["reason"]
    finally:
        runtime.close()


@pytest.mark.parametrize(
    ("edit", "chain"),
    [
        (  # another torch: tier 1 needs the exact key, tier 0 only drops the caches
            {"torch": "0.0.1"},
            [
                ("process", "portable", "gate"),
                ("portable", "portable, caches dropped", "validate"),
            ],
        ),
        (  # another layout (two ranks): tier 0 refuses too
            {"world_size": 2},
            [("process", "portable", "gate"), ("portable", "cold", "validate")],
        ),
    ],
    ids=["cache-field", "layout-field"],
)
def test_the_compat_key_decides_the_chain_field_by_field(hello_snapshot, tmp_path, edit, chain):
    import json
    import shutil

    edited = shutil.copytree(hello_snapshot, tmp_path / "edited")
    manifest = json.loads((edited / "manifest.json").read_text())
    manifest["compat"].update(edit)
    (edited / "manifest.json").write_text(json.dumps(manifest))
    runtime = start(edited)
    try:
        steps = [(f["from"], f["to"], f["step"]) for f in runtime.startup.fallbacks]
        assert steps == chain, runtime.startup.fallbacks
        field = next(iter(edit))
        assert all(field in f["reason"] for f in runtime.startup.fallbacks)
        want = "portable" if chain[-1][1].startswith("portable") else "cold (fallback)"
        assert runtime.startup.tier == want
        if want == "portable":
            assert "dropped" in runtime.startup.stage("restore_caches").figures
        assert runtime.invoke({"name": "Cy"})["restores"] == 0  # no process image served
    finally:
        runtime.close()
