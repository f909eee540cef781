"""An activator's instance never outlives the activator.

Contract: the activator starts each instance (`snapfn serve` under gunicorn) with
`SNAPFN_PARENT_PID=<its pid>`. `exit_with_parent(environ)`, called by the instance's master
before gunicorn starts, asks Linux to send the master SIGTERM when its parent dies
(`prctl(PR_SET_PDEATHSIG)`); gunicorn then stops its workers as on any SIGTERM, so a killed
activator leaves no instance holding GPU memory. It returns False when the parent is already
gone (the caller should exit); without the variable, or off Linux, it does nothing.
NOTE: the signal follows the parent *thread* that forked: the activator forks from its event
loop's thread, which lives as long as the activator.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Mapping

PARENT_PID_VARIABLE = "SNAPFN_PARENT_PID"
PR_SET_PDEATHSIG = 1


def exit_with_parent(environ: Mapping[str, str]) -> bool:
    """SIGTERM this process when the parent named in `SNAPFN_PARENT_PID` dies; False if gone."""
    raw = environ.get(PARENT_PID_VARIABLE)
    if not raw or not sys.platform.startswith("linux"):
        return True
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    # NOTE: checked after the prctl: a parent that died before it would never signal us
    return os.getppid() == int(raw)
