"""Which CPUs a benchmark's processes may run on (Linux CPU affinity).

On a machine this small every process shares every core, so a proxy's CPU comes out of the
nodes' share. `pinned()` gives groups of process trees cores of their own for a span, the
way a deployment gives the routing tier and the stateful nodes machines of their own, and
puts everything back on all cores afterwards. Affinity is set on every thread of every process
in each tree; threads and processes started later inherit it from the thread that starts them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from benchmarks.sampling import process_tree


def pin_threads(pid: int, cpus: set[int]) -> int:
    """Every thread of one process onto cpus; how many were pinned (0 if it is gone)."""
    try:
        threads = [int(task.name) for task in Path(f"/proc/{pid}/task").iterdir()]
    except OSError:
        return 0
    pinned = 0
    for tid in threads:
        try:
            os.sched_setaffinity(tid, cpus)
            pinned += 1
        except (ProcessLookupError, PermissionError):
            continue  # the thread exited in the meantime
    return pinned


def pin_tree(root: int, cpus: set[int]) -> int:
    """Every thread of root and of its descendants onto cpus; how many were pinned."""
    return sum(pin_threads(pid, cpus) for pid in process_tree(root))


def can_isolate(groups: int) -> bool:
    """Whether this process may use at least one CPU per group."""
    return len(os.sched_getaffinity(0)) >= groups


@contextmanager
def pinned(placement: Mapping[frozenset[int], Iterable[int]], here: set[int]) -> Iterator[None]:
    """For the span: each group of process trees on its CPUs, and this process's own threads
    (not its children: those are in the groups) on `here`, so that what it starts during the
    span, such as wrk, runs there too."""
    everywhere = os.sched_getaffinity(0)
    roots = {root: set(cpus) for cpus, group in placement.items() for root in group}
    try:
        for root, cpus in roots.items():
            pin_tree(root, cpus)
        pin_threads(os.getpid(), here)
        yield
    finally:
        pin_threads(os.getpid(), everywhere)
        for root in roots:
            pin_tree(root, everywhere)
