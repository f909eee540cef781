"""pyproject.toml lists every package folder, so an installed snapfn has all its modules."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    found = set()
    for top, dotted in cfg["package-dir"].items():
        for init in (ROOT / dotted).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / dotted).parts
            found.add(".".join((top, *rel)))
    assert found - listed == set(), "add these to [tool.setuptools] packages"
    assert listed - found == set(), "these listed packages have no folder"
