"""The configured grammars: `InitConfig.structured_schemas` (`SNAPFN_STRUCTURED_SCHEMAS=FILE`),
a JSON file holding a list whose every entry is the part of a request that asks for structured
output, e.g.

    [{"response_format": {"type": "json_schema", "json_schema": {"name": "user", "schema": {...}}}},
     {"guided_regex": "[0-9]{3}-[0-9]{4}"},
     {"guided_choice": ["yes", "no"]}]

`read_configured_specs(path)` is their specs in order (duplicates dropped), or `InitFailed`
naming the entry and what is wrong with it. The init compiles them (the `grammars` stage) and
the snapshot records them (the "llm" section's `grammars`), so a request for one of them finds
it compiled, after a restore too.
"""

from __future__ import annotations

from pathlib import Path

from snapfn.handler.llm.init_config import read_json_file
from snapfn.handler.llm.structured.spec import GrammarSpec, spec_from_fields
from snapfn.snapshot.errors import BadRequest, InitFailed, one_line

MAX_CONFIGURED = 1024
MAX_FILE_BYTES = 64 << 20


def read_configured_specs(path: Path | str) -> list[GrammarSpec]:
    """The specs the file at `path` lists (module docstring)."""
    where = f"structured_schemas {path}"
    entries = read_json_file(path, where, MAX_FILE_BYTES)
    if not isinstance(entries, list) or len(entries) > MAX_CONFIGURED:
        raise InitFailed(f"{where}: not a list of at most {MAX_CONFIGURED} entries")
    return list(dict.fromkeys(_entry_spec(entry, k, where) for k, entry in enumerate(entries)))


def _entry_spec(entry: object, k: int, where: str) -> GrammarSpec:
    if not isinstance(entry, dict):
        raise InitFailed(f"{where}: entry {k} is not an object of request fields")
    try:
        spec = spec_from_fields(entry)
    except BadRequest as exc:
        raise InitFailed(one_line(f"{where}: entry {k}: {exc}")) from None
    if spec is None:
        raise InitFailed(
            f"{where}: entry {k} asks for no structured output (give 'response_format' of type "
            "json_object or json_schema, or one of the guided_* fields)"
        )
    return spec
