"""A minimal snapfn function, the shape every function takes.

Serve it (from the repository root):

    snapfn serve --function examples.hello:handler
    curl -s localhost:8000/invoke -d '{"name": "Ada"}'
    # {"message": "Hello, Ada!", "instance": "…", "restores": 0, "remaining_ms": 899998}

`handler(event, context)` is what AWS Lambda calls too. The expensive work goes in an init hook,
which runs once, before the snapshot is taken; every cold start after that restores the warmed
state instead of repeating it. A restored process is a copy, so anything that must differ
between copies (random seeds, instance ids, connections) is redone in an after-restore hook.

State lives in one object the module owns (`greeter`), not in loose globals. Hooks are declared
with decorators (`@init`, `@before_snapshot`, `@after_restore`) or plain calls
(`register_init(fn, *args)`, …); functions written for Lambda SnapStart with
`snapshot_restore_py` hooks run unchanged.
"""

from __future__ import annotations

import random
import uuid

from snapfn.handler.api import (
    BadRequest,
    Context,
    after_restore,
    register_after_restore,
    register_init,
)


class Greeter:
    def __init__(self) -> None:
        self.greetings: dict[str, str] = {}
        self.instance_id = ""
        self.restores = 0

    def load(self, language: str) -> None:
        """Stands for the expensive part of a cold start (load a model, build an index)."""
        self.greetings = {"en": "Hello", "fr": "Bonjour", "de": "Hallo"}
        self.greetings["default"] = self.greetings[language]
        self.new_identity()

    def new_identity(self) -> None:
        """Each restored copy must not share the snapshotted instance's id or random state."""
        self.instance_id = str(uuid.uuid4())
        random.seed()

    def greet(self, event: dict, context: Context) -> dict:
        name = event.get("name", "world")
        if not isinstance(name, str):
            raise BadRequest(f"name must be a string, got {type(name).__name__}")
        greeting = self.greetings.get(event.get("lang", "default"), self.greetings["default"])
        return {
            "message": f"{greeting}, {name}!",
            "instance": self.instance_id,
            "restores": self.restores,
            "remaining_ms": context.get_remaining_time_in_millis(),
        }


greeter = Greeter()
register_init(greeter.load, "en")
register_after_restore(greeter.new_identity)


@after_restore
def count_restore() -> None:
    greeter.restores += 1


def handler(event: dict, context: Context) -> dict:
    return greeter.greet(event, context)
