"""Structured output (handler/llm/structured/): specs from request fields, the compile cache,
masked sampling that yields outputs matching their schema, regex, grammar or choices (greedy and
seeded), and the configured grammars carried by a snapshot into its restore."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from snapfn.handler.llm.engine.request import SamplingParams
from snapfn.handler.llm.structured.bitmask import allowed_tokens, mask_logits
from snapfn.handler.llm.structured.spec import GrammarSpec, InvalidGuide, spec_from_fields
from snapfn.snapshot.errors import BadRequest, InitFailed

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
SCHEMAS = {
    "required_fields": PERSON,
    "enum": {
        "type": "object",
        "properties": {"mood": {"enum": ["happy", "sad", "calm"]}},
        "required": ["mood"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "enum": ["a", "b", "c"]},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": PERSON,
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    "number_ranges": {
        "type": "object",
        "properties": {
            "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
            "count": {"type": "integer", "exclusiveMinimum": 3, "maximum": 9},
        },
        "required": ["score", "count"],
        "additionalProperties": False,
    },
}
SAMPLING = {"greedy": {}, "seeded": {"temperature": 1.0, "seed": 11}}


@pytest.fixture(scope="module")
def engine():
    from snapfn.handler.llm.build import build_engine
    from snapfn.handler.llm.embedded import embedded_model_dir
    from snapfn.handler.llm.structured.compiler import GrammarCache

    loaded = build_engine(embedded_model_dir())
    e = loaded.engine
    e.attach_grammars(GrammarCache(e.tokenizer, loaded.config.vocab_size, e.eos_token_ids))
    return e


def run(engine, spec: GrammarSpec, max_new_tokens: int = 96, **params):
    prompt = engine.tokenizer.encode("The answer is")
    p = SamplingParams(max_new_tokens=max_new_tokens, guide=spec, **params)
    return engine.generate([prompt], p)[0]


# ---- specs ----------------------------------------------------------------------------------
def test_response_format_and_guided_json_are_one_spec():
    a = spec_from_fields(
        {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}}
    )
    b = spec_from_fields({"guided_json": PERSON})
    c = spec_from_fields({"guided_json": json.dumps(PERSON, indent=2)})
    assert a == b == c and a.kind == "json_schema"
    assert list(json.loads(a.text)["properties"]) == ["name", "age"]  # the order sent
    assert spec_from_fields({"response_format": {"type": "text"}}) is None
    assert spec_from_fields({}) is None


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema"),
        ({"response_format": {"type": "yaml"}}, "response_format", "'json_object'"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_json": [1, 2]}, "guided_json", "JSON schema"),
        ({"guided_regex": ""}, "guided_regex", "non-empty"),
        ({"guided_choice": []}, "guided_choice", "list of 1"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice", "send one of them"),
    ],
)
def test_a_malformed_spec_names_its_field(fields, param, says):
    with pytest.raises(InvalidGuide) as caught:
        spec_from_fields(fields)
    assert caught.value.param == param and says in str(caught.value)


def test_sampling_params_carry_the_spec_through_json():
    params = SamplingParams(guide=spec_from_fields({"guided_regex": "[a-z]+"}))
    wire = json.loads(json.dumps(params.to_json()))
    assert SamplingParams.from_json(wire) == params
    assert SamplingParams.from_json(SamplingParams().to_json()).guide is None
    assert not params.plain_greedy  # a guided row never takes the unmasked fast path


# ---- the bitmask ----------------------------------------------------------------------------
def test_bitmask_unpacks_bit_t_of_word_t_over_32():
    words = torch.tensor([[0b101, -(1 << 31)], [0, 1]], dtype=torch.int32)
    allowed = allowed_tokens(words, 40)  # token 63 (bit 31 of word 1) is past the vocabulary
    assert allowed.shape == (2, 40)
    assert allowed[0].nonzero().flatten().tolist() == [0, 2]
    assert allowed[1].nonzero().flatten().tolist() == [32]
    assert allowed_tokens(words, 64)[0].nonzero().flatten().tolist() == [0, 2, 63]


def test_mask_leaves_unconstrained_rows_and_the_input_alone(engine):
    matcher = engine.grammars.matcher(spec_from_fields({"guided_choice": ["yes", "no"]}))
    logits = torch.randn(2, engine.model.config.vocab_size)
    before = logits.clone()
    masked = mask_logits(logits, [None, matcher])
    assert torch.equal(logits, before) and torch.equal(masked[0], logits[0])
    allowed = torch.isfinite(masked[1]).nonzero().flatten().tolist()
    texts = [engine.tokenizer.decode([t]) for t in allowed]
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts), texts


# ---- outputs --------------------------------------------------------------------------------
@pytest.mark.parametrize("sampling", sorted(SAMPLING))
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_parse_and_validate(engine, name, sampling):
    result = run(engine, spec_from_fields({"guided_json": SCHEMAS[name]}), **SAMPLING[sampling])
    assert result.finish_reason == "stop", result.text
    jsonschema.validate(json.loads(result.text), SCHEMAS[name])


@pytest.mark.parametrize("sampling", sorted(SAMPLING))
def test_json_object_is_a_json_object(engine, sampling):
    quote, close = engine.tokenizer.encode('"', False), engine.tokenizer.encode("}", False)
    bias = tuple((t, 30.0) for t in quote + close)  # the toy model would write keys forever
    spec = spec_from_fields({"response_format": {"type": "json_object"}})
    result = run(engine, spec, logit_bias=bias, **SAMPLING[sampling])
    assert result.finish_reason == "stop" and isinstance(json.loads(result.text), dict)


@pytest.mark.parametrize("sampling", sorted(SAMPLING))
def test_regex_grammar_and_choice_outputs_match(engine, sampling):
    params = SAMPLING[sampling]
    regex = "[0-9]{3}-[a-z]{2,4}"
    text = run(engine, spec_from_fields({"guided_regex": regex}), **params).text
    assert re.fullmatch(regex, text), text
    choices = ["yes", "no", "perhaps"]
    result = run(engine, spec_from_fields({"guided_choice": choices}), **params)
    assert result.text in choices and result.finish_reason == "stop"
    lark = 'start: "(" NUM ("+" NUM){0,3} ")"\nNUM: /[1-9][0-9]?/'
    result = run(engine, spec_from_fields({"guided_grammar": lark}), **params)
    assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?){0,3}\)", result.text), result.text


def test_a_guided_request_in_a_greedy_batch_leaves_the_others_as_alone(engine):
    prompt = engine.tokenizer.encode("The answer is")
    plain = SamplingParams(max_new_tokens=8, ignore_eos=True)
    alone = engine.generate([prompt], plain)[0].token_ids
    guided = SamplingParams(max_new_tokens=8, guide=spec_from_fields({"guided_regex": "[0-9]+"}))
    together = engine.generate([prompt, prompt], [plain, guided])
    assert together[0].token_ids == alone
    assert re.fullmatch("[0-9]+", together[1].text)


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"guided_regex": "[a-z"}, "the regex does not compile"),
        ({"guided_json": {"type": "frobnicate"}}, "the JSON schema does not compile"),
        ({"guided_grammar": "start: undefined_rule"}, "the grammar does not compile"),
    ],
)
def test_a_spec_that_does_not_compile_is_refused_saying_so(engine, fields, says):
    before = engine.grammars.stats()["entries"]
    with pytest.raises(BadRequest, match=says):
        engine.check_request([1, 2], SamplingParams(guide=spec_from_fields(fields)))
    assert engine.grammars.stats()["entries"] == before  # nothing cached for it


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"guided_json": {"$ref": "#"}}, "response_format", "no output can match it"),
        ({"guided_grammar": "start: a\na: a"}, "guided_grammar", "no output can match it"),
        ({"guided_regex": "[a-z"}, "guided_regex", "parse error: unclosed character class"),
        ({"guided_json": False}, "response_format", "the schema is false"),
    ],
)
def test_a_compile_error_names_its_field_and_a_one_line_reason(engine, fields, param, says):
    with pytest.raises(InvalidGuide) as caught:
        engine.check_request([1, 2], SamplingParams(guide=spec_from_fields(fields)))
    message = str(caught.value)
    assert caught.value.param == param and says in message
    assert message.startswith(f"'{param}'") and "<state>" not in message and len(message) < 400


def test_the_boolean_schema_true_is_any_json_value(engine):
    fields = {"response_format": {"type": "json_schema", "json_schema": {"schema": True}}}
    out = run(engine, spec_from_fields(fields), **SAMPLING["seeded"])
    assert out.finish_reason == "stop"
    json.loads(out.text)  # any value, not only an object (this seed writes `true`)


# ---- the compile cache ----------------------------------------------------------------------
def test_cache_counts_hits_and_misses_and_drops_the_least_recently_used(engine):
    from snapfn.handler.llm.structured.compiler import GrammarCache

    vocab = engine.model.config.vocab_size
    cache = GrammarCache(engine.tokenizer, vocab, engine.eos_token_ids, max_entries=2)
    specs = [GrammarSpec("regex", f"a{k}+") for k in range(3)]
    assert cache.preload(specs[:1])["compiled"] == 1
    cache.matcher(specs[0])
    cache.matcher(specs[1])
    cache.matcher(specs[1])
    cache.matcher(specs[2])  # drops specs[0], the least recently used
    cache.matcher(specs[0])
    stats = cache.stats()
    assert (stats["hits"], stats["misses"], stats["preloaded"]) == (2, 3, 1)
    assert stats["entries"] == 2 and stats["compile_s"] > 0


# ---- configured grammars and the snapshot ---------------------------------------------------
CONFIGURED = [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}},
    {"guided_regex": "[0-9]{3}-[a-z]{2,4}"},
    {"guided_choice": ["yes", "no"]},
]


def _config(tmp, schemas):
    from snapfn.handler.llm.init_config import InitConfig

    return InitConfig(
        max_num_batched_tokens=64,
        kv_cache_bytes_cpu=1 << 20,
        cache_dir=tmp / "cache",
        structured_schemas=schemas,
    )


@pytest.fixture(scope="module")
def configured_snapshot(tmp_path_factory):
    from snapfn.handler.llm.embedded import embedded_model_dir
    from snapfn.handler.llm.recipes.function import LLMFunction
    from snapfn.snapshot.runtime import init_and_snapshot

    tmp = tmp_path_factory.mktemp("structured")
    (tmp / "schemas.json").write_text(json.dumps(CONFIGURED))
    fn = LLMFunction(_config(tmp, tmp / "schemas.json"), embedded_model_dir())
    startup = init_and_snapshot(fn, tmp / "snap", log=None)
    fn.release()
    return tmp, startup


def _restore(tmp, snap, named=False):
    from snapfn.handler.llm.embedded import embedded_model_dir
    from snapfn.handler.llm.recipes.function import LLMFunction
    from snapfn.handler.llm.recipes.sources import llm_fallback
    from snapfn.snapshot.runtime import restore

    config = _config(tmp, None)  # the restore's own config names no schemas
    model = embedded_model_dir() if named else None
    return restore(
        lambda: LLMFunction(config, model),
        snap,
        fallback=llm_fallback(config, model),
        log=None,
    )


@pytest.mark.slow
def test_a_restore_compiles_the_recorded_grammars_before_its_first_request(configured_snapshot):
    tmp, made = configured_snapshot
    stage = made.stage("grammars")
    assert stage.figures["compiled"] == len(CONFIGURED)
    manifest = json.loads((tmp / "snap" / "manifest.json").read_text())
    assert len(manifest["llm"]["grammars"]) == len(CONFIGURED)
    fn, startup = _restore(tmp, tmp / "snap")
    try:
        assert startup.tier == "portable" and not startup.fallbacks
        assert startup.stage("grammars").figures["compiled"] == len(CONFIGURED)
        cache = fn.engine.grammars
        for entry in CONFIGURED:
            result = run(fn.engine, spec_from_fields(entry), max_new_tokens=64)
            assert result.finish_reason == "stop"
        stats = cache.stats()
        assert stats["misses"] == 0 and stats["hits"] == len(CONFIGURED)
        assert stats["preloaded"] == len(CONFIGURED)
        jsonschema.validate(
            json.loads(run(fn.engine, spec_from_fields(CONFIGURED[0])).text), PERSON
        )
    finally:
        fn.release()


@pytest.mark.slow
@pytest.mark.parametrize(
    "tamper",
    [
        lambda g: g.append({"kind": "pickle", "text": "x"}),
        lambda g: g.__setitem__(0, {"kind": "regex"}),
        lambda g: g.__setitem__(1, {"kind": "regex", "text": "[unclosed"}),
    ],
    ids=["unknown_kind", "missing_text", "does_not_compile"],
)
def test_a_tampered_grammar_entry_is_refused_and_the_restore_falls_back(
    configured_snapshot, tmp_path, tamper
):
    import shutil

    tmp, _ = configured_snapshot
    snap = shutil.copytree(tmp / "snap", tmp_path / "snap")
    doc = json.loads((snap / "manifest.json").read_text())
    tamper(doc["llm"]["grammars"])
    (snap / "manifest.json").write_text(json.dumps(doc))
    fn, startup = _restore(tmp, snap, named=True)
    try:
        assert startup.tier == "cold (fallback)"
        reason = startup.fallbacks[0]["reason"]
        assert "grammars" in reason and "\n" not in reason, reason
    finally:
        fn.release()


def test_a_configured_list_with_a_bad_entry_fails_the_init_naming_it(tmp_path):
    from snapfn.handler.llm.structured.configured import read_configured_specs

    path = tmp_path / "schemas.json"
    path.write_text(json.dumps([{"guided_regex": "a+"}, {"response_format": {"type": "text"}}]))
    with pytest.raises(InitFailed, match="entry 1 asks for no structured output"):
        read_configured_specs(path)
    path.write_text(json.dumps([{"guided_regex": "a+"}, {"guided_regex": "a+"}]))
    assert read_configured_specs(path) == [GrammarSpec("regex", "a+")]


def test_without_llguidance_a_structured_request_is_a_bad_request(engine, monkeypatch):
    """A machine without llguidance serves every other request; a guided one is refused
    saying what to install (nothing about grammars runs at start-up without configured specs)."""
    import sys

    from snapfn.handler.llm.structured.compiler import GrammarCache

    monkeypatch.setitem(sys.modules, "llguidance", None)  # `import llguidance` fails
    vocab = engine.model.config.vocab_size
    cache = GrammarCache(engine.tokenizer, vocab, engine.eos_token_ids)
    spec = spec_from_fields({"guided_regex": "[ab]+"})
    with pytest.raises(BadRequest, match="needs the llguidance package"):
        cache.matcher(spec)
