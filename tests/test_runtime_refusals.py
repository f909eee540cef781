"""Refused snapshots and where their fallback reads from (snapshot/runtime.py's `restore`, with
the LLM's section checks and fallback sources: handler/llm/recipes/section.py, sources.py).

One real snapshot of a tiny llama is made here; mutations of it are generated in three classes:

- FIELD_EDITS: memory-plan, table and section fields edited (types, ranges, inconsistency);
- UNREADABLE: manifests that cannot be read (bit flips, truncation, deletion, a directory, an
  array, a FIFO, invalid UTF-8, missing sections, deep nesting, huge files);
- POINTED: manifests that point the fallback at another model, refused for a damage.

Every mutated snapshot goes through the whole restore: refused with a one-line reason, then
answered by the fallback from the model the user named with exactly the tokens of one cold init
of it (made once: a cold init is deterministic here, and each fallback still runs its own).
Without a named model, a manifest that is unreadable or points elsewhere is NoTrustedSource:
nothing cold-initialised from it, nothing served, the snapshot not rewritten.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from snapfn.handler.llm.engine.request import SamplingParams
from snapfn.handler.llm.init_config import InitConfig
from snapfn.handler.llm.recipes.function import LLMFunction
from snapfn.handler.llm.recipes.sources import llm_fallback
from snapfn.snapshot.runtime import NoTrustedSource, init_and_snapshot, restore

PROMPT = [5, 17, 42, 9]
GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)
WEIGHTS = "weights/rank0.bin"


@dataclass(frozen=True)
class Made:
    model: Path  # the model the user names
    snapshot: Path
    manifest: bytes  # the snapshot's manifest.json as written
    tokens: tuple[int, ...]  # what the cold init answered
    tmp: Path

    def config(self) -> InitConfig:
        return InitConfig(
            page_size=4,
            max_num_batched_tokens=64,
            kv_cache_bytes_cpu=1 << 20,
            cache_dir=self.tmp / "cache",
            prewarm_threads=2,
            stream_threads=2,
        )

    def doc(self) -> dict:
        return json.loads(self.manifest)


@pytest.fixture(scope="module")
def made(llama_with_tokenizer, tmp_path_factory) -> Made:
    tmp = tmp_path_factory.mktemp("trust")
    unfinished = Made(llama_with_tokenizer, tmp / "snap", b"", (), tmp)
    cold = LLMFunction(unfinished.config(), llama_with_tokenizer)
    init_and_snapshot(cold, tmp / "snap", log=None)
    tokens = cold.engine.generate([PROMPT], GREEDY)[0].token_ids
    cold.release()
    manifest = (tmp / "snap" / "manifest.json").read_bytes()
    return Made(llama_with_tokenizer, tmp / "snap", manifest, tuple(tokens), tmp)


@pytest.fixture(scope="module")
def other_llama(tmp_path_factory) -> Path:
    """A llama of the same shape and config as the named one, other weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from conftest import TINY

    torch.manual_seed(7)
    model = LlamaForCausalLM(LlamaConfig(**(TINY | {"intermediate_size": 128}))).eval()
    path = tmp_path_factory.mktemp("other_llama")
    model.save_pretrained(path, safe_serialization=True)
    return path


def clone(made: Made, dest: Path) -> Path:
    """The snapshot's files hard-linked into `dest` (a rewrite replaces, never edits, them),
    its manifest a fresh copy."""
    for path in sorted(made.snapshot.rglob("*")):
        target = dest / path.relative_to(made.snapshot)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            if path.name == "manifest.json":
                target.write_bytes(path.read_bytes())
            else:
                os.link(path, target)
    return dest


def restored(made: Made, snap: Path, named: bool, rewrite: bool = False):
    config, model = made.config(), made.model if named else None
    return restore(
        lambda: LLMFunction(config, model),
        snap,
        fallback=llm_fallback(config, model),
        rewrite_on_fallback=rewrite,
        log=None,
    )


def answered_by_fallback(made: Made, snap: Path) -> dict:
    """The restore was refused (one line) and the named model's cold init answered."""
    fn, startup = restored(made, snap, named=True)
    try:
        assert startup.tier == "cold (fallback)", "served from a mutated snapshot"
        refusal = startup.fallbacks[0]
        assert refusal["reason"] and "\n" not in refusal["reason"], refusal
        assert fn.source == made.model
        assert tuple(fn.engine.generate([PROMPT], GREEDY)[0].token_ids) == made.tokens
    finally:
        fn.release()
    return refusal


def fatal_without_a_named_model(made: Made, snap: Path) -> str:
    """NoTrustedSource, one line; the snapshot as it was (never rewritten from its record)."""
    before = _tree(snap)
    with pytest.raises(NoTrustedSource) as info:
        restored(made, snap, named=False, rewrite=True)
    message = str(info.value)
    assert "\n" not in message, message
    assert "no trustworthy source" in message or "could not be verified" in message, message
    assert _tree(snap) == before
    return message


def _tree(snap: Path) -> dict:
    if not snap.is_dir():
        return {}
    found = {}
    for path in sorted(snap.rglob("*")):
        if path.is_symlink() or not path.is_file():
            found[str(path)] = "special"
        elif path.name == "manifest.json":
            found[str(path)] = path.read_bytes()
        else:
            found[str(path)] = path.stat().st_ino
    return found


# ---------------------------------------------------------------- mutations of the llm section


def section_edit(path: str, change):
    """An edit of the value at `path` (dot-separated, inside the manifest) by `change(old)`;
    `change` returning DROP removes the key."""

    def edit(doc: dict) -> None:
        *parents, key = path.split(".")
        node = doc
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        new = change(node[key])
        if new is DROP:
            del node[key]
        else:
            node[key] = new

    return edit


def table_edit(change):
    """An edit of the restore layout's table, which travels as JSON text in the section."""

    def edit(doc: dict) -> None:
        table = json.loads(doc["llm"]["layout"])
        change(table)
        doc["llm"]["layout"] = json.dumps(table)

    return edit


DROP = object()
PLAN_INTS = (
    "num_pages",
    "page_size",
    "bytes_per_page",
    "kv_bytes",
    "weights_bytes",
    "peak_activation_bytes",
    "total_bytes",
)
PLAN_KEYS = (*PLAN_INTS, "mem_fraction_static", "source")
INT_EDITS = {  # a plan's integers: wrong types, out of range, inconsistent
    "str": str,
    "float": float,
    "float+half": lambda v: v + 0.5,
    "true": lambda v: True,
    "null": lambda v: None,
    "list": lambda v: [v],
    "object": lambda v: {"v": v},
    "-1": lambda v: -1,
    "2^62": lambda v: 2**62,
    "2^70": lambda v: 2**70,
    "+1": lambda v: v + 1,
    "x2+2": lambda v: v * 2 + 2,
    "-1 or 3": lambda v: v - 1 if v else 3,
}


def _tensor(table: dict, which: int) -> dict:
    return table["tensors"][list(table["tensors"])[which]]


def _rename(table: dict, which: int) -> None:
    name = list(table["tensors"])[which]
    table["tensors"][name + ".renamed"] = table["tensors"].pop(name)


def _tensor_edits(which: int) -> dict:
    t = lambda table: _tensor(table, which)  # noqa: E731
    return {
        "dtype float16": lambda d: t(d).update(dtype="float16"),
        "dtype int4": lambda d: t(d).update(dtype="int4"),
        "shape +dim": lambda d: t(d).update(shape=[*t(d)["shape"], 2]),
        "shape flat": lambda d: t(d).update(shape=[math.prod(t(d)["shape"])]),
        "shape negative": lambda d: t(d).update(shape=[-1]),
        "shape text": lambda d: t(d).update(shape="64x64"),
        "offset +1": lambda d: t(d).update(offset=t(d)["offset"] + 1),
        "offset +2MiB": lambda d: t(d).update(offset=t(d)["offset"] + (2 << 20)),
        "offset -2MiB": lambda d: t(d).update(offset=t(d)["offset"] - (2 << 20)),
        "nbytes +1": lambda d: t(d).update(nbytes=t(d)["nbytes"] + 1),
        "renamed": lambda d: _rename(d, which),
        "dropped": lambda d: d["tensors"].pop(list(d["tensors"])[which]),
    }


def _first_hex_flipped(digest: str) -> str:
    return ("1" if digest[0] == "0" else "0") + digest[1:]


def field_edits() -> dict:
    cases: dict = {}
    for name in PLAN_INTS:
        for label, change in INT_EDITS.items():
            cases[f"memory_plan.{name} {label}"] = section_edit(f"llm.memory_plan.{name}", change)
    for value in ("0", None, True, -0.1, 1.5, 0.5, 1.0, math.nan, math.inf):
        cases[f"memory_plan.mem_fraction_static {value!r}"] = section_edit(
            "llm.memory_plan.mem_fraction_static", lambda v, value=value: value
        )
    for value in ("profiled", "", "fixed", 3, None):
        cases[f"memory_plan.source {value!r}"] = section_edit(
            "llm.memory_plan.source", lambda v, value=value: value
        )
    for key in PLAN_KEYS:
        cases[f"memory_plan without {key}"] = section_edit(f"llm.memory_plan.{key}", lambda v: DROP)
    cases["memory_plan with an extra key"] = section_edit(
        "llm.memory_plan", lambda v: {**v, "num_pages_extra": 1}
    )
    for value in ([], "plan", None, {}):
        cases[f"memory_plan {value!r}"] = section_edit(
            "llm.memory_plan", lambda v, value=value: value
        )

    made_with = {
        "kv_cache_bytes_cpu x2": lambda c: c.update(kv_cache_bytes_cpu=c["kv_cache_bytes_cpu"] * 2),
        "kv_cache_bytes_cpu half": lambda c: c.update(
            kv_cache_bytes_cpu=c["kv_cache_bytes_cpu"] // 2
        ),
        "kv_cache_bytes_cpu -1": lambda c: c.update(kv_cache_bytes_cpu=-1),
        "kv_cache_bytes_cpu text": lambda c: c.update(kv_cache_bytes_cpu="1M"),
        "kv_cache_bytes_cpu dropped": lambda c: c.pop("kv_cache_bytes_cpu"),
        "page_size 16": lambda c: c.update(page_size=16),
        "page_size dropped": lambda c: c.pop("page_size"),
        "mem_fraction_static 2": lambda c: c.update(mem_fraction_static=2),
        "mem_fraction_static text": lambda c: c.update(mem_fraction_static="0.85"),
    }
    for label, change in made_with.items():
        cases[f"init_config {label}"] = lambda d, change=change: change(d["llm"]["init_config"])
    for value in ([], "config", None):
        cases[f"init_config {value!r}"] = section_edit(
            "llm.init_config", lambda v, value=value: value
        )
    table = {
        "file_bytes +1": lambda d: d.update(file_bytes=d["file_bytes"] + 1),
        "file_bytes -1": lambda d: d.update(file_bytes=d["file_bytes"] - 1),
        "file_bytes 0": lambda d: d.update(file_bytes=0),
        "file_bytes text": lambda d: d.update(file_bytes="many"),
        "file_bytes null": lambda d: d.update(file_bytes=None),
        "file_bytes 2^64": lambda d: d.update(file_bytes=2**64),
        "align 3": lambda d: d.update(align=3),
        "align 0": lambda d: d.update(align=0),
        "align -2": lambda d: d.update(align=-2),
        "align 2^40": lambda d: d.update(align=2**40),
        "align 1.5": lambda d: d.update(align=1.5),
        "align text": lambda d: d.update(align="2MiB"),
        "align x2": lambda d: d.update(align=d["align"] * 2),
        "chunk_bytes 0": lambda d: d.update(chunk_bytes=0),
        "chunk_bytes -1": lambda d: d.update(chunk_bytes=-1),
        "chunk_bytes 2^40": lambda d: d.update(chunk_bytes=2**40),
        "chunk_bytes +1": lambda d: d.update(chunk_bytes=d["chunk_bytes"] + 1),
        "chunk_bytes half": lambda d: d.update(chunk_bytes=d["chunk_bytes"] // 2),
        "chunk_sha256 one fewer": lambda d: d["chunk_sha256"].pop(),
        "chunk_sha256 one more": lambda d: d["chunk_sha256"].append(d["chunk_sha256"][0]),
        "chunk_sha256 flipped": lambda d: d["chunk_sha256"].__setitem__(
            0, _first_hex_flipped(d["chunk_sha256"][0])
        ),
        "chunk_sha256 upper": lambda d: d["chunk_sha256"].__setitem__(
            0, d["chunk_sha256"][0].upper()
        ),
        "chunk_sha256 empty": lambda d: d.update(chunk_sha256=[]),
        "chunk_sha256 text": lambda d: d.update(chunk_sha256="x"),
        "chunk_sha256 null": lambda d: d.update(chunk_sha256=None),
        "file_sha256 flipped": lambda d: d.update(file_sha256=_first_hex_flipped(d["file_sha256"])),
        "file_sha256 empty": lambda d: d.update(file_sha256=""),
        "file_sha256 null": lambda d: d.update(file_sha256=None),
        "file_sha256 number": lambda d: d.update(file_sha256=5),
        "chunk_sum64 2^64": lambda d: d.update(chunk_sum64=[2**64] * len(d["chunk_sha256"])),
        "chunk_sum64 text": lambda d: d.update(chunk_sum64=["1"] * len(d["chunk_sha256"])),
        "chunk_sum64 one more": lambda d: d["chunk_sum64"].append(0),
        "chunk_sum64 not a list": lambda d: d.update(chunk_sum64="x"),
        "chunk_sum64 floats": lambda d: d.update(chunk_sum64=[0.5] * len(d["chunk_sha256"])),
        "extra tensor": lambda d: d["tensors"].update(
            extra={"dtype": "uint8", "shape": [0], "offset": 0, "nbytes": 0}
        ),
        "format other": lambda d: d.update(format="safetensors"),
        "version 2": lambda d: d.update(version=2),
        "tensors a list": lambda d: d.update(tensors=[]),
    }
    for which, where in ((0, "first"), (5, "sixth"), (-1, "last")):
        for label, change in _tensor_edits(which).items():
            table[f"{where} tensor {label}"] = change
    for label, change in table.items():
        cases[f"layout {label}"] = table_edit(change)
    for label, value in {
        "an object": {"format": "snapfn-restore-layout"},
        "a list": [],
        "null": None,
        "not JSON": "{not json",
        "nested deep": "[" * 200 + "]" * 200,
        "JSON array": "[1, 2]",
    }.items():
        cases[f"layout {label}"] = section_edit("llm.layout", lambda v, value=value: value)

    health = {
        "prompt_ids []": lambda v: [],
        "prompt_ids [-1]": lambda v: [-1],
        "prompt_ids text": lambda v: ["a"],
        "prompt_ids float": lambda v: [1.5],
        "prompt_ids past the vocabulary": lambda v: [256],
        "prompt_ids 2^40": lambda v: [2**40],
        "prompt_ids a string": lambda v: "x",
        "prompt_ids null": lambda v: None,
        "prompt_ids 70000 long": lambda v: [0] * 70000,
        "prompt_ids others": lambda v: [(i + 1) % 256 for i in v],
    }
    for label, change in health.items():
        cases[f"health {label}"] = section_edit("llm.health.prompt_ids", change)
    token = {
        "-1": lambda v: -1,
        "text": lambda v: "3",
        "float": lambda v: 3.0,
        "null": lambda v: None,
        "list": lambda v: [3],
        "past the vocabulary": lambda v: 256,
        "2^40": lambda v: 2**40,
        "another": lambda v: (v + 1) % 256,
    }
    for label, change in token.items():
        cases[f"health token {label}"] = section_edit("llm.health.token", change)
    logprob = {
        "positive": lambda v: 0.5,
        "text": lambda v: "x",
        "null": lambda v: None,
        "true": lambda v: True,
        "NaN": lambda v: math.nan,
        "-inf": lambda v: -math.inf,
        "lower": lambda v: v - 1.0,
        "halved": lambda v: v / 2 - 0.25,
    }
    for label, change in logprob.items():
        cases[f"health logprob {label}"] = section_edit("llm.health.logprob", change)
    for value in ([], "x", None):
        cases[f"health {value!r}"] = section_edit("llm.health", lambda v, value=value: value)
    for key in ("prompt_ids", "token", "logprob"):
        cases[f"health without {key}"] = section_edit(f"llm.health.{key}", lambda v: DROP)

    for value in ("qwen3", "", 5, None, "x" * 100):
        cases[f"model_type {value!r:.20}"] = section_edit(
            "llm.model_type", lambda v, value=value: value
        )
    for label, change in {
        "short": lambda v: "ABC",
        "null": lambda v: None,
        "number": lambda v: 5,
        "upper": lambda v: v.upper(),
    }.items():
        cases[f"model_content_hash {label}"] = section_edit("llm.model_content_hash", change)
    for key in ("model_content_hash", "model_type", "layout", "memory_plan", "health"):
        cases[f"section without {key}"] = section_edit(f"llm.{key}", lambda v: DROP)
    weights = {
        "chunk_bytes": lambda e: e.update(chunk_bytes=e["chunk_bytes"] // 2),
        "chunks": lambda e: e.update(chunks=[]),
        "size": lambda e: e.update(size=e["size"] + 1),
        "sha256": lambda e: e.update(sha256="0" * 64),
    }
    for label, change in weights.items():
        cases[f"files {WEIGHTS} {label}"] = lambda d, change=change: change(d["files"][WEIGHTS])
    # a rank layout this one-rank restore is not, or none at all
    two = {"tp_size": 2, "ep_size": 1, "ep_dispatch": "replicated"}
    for label, value in {
        "of two ranks": two,
        "of one rank by another dispatch": {**two, "tp_size": 1, "ep_dispatch": "all_to_all"},
        "a string": "tp2",
        "with an extra key": {**two, "tp_size": 1, "pp_size": 1},
        "null": None,
    }.items():
        cases[f"parallel {label}"] = lambda d, value=value: d["llm"].update(parallel=value)
    # the kernels' configs a restore pins (CUDA inits record them; any snapshot may carry some)
    choice = {"kernel": "_gemv_kernel", "key": "(4096,)", "config": "BLOCK_K=512,w4,s3"}
    for label, value in {
        "a string": "shipped",
        "an object": choice,
        "a list of numbers": [1, 2],
        "an entry without config": [{k: v for k, v in choice.items() if k != "config"}],
        "a kernel name with a space": [{**choice, "kernel": "gemv kernel"}],
        "a kernel name of 200 characters": [{**choice, "kernel": "k" * 200}],
        "an empty key": [{**choice, "key": ""}],
        "a config of 600 characters": [{**choice, "config": "w" * 600}],
        "a numeric config": [{**choice, "config": 4}],
    }.items():
        cases[f"kernel_choices {label}"] = lambda d, value=value: d["llm"].update(
            kernel_choices=value
        )
    for label, value in {
        "a string": "You are a helpful assistant.",
        "a list of numbers": [1, 2],
        "an empty prompt": [""],
        "65 prompts": ["x"] * 65,
    }.items():
        cases[f"prefix_warm {label}"] = lambda d, value=value: d["llm"].update(prefix_warm=value)
    cases["function user_function"] = section_edit("function", lambda v: "user_function")
    cases["section a list"] = section_edit("llm", lambda v: [v])
    return cases


FIELD_EDITS = field_edits()


def test_each_class_has_at_least_100_mutations():
    assert len(FIELD_EDITS) >= 100
    assert len(UNREADABLE) >= 100
    assert len(POINTED) >= 100


def write_edited(made: Made, snap: Path, edit) -> None:
    doc = made.doc()
    edit(doc)
    (snap / "manifest.json").write_text(json.dumps(doc))


@pytest.mark.parametrize("case", sorted(FIELD_EDITS))
def test_an_edited_field_is_refused_and_the_fallback_answers(made, tmp_path, case):
    snap = clone(made, tmp_path / "snap")
    write_edited(made, snap, FIELD_EDITS[case])
    answered_by_fallback(made, snap)


# ---------------------------------------------------------------- unreadable manifests


def _structural(data: bytes) -> list[int]:
    """Offsets of JSON's structural characters outside strings."""
    found, in_string, escaped = [], False, False
    for i, c in enumerate(data.decode()):
        if escaped:
            escaped = False
        elif in_string and c == "\\":
            escaped = True
        elif c == '"':
            in_string = not in_string
            found.append(i)
        elif not in_string and c in "{}[]:,":
            found.append(i)
    return found


def _flip(data: bytes, offset: int, bit: int) -> bytes:
    out = bytearray(data)
    out[offset] ^= 1 << bit
    return bytes(out)


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _with_key(data: bytes, text: str) -> bytes:
    """`text` (JSON) as the value of a new first key of the manifest."""
    return b'{"deep": ' + text.encode() + b", " + data[1:]


def _replace(snap: Path, make) -> None:
    manifest = snap / "manifest.json"
    manifest.unlink()
    make(manifest)


def _socket(path: Path) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()  # the socket file stays


def _sparse(size: int):
    def make(path: Path) -> None:
        with open(path, "wb") as f:
            f.truncate(size)

    return make


def unreadable() -> dict:
    """Each case: (write(snap, manifest bytes), named). Offsets are fractions of the manifest."""
    cases: dict = {}
    for k in range(50):  # a high bit set: that byte cannot be UTF-8 among ASCII ones
        cases[f"bit flip {k} (not UTF-8)"] = lambda s, d, k=k: (s / "manifest.json").write_bytes(
            _flip(d, len(d) * k // 50, 7)
        )
    for k in range(50):  # a structural character turned into another one: not JSON
        cases[f"bit flip {k} (structure)"] = lambda s, d, k=k: (s / "manifest.json").write_bytes(
            _flip(d, _structural(d)[len(_structural(d)) * k // 50], 0)
        )
    for k in range(30):
        cases[f"truncated {k}/30"] = lambda s, d, k=k: (s / "manifest.json").write_bytes(
            d[: len(d) * k // 30]
        )
    writes = {
        "deleted": lambda s, d: (s / "manifest.json").unlink(),
        "a directory": lambda s, d: _replace(s, lambda p: p.mkdir()),
        "a directory holding a manifest": lambda s, d: _replace(
            s, lambda p: (p.mkdir(), (p / "manifest.json").write_bytes(d))
        ),
        "a FIFO": lambda s, d: _replace(s, os.mkfifo),
        "a socket": lambda s, d: _replace(s, _socket),
        "a symlink to a copy": lambda s, d: _replace(
            s,
            lambda p: (
                (s.parent / "copy.json").write_bytes(d),
                p.symlink_to(s.parent / "copy.json"),
            ),
        ),
        "a symlink to /dev/zero": lambda s, d: _replace(s, lambda p: p.symlink_to("/dev/zero")),
        "an array of it": lambda s, d: (s / "manifest.json").write_bytes(b"[" + d + b"]"),
        "an empty array": lambda s, d: (s / "manifest.json").write_bytes(b"[]"),
        "null": lambda s, d: (s / "manifest.json").write_bytes(b"null"),
        "a string": lambda s, d: (s / "manifest.json").write_bytes(b'"manifest"'),
        "a number": lambda s, d: (s / "manifest.json").write_bytes(b"3"),
        "empty": lambda s, d: (s / "manifest.json").write_bytes(b""),
        "UTF-8 BOM": lambda s, d: (s / "manifest.json").write_bytes(b"\xef\xbb\xbf" + d),
        "UTF-16": lambda s, d: (s / "manifest.json").write_bytes(d.decode().encode("utf-16")),
        "latin-1 byte in a string": lambda s, d: (s / "manifest.json").write_bytes(
            d.replace(b'"created_at": "', b'"created_at": "\xe9', 1)
        ),
        "overlong encoding": lambda s, d: (s / "manifest.json").write_bytes(
            d.replace(b'"created_at": "', b'"created_at": "\xc0\xaf', 1)
        ),
        "encoded surrogate": lambda s, d: (s / "manifest.json").write_bytes(
            d.replace(b'"created_at": "', b'"created_at": "\xed\xa0\x80', 1)
        ),
        "NUL bytes after it": lambda s, d: (s / "manifest.json").write_bytes(d + b"\0\0"),
        "garbage after it": lambda s, d: (s / "manifest.json").write_bytes(d + b"x"),
        "twice": lambda s, d: (s / "manifest.json").write_bytes(d + d),
        "unclosed 100000 deep": lambda s, d: (s / "manifest.json").write_bytes(b"[" * 100000),
        "sparse 64 MiB + 1": lambda s, d: _replace(s, _sparse((64 << 20) + 1)),
        "sparse 1 GiB": lambda s, d: _replace(s, _sparse(1 << 30)),
        "sparse 1 TiB": lambda s, d: _replace(s, _sparse(1 << 40)),
        "64 MiB + 1 of real JSON": lambda s, d: (s / "manifest.json").write_bytes(
            d[:-1] + b" " * ((64 << 20) + 1 - len(d)) + b"}"
        ),
    }
    for depth in (33, 40, 100, 1000, 100000, 1000000):
        writes[f"nested {depth} deep"] = lambda s, d, depth=depth: (
            s / "manifest.json"
        ).write_bytes(_with_key(d, _nested(depth)))
    for key in ("format_version", "created_at", "compat", "files", "llm"):
        writes[f"without {key}"] = lambda s, d, key=key: _write_doc(s, d, lambda m: m.pop(key))
    for key, value in (
        ("files", []),
        ("files", "x"),
        ("compat", []),
        ("compat", None),
        ("created_at", 5),
        ("llm", None),
        ("format_version", "1"),
        ("format_version", 2),
        ("format_version", True),
        ("tier", 5),
        ("tier", "other"),
        ("function", 5),
        ("files", {"../escape": {"size": 0, "sha256": "0" * 64}}),
    ):
        writes[f"{key} {value!r:.30}"] = lambda s, d, key=key, value=value: _write_doc(
            s, d, lambda m: m.update({key: value})
        )
    cases.update(writes)
    return cases


def _write_doc(snap: Path, data: bytes, edit) -> None:
    doc = json.loads(data)
    edit(doc)
    (snap / "manifest.json").write_text(json.dumps(doc))


UNREADABLE = unreadable()


def _run_bounded(fn, timeout_s: float = 60.0):
    """fn() on a thread: a hang (a FIFO opened for reading blocks forever) fails the test."""
    result: list = []

    def run() -> None:
        try:
            result.append(("ok", fn()))
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            result.append(("raised", exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert result, f"hung for {timeout_s} s"
    kind, value = result[0]
    if kind == "raised":
        raise value
    return value


@pytest.mark.parametrize("case", sorted(UNREADABLE))
def test_an_unreadable_manifest_is_refused_and_the_named_model_answers(made, tmp_path, case):
    snap = clone(made, tmp_path / "snap")
    UNREADABLE[case](snap, made.manifest)
    refusal = _run_bounded(lambda: answered_by_fallback(made, snap))
    assert refusal["step"] == "validate", refusal


UNNAMED_SAMPLE = sorted(UNREADABLE)[::7]


@pytest.mark.parametrize("case", UNNAMED_SAMPLE)
def test_an_unreadable_manifest_without_a_named_model_is_fatal_in_one_line(made, tmp_path, case):
    snap = clone(made, tmp_path / "snap")
    UNREADABLE[case](snap, made.manifest)
    message = _run_bounded(lambda: fatal_without_a_named_model(made, snap))
    assert "falling back" not in message and message.startswith(f"restore from {snap} failed")


# ---------------------------------------------------------------- pointed at another model


def _sources(made: Made, others: dict[str, Path]) -> dict:
    """What a damaged manifest may record as its source: (source_model_dir, source_embedded
    or None to leave it out, model_content_hash edit or None)."""
    from snapfn.handler.llm.embedded import embedded_model_dir

    other, qwen2, qwen3 = others["llama"], others["qwen2"], others["qwen3"]
    link = made.tmp / "link-to-other"
    if not link.exists():
        link.symlink_to(other, target_is_directory=True)
    config_file = str(made.model / "config.json")
    return {
        "another llama": (str(other), None, None),
        "another llama, trailing slash": (str(other) + "/", None, None),
        "another llama, dot segment": (f"{other}/.", None, None),
        "another llama through a symlink": (str(link), None, None),
        "a qwen2": (str(qwen2), None, None),
        "a qwen3": (str(qwen3), None, None),
        "the embedded model (flag)": (None, True, None),
        "the embedded model (path)": (str(embedded_model_dir()), False, None),
        "the snapshot's own model folder": (str(made.snapshot / "model"), None, None),
        "a missing folder": ("/nonexistent/model", None, None),
        "a relative path": (os.path.relpath(made.model), None, None),
        "an empty path": ("", None, None),
        "a number": (5, None, None),
        "a list": ([str(other)], None, None),
        "the root": ("/", None, None),
        "a file": (config_file, None, None),
        "/proc/self": ("/proc/self", None, None),
        "a NUL in the path": (str(other) + "\0x", None, None),
        "the named model, another hash": (str(made.model), None, "0" * 64),
        "the named model, a malformed hash": (str(made.model), None, "not a hash"),
    }


def _damages() -> dict:
    return {
        "num_pages +1": lambda m: m["llm"]["memory_plan"].update(
            num_pages=m["llm"]["memory_plan"]["num_pages"] + 1
        ),
        "health logprob": lambda m: m["llm"]["health"].update(logprob=-0.5),
        "compat world_size": lambda m: m["compat"].update(world_size=2),
        "table offset": table_edit(lambda d: _tensor(d, 0).update(offset=10**9)),
        "weights listed size": lambda m: m["files"][WEIGHTS].update(size=1),
        "page_size": lambda m: m["llm"]["memory_plan"].update(page_size=16),
    }


SOURCE_NAMES = (
    "another llama",
    "another llama, trailing slash",
    "another llama, dot segment",
    "another llama through a symlink",
    "a qwen2",
    "a qwen3",
    "the embedded model (flag)",
    "the embedded model (path)",
    "the snapshot's own model folder",
    "a missing folder",
    "a relative path",
    "an empty path",
    "a number",
    "a list",
    "the root",
    "a file",
    "/proc/self",
    "a NUL in the path",
    "the named model, another hash",
    "the named model, a malformed hash",
)
POINTED = [(source, damage) for source in SOURCE_NAMES for damage in _damages()]


@pytest.fixture(scope="module")
def others(other_llama, tiny_qwen2_dir, tiny_qwen3_dir) -> dict[str, Path]:
    return {"llama": other_llama, "qwen2": tiny_qwen2_dir, "qwen3": tiny_qwen3_dir}


def write_pointed(made: Made, snap: Path, others: dict[str, Path], source: str, damage: str):
    path, embedded, content_hash = _sources(made, others)[source]

    def edit(m: dict) -> None:
        m["llm"]["source_model_dir"] = path
        if embedded is not None:
            m["llm"]["source_embedded"] = embedded
        if content_hash is not None:
            m["llm"]["model_content_hash"] = content_hash
        _damages()[damage](m)

    write_edited(made, snap, edit)


def _ids(cases) -> list[str]:
    return [f"{source} + {damage}" for source, damage in cases]


@pytest.mark.parametrize("source, damage", POINTED, ids=_ids(POINTED))
def test_a_manifest_pointing_elsewhere_falls_back_to_the_named_model(
    made, others, tmp_path, source, damage
):
    snap = clone(made, tmp_path / "snap")
    write_pointed(made, snap, others, source, damage)
    answered_by_fallback(made, snap)


@pytest.mark.parametrize("source, damage", POINTED, ids=_ids(POINTED))
def test_a_manifest_pointing_elsewhere_is_never_trusted_unnamed(
    made, others, tmp_path, source, damage
):
    snap = clone(made, tmp_path / "snap")
    write_pointed(made, snap, others, source, damage)
    fatal_without_a_named_model(made, snap)


def test_an_unnamed_fallback_to_the_recorded_source_runs_once_its_hash_matches(made, tmp_path):
    snap = clone(made, tmp_path / "snap")
    write_edited(made, snap, _damages()["num_pages +1"])
    fn, startup = restored(made, snap, named=False, rewrite=True)
    try:
        assert startup.tier == "cold (fallback)"
        assert (
            startup.stage("verify_source").figures["content_hash"]
            == made.doc()["llm"]["model_content_hash"]
        )
        assert tuple(fn.engine.generate([PROMPT], GREEDY)[0].token_ids) == made.tokens
    finally:
        fn.release()
    rewritten = json.loads((snap / "manifest.json").read_text())
    assert rewritten["llm"]["memory_plan"] == made.doc()["llm"]["memory_plan"]  # from the source


def test_a_manifest_the_configured_key_did_not_sign_names_no_source_to_trust(
    made, tmp_path, monkeypatch
):
    """With a snapshot key configured, an unsigned manifest is refused, and the source it
    records (intact, its hash matching) is not trusted for the fallback either."""
    snap = clone(made, tmp_path / "snap")
    write_edited(made, snap, _damages()["num_pages +1"])
    monkeypatch.setenv(
        "SNAPFN_SNAPSHOT_KEY_VALUE", "a shared secret of at least 32 bytes, for tests"
    )
    fatal_without_a_named_model(made, snap)
    answered_by_fallback(made, snap)  # the model named by the user is still trusted


def test_the_embedded_model_is_trusted_when_recorded_and_its_hash_matches(
    embedded_snapshot, tmp_path
):
    from snapfn.snapshot.portable.format import read_manifest

    recorded = read_manifest(embedded_snapshot)["llm"]
    assert recorded["source_embedded"] is True
    snap = Path(shutil.copytree(embedded_snapshot, tmp_path / "snap"))
    doc = json.loads((snap / "manifest.json").read_text())
    doc["llm"]["health"]["logprob"] = -0.5  # refused at the replay check
    doc["llm"]["source_model_dir"] = "/elsewhere"  # the flag names the embedded model
    (snap / "manifest.json").write_text(json.dumps(doc))
    config = InitConfig(
        max_num_batched_tokens=64, kv_cache_bytes_cpu=1 << 20, cache_dir=tmp_path / "c"
    )
    fn, startup = restore(
        lambda: LLMFunction(config),
        snap,
        fallback=llm_fallback(config, None),
        rewrite_on_fallback=False,
        log=None,
    )
    try:
        assert startup.tier == "cold (fallback)" and startup.fallbacks[0]["step"] == "health_check"
        assert startup.stage("verify_source").ok
    finally:
        fn.release()


# ---------------------------------------------------------------- the front doors' end


@pytest.fixture
def same_config(made, monkeypatch):
    """The environment a `snapfn generate` / serve worker needs to build `made`'s config."""
    config = made.config()
    for name in ("page_size", "max_num_batched_tokens", "kv_cache_bytes_cpu", "cache_dir"):
        monkeypatch.setenv(f"SNAPFN_{name.upper()}", str(getattr(config, name)))
    return config


def _generate(made: Made, snap: Path, *extra: str) -> int:
    from snapfn.handler.cli import main

    ids = ",".join(map(str, PROMPT))
    argv = ["generate", "--snapshot", str(snap), "--prompt-ids", ids, "--max-new-tokens", "8"]
    return main([*argv, "--ignore-eos", "--json", *extra])


def test_generate_without_a_trustworthy_source_says_so_and_exits_at_once(
    made, same_config, tmp_path, capsys
):
    snap = clone(made, tmp_path / "snap")
    (snap / "manifest.json").write_bytes(made.manifest[:100])  # truncated
    assert _generate(made, snap) != 0
    captured = capsys.readouterr()
    (error,) = [line for line in captured.err.splitlines() if "error" in line]
    assert "[no_trusted_source]" in error and "--model" in error
    assert "falling back" not in captured.err and not captured.out
    assert _generate(made, snap, "--model", str(made.model)) == 0
    answer = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert tuple(answer["token_ids"]) == made.tokens


def test_a_server_without_a_trustworthy_source_is_fatal_with_the_reason(
    made, same_config, tmp_path
):
    from snapfn.handler.function.runtime import WorkerRuntime
    from snapfn.handler.function.target import ServeTarget
    from snapfn.snapshot.stages import Readiness

    snap = clone(made, tmp_path / "snap")
    doc = made.doc()
    doc["llm"]["source_model_dir"] = str(made.tmp / "nowhere")
    doc["llm"]["memory_plan"]["num_pages"] *= 1000
    (snap / "manifest.json").write_text(json.dumps(doc))
    runtime = WorkerRuntime(ServeTarget(snapshot_dir=snap, init_config=same_config))
    runtime.start(background=False)
    assert runtime.readiness.state is Readiness.FAILED
    assert isinstance(runtime.fatal, NoTrustedSource) and runtime.fatal.code == "no_trusted_source"
    assert runtime.readiness.reason == f"NoTrustedSource: {runtime.fatal}"
    runtime.close()
    named = WorkerRuntime(
        ServeTarget(model_dir=made.model, snapshot_dir=snap, init_config=same_config)
    )
    named.start(background=False)
    try:
        assert named.readiness.state is Readiness.UP and named.fatal is None
        assert named.startup.tier == "cold (fallback)"
        assert "memory_plan kv_bytes" in named.startup.fallbacks[0]["reason"]
        result = named.llm.generate(PROMPT, GREEDY)
        assert tuple(result.token_ids) == made.tokens
    finally:
        named.close()
    rewritten = json.loads((snap / "manifest.json").read_text())  # from the named model
    assert rewritten["llm"]["memory_plan"] == made.doc()["llm"]["memory_plan"]
    assert rewritten["llm"]["source_model_dir"] == str(made.model.absolute())


# ---------------------------------------------------------------- a profiled (CUDA) plan


def _profiled(made: Made, config: InitConfig, **changes) -> dict:
    """`made`'s section with a plan as a CUDA profile of an 80 GiB GPU would record it."""
    section = made.doc()["llm"]
    plan = section["memory_plan"]
    total, peak = 80 << 30, 3 << 20
    pages = (int(total * config.mem_fraction_static) - plan["weights_bytes"] - peak) // plan[
        "bytes_per_page"
    ]
    plan.update(
        source="profiled",
        total_bytes=total,
        peak_activation_bytes=peak,
        mem_fraction_static=config.mem_fraction_static,
        num_pages=pages,
        kv_bytes=pages * plan["bytes_per_page"],
    )
    plan.update(changes)
    return section


@pytest.mark.parametrize(
    "changes, reason",
    [
        ({"num_pages": 10**9, "kv_bytes": 10**9 * 2048}, "do not fit"),
        ({"peak_activation_bytes": 70 << 30}, "do not fit"),
        ({"mem_fraction_static": 0.95}, "mem_fraction_static"),
        ({"page_size": 16}, "page_size"),
        ({"source": "fixed budget"}, "needs a profiled one"),
        ({"num_pages": 1, "kv_bytes": 2048}, "do not fit"),
    ],
)
def test_a_profiled_plan_must_fit_its_gpu_and_this_configuration(made, changes, reason):
    from dataclasses import replace

    from snapfn.handler.llm.recipes.section import check_section
    from snapfn.snapshot.errors import BadSnapshot

    config = replace(made.config(), device="cuda")
    files = made.doc()["files"]
    check_section(_profiled(made, config), files, config)  # as profiled: accepted
    with pytest.raises(BadSnapshot, match=reason):
        check_section(_profiled(made, config, **changes), files, config)


def test_a_plan_made_with_a_smaller_budget_restores_and_a_larger_one_is_refused(made, tmp_path):
    from dataclasses import replace

    config = made.config()
    for budget, served in (
        (config.kv_cache_bytes_cpu * 4, True),
        (config.kv_cache_bytes_cpu // 2, False),
    ):
        here = replace(config, kv_cache_bytes_cpu=budget)
        fn, startup = restore(
            lambda here=here: LLMFunction(here, made.model),
            made.snapshot,
            fallback=llm_fallback(here, made.model),
            rewrite_on_fallback=False,
            log=None,
        )
        try:
            assert (startup.tier == "portable") is served, startup.fallbacks
            if not served:
                assert "more than this configuration's budget" in startup.fallbacks[0]["reason"]
            assert tuple(fn.engine.generate([PROMPT], GREEDY)[0].token_ids) == made.tokens
        finally:
            fn.release()
