"""CPU and memory of each component's processes, sampled from /proc while a benchmark runs.

A component is a root PID and all its descendants (a materializer node is a Python process, its
Spark JVM and the JVM's Python workers). Every `interval_s` the sampler adds up user+system CPU
time and resident memory over each component's process tree. `phase()` marks a named span;
`summary()` gives, per phase and component, the CPU used (seconds, and cores on average) and
the largest resident set seen.

A process that exits takes its CPU time out of the tree; the kernel adds it to its parent's
`cutime`/`cstime` once the parent reaps it, so each process counts its own time and that of
its reaped descendants, and short-lived children (Spark's Python workers, `readlink`) are
counted. A component's total never goes down: when its root is restarted (`watch()` with a new
PID) or dies, the new tree's time is added to what the old one had used (a root killed loses
only what it used since the last sample: no process is left to reap it).
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TICKS = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def process_tree(root: int) -> list[int]:
    """root and its descendants (through every thread's children list)."""
    found, pending = [], [root]
    while pending:
        pid = pending.pop()
        found.append(pid)
        try:
            for task in Path(f"/proc/{pid}/task").iterdir():
                pending.extend(int(c) for c in (task / "children").read_text().split())
        except OSError:
            continue
    return found


def user_and_kernel_s(pid: int) -> tuple[float, float]:
    """CPU seconds one process spent in its own code and in the kernel on its behalf; (0, 0)
    for a process that is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(stat[11]) / TICKS, int(stat[12]) / TICKS
    except (OSError, IndexError, ValueError):
        return 0.0, 0.0


def reaped_children_s(pid: int) -> float:
    """CPU seconds (user+system) of the process's children that exited and were reaped, theirs
    and their own reaped descendants' (cutime + cstime); 0 for a process that is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(stat[13]) + int(stat[14])) / TICKS
    except (OSError, IndexError, ValueError):
        return 0.0


def cpu_and_rss(pid: int) -> tuple[float, int]:
    """(user+system CPU seconds, resident bytes); (0, 0) for a process that is gone."""
    try:
        resident_pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0.0, 0
    return sum(user_and_kernel_s(pid)), resident_pages * PAGE


def tree_cpu_and_rss(root: int) -> tuple[float, int]:
    """CPU seconds used by a process tree, its exited and reaped descendants included, and the
    resident bytes of its live processes."""
    cpu, rss = 0.0, 0
    for pid in process_tree(root):
        used, resident = cpu_and_rss(pid)
        cpu, rss = cpu + used + reaped_children_s(pid), rss + resident
    return cpu, rss


@dataclass(frozen=True)
class Sample:
    at: float  # monotonic seconds
    component: str
    cpu_s: float  # cumulative: every process the component ran, exited ones and restarts included
    rss_bytes: int


@dataclass
class _Tally:
    """A component's CPU so far: the roots it had before (`earlier_s`) plus the current one's."""

    root: int
    earlier_s: float = 0.0
    current_s: float = 0.0

    def total(self) -> float:
        return self.earlier_s + self.current_s


class ProcessSampler:
    def __init__(self, interval_s: float = 0.5) -> None:
        self._interval_s = interval_s
        self._components: dict[str, _Tally] = {}
        self._lock = threading.Lock()
        self.samples: list[Sample] = []
        self.phases: list[tuple[str, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def watch(self, component: str, pid: int) -> None:
        """Sample the tree under `pid` as `component`; a new PID for a component is a restart
        (its CPU adds to the old process's)."""
        with self._lock:
            tally = self._components.get(component)
            if tally is None:
                self._components[component] = _Tally(pid)
            elif tally.root != pid:
                self._components[component] = _Tally(pid, earlier_s=tally.total())

    def start(self) -> ProcessSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        began = time.monotonic()
        self.sample_now()
        try:
            yield
        finally:
            self.sample_now()
            self.phases.append((name, began, time.monotonic()))

    def sample_now(self) -> None:
        at = time.monotonic()
        with self._lock:
            components = {name: tally.root for name, tally in self._components.items()}
        measured = {root: tree_cpu_and_rss(root) for root in components.values()}
        with self._lock:
            for component, root in components.items():
                tally = self._components[component]
                cpu, rss = measured[root]
                if tally.root == root:
                    # Never down: a root that is gone (killed, not yet restarted) keeps what it
                    # used, and so does a child read just after it exited but before its parent
                    # reaped it (its time is in neither; the next sample finds it in cutime).
                    tally.current_s = max(tally.current_s, cpu)
                self.samples.append(Sample(at, component, tally.total(), rss))

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.sample_now()

    def summary(self) -> dict[str, dict[str, dict[str, Any]]]:
        """phase -> component -> cpu_s, cores (average), rss_max_mb."""
        result: dict[str, dict[str, dict[str, Any]]] = {}
        for name, began, ended in self.phases:
            within = [s for s in self.samples if began <= s.at <= ended]
            per: dict[str, dict[str, Any]] = {}
            for component in sorted({s.component for s in within}):
                mine = [s for s in within if s.component == component]
                used = max(s.cpu_s for s in mine) - min(s.cpu_s for s in mine)  # never goes down
                per[component] = {
                    "cpu_s": round(used, 2),
                    "cores": round(used / max(ended - began, 1e-9), 2),
                    "rss_max_mb": round(max(s.rss_bytes for s in mine) / 2**20, 1),
                }
            result[name] = per
        return result

    def rss_series(self, component: str) -> list[tuple[float, float]]:
        """(seconds since the first sample, resident MB) for one component."""
        mine = [s for s in self.samples if s.component == component]
        if not mine:
            return []
        first = mine[0].at
        return [(round(s.at - first, 1), round(s.rss_bytes / 2**20, 1)) for s in mine]

    def rss_per_minute(self, component: str, since: float, minutes: int) -> list[float | None]:
        """Mean resident MB of a component in each minute after `since` (monotonic); moments
        when its process was not running (restarts) do not count; None for a minute without
        samples."""
        series = [
            (s.at - since, s.rss_bytes / 2**20)
            for s in self.samples
            if s.component == component and s.at >= since and s.rss_bytes > 0
        ]
        means: list[float | None] = []
        for m in range(minutes):
            inside = [mb for t, mb in series if m * 60 <= t < (m + 1) * 60]
            means.append(round(statistics.mean(inside), 1) if inside else None)
        return means
