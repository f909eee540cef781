"""Tokenizer, chat template and streaming detokenizer, checked against transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from snapfn.handler.llm.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop
from snapfn.snapshot.errors import BadRequest, CheckpointError

SPECIALS = ["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>"]
SENTENCES = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "a stop string may straddle tokens; STOP here means stop.",
    "héllo wörld, café au lait and crème brûlée.",
    "tokens, tokens everywhere: 1 2 3 4 5 6 7 8 9 10",
] * 20
TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}\n"
    "<|{{ message['role'] }}|>\n"
    "{{ message['content'] | trim }}{{ eos_token }}\n"
    "{% endfor %}\n"
    "{% if tools %}tools: {{ tools | tojson }}\n{% endif %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "Be brief.  "},
    {"role": "user", "content": "héllo wörld 日本語 🙂"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "once more"},
]
TEXTS = ["hello world", "héllo wörld 日本語 🙂", " leading space", "<s> literal special", ""]


def train_backend() -> BackendTokenizer:
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(SENTENCES, trainer=trainer)
    return backend


def write_model_dir(
    path: Path, *, bos_in_post_processor: bool = True, **config_overrides: object
) -> Path:
    backend = train_backend()
    if bos_in_post_processor:
        bos_id = backend.token_to_id("<s>")
        backend.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
        )
    backend.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True},
        "pad_token": "<pad>",
        "add_bos_token": True,
        "clean_up_tokenization_spaces": False,
        "chat_template": TEMPLATE,
    }
    config.update(config_overrides)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def reference(model_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(model_dir)


def test_encode_and_decode_match_transformers(tokenizer, reference):
    for text in TEXTS:
        for special in (True, False):
            ids = tokenizer.encode(text, add_special_tokens=special)
            assert ids == reference.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                assert tokenizer.decode(ids, skip) == reference.decode(
                    ids, skip_special_tokens=skip
                )
    assert tokenizer.encode("hi")[0] == tokenizer.token_to_id("<s>")
    assert tokenizer.vocab_size == len(reference)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tokenizer, reference, add_generation_prompt):
    tools = [{"type": "function", "function": {"name": "f", "description": "é <b>"}}]
    for kwargs in ({}, {"tools": tools}):
        ours = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt, **kwargs)
        theirs = reference.apply_chat_template(
            MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
        )
        assert ours == theirs
    assert ours.startswith("<s><|system|>\nBe brief.</s>\n<|user|>")  # trim_blocks ate a newline
    assert '"é <b>"' in ours  # tojson without HTML escaping


def test_chat_template_file_and_named_list_are_read(tmp_path, reference):
    listed = [{"name": "tool_use", "template": "nope"}, {"name": "default", "template": TEMPLATE}]
    list_dir = write_model_dir(tmp_path)
    (list_dir / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "chat_template": listed})
    )
    expected = reference.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert Tokenizer.from_dir(list_dir).apply_chat_template(MESSAGES) == expected
    (list_dir / "chat_template.jinja").write_text("{{ messages | length }}{{ eos_token }}")
    assert Tokenizer.from_dir(list_dir).apply_chat_template(MESSAGES) == "4</s>"


def test_chat_template_errors_are_bad_requests(tokenizer, tmp_path):
    with pytest.raises(BadRequest, match="unknown role tool"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}])
    unsafe = write_model_dir(tmp_path, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(BadRequest, match="unsafe"):
        Tokenizer.from_dir(unsafe).apply_chat_template(MESSAGES)
    mutating = write_model_dir(tmp_path, chat_template="{{ messages.append(1) }}")
    with pytest.raises(BadRequest, match="unsafe"):
        Tokenizer.from_dir(mutating).apply_chat_template(MESSAGES)
    no_template = write_model_dir(tmp_path, chat_template=None)
    with pytest.raises(BadRequest, match="no chat template"):
        Tokenizer.from_dir(no_template).apply_chat_template(MESSAGES)


def test_eos_ids_merge_all_configs(tmp_path):
    model_dir = write_model_dir(tmp_path)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [4, 5]}))
    (model_dir / "config.json").write_text(json.dumps({"eos_token_id": 3}))
    tokenizer = Tokenizer.from_dir(model_dir)
    assert tokenizer.eos_token_ids == frozenset({tokenizer.token_to_id("</s>"), 3, 4, 5})


def test_add_bos_token_prepends_when_post_processor_does_not(tmp_path):
    with_flag = Tokenizer.from_dir(write_model_dir(tmp_path, bos_in_post_processor=False))
    bos = with_flag.token_to_id("<s>")
    assert with_flag.encode("hello")[0] == bos
    assert with_flag.encode("hello")[1:] == with_flag.encode("hello", add_special_tokens=False)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    assert Tokenizer.from_dir(tmp_path).encode("hello")[0] != bos


def test_missing_files_are_checkpoint_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    write_model_dir(tmp_path, eos_token="<|missing|>")
    with pytest.raises(CheckpointError, match="missing"):
        Tokenizer.from_dir(tmp_path)


def stream(tokenizer: Tokenizer, ids: list[int]) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push(i) for i in ids]
    return deltas, detok


def test_incremental_detokenizer_equals_full_decode_on_multibyte_text(tokenizer):
    text = "héllo wörld 日本語 🙂 done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.encode("utf-8")) // 2, "multi-byte characters should span tokens"
    deltas, detok = stream(tokenizer, ids)
    assert "".join(deltas) == detok.text == tokenizer.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # some ids ended mid-character and were held back


def test_incremental_detokenizer_holds_then_flushes_broken_bytes(tokenizer):
    ids = tokenizer.encode("ok 🙂", add_special_tokens=False)
    deltas, detok = stream(tokenizer, ids[:-1])  # cut inside the emoji's 4 bytes
    assert detok.text == "ok "
    assert detok.flush().endswith("\ufffd")


def test_incremental_detokenizer_skips_special_tokens(tokenizer):
    eos = tokenizer.token_to_id("</s>")
    ids = [*tokenizer.encode("hello", add_special_tokens=False), eos]
    assert "".join(stream(tokenizer, ids)[0]) == "hello"


def test_incremental_detokenizer_context_ids_are_not_emitted(tokenizer):
    context = tokenizer.encode("the quick brown", add_special_tokens=False)
    generated = tokenizer.encode(" fox jumps", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, context_ids=context)
    assert "".join(detok.push(i) for i in generated) == detok.text == " fox jumps"


def test_stop_string_found_across_token_boundaries(tokenizer):
    text, stop = "the fox said STOP and more", "id STOP a"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert all(stop not in tokenizer.decode([i]) for i in ids), "the stop must span tokens"
    detok, found, num_pushed = IncrementalDetokenizer(tokenizer), None, 0
    while found is None and num_pushed < len(ids):
        start = len(detok.text)
        detok.push(ids[num_pushed])
        num_pushed += 1
        found = find_stop(detok.text, ["nope", stop], start)
    assert found == text.index(stop)
    assert detok.text == text[: len(detok.text)] and len(detok.text) < len(text)
    assert len(detok.text) - len(tokenizer.decode([ids[num_pushed - 1]])) < found + len(stop)


def test_find_stop_overlaps_back_and_picks_earliest():
    assert find_stop("abcSTO", ["STOP"], 3) is None
    assert find_stop("abcSTOP", ["STOP"], 6) == 3  # straddles the old/new boundary
    # a match wholly before start - len(stop) + 1 is old news and is not rescanned
    assert find_stop("STOP abc STOP", ["STOP"], 10) == 9
    assert find_stop("xx END yy STOP", ["STOP", "END"], 0) == 3
    assert find_stop("anything", ["", "zz"], 0) is None


def test_generation_tag_and_loop_controls_match_transformers(tmp_path):
    template = (
        "{% for m in messages %}{% if loop.index > 3 %}{% break %}{% endif %}"
        "{% if m.role == 'assistant' %}{% generation %}[{{ m.content }}]{% endgeneration %}"
        "{% else %}{{ m.content }}{% endif %}{% endfor %}"
    )
    model_dir = write_model_dir(tmp_path, chat_template=template)
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(model_dir)
    ours = Tokenizer.from_dir(model_dir).apply_chat_template(MESSAGES)
    assert ours == reference.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    assert ours == "Be brief.  héllo wörld 日本語 🙂[hello]"
