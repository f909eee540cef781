"""The OpenAPI document (`handler/http/openapi.py`): its request schemas are the request models'.

No app and no model here: the document is a pure function of the models in
`openai/schema.py` and the deployment's model name (the fuzz test runs it against the app).
"""

from __future__ import annotations

import json
import subprocess
import sys

from snapfn.handler.http.openai import schema as request_schema
from snapfn.handler.http.openai.schema import GENERATION_MODELS, REQUEST_MODELS, StrictModel
from snapfn.handler.http.openapi import REF_TEMPLATE, openapi_document

MODEL = "tiny"


def refs(value) -> set[str]:
    """Every `$ref` in a JSON value."""
    if isinstance(value, dict):
        found = {value["$ref"]} if isinstance(value.get("$ref"), str) else set()
        return found.union(*(refs(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(refs(v) for v in value))
    return set()


def test_every_request_model_is_published_as_pydantic_writes_it():
    schemas = openapi_document(MODEL)["components"]["schemas"]
    for model in REQUEST_MODELS:
        published = json.loads(json.dumps(schemas[model.__name__]))
        assert published["properties"].pop("model") == {
            **model.model_json_schema()["properties"]["model"],
            "enum": [MODEL, None],  # null: left out, the served one
        }
        own = model.model_json_schema(ref_template=REF_TEMPLATE)
        own.pop("$defs", None)
        own["properties"].pop("model")
        assert published == own


def test_the_request_properties_are_the_models_fields():
    schemas = openapi_document(MODEL)["components"]["schemas"]
    for model in REQUEST_MODELS:
        schema = schemas[model.__name__]
        assert list(schema["properties"]) == list(model.model_fields)
        required = [name for name, field in model.model_fields.items() if field.is_required()]
        assert schema["required"] == required
        assert schema["additionalProperties"] is True  # unknown fields are ignored


def test_every_model_a_request_uses_is_a_component_and_every_ref_resolves():
    document = openapi_document(MODEL)
    schemas = document["components"]["schemas"]
    used = {"ChatMessage", "TextPart", "StreamOptions", "ResponseFormat"}
    assert used <= set(schemas)
    assert all(issubclass(getattr(request_schema, name), StrictModel) for name in used)
    assert refs(document) == {REF_TEMPLATE.format(model=name) for name in schemas}


def test_the_generation_paths_take_the_request_models():
    paths = openapi_document(MODEL)["paths"]
    for path, model in zip(
        ("/v1/completions", "/v1/chat/completions"), GENERATION_MODELS, strict=True
    ):
        body = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": REF_TEMPLATE.format(model=model.__name__)}


def test_tokenize_takes_either_shape_and_detokenize_its_model():
    paths = openapi_document(MODEL)["paths"]
    body = paths["/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {
        "anyOf": [
            {"$ref": REF_TEMPLATE.format(model="TokenizeCompletionRequest")},
            {"$ref": REF_TEMPLATE.format(model="TokenizeChatRequest")},
        ]
    }
    body = paths["/detokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": REF_TEMPLATE.format(model="DetokenizeRequest")}
    assert {"/version", "/v1/models/{model_id}"} <= set(paths)


def test_the_document_is_openapi_3_1_and_strict_json():
    document = openapi_document(MODEL)
    assert document["openapi"] == "3.1.0"
    assert "nullable" not in json.dumps(document)  # 3.0's keyword; 3.1 spells null as a type
    json.dumps(document, allow_nan=False)


def test_pydantic_stays_off_the_cli_and_activator_import_paths():
    check = """
import json, sys
from snapfn.handler.cli import build_parser
from snapfn.handler.activator.app import create_activator_app
from snapfn.handler.http.serve import serve_config
import snapfn.handler.http.app
build_parser()
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] == "pydantic")))
"""
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []
