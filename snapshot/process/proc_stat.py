"""/proc/PID/stat read without psutil: the fields after `pid (comm)`, where comm may hold
spaces and parentheses (so the split starts after the last ")")."""

from __future__ import annotations

from pathlib import Path

GONE_STATES = ("Z", "X")  # zombie, dead: exited, whatever is left of it


def stat_fields(path: Path | str) -> list[str] | None:
    """`state ppid pgrp …` of the process whose stat file is `path` (state is [0], ppid [1],
    pgrp [2]); None when it cannot be read (the process is gone)."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()
