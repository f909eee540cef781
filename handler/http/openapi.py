"""The published OpenAPI 3.1 document of the HTTP front door (served at `GET /openapi.json`).

`openapi_document(model_name)` returns it as a dict; the model name is the one value that
depends on the deployment. The request schemas are generated from the pydantic models that
validate the requests (`openai/schema.py`), so the two cannot drift; the responses, paths and
security are written here. The fuzz test (`tests/test_openapi_fuzz.py`) holds the document and
the app together. Importing this module loads pydantic (app.py imports it as a worker builds
its app, not at its own import).
"""

from __future__ import annotations

from typing import Any

from snapfn.handler.http.openai.schema import (
    LOGPROBS_NOTE,
    REQUEST_MODELS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    json_schemas,
)

OPENAPI_VERSION = "3.1.0"  # its schemas are JSON Schema 2020-12, which pydantic writes
API_VERSION = "1"
REF_TEMPLATE = "#/components/schemas/{model}"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": REF_TEMPLATE.format(model=name)}


def _json_content(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": _json_content(_ref("Error"))}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


ERRORS = {
    "400": _error("Bad input: the message says what to fix, `param` names the field"),
    "401": _error("Missing or wrong API key (when the server has one)"),
    "404": _error("Unknown model, or not a language model worker"),
    "408": _error("The request's headers and body did not arrive within the receive deadline"),
    "413": _error("Body larger than the server's limit"),
    "503": _error("Starting (with Retry-After), failed to start, or stopped after it was up"),
}

ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": _nullable({"type": "string"}),
                "code": _nullable({"type": "string"}),
            },
        }
    },
}


def _request_schemas(model_name: str) -> dict[str, Any]:
    """The request models' JSON schemas, each body's `model` the one this server serves (or
    null, the same as leaving it out)."""
    schemas = json_schemas(REF_TEMPLATE)
    for model in REQUEST_MODELS:
        schemas[model.__name__]["properties"]["model"]["enum"] = [model_name, None]
    return schemas


USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        k: {"type": "integer", "minimum": 0}
        for k in ("prompt_tokens", "completion_tokens", "total_tokens")
    },
}

FINISH_REASON = _nullable({"type": "string", "enum": ["stop", "length", "cancelled"]})


def _response(object_name: str, content_field: str, content_schema: dict) -> dict:
    """A completion-shaped response whose choices carry `content_field`."""
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string", "enum": [object_name]},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["index", content_field, "finish_reason"],
                    "properties": {
                        "index": {"type": "integer"},
                        content_field: content_schema,
                        "logprobs": _nullable({"type": "object"}),
                        "finish_reason": FINISH_REASON,
                        "token_ids": {"type": "array", "items": {"type": "integer"}},
                    },
                },
            },
            "usage": USAGE,
        },
    }


COMPLETION_RESPONSE = _response("text_completion", "text", {"type": "string"})

CHAT_RESPONSE = _response(
    "chat.completion",
    "message",
    {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"type": "string", "enum": ["assistant"]},
            "content": {"type": "string"},
        },
    },
)

HEALTH = {
    "type": "object",
    "required": ["status"],
    "properties": {
        "status": {"type": "string", "enum": ["starting", "up", "failed"]},
        "reason": _nullable({"type": "string"}),
    },
}

FUNCTION_ERROR = {
    "type": "object",
    "required": ["errorType", "errorMessage"],
    "properties": {"errorType": {"type": "string"}, "errorMessage": {"type": "string"}},
}

SSE = {
    "text/event-stream": {
        "schema": {
            "type": "string",
            "description": "`data: <chunk JSON>` events, the last one `data: [DONE]`",
        }
    }
}


def _generation_op(summary: str, request_schema: str, response_schema: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": _json_content(_ref(request_schema))},
            "responses": {
                "200": {
                    "description": "The completion (JSON), or with `stream: true` its chunks as "
                    "server-sent events; a stream that fails midway ends with an `error` event",
                    "content": {**_json_content(_ref(response_schema)), **SSE},
                },
                **ERRORS,
            },
        }
    }


def _get_op(summary: str, schema: dict[str, Any], extra: dict[str, Any] | None = None) -> dict:
    responses = {"200": {"description": summary, "content": _json_content(schema)}}
    return {"get": {"summary": summary, "responses": {**responses, **(extra or ERRORS)}}}


def _health_paths() -> dict[str, Any]:
    open_health = _get_op(
        "Readiness: 200 when up, 503 while starting or failed",
        HEALTH,
        {"503": {"description": "Starting or failed", "content": _json_content(HEALTH)}},
    )
    open_health["get"]["security"] = []
    generate = _get_op("A real 1-token generation through the whole path", {"type": "object"})
    generate["get"]["responses"]["503"] = {
        "description": "Starting, failed, or the generation failed",
        "content": _json_content({"type": "object"}),
    }
    startup = _get_op("The startup manifest: init or restore stages, fallbacks", {"type": "object"})
    startup["get"]["responses"]["503"] = {
        "description": "No manifest yet",
        "content": _json_content({"type": "object"}),
    }
    return {"/health": open_health, "/health/generate": generate, "/startup": startup}


MODEL_CARD = {
    "type": "object",
    "required": ["id", "object", "created", "owned_by"],
    "properties": {
        "id": {"type": "string"},
        "object": {"type": "string", "enum": ["model"]},
        "created": {"type": "integer"},
        "owned_by": {"type": "string"},
        "max_model_len": {"type": "integer"},
    },
}

TOKENIZE_RESPONSE = {
    "type": "object",
    "required": ["count", "max_model_len", "tokens", "token_strs"],
    "properties": {
        "count": {"type": "integer", "minimum": 0},
        "max_model_len": {"type": "integer"},
        "tokens": {"type": "array", "items": {"type": "integer"}},
        "token_strs": _nullable({"type": "array", "items": {"type": "string"}}),
    },
}

DETOKENIZE_RESPONSE = {
    "type": "object",
    "required": ["prompt"],
    "properties": {"prompt": {"type": "string"}},
}


def _post_op(summary: str, request_schema: dict, response_schema: dict) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": _json_content(request_schema)},
            "responses": {
                "200": {"description": summary, "content": _json_content(response_schema)},
                **ERRORS,
            },
        }
    }


def _tokenizer_paths() -> dict[str, Any]:
    tokenize_body = {
        "anyOf": [_ref(TokenizeCompletionRequest.__name__), _ref(TokenizeChatRequest.__name__)]
    }
    return {
        "/tokenize": _post_op(
            "Text or chat messages to token ids (vLLM's shapes)", tokenize_body, TOKENIZE_RESPONSE
        ),
        "/detokenize": _post_op(
            "Token ids to text (vLLM's shapes)",
            _ref(DetokenizeRequest.__name__),
            DETOKENIZE_RESPONSE,
        ),
    }


def _model_path() -> dict[str, Any]:
    card = _get_op("The model's card; 404 for any other model", MODEL_CARD)
    card["get"]["parameters"] = [
        {"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}
    ]
    return {"/v1/models/{model_id}": card}


def _other_paths() -> dict[str, Any]:
    metrics = {
        "get": {
            "summary": "Prometheus metrics (text exposition format)",
            "responses": {
                "200": {
                    "description": "Metrics",
                    "content": {"text/plain": {"schema": {"type": "string"}}},
                },
                "401": ERRORS["401"],
            },
        }
    }
    spec = _get_op("This document", {"type": "object"}, {})
    spec["get"]["security"] = []
    models = _get_op(
        "The model served",
        {
            "type": "object",
            "required": ["object", "data"],
            "properties": {"data": {"type": "array", "items": MODEL_CARD}},
        },
    )
    version = _get_op(
        "snapfn's version",
        {"type": "object", "required": ["version"], "properties": {"version": {"type": "string"}}},
    )
    return {
        "/metrics": metrics,
        "/openapi.json": spec,
        "/version": version,
        "/v1/models": models,
        **_model_path(),
    }


def _invoke_path() -> dict[str, Any]:
    responses = {
        "200": {
            "description": "The function's result; with `--function-errors lambda`, also its "
            "error (header X-Amz-Function-Error), as Lambda's Invoke API answers",
            "content": _json_content({}),
        },
        "500": {
            "description": "The function raised: its error (header X-Snapfn-Function-Error)",
            "content": _json_content(FUNCTION_ERROR),
        },
        **{k: v for k, v in ERRORS.items() if k != "404"},
    }
    body = {"required": True, "content": _json_content({"description": "any JSON event"})}
    return {
        "/invoke": {
            "post": {
                "summary": "Invoke the function with a JSON event",
                "requestBody": body,
                "responses": responses,
            }
        }
    }


def openapi_document(model_name: str) -> dict[str, Any]:
    """The OpenAPI 3.1 document for a server whose model is called `model_name`."""
    schemas = {
        "Error": ERROR_SCHEMA,
        **_request_schemas(model_name),
        "CompletionResponse": COMPLETION_RESPONSE,
        "ChatCompletionResponse": CHAT_RESPONSE,
    }
    paths = {
        **_health_paths(),
        **_other_paths(),
        "/v1/completions": _generation_op(
            "OpenAI completions", CompletionRequest.__name__, "CompletionResponse"
        ),
        "/v1/chat/completions": _generation_op(
            "OpenAI chat completions", ChatCompletionRequest.__name__, "ChatCompletionResponse"
        ),
        **_tokenizer_paths(),
        **_invoke_path(),
    }
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "snapfn",
            "version": API_VERSION,
            "description": "A snapfn worker: OpenAI-compatible generation, function "
            "invocation, health and metrics. " + LOGPROBS_NOTE,
        },
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{}, {"bearer": []}],
    }
