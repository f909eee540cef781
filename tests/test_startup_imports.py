"""A start-up's imports with the cyclic collector paused, then frozen (snapshot/imports.py)."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import pytest

from snapfn.snapshot.errors import BadRequest
from snapfn.snapshot.imports import collector_paused, import_for_startup

# in a fresh interpreter: unittest.mock is imported by nothing else there, and its import makes
# objects enough for the collector to run a few dozen times
PROBE = """
import gc, json, sys
from snapfn.snapshot.imports import import_for_startup
seen = []
gc.callbacks.append(lambda phase, info: phase == "start" and seen.append(phase))
assert "unittest.mock" not in sys.modules
seconds = import_for_startup(["unittest.mock", "json:dumps"])
print(json.dumps({
    "imported": "unittest.mock" in sys.modules,
    "collections_inside": len(seen),
    "frozen": gc.get_freeze_count(),
    "enabled": gc.isenabled(),
    "seconds": seconds,
}))
"""


def probe(mode: str | None) -> dict:
    import json
    import os

    env = {k: v for k, v in os.environ.items() if k != "SNAPFN_STARTUP_GC"}
    if mode is not None:
        env["SNAPFN_STARTUP_GC"] = mode
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_the_collector_is_off_inside_and_as_it_was_after():
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():  # nested: still off, and not turned on by the inner one
            pass
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # off before: off after
    finally:
        gc.enable()


def test_startup_imports_run_with_the_collector_paused_then_freeze_what_exists():
    got = probe(None)
    assert got["imported"] and got["enabled"]
    assert got["collections_inside"] == 1  # the one before the imports, none during them
    assert got["frozen"] > 1000  # the interpreter's and the imports' objects, out of its walks


def test_startup_gc_on_imports_with_the_collector_running_and_freezes_nothing():
    got = probe("on")
    assert got["imported"] and got["enabled"] and got["frozen"] == 0
    assert got["collections_inside"] > 0


FREEZES = """
import gc, json, weakref
from snapfn.snapshot.imports import import_for_startup

class Node:
    pass

def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle only the collector frees
    return weakref.ref(a)

before = cycle()  # garbage before the first call: collected, not frozen
import_for_startup(["json"])
first = gc.get_freeze_count()
kept = Node()
kept.other = kept  # alive at the second call, garbage after it
watch = weakref.ref(kept)
import_for_startup(["json.tool"])
del kept
gc.collect()
print(json.dumps({
    "before_freed": before() is None,
    "first": first,
    "second_froze_nothing": gc.get_freeze_count() == first,
    "later_garbage_freed": watch() is None,
}))
"""


def test_only_the_first_call_freezes_and_never_freezes_garbage():
    import json

    out = subprocess.run(
        [sys.executable, "-c", FREEZES], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["before_freed"] and got["first"] > 0
    assert got["second_froze_nothing"] and got["later_garbage_freed"]


def test_an_unknown_startup_gc_is_refused():
    with pytest.raises(BadRequest, match="SNAPFN_STARTUP_GC must be one of paused, on"):
        import_for_startup(["json"], {"SNAPFN_STARTUP_GC": "off"})


RUNTIME_ENV = """
import json, os, sys, tempfile
from pathlib import Path
from snapfn.handler.llm.init_config import InitConfig
from snapfn.handler.llm.recipes.function import LLMFunction

cache = Path(tempfile.mkdtemp()) / "cache"
fn = LLMFunction(InitConfig(cache_dir=cache), None)
assert "torch" not in sys.modules, "torch imported before the runtime_env stage"
seen = {}

class Spy:  # the compile caches' variables as torch's import finds them
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "torch":
            seen.setdefault("triton_cache", os.environ.get("TRITON_CACHE_DIR"))
        return None

sys.meta_path.insert(0, Spy)
figures = {}
fn.stage_runtime_env(figures)
print(json.dumps({**figures, **seen, "cache": str(cache)}))
"""


def test_the_runtime_env_stage_imports_torch_itself_after_setting_the_compile_caches():
    import json

    out = subprocess.run(
        [sys.executable, "-c", RUNTIME_ENV], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["torch_preloaded"] is False and got["import_torch_s"] > 0
    assert got["triton_cache"] == str(Path(got["cache"]) / "compile" / "triton")
    assert got["imports_s"] >= 0
