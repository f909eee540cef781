"""Structured output on a CUDA device: the bitmask applied on the logits' device, and a restored
worker's first structured request, which compiles nothing and is as fast as its tenth."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)"
    ),
]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_the_mask_is_applied_on_the_logits_device():
    from snapfn.handler.llm.structured.bitmask import allowed_tokens

    words = torch.tensor([[0b101, 0]], dtype=torch.int32, device="cuda")
    allowed = allowed_tokens(words, 64)
    assert allowed.is_cuda and allowed[0].nonzero().flatten().tolist() == [0, 2]


def test_a_restored_workers_first_structured_request_is_as_fast_as_its_tenth(tmp_path):
    import jsonschema

    from snapfn.handler.llm.embedded import embedded_model_dir
    from snapfn.handler.llm.engine.request import SamplingParams
    from snapfn.handler.llm.init_config import InitConfig
    from snapfn.handler.llm.recipes.function import LLMFunction
    from snapfn.handler.llm.structured.spec import spec_from_fields
    from snapfn.snapshot.runtime import init_and_snapshot, restore

    (tmp_path / "schemas.json").write_text(json.dumps([{"guided_json": SCHEMA}]))
    config = InitConfig(device="cuda", cache_dir=tmp_path / "c")
    made = replace(config, structured_schemas=tmp_path / "schemas.json")
    init_and_snapshot(LLMFunction(made, embedded_model_dir()), tmp_path / "snap", log=None)
    fn, startup = restore(lambda: LLMFunction(config, None), tmp_path / "snap", log=None)
    try:
        assert startup.tier == "portable" and startup.stage("grammars").figures["compiled"] == 1
        prompt = fn.engine.tokenizer.encode("The record is")
        params = SamplingParams(max_new_tokens=48, guide=spec_from_fields({"guided_json": SCHEMA}))
        graphs = fn.engine.graph_stats
        times, captures = [], []
        for _ in range(10):
            captured, start = graphs.capture_s, time.perf_counter()
            (result,) = fn.engine.generate([prompt], params)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            captures.append(graphs.capture_s - captured)
            jsonschema.validate(json.loads(result.text), SCHEMA)
        stats = fn.engine.grammars.stats()
        assert stats["misses"] == 0 and stats["hits"] == 10  # the first compiled nothing
        # the first request's first decode step captures the batch-1 decode graph (a tier-0
        # restore captures each bucket at its first use: InitConfig.restore_graphs_on_first_use),
        # timed by the graphs' own counter; apart from it the first is as fast as the tenth
        assert captures[0] > 0 and not any(captures[1:]), captures
        assert times[0] - captures[0] <= 1.5 * times[-1] + 0.005, (times, captures)
    finally:
        fn.release()
