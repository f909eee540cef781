"""A tiny user function for the worker-runtime tests: every hook style, a handler, a failure.

`recorder.calls` lists the hooks in the order they ran; tests clear it before they start.
"""

from __future__ import annotations

from snapfn.handler.api import (
    Context,
    after_restore,
    before_snapshot,
    init,
    register_after_restore,
    register_before_snapshot,
    register_init,
)


class Recorder:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.table: dict[str, int] = {}

    def note(self, name: str, *args: object, **kwargs: object) -> None:
        self.calls.append(
            ":".join([name, *map(str, args), *(f"{k}={v}" for k, v in kwargs.items())])
        )


recorder = Recorder()


@init
def load_table() -> None:
    recorder.table = {"one": 1, "two": 2}
    recorder.note("init")
    register_after_restore(recorder.note, "registered_in_init")


register_init(recorder.note, "init_plain", 2)


@before_snapshot
def close_first() -> None:
    recorder.note("before_1")


register_before_snapshot(recorder.note, "before_2", why="plain")


@before_snapshot
def close_last() -> None:
    recorder.note("before_3")


@after_restore
def reopen_first() -> None:
    recorder.note("after_1")


register_after_restore(recorder.note, "after_2")


def handler(event: dict, context: Context) -> dict:
    if "fail" in event:
        raise ValueError(f"asked to fail: {event['fail']}")
    return {
        "value": recorder.table.get(event.get("key", ""), 0),
        "request_id": context.request_id,
        "function_name": context.function_name,
        "remaining_ms": context.get_remaining_time_in_millis(),
    }
