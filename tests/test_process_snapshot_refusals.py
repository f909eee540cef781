"""A process snapshot (tier 1) whose process section was edited: refused before criu, the prefetch
helper or the validation use a field of it (snapshot/process/snapshot.py), and answered by the
portable tier with a cold init's exact tokens. Skips with criu's reason where criu cannot run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from snapfn.handler.llm.embedded import embedded_model_dir
from snapfn.handler.llm.engine.request import SamplingParams
from snapfn.handler.llm.init_config import InitConfig
from snapfn.snapshot.errors import BadSnapshot
from snapfn.snapshot.portable.format import read_manifest

PROMPT = [5, 17, 42, 9]
GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)
MiB = 1 << 20

pytestmark = pytest.mark.usefixtures("criu_config")


def config(tmp: Path) -> InitConfig:
    return InitConfig(kv_cache_bytes_cpu=8 << 20, cache_dir=tmp / "cache")


@pytest.fixture(scope="module")
def tier1(tmp_path_factory):
    """(folder, process snapshot, the tokens of a cold init) of the embedded model."""
    import torch

    from snapfn.handler.llm.recipes.cli import _init_process
    from snapfn.handler.llm.recipes.function import LLMFunction
    from snapfn.snapshot.runtime import cold_init

    tmp = tmp_path_factory.mktemp("tier1")
    with pytest.MonkeyPatch.context() as mp:  # the worker computes on as many threads as we do
        mp.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
        startup = _init_process(config(tmp), embedded_model_dir(), tmp / "snap")
    assert startup.tier == "process", startup.fallbacks
    cold = LLMFunction(config(tmp), embedded_model_dir())
    cold_init(cold, log=None)
    tokens = tuple(cold.engine.generate([PROMPT], GREEDY)[0].token_ids)
    cold.release()
    return tmp, tmp / "snap", tokens


def clone(snapshot: Path, dest: Path, manifest: dict) -> Path:
    for path in sorted(snapshot.rglob("*")):
        target = dest / path.relative_to(snapshot)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif path.name != "manifest.json":
            os.link(path, target)
    (dest / "manifest.json").write_text(json.dumps(manifest))
    return dest


REGION = {"name": "w", "address": 1 << 40, "nbytes": 2 * MiB, "device": 0, "fill": "zero"}


def _regions(*changes: dict) -> list[dict]:
    return [{**REGION, **change} for change in changes]


def process_edits() -> dict:
    """Each case: a change of the process section (or of the keys that say it is there)."""
    cases: dict = {}
    for value in (
        "",
        "..",
        ".",
        "/abs",
        "a/b",
        "process/",
        "process\0",
        5,
        None,
        "other",
        ["process"],
    ):
        cases[f"images {value!r}"] = lambda p, value=value: p.update(images=value)
    cases["images dropped"] = lambda p: p.pop("images")
    for value in ([], {}, "pipes", None):
        cases[f"inherit {value!r}"] = lambda p, value=value: p.update(inherit=value)
    cases["inherit dropped"] = lambda p: p.pop("inherit")
    cases["inherit with an extra fd"] = lambda p: p["inherit"].update(extra="pipe:[1]")
    for pipe in ("ctl", "rep", "out"):
        cases[f"inherit without {pipe}"] = lambda p, pipe=pipe: p["inherit"].pop(pipe)
        for value in (
            "pipe:[x]",
            "file:/etc/passwd",
            "/dev/tty",
            5,
            "",
            "pipe:[1] --exec",
            "pipe:[1]\n",
            None,
            ["pipe:[1]"],
            "pipe:[123456789012345678901]",
            "PIPE:[1]",
            "pipe:[]",
        ):
            cases[f"inherit {pipe} {value!r}"] = lambda p, pipe=pipe, value=value: p[
                "inherit"
            ].update({pipe: value})
    for key in ("uses_cuda", "mount_namespace", "net_namespace"):
        for value in ("true", 1, None, [True]):
            cases[f"{key} {value!r}"] = lambda p, key=key, value=value: p.update({key: value})
    cases["uses_cuda dropped"] = lambda p: p.pop("uses_cuda")
    for value in (0, -1, 1 << 22, "1234", 12.0, True, [5]):
        cases[f"host_pid {value!r}"] = lambda p, value=value: p.update(host_pid=value)
    memory = {"file": "memory.bin", "key": "snapfn-memory", "file_bytes": 4096}
    for label, value in {
        "a string": "memory.bin",
        "a number": 5,
        "a list": [],
        "an unlisted file": memory,
        "an escaping file": {**memory, "file": "../manifest.json"},
        "a nested file": {**memory, "file": "a/b"},
        "another key": {**memory, "key": "other"},
        "no file": {"key": "snapfn-memory"},
    }.items():
        cases[f"memory {label}"] = lambda p, value=value: p.update(memory=value)
    for label, value in {
        "a string": "regions",
        "an object": {},
        "numbers": [5],
        "empty specs": [{}],
        "4097 of them": [REGION] * 4097,
        "fill ones": _regions({"fill": "ones"}),
        "nbytes 0": _regions({"nbytes": 0}),
        "nbytes 3 MiB": _regions({"nbytes": 3 * MiB}),
        "nbytes 2^50": _regions({"nbytes": 1 << 50}),
        "nbytes text": _regions({"nbytes": "2097152"}),
        "nbytes float": _regions({"nbytes": 2.0 * MiB}),
        "address 0": _regions({"address": 0}),
        "address -1": _regions({"address": -1}),
        "address past 2^64": _regions({"address": (1 << 64) - MiB}),
        "address true": _regions({"address": True}),
        "device -1": _regions({"device": -1}),
        "device 5000": _regions({"device": 5000}),
        "device text": _regions({"device": "0"}),
        "name empty": _regions({"name": ""}),
        "name number": _regions({"name": 5}),
        "name 300 long": _regions({"name": "w" * 300}),
        "file without a path": _regions({"fill": "file"}),
        "file absolute": _regions({"fill": "file", "path": "/etc/passwd"}),
        "file escaping": _regions({"fill": "file", "path": "../x"}),
        "file unlisted": _regions({"fill": "file", "path": "weights/missing.bin"}),
        "file past its end": _regions(
            {"fill": "file", "path": "weights/rank0.bin", "offset": 1 << 40}
        ),
        "offset -1": _regions({"offset": -1}),
        "overlapping": _regions({}, {"name": "v", "address": (1 << 40) + MiB}),
        "the same twice": _regions({}, {}),
    }.items():
        cases[f"regions {label}"] = lambda p, value=value: p.update(regions=value)
    return cases


PROCESS_EDITS = process_edits()
TOP_EDITS = {
    "tier portable": lambda m: m.update(tier="portable"),
    "no process section": lambda m: m.pop("process"),
    "process a list": lambda m: m.update(process=[]),
}


def test_at_least_100_process_section_edits():
    assert len(PROCESS_EDITS) + len(TOP_EDITS) >= 100


def edited(snapshot: Path, case: str) -> dict:
    manifest = read_manifest(snapshot)
    if case in TOP_EDITS:
        TOP_EDITS[case](manifest)
    else:
        PROCESS_EDITS[case](manifest["process"])
    return manifest


@pytest.mark.parametrize("case", sorted(PROCESS_EDITS) + sorted(TOP_EDITS))
def test_an_edited_process_section_is_refused_before_criu_starts(tier1, tmp_path, case):
    from snapfn.snapshot.process.snapshot import _validate

    snap = clone(tier1[1], tmp_path / "snap", edited(tier1[1], case))
    with pytest.raises(BadSnapshot) as info:  # criu starts only once validate passed
        _validate(snap, None)
    assert "\n" not in str(info.value)


def test_the_unedited_process_section_passes(tier1):
    from snapfn.snapshot.process.snapshot import _validate, process_section_problem

    manifest = _validate(tier1[1], None)
    assert process_section_problem(manifest) is None and manifest["process"]["code"]


@pytest.mark.parametrize(
    "case",
    ["inherit out 'file:/etc/passwd'", "regions 4097 of them", "images '..'", "memory a list"],
)
def test_a_refused_process_image_is_answered_by_the_portable_tier(tier1, tmp_path, case):
    from snapfn.handler.llm.recipes.process_restore import restore_llm

    tmp, snapshot, tokens = tier1
    snap = clone(snapshot, tmp_path / "snap", edited(snapshot, case))
    service, startup, fn = restore_llm(snap, config(tmp), None, log=None)
    try:
        assert startup.tier == "portable"
        (refused,) = startup.fallbacks
        assert (refused["from"], refused["step"]) == ("process", "validate")
        assert "\n" not in refused["reason"]
        assert tuple(service.generate(PROMPT, GREEDY).token_ids) == tokens
    finally:
        service.close()
        fn.release()
