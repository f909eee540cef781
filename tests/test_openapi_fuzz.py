"""Fuzz the published OpenAPI document against the Flask app (schemathesis, WSGI, no network).

Schema-valid and schema-violating requests to every operation: no response may be a 5xx, every
status code and content type must be documented, and JSON bodies must match their schemas.
Bounded: a fixed number of examples per operation, generated deterministically (reproducible
in CI), on a tiny model whose context (64 tokens) bounds every generation.
"""

from __future__ import annotations

import re

import pytest
import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from snapfn.handler.function.runtime import WorkerRuntime
from snapfn.handler.function.target import ServeTarget
from snapfn.handler.http.app import create_app
from snapfn.handler.http.openapi import openapi_document
from snapfn.handler.http.serve_config import ServeConfig
from snapfn.handler.llm.init_config import InitConfig

MODEL = "tiny"
MAX_EXAMPLES = 30  # per operation and generation mode
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


@pytest.fixture(scope="module")
def runtime(llama_with_tokenizer, tmp_path_factory):
    config = InitConfig(
        kv_cache_bytes_cpu=4 << 20, max_model_len=64, cache_dir=tmp_path_factory.mktemp("c")
    )
    rt = WorkerRuntime(ServeTarget(model_dir=llama_with_tokenizer, init_config=config))
    rt.start(background=False)
    yield rt
    rt.close()


@pytest.fixture(scope="module")
def app(runtime):
    return create_app(runtime, ServeConfig(model_name=MODEL, max_choices=4))


# NOTE: built from the document itself rather than lazily from the app fixture: schemathesis'
# lazy fixture loader does not work under pytest 9; the next test checks that the app serves
# exactly this document.
schema = schemathesis.openapi.from_dict(openapi_document(MODEL))
schema.config.generation.update(
    modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
    max_examples=MAX_EXAMPLES,
    deterministic=True,
    database="none",
)


def test_the_app_serves_this_document_and_it_names_every_route(app):
    assert app.test_client().get("/openapi.json").json == schema.raw_schema
    routes = {
        re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule.rule)  # Flask's <path:x> is OpenAPI's {x}
        for rule in app.url_map.iter_rules()
        if rule.endpoint != "static"
    }
    assert routes == set(schema.raw_schema["paths"])


@schema.parametrize()
def test_no_server_errors_and_responses_match_the_document(case, app):
    case.call_and_validate(app=app, checks=CHECKS)
