"""A child process that never outlives its parent (PR_SET_PDEATHSIG): the proxy's workers and
its table process."""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, signum: int = signal.SIGTERM) -> bool:
    """`signum` to this process when its parent dies (PR_SET_PDEATHSIG); False when the parent
    (`parent_pid`) died before the request was made (the kernel would never send it then)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    return os.getppid() == parent_pid
