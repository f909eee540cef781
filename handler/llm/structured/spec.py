"""What a request asks its output to match: `GrammarSpec`, and its parsing from request fields.

A spec is a frozen value of two strings, `kind` (one of `KINDS`) and `text` (its canonical
form: a JSON schema as compact JSON, its keys in the order sent, which is the order the output
writes properties in; a regex or a grammar as sent; the choices as a JSON list), so that it
travels as JSON (`to_json` / `from_json`, inside `SamplingParams`) and the same constraint sent
twice, by either spelling (`response_format` or `guided_json`), is one compile-cache key.

`spec_from_fields(fields)` reads the request fields that ask for one (OpenAI's
`response_format` `json_object` / `json_schema`, vLLM's `guided_json`, `guided_regex`,
`guided_grammar`, `guided_choice`; `{"type": "text"}` asks for none) and raises `InvalidGuide`
(a `BadRequest`, 400, with the field's name in `param`) for a shape that cannot be a
constraint or for two constraints at once. Whether a schema, regex or grammar compiles is the
compile cache's to say (`compiler.py`), also a 400 naming the kind. Torch-free, library-free:
the front door and the activator import it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from snapfn.snapshot.errors import BadRequest

KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_grammar", "guided_choice")
MAX_SPEC_CHARS = 1 << 20  # a schema, regex or grammar longer than 1 MiB is refused
# llguidance's parser holds at most 2000 items in a row (`LLParserLimits.max_items_in_row`):
# one per choice and one more, so a longer list would compile and then fail at its first token
MAX_CHOICES = 1999
DESCRIPTIONS = {
    "json_schema": "the JSON schema",
    "json_object": "the JSON object grammar",
    "regex": "the regex",
    "grammar": "the grammar",
    "choice": "the choices",
}


class InvalidGuide(BadRequest):
    """A structured-output field that cannot be served; `param` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class GrammarSpec:
    """One output constraint: `kind` (in `KINDS`) and its canonical `text`."""

    kind: str
    text: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise BadRequest(f"grammar kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.text, str) or len(self.text) > MAX_SPEC_CHARS:
            raise BadRequest(
                f"{self.describe()} must be a string of at most {MAX_SPEC_CHARS} characters"
            )

    def describe(self) -> str:
        return DESCRIPTIONS[self.kind]

    def to_json(self) -> dict[str, str]:
        return {"kind": self.kind, "text": self.text}

    @classmethod
    def from_json(cls, doc: Any) -> GrammarSpec:
        """`to_json`'s output back (BadRequest for anything else)."""
        if not isinstance(doc, dict) or set(doc) != {"kind", "text"}:
            raise BadRequest('a grammar spec is {"kind": ..., "text": ...}')
        return cls(doc["kind"], doc["text"])


def spec_from_fields(fields: Mapping[str, Any]) -> GrammarSpec | None:
    """The constraint the request fields ask for (None: none), or `InvalidGuide`."""
    found = [(name, fields.get(name)) for name in ("response_format", *GUIDED_FIELDS)]
    found = [(name, value) for name, value in found if value is not None]
    specs = [(name, _parse_field(name, value)) for name, value in found]
    specs = [(name, spec) for name, spec in specs if spec is not None]
    if len(specs) > 1:
        names = " and ".join(name for name, _ in specs)
        raise InvalidGuide(
            f"{names} each constrain the output: send one of them", param=specs[1][0]
        )
    return specs[0][1] if specs else None


def json_schema_spec(schema: Any, param: str) -> GrammarSpec:
    """A JSON schema (an object or a boolean; a string holding one) as a spec."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise InvalidGuide(f"'{param}' is not valid JSON: {exc}", param) from None
    if not isinstance(schema, dict | bool):
        raise InvalidGuide(
            f"'{param}' must be a JSON schema (an object), got {type(schema).__name__}", param
        )
    return _spec("json_schema", json.dumps(schema, separators=(",", ":")), param)


def _parse_field(name: str, value: Any) -> GrammarSpec | None:
    if name == "response_format":
        return _response_format(value)
    if name == "guided_json":
        return json_schema_spec(value, name)
    if name == "guided_choice":
        return _choices(value)
    if not isinstance(value, str) or not value:
        raise InvalidGuide(f"'{name}' must be a non-empty string", name)
    return _spec("regex" if name == "guided_regex" else "grammar", value, name)


def _response_format(value: Any) -> GrammarSpec | None:
    param = "response_format"
    if not isinstance(value, Mapping):
        raise InvalidGuide(f"'{param}' must be an object with a 'type'", param)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", "")
    if kind != "json_schema":
        raise InvalidGuide(
            f"'{param}.type' must be 'text', 'json_object' or 'json_schema', got {kind!r:.40}",
            param,
        )
    inner = value.get("json_schema")
    if not isinstance(inner, Mapping) or inner.get("schema") is None:
        raise InvalidGuide(
            f"'{param}.json_schema.schema' is required with type 'json_schema' "
            '(e.g. {"type": "json_schema", "json_schema": {"name": "x", "schema": {...}}})',
            param,
        )
    return json_schema_spec(inner["schema"], f"{param}.json_schema.schema")


def _choices(value: Any) -> GrammarSpec:
    param = "guided_choice"
    if (
        not isinstance(value, list)
        or not 0 < len(value) <= MAX_CHOICES
        or not all(isinstance(c, str) and c for c in value)
    ):
        raise InvalidGuide(
            f"'{param}' must be a list of 1 to {MAX_CHOICES} non-empty strings", param
        )
    return _spec("choice", json.dumps(value), param)


def _spec(kind: str, text: str, param: str) -> GrammarSpec:
    if len(text) > MAX_SPEC_CHARS:
        raise InvalidGuide(f"'{param}' is longer than {MAX_SPEC_CHARS} characters", param)
    return GrammarSpec(kind, text)
