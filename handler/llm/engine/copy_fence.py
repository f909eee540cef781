"""Copies between pinned host memory and the GPU that the host does not wait for.

A pinned host buffer read by an asynchronous copy to the GPU must not be written again until
that copy is done: `CopyFence` marks the copy and waits for it (the decode graphs' host mirror
of their inputs; flashinfer's plans, which stage their metadata in a pinned buffer and copy it
without waiting). The other way, `HostCopy` enqueues a device tensor's copy to the host and
waits for that copy alone, not for the work enqueued after it (greedy picks and drafts).
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass
class HostCopy:
    """A device tensor's copy to the host, enqueued with no wait (into pinned memory: `into`,
    or a new buffer): `land` waits for it alone."""

    host: torch.Tensor
    done: torch.cuda.Event | None  # None: `host` is the tensor itself (CPU runs)

    @classmethod
    def launch(cls, t: torch.Tensor, into: torch.Tensor | None = None) -> HostCopy:
        if not t.is_cuda:
            return cls(t, None)
        host = into if into is not None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return cls(host, done)

    def land(self) -> torch.Tensor:
        if self.done is not None:
            self.done.synchronize()
        return self.host
