"""A pinned host buffer read by an asynchronous copy to the GPU must not be written again until
that copy is done: `CopyFence` marks the copy and waits for it.

Used by the decode graphs' host mirror of their inputs and by flashinfer's plans (`plan()`
stages its metadata in a pinned buffer and copies it without waiting).
"""

from __future__ import annotations

import torch


class CopyFence:
    def __init__(self) -> None:
        self._event: torch.cuda.Event | None = None  # recorded after the last copy enqueued

    def mark(self, device: torch.device) -> None:
        """After enqueueing a copy out of the buffer (nothing to wait for off the GPU)."""
        if device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()

    def wait(self) -> None:
        """Before writing the buffer again: the last marked copy is done."""
        if self._event is not None:
            self._event.synchronize()
