"""benchmarks.placement: process trees pinned to CPUs for a span, then given every CPU back."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from benchmarks.placement import can_isolate, pinned

pytestmark = pytest.mark.skipif(not can_isolate(2), reason="needs two CPUs")

# A parent that starts a child, so the pinned tree has two processes and several threads.
PARENT = """
import subprocess, sys, threading, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(child.pid, flush=True)
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
time.sleep(60)
"""


@pytest.fixture
def tree() -> Iterator[tuple[int, int]]:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    try:
        yield parent.pid, child
    finally:
        os.kill(child, 9)
        parent.kill()
        parent.wait(timeout=10)
        parent.stdout.close()


def thread_affinities(pid: int) -> list[set[int]]:
    return [os.sched_getaffinity(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")]


def test_a_tree_is_pinned_for_the_span_and_given_every_cpu_back(tree: tuple[int, int]) -> None:
    parent, child = tree
    everywhere = os.sched_getaffinity(0)
    first, second = sorted(everywhere)[:2]
    with pinned({frozenset({first}): [parent]}, here={second}):
        assert len(thread_affinities(parent)) >= 2
        assert all(cpus == {first} for cpus in thread_affinities(parent))
        assert thread_affinities(child) == [{first}]
        assert os.sched_getaffinity(0) == {second}  # this thread: what it starts runs there
        started_here = subprocess.run(
            [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert started_here.stdout.strip() == str([second])
    assert all(cpus == everywhere for cpus in thread_affinities(parent) + thread_affinities(child))
    assert os.sched_getaffinity(0) == everywhere


def test_everything_is_given_back_when_the_span_fails(tree: tuple[int, int]) -> None:
    parent, _ = tree
    everywhere = os.sched_getaffinity(0)
    first = min(everywhere)
    with pytest.raises(RuntimeError), pinned({frozenset({first}): [parent]}, here={first}):
        raise RuntimeError("the benchmark failed")
    assert all(cpus == everywhere for cpus in thread_affinities(parent))
    assert os.sched_getaffinity(0) == everywhere
