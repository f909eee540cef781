"""Prompts warmed into the prefix cache at start-up (recipes/prefix_warm.py): configured for
the init, recorded in the snapshot, prefilled again by the restore; bad files and tampered
records refused."""

from __future__ import annotations

import json

import pytest

from snapfn.handler.llm.engine.request import SamplingParams
from snapfn.handler.llm.init_config import InitConfig
from snapfn.handler.llm.recipes.function import LLMFunction
from snapfn.handler.llm.recipes.prefix_warm import check_warm_prompts, read_warm_prompts
from snapfn.snapshot.errors import BadSnapshot, InitFailed
from snapfn.snapshot.portable.format import read_manifest
from snapfn.snapshot.runtime import cold_init, init_and_snapshot, restore

SYSTEM = "You are a careful assistant. Answer in one short sentence, and say so when unsure. " * 3


def config(tmp_path, warm=None) -> InitConfig:
    return InitConfig(
        page_size=4,
        max_num_batched_tokens=256,
        kv_cache_bytes_cpu=4 << 20,
        cache_dir=tmp_path / "cache",
        prefix_warm=warm,
    )


def warm_file(tmp_path, prompts) -> object:
    path = tmp_path / "warm.json"
    path.write_text(json.dumps(prompts))
    return path


def asked(fn, question: str) -> int:
    """The prompt tokens a request of SYSTEM + `question` found cached."""
    ids = fn.engine.tokenizer.encode(SYSTEM + question)
    rid = fn.engine.add_request(ids, SamplingParams(max_new_tokens=1, ignore_eos=True))
    req = fn.engine._requests[rid]
    while fn.engine.has_work():
        fn.engine.step()
    return req.cached_tokens


def test_the_init_warms_records_and_the_restore_warms_again(llama_with_tokenizer, tmp_path):
    path = warm_file(tmp_path, [SYSTEM, SYSTEM, "a second, shorter prompt for the cache"])
    made = LLMFunction(config(tmp_path, path), llama_with_tokenizer)
    startup = init_and_snapshot(made, tmp_path / "snap", log=None)
    figures = startup.stage("prefix_warm").figures
    assert figures["prompts"] == 2 and figures["cached_pages"] > 0  # the repeat counted once
    section = read_manifest(tmp_path / "snap")["llm"]
    assert section["prefix_warm"] == [SYSTEM, "a second, shorter prompt for the cache"]
    assert asked(made, " What is two and two?") > 0

    # the restore's own configuration names no file: the snapshot's list is what it warms
    fn, restored = restore(
        lambda: LLMFunction(config(tmp_path / "r"), llama_with_tokenizer),
        tmp_path / "snap",
        log=None,
    )
    assert restored.tier == "portable"
    assert restored.stage("prefix_warm").figures["cached_pages"] == figures["cached_pages"]
    assert asked(fn, " What is two and two?") > 0


def test_no_file_no_stage(llama_with_tokenizer, tmp_path):
    startup = cold_init(LLMFunction(config(tmp_path), llama_with_tokenizer), log=None)
    assert "prefix_warm" not in [s.name for s in startup.stages]


@pytest.mark.parametrize(
    "text, says",
    [
        ("{not json", "not JSON"),
        ('{"a": 1}', "not a list"),
        ('["ok", 5]', "entry 1 is not a prompt text"),
        ('[""]', "entry 0 is not a prompt text"),
        (json.dumps(["x"] * 65), "at most 64"),
    ],
)
def test_a_bad_file_fails_the_init_naming_it(tmp_path, text, says):
    path = tmp_path / "warm.json"
    path.write_text(text)
    with pytest.raises(InitFailed, match=says):
        read_warm_prompts(path)


def test_a_missing_file_fails_the_init(tmp_path):
    with pytest.raises(InitFailed, match="cannot be read"):
        read_warm_prompts(tmp_path / "none.json")


@pytest.mark.parametrize("value", ["a prompt", {"0": "x"}, [1], [""], ["x"] * 65, [None]])
def test_a_tampered_record_is_refused(value):
    with pytest.raises(BadSnapshot, match="prefix_warm"):
        check_warm_prompts(value)
