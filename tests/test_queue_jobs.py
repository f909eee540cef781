"""The job wire format (`handler/queue/jobs.py`): what `parse_job` accepts, derives and refuses."""

from __future__ import annotations

import json

import pytest

from snapfn.handler.queue.jobs import parse_job
from snapfn.snapshot.errors import BadRequest


# ---- the wire format --------------------------------------------------------------------------
def test_parse_job_forms_and_derived_keys():
    s3_prefix = {"s3": "s3://bkt/out/"}
    job = parse_job(json.dumps({"id": "a-1", "prompt": "hi", "result": s3_prefix}))
    assert (
        job.prompts == ("hi",) and job.result.bucket == "bkt" and job.result.key == "out/a-1.json"
    )
    job = parse_job(
        json.dumps({"id": "b", "prompt_ids": [[1, 2], [3]], "result": {"s3": "s3://bkt/k.json"}})
    )
    assert job.prompts == ((1, 2), (3,)) and job.result.key == "k.json"
    job = parse_job(json.dumps({"id": "c", "event": {"x": 1}, "result": {"queue_url": "u"}}))
    assert job.event == {"x": 1} and job.prompts == ()
    body = {"id": "d", "prompts": ["a", "b"], "params": {"temperature": 0.7}, "result": s3_prefix}
    seeds = [parse_job(json.dumps(body)).sampling(i).seed for i in range(2)]
    assert None not in seeds and seeds[0] != seeds[1]  # derived per prompt …
    assert seeds == [parse_job(json.dumps(body)).sampling(i).seed for i in range(2)]  # … stably
    assert parse_job(json.dumps({**body, "params": {}})).sampling(0).seed is None  # greedy


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ("not json", "not JSON"),
        ('["a list"]', "JSON object"),
        ('{"prompt": "x", "result": {"s3": "s3://b/k"}}', "'id'"),
        ('{"id": "a/b", "prompt": "x", "result": {"s3": "s3://b/k"}}', "'id'"),
        ('{"id": "a", "result": {"s3": "s3://b/k"}}', "exactly one of"),
        (
            '{"id": "a", "prompt": "x", "prompts": ["y"], "result": {"s3": "s3://b/k"}}',
            "exactly one",
        ),
        ('{"id": "a", "prompt": "x"}', "'result'"),
        ('{"id": "a", "event": null, "result": {"s3": "s3://b/k"}}', "'event' must be"),
        ('{"id": "a", "prompt": "x", "parms": {}, "result": {"s3": "s3://b/k"}}', "unknown fields"),
        ('{"id": "a", "prompt": "x", "result": {"s3": "http://b/k"}}', "s3://"),
        (
            '{"id": "a", "prompt": "x", "params": {"max_tokens": 0}, "result": {"s3": "s3://b/k"}}',
            "max_new_tokens",
        ),
        (
            '{"id": "a", "prompt": "x", "params": {"beam": 2}, "result": {"s3": "s3://b/k"}}',
            "unknown params",
        ),
        (
            '{"id": "a", "prompt": "x", "params": {"top_k": true}, "result": {"s3": "s3://b/k"}}',
            "wrong type",
        ),
        ('{"id": "a", "prompt_ids": [1, "2"], "result": {"s3": "s3://b/k"}}', "prompt_ids"),
        (
            '{"id": "a", "prompt": "x", "params": {"temperature": 2.5}, "result": {"s3": "s3://b/k"}}',
            "temperature must be in",
        ),
        (
            '{"id": "a", "prompt": "x", "params": {"repetition_penalty": 0}, '
            '"result": {"s3": "s3://b/k"}}',
            "repetition_penalty",
        ),
        (
            '{"id": "a", "prompt": "x", "params": {"stop_token_ids": ["2"]}, '
            '"result": {"s3": "s3://b/k"}}',
            "stop_token_ids",
        ),
    ],
)
def test_parse_job_refuses_bad_jobs_saying_what_to_fix(body, says):
    with pytest.raises(BadRequest, match=says):
        parse_job(body)


def test_params_take_what_the_api_takes():
    params = {
        "presence_penalty": 0.5,
        "frequency_penalty": -1,
        "repetition_penalty": 1.2,
        "stop_token_ids": [2, 7],
        "temperature": 2,
    }
    body = {"id": "p", "prompt": "hi", "params": params, "result": {"s3": "s3://b/k"}}
    p = parse_job(json.dumps(body)).params
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -1.0, 1.2)
    assert p.stop_token_ids == (2, 7) and p.temperature == 2.0
