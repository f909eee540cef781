"""snapfn's version, as `snapfn --version` and `GET /version` report it.

`snapfn_version()` is the installed distribution's version; a source tree run without
installing it (`infra/dev-pythonpath.sh`) reads the `version` of its `pyproject.toml`; neither:
"unknown".
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

DISTRIBUTION = "snapfn"


def snapfn_version() -> str:
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return _source_tree_version() or "unknown"


def _source_tree_version() -> str | None:
    import tomllib

    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    try:
        project = tomllib.loads(pyproject.read_text())["project"]
    except (OSError, ValueError, KeyError):
        return None
    return project.get("name") == DISTRIBUTION and str(project.get("version")) or None
