"""A thread's I/O priority class (Linux `ioprio_set`/`ioprio_get` through ctypes; never imports
torch): a read-ahead that should yield the disk to the reads a process is blocked on (its
interpreter's page faults while torch imports) runs in the idle class.

Advice only, as the kernel treats it: the block layer's scheduler decides (BFQ and mq-deadline
serve the classes in order; `none`, common on NVMe and virtio disks, ignores them). `scheduler`
says which one a file's disk has, for the figures.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import threading
from pathlib import Path

CLASSES = {"none": 0, "realtime": 1, "best-effort": 2, "idle": 3}
_CLASS_SHIFT = 13
_WHO_PROCESS = 1  # with a thread id: that thread alone
# ioprio_set / ioprio_get by machine (asm-generic numbers on arm64)
_SYSCALLS = {"x86_64": (251, 252), "aarch64": (30, 31)}


def _syscall():
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return libc.syscall


def set_thread_class(name: str) -> str | None:
    """Put the calling thread in I/O class `name` (`CLASSES`); None, or why it could not."""
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None:
        return f"ioprio_set is not known on {platform.machine()}"
    value = CLASSES[name] << _CLASS_SHIFT
    if _syscall()(numbers[0], _WHO_PROCESS, threading.get_native_id(), value) != 0:
        return f"ioprio_set: {os.strerror(ctypes.get_errno())}"
    return None


def thread_class(tid: int | None = None) -> str:
    """The I/O class of thread `tid` (the calling thread by default)."""
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None:
        raise OSError(f"ioprio_get is not known on {platform.machine()}")
    got = _syscall()(numbers[1], _WHO_PROCESS, tid or threading.get_native_id())
    if got < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    by_number = {v: k for k, v in CLASSES.items()}
    return by_number.get(got >> _CLASS_SHIFT, str(got >> _CLASS_SHIFT))


def scheduler(path: str | os.PathLike) -> str | None:
    """The I/O scheduler of the disk holding `path` (`[mq-deadline]`'s name), or None where
    sysfs does not say (an overlay, tmpfs, no permission)."""
    try:
        dev = os.stat(path).st_dev
        block = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
        queue = block / "queue" / "scheduler"
        if not queue.exists():  # a partition: its disk's queue
            queue = block.resolve().parent / "queue" / "scheduler"
        text = queue.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else text.strip() or None
