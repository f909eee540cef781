"""Snapshots written by someone who can write the snapshot folder but not the model folder the
user names: what a restore does with them (handler/llm/tokenizer.py's chat-template sandbox,
snapshot/portable/format.py's JSON reader, snapshot/portable/compile_caches.py's restore of the
compile caches, handler/function/user_function.py's use of it).

Each case is refused with a one-line reason (the named model's cold init then answers what it
answers cold), or is bounded where it runs: nothing evaluates at load, nothing past a snapshot's
listed bytes lands in a cache folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest
from test_user_function_refusals import Fn

from snapfn.handler.function.user_function import UserFunction
from snapfn.handler.llm.tokenizer import compile_chat_template, load_tokenizer
from snapfn.snapshot.errors import BadRequest, BadSnapshot, CheckpointError
from snapfn.snapshot.portable import compile_caches
from snapfn.snapshot.portable.format import load_json, read_manifest, validate_snapshot
from snapfn.snapshot.runtime import init_and_snapshot

from test_runtime_refusals import answered_by_fallback, clone, made, write_edited

__all__ = ["made"]  # the tiny llama's snapshot (module-scoped), shared with the refusal corpus

# ---------------------------------------------------------------- chat templates

# 200 MB of text if evaluated: 2.6 s and 0.8 GB to compile where jinja folds constants
FOLDED_BOMB = "{{ 'ab' * 100000000 }}"


def _relisted(snap: Path, relpath: str) -> None:
    """`relpath` rewritten in place: its manifest entry made to match (no key signs it)."""
    doc = json.loads((snap / "manifest.json").read_bytes())
    data = (snap / relpath).read_bytes()
    doc["files"][relpath] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (snap / "manifest.json").write_text(json.dumps(doc))


def _with_chat_template(made, tmp_path: Path, template: str) -> Path:
    snap = clone(made, tmp_path / "snap")
    config = snap / "model" / "tokenizer_config.json"
    config.unlink()  # a hard link of the original: replaced, not edited
    config.write_text(json.dumps({"chat_template": template}))
    _relisted(snap, "model/tokenizer_config.json")
    return snap


def test_a_snapshots_chat_template_is_not_evaluated_while_it_loads(made, tmp_path):
    snap = _with_chat_template(made, tmp_path, FOLDED_BOMB)
    validate_snapshot(snap)  # nothing else differs: the tier-0 restore would load it
    start = time.perf_counter()
    tokenizer = load_tokenizer(snap / "model")
    assert time.perf_counter() - start < 0.5
    with pytest.raises(BadRequest, match="repetition of 200000000 items"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    "template",
    [
        "{{ 'ab' * (messages | length * 100000000) }}",
        "{% autoescape 'ab' * 100000000 %}x{% endautoescape %}",
        "{{ 7 ** (messages | length * 100000000) }}",
        "{{ [0] * (messages | length * 100000000) }}",
    ],
)
def test_a_chat_template_that_would_make_a_huge_value_is_a_bad_request(template):
    compiled = compile_chat_template(template)
    with pytest.raises(Exception, match="more than allowed|bits") as info:
        compiled.render(messages=[{"role": "user", "content": "hi"}])
    assert "\n" not in str(info.value)


def test_a_template_that_fails_on_arithmetic_is_a_bad_request(made, tmp_path):
    snap = _with_chat_template(made, tmp_path, "{{ 1 / (messages | length - 1) }}")
    tokenizer = load_tokenizer(snap / "model")
    with pytest.raises(BadRequest, match="ZeroDivisionError"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("name", ["tokenizer_config.json", "chat_template.jinja"])
def test_a_tokenizer_file_larger_than_any_real_one_is_refused_unread(made, tmp_path, name):
    folder = tmp_path / "model"
    folder.mkdir()
    for path in (made.snapshot / "model").iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    with open(folder / name, "wb") as huge:  # sparse: 65 MiB that take no disk
        huge.truncate(65 << 20)
    with pytest.raises(CheckpointError, match="more than the 67108864 bytes"):
        load_tokenizer(folder)


def test_ordinary_templates_render_as_before():
    template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}{{ '-' * 3 }}{% endfor %}"
        "{{ 2 ** 10 }}{{ [1] * 2 }}{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    rendered = compile_chat_template(template).render(
        messages=[{"role": "user", "content": " hi "}], add_generation_prompt=True
    )
    assert rendered == "<user>hi---1024[1, 1]<assistant>"


# ---------------------------------------------------------------- JSON read twice, two ways


def test_json_naming_a_key_twice_is_refused():
    with pytest.raises(ValueError, match="names the key 'size' twice"):
        load_json('{"files": {"a": {"size": 1, "size": 2}}}')
    assert load_json('{"a": {"b": 1}, "b": {"b": 2}}') == {"a": {"b": 1}, "b": {"b": 2}}


def test_a_layout_table_naming_a_tensor_twice_is_refused(made, tmp_path):
    """The first entry of the name would be dropped unread: refused, not served."""

    def edit(doc: dict) -> None:
        layout = doc["llm"]["layout"]
        name, entry = next(iter(json.loads(layout)["tensors"].items()))
        bogus = json.dumps({**entry, "offset": 1 << 40})
        assert '"tensors": {' in layout
        doc["llm"]["layout"] = layout.replace(
            '"tensors": {', f'"tensors": {{"{name}": {bogus}, ', 1
        )

    snap = clone(made, tmp_path / "snap")
    write_edited(made, snap, edit)
    refusal = answered_by_fallback(made, snap)
    assert "twice" in refusal["reason"], refusal


def test_a_manifest_listing_a_file_twice_is_refused(made, tmp_path):
    snap = clone(made, tmp_path / "snap")
    doc = json.loads((snap / "manifest.json").read_text())
    text = json.dumps(doc)
    entry = json.dumps(doc["files"]["model/config.json"])
    fake = json.dumps({"size": 1, "sha256": "0" * 64})
    text = text.replace(
        f'"model/config.json": {entry}',
        f'"model/config.json": {fake}, "model/config.json": {entry}',
    )
    assert text.count('"model/config.json"') == 2
    (snap / "manifest.json").write_text(text)
    with pytest.raises(BadSnapshot, match="twice"):
        read_manifest(snap)


# ---------------------------------------------------------------- compile caches


@pytest.fixture(scope="module")
def function_snapshot(tmp_path_factory):
    """A user function's tier-0 snapshot whose caches hold one Triton file."""
    tmp = tmp_path_factory.mktemp("adversarial_fn")
    fn = Fn(tmp)
    triton = fn.cache / "compile" / "triton"
    triton.mkdir(parents=True)
    (triton / "launcher.so").write_bytes(b"compiled" * 100)
    init_and_snapshot(fn.make(), fn.snapshot, log=None)
    return fn


def _restore_caches_stage(fn: Fn, snap: Path, cache: Path):
    target = UserFunction(fn.spec, fn.folder, "cpu", cache)
    stages = dict(target.restore_stages(snap, read_manifest(snap)))
    return lambda: stages["restore_caches"]({})


def _copied(function_snapshot, tmp_path: Path) -> Path:
    snap = tmp_path / "snap"
    for path in sorted(function_snapshot.snapshot.rglob("*")):
        target = snap / path.relative_to(function_snapshot.snapshot)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.write_bytes(path.read_bytes())
    return snap


def test_a_cache_file_changed_after_validation_is_not_planted(function_snapshot, tmp_path):
    snap = _copied(function_snapshot, tmp_path)
    validate_snapshot(snap)
    run = _restore_caches_stage(function_snapshot, snap, tmp_path / "cache")
    (snap / "caches" / "triton" / "launcher.so").write_bytes(b"planted!" * 100)  # same size
    with pytest.raises(BadSnapshot, match="does not hold the bytes") as info:
        run()
    assert "\n" not in str(info.value)
    assert not any(p.is_file() for p in (tmp_path / "cache").rglob("*"))


def test_a_cache_file_added_after_validation_is_not_planted(function_snapshot, tmp_path):
    snap = _copied(function_snapshot, tmp_path)
    validate_snapshot(snap)
    run = _restore_caches_stage(function_snapshot, snap, tmp_path / "cache")
    (snap / "caches" / "triton" / "extra.py").write_text("import os; os.system('true')\n")
    with pytest.raises(BadSnapshot, match="not listed"):
        run()
    assert not (tmp_path / "cache" / "compile" / "triton" / "extra.py").exists()


def test_the_listed_caches_are_restored(function_snapshot, tmp_path):
    snap = _copied(function_snapshot, tmp_path)
    run = _restore_caches_stage(function_snapshot, snap, tmp_path / "cache")
    run()
    restored = tmp_path / "cache" / "compile" / "triton" / "launcher.so"
    assert restored.read_bytes() == b"compiled" * 100


@pytest.mark.parametrize("kind", ["symlink", "fifo", "symlinked folder"])
def test_a_link_or_special_file_in_the_caches_is_refused_not_followed(
    function_snapshot, tmp_path, kind
):
    """Swapped in after the validation: never read through, never copied."""
    snap = _copied(function_snapshot, tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "launcher.so").write_bytes(b"private!" * 100)  # what a link would leak
    triton = snap / "caches" / "triton"
    if kind == "symlink":
        (triton / "launcher.so").unlink()
        (triton / "launcher.so").symlink_to(outside / "launcher.so")
    elif kind == "fifo":
        (triton / "launcher.so").unlink()
        os.mkfifo(triton / "launcher.so")
    else:
        for path in triton.iterdir():
            path.unlink()
        triton.rmdir()
        triton.symlink_to(outside)
    cache = tmp_path / "cache"
    for listed in (None, read_manifest(function_snapshot.snapshot)["files"]):
        with pytest.raises(BadSnapshot, match="not a regular file|not a directory") as info:
            compile_caches.restore_caches(snap / "caches", cache, listed)
        assert "\n" not in str(info.value)
    assert not any(p.is_file() for p in cache.rglob("*"))


def test_the_llm_restore_checks_its_caches_against_the_manifest(made, tmp_path, monkeypatch):
    """The LLM's restore_caches stage hands the manifest's files to the copy, so a cache file
    changed after the validation is refused there too (as the function path's, above)."""
    from test_runtime_refusals import restored

    seen = []
    copy = compile_caches.restore_caches

    def recording(src, cache_dir, listed=None):
        seen.append(listed)
        return copy(src, cache_dir, listed)

    monkeypatch.setattr(compile_caches, "restore_caches", recording)
    snap = clone(made, tmp_path / "snap")
    fn, startup = restored(made, snap, named=True)
    try:
        assert startup.tier == "portable" and not startup.fallbacks
        assert seen == [read_manifest(snap)["files"]]
    finally:
        fn.release()


@pytest.mark.parametrize(
    "field, value, says",
    [
        ("num_hidden_layers", 20000, "builds 20000 layers, the weights hold"),
        ("vocab_size", 1 << 40, "makes an embedding of"),
        ("hidden_size", 1 << 20, "makes an embedding of"),
    ],
)
def test_a_config_json_naming_a_vast_model_is_refused_before_it_is_built(
    made, tmp_path, field, value, says
):
    """The snapshot's model/config.json is checked against its layout table before the model
    is built: a vast one is refused at once (20000 layers took seconds and a GB to build)."""
    snap = clone(made, tmp_path / "snap")
    config = snap / "model" / "config.json"
    doc = json.loads(config.read_bytes())
    doc[field] = value
    config.unlink()  # a hard link of the original: replaced, not edited
    config.write_text(json.dumps(doc))
    _relisted(snap, "model/config.json")
    started = time.monotonic()
    fallback = answered_by_fallback(made, snap)
    assert time.monotonic() - started < 30
    assert fallback["step"] == "build_model" and says in fallback["reason"], fallback
