"""The published OpenAPI 3 document of the HTTP front door (served at `GET /openapi.json`).

`openapi_document(model_name)` returns it as a dict; the model name is the one value that
depends on the deployment. Request schemas mirror what `openai/parse.py` accepts (strict types,
no unknown fields); the fuzz test (`tests/test_openapi_fuzz.py`) holds the two together.
"""

from __future__ import annotations

from typing import Any

OPENAPI_VERSION = "3.0.3"
API_VERSION = "1"

LOGPROBS_NOTE = (
    "Only the chosen token's logprob is recorded by the engine: alternatives "
    "(top logprobs) are not available, and asking for them is a 400."
)

NO_TOOLS = "tool calling is not implemented: only an empty list is accepted"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json_content(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": _json_content(_ref("Error"))}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "nullable": True}


ERRORS = {
    "400": _error("Bad input: the message says what to fix, `param` names the field"),
    "401": _error("Missing or wrong API key (when the server has one)"),
    "404": _error("Unknown model, or not a language model worker"),
    "413": _error("Body larger than the server's limit"),
    "503": _error("Starting (with Retry-After) or failed to start"),
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

COMMON_REQUEST_PROPERTIES: dict[str, Any] = {
    "max_tokens": _nullable({"type": "integer", "minimum": 1}),
    "temperature": _nullable(
        {"type": "number", "minimum": 0, "maximum": 2, "description": "below 1e-5: greedy"}
    ),
    "top_p": _nullable({"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 1}),
    "n": _nullable({"type": "integer", "minimum": 1, "maximum": 128}),
    "stream": _nullable({"type": "boolean"}),
    "stream_options": _nullable(
        {
            "type": "object",
            "additionalProperties": False,
            "properties": {"include_usage": _nullable({"type": "boolean"})},
        }
    ),
    "stop": _nullable(
        {
            "oneOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "maxItems": 16, "items": {"type": "string", "minLength": 1}},
            ]
        }
    ),
    "presence_penalty": _nullable(
        {"type": "number", "minimum": -2, "maximum": 2, "description": "only 0 is served"}
    ),
    "frequency_penalty": _nullable(
        {"type": "number", "minimum": -2, "maximum": 2, "description": "only 0 is served"}
    ),
    "logit_bias": _nullable({"type": "object", "description": "only {} is served"}),
    "user": _nullable({"type": "string"}),
    "seed": _nullable(
        {
            "type": "integer",
            "minimum": 0,
            "maximum": 2**63 - 1,
            "description": "choice i samples with seed + i",
        }
    ),
    "top_k": _nullable({"type": "integer", "minimum": -1, "description": "extension; 0/-1 off"}),
    "ignore_eos": _nullable({"type": "boolean", "description": "extension"}),
    "stop_token_ids": _nullable(
        {
            "type": "array",
            "maxItems": 64,
            "items": {"type": "integer", "minimum": 0},
            "description": "extension: token ids that end a choice",
        }
    ),
    "return_token_ids": _nullable(
        {"type": "boolean", "description": "extension: `token_ids` in every choice and chunk"}
    ),
}

TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}

COMPLETION_EXTRA = {
    "prompt": {
        "oneOf": [
            {"type": "string"},
            {"type": "array", "minItems": 1, "items": {"type": "string"}},
            TOKEN_IDS,
            {"type": "array", "minItems": 1, "items": TOKEN_IDS},
        ]
    },
    "logprobs": _nullable(
        {"type": "integer", "minimum": 0, "maximum": 5, "description": LOGPROBS_NOTE}
    ),
    "echo": _nullable({"type": "boolean", "description": "only false is served"}),
    "best_of": _nullable({"type": "integer", "minimum": 1, "maximum": 128}),
    "suffix": _nullable({"type": "string", "description": "only empty is served"}),
}

TEXT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}},
}

MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": _nullable(
            {"oneOf": [{"type": "string"}, {"type": "array", "items": TEXT_PART}]}
        ),
        "name": {"type": "string"},
    },
}

CHAT_EXTRA = {
    "messages": {"type": "array", "minItems": 1, "items": MESSAGE},
    "max_completion_tokens": _nullable({"type": "integer", "minimum": 1}),
    "logprobs": _nullable({"type": "boolean", "description": LOGPROBS_NOTE}),
    "top_logprobs": _nullable(
        {"type": "integer", "minimum": 0, "maximum": 20, "description": LOGPROBS_NOTE}
    ),
    "tools": _nullable({"type": "array", "maxItems": 0, "items": {}, "description": NO_TOOLS}),
    "functions": _nullable({"type": "array", "maxItems": 0, "items": {}, "description": NO_TOOLS}),
    "tool_choice": _nullable({"type": "string", "enum": ["none", "auto"]}),
    "function_call": _nullable({"type": "string", "enum": ["none", "auto"]}),
    "parallel_tool_calls": _nullable({"type": "boolean", "description": "ignored"}),
    "response_format": _nullable(
        {
            "type": "object",
            "required": ["type"],
            "additionalProperties": False,
            "properties": {"type": {"type": "string", "enum": ["text"]}},
        }
    ),
}


def _request_schema(model_name: str, extra: dict[str, Any], required: list[str]) -> dict:
    properties = {"model": {"type": "string", "enum": [model_name]}}
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["model", *required],
        "properties": {**properties, **COMMON_REQUEST_PROPERTIES, **extra},
    }


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
    models = _get_op("The model served", {"type": "object", "required": ["object", "data"]})
    return {"/metrics": metrics, "/openapi.json": spec, "/v1/models": models}


def _invoke_path() -> dict[str, Any]:
    responses = {
        "200": {"description": "The function's result", "content": _json_content({})},
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
    """The OpenAPI 3 document for a server whose model is called `model_name`."""
    schemas = {
        "Error": ERROR_SCHEMA,
        "CompletionRequest": _request_schema(model_name, COMPLETION_EXTRA, ["prompt"]),
        "ChatCompletionRequest": _request_schema(model_name, CHAT_EXTRA, ["messages"]),
        "CompletionResponse": COMPLETION_RESPONSE,
        "ChatCompletionResponse": CHAT_RESPONSE,
    }
    paths = {
        **_health_paths(),
        **_other_paths(),
        "/v1/completions": _generation_op(
            "OpenAI completions", "CompletionRequest", "CompletionResponse"
        ),
        "/v1/chat/completions": _generation_op(
            "OpenAI chat completions", "ChatCompletionRequest", "ChatCompletionResponse"
        ),
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
