"""A user function's refused snapshot (handler/function/user_function.py, runtime.py): the fallback
runs the function the user named — never the spec, device or cache folder its manifest records —
and answers what its cold init answers."""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path

import pytest

from snapfn.handler.api import Context
from snapfn.handler.function.user_function import UserFunction, restore_image_caches
from snapfn.snapshot.errors import BadSnapshot
from snapfn.snapshot.runtime import init_and_snapshot, restore

from test_runtime_refusals import UNREADABLE, _run_bounded

FUNCTION = """
from snapfn.handler.api import init

state = {}


@init
def build():
    state["table"] = [i * i for i in range(10)]


def handler(event, context):
    return {"answer": sum(state["table"]) + event.get("x", 0), "by": __name__}
"""
EVENT = {"x": 3}


class Fn:
    def __init__(self, tmp: Path) -> None:
        tag = uuid.uuid4().hex[:8]
        self.folder = tmp / "code"
        self.folder.mkdir()
        self.named, self.other = f"trusted_{tag}", f"other_{tag}"
        (self.folder / f"{self.named}.py").write_text(FUNCTION)
        (self.folder / f"{self.other}.py").write_text(FUNCTION.replace("i * i", "i"))
        self.spec, self.other_spec = f"{self.named}:handler", f"{self.other}:handler"
        self.cache = tmp / "cache"
        self.snapshot = tmp / "snap"

    def make(self) -> UserFunction:
        return UserFunction(self.spec, self.folder, "cpu", self.cache)


def answer(fn: UserFunction) -> dict:
    return fn.loaded.handler(dict(EVENT), Context.new("f", 10.0))


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("user_fn")
    fn = Fn(tmp)
    triton = fn.cache / "compile" / "triton"  # a compile cache for the image's caches to hold
    triton.mkdir(parents=True)
    (triton / "kernel.bin").write_bytes(b"compiled" * 100)
    cold = fn.make()
    init_and_snapshot(cold, fn.snapshot, log=None)
    reference = answer(cold)
    assert reference == {"answer": 285 + 3, "by": fn.named}
    return fn, reference


def clone(snapshot: Path, dest: Path) -> Path:
    for path in sorted(snapshot.rglob("*")):
        target = dest / path.relative_to(snapshot)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif path.name == "manifest.json":
            target.write_bytes(path.read_bytes())
        else:
            os.link(path, target)
    return dest


def answered_by_the_named_function(fn: Fn, reference: dict, snap: Path) -> dict:
    restored, startup = restore(
        fn.make, snap, fallback=lambda recorded: fn.make(), rewrite_on_fallback=False, log=None
    )
    assert startup.tier == "cold (fallback)", "served from a mutated snapshot"
    refusal = startup.fallbacks[0]
    assert refusal["reason"] and "\n" not in refusal["reason"]
    assert restored.spec == fn.spec and answer(restored) == reference
    assert fn.other not in sys.modules  # the function the manifest named never ran
    return refusal


FUNCTION_UNREADABLE = sorted(name for name in UNREADABLE if "llm" not in name)


@pytest.mark.parametrize("case", FUNCTION_UNREADABLE)
def test_an_unreadable_function_manifest_is_answered_by_the_named_function(made, tmp_path, case):
    fn, reference = made
    snap = clone(fn.snapshot, tmp_path / "snap")
    UNREADABLE[case](snap, (fn.snapshot / "manifest.json").read_bytes())
    _run_bounded(lambda: answered_by_the_named_function(fn, reference, snap))


def _edit(snap: Path, edit) -> None:
    doc = json.loads((snap / "manifest.json").read_text())
    edit(doc)
    (snap / "manifest.json").write_text(json.dumps(doc))


SECTION_EDITS = {
    "spec of another function": lambda m, fn: m["user_function"].update(spec=fn.other_spec),
    "spec a number": lambda m, fn: m["user_function"].update(spec=5),
    "spec null": lambda m, fn: m["user_function"].update(spec=None),
    "spec empty": lambda m, fn: m["user_function"].update(spec=""),
    "section a list": lambda m, fn: m.update(user_function=[fn.other_spec]),
    "section null": lambda m, fn: m.update(user_function=None),
    "section dropped": lambda m, fn: m.pop("user_function"),
    "function llm": lambda m, fn: m.update(function="llm"),
}


@pytest.mark.parametrize("case", sorted(SECTION_EDITS))
def test_an_edited_function_section_is_refused_and_the_named_function_answers(made, tmp_path, case):
    fn, reference = made
    snap = clone(fn.snapshot, tmp_path / "snap")
    _edit(snap, lambda m: SECTION_EDITS[case](m, fn))
    refusal = answered_by_the_named_function(fn, reference, snap)
    assert refusal["step"] == "validate"


def test_a_served_function_falls_back_to_the_spec_the_target_names(made, tmp_path):
    from snapfn.handler.function.runtime import WorkerRuntime
    from snapfn.handler.function.target import ServeTarget
    from snapfn.handler.llm.init_config import InitConfig
    from snapfn.snapshot.stages import Readiness

    fn, reference = made
    snap = clone(fn.snapshot, tmp_path / "snap")
    _edit(snap, lambda m: m["user_function"].update(spec=fn.other_spec, device="cuda:7"))
    target = ServeTarget(
        kind="function",
        function=fn.spec,
        function_dir=fn.folder,
        snapshot_dir=snap,
        init_config=InitConfig(cache_dir=tmp_path / "cache"),
    )
    runtime = WorkerRuntime(target)
    runtime.start(background=False)
    try:
        assert runtime.readiness.state is Readiness.UP, runtime.readiness.reason
        assert runtime.startup.tier == "cold (fallback)" and runtime.fatal is None
        assert "holds function" in runtime.startup.fallbacks[0]["reason"]
        result = runtime.invoke(dict(EVENT))
        assert {k: result[k] for k in reference} == reference
        assert os.environ["SNAPFN_DEVICE"] == "cpu"  # not the device the manifest names
    finally:
        runtime.close()
    assert fn.other not in sys.modules


@pytest.mark.parametrize("device", ["cuda:7", "gpu", "cpu:0", "cuda:x", 5, None, "cuda:1234"])
def test_a_recorded_device_this_machine_lacks_gives_way_to_the_targets(device):
    from snapfn.handler.function.user_function import recorded_device

    assert recorded_device({"device": device}, "cpu") == "cpu"
    assert recorded_device({"device": "cpu"}, "cuda") == "cpu"


def test_image_caches_go_only_into_this_functions_cache_folder(made, tmp_path):
    fn, _ = made
    manifest = json.loads((fn.snapshot / "manifest.json").read_text())
    elsewhere = tmp_path / "elsewhere" / "functions" / "x"
    manifest["user_function"]["cache_dir"] = str(elsewhere)
    mine = tmp_path / "mine"
    reason = restore_image_caches(fn.snapshot, manifest, mine)
    assert isinstance(reason, str) and "not put back" in reason
    assert not elsewhere.exists() and not mine.exists()
    manifest["user_function"]["cache_dir"] = str(mine.absolute())
    assert restore_image_caches(fn.snapshot, manifest, mine) == 1
    assert (mine / "compile" / "triton" / "kernel.bin").read_bytes() == b"compiled" * 100


def test_image_caches_are_checked_before_they_are_copied(made, tmp_path):
    fn, _ = made
    snap = tmp_path / "snap"
    clone(fn.snapshot, snap)
    kernel = snap / "caches" / "triton" / "kernel.bin"
    kernel.unlink()
    kernel.write_bytes(b"COMPILED" * 100)  # same size, other bytes
    manifest = json.loads((snap / "manifest.json").read_text())
    mine = tmp_path / "mine"
    manifest["user_function"]["cache_dir"] = str(mine.absolute())
    with pytest.raises(BadSnapshot, match="sha256 mismatch"):
        restore_image_caches(snap, manifest, mine)
    (snap / "caches" / "triton" / "stray.bin").write_bytes(b"x")
    with pytest.raises(BadSnapshot, match="not listed"):
        restore_image_caches(snap, manifest, mine)
    assert not (mine / "compile" / "triton" / "kernel.bin").exists()
