"""The node's hosting (materializer.hosting, carried out by materializer.node.Node) against what
can happen around it: a reset on the pipeline's thread while the loop assigns, a partition
given up, assigned back and given up again within the grace period, several partitions with
their own deadlines, and the shared clock stepping under the one drop timer."""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.clock import now_ms
from materializer.hosting import HostedPartitions
from materializer.node import Node
from materializer.settings import NodeSettings

GRACE_S = 0.3


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    settings = NodeSettings.from_env(
        {
            "KROUTE_BOOTSTRAP_SERVERS": "127.0.0.1:9",
            "KROUTE_TOPIC": "bookings",
            "KROUTE_DATA_DIR": str(tmp_path),
            "KROUTE_GRACE_PERIOD_S": str(GRACE_S),
        }
    )
    built = Node(settings, java=None)  # type: ignore[arg-type]  # Spark is never started here
    yield built
    built.store.close()


def test_a_reset_on_another_thread_never_leaves_a_stall_clock_on_a_partition_given_up() -> None:
    """`reset` runs on the pipeline's thread (between batches) while assignments arrive on the
    loop: a reset that found a partition hosted must not stamp it after it was given up."""
    hosting = HostedPartitions(grace_ms=1_000, default_role="active")
    stop = threading.Event()
    errors: list[BaseException] = []

    def resets() -> None:
        while not stop.is_set():
            try:
                hosting.reset(range(8), 5)
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)

    stale = 0
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    resetter = threading.Thread(target=resets)
    resetter.start()
    try:
        for i in range(30_000):
            hosting.assign({p: "active" for p in range(8) if (i >> p) & 1 or p % 2}, i)
            hosted = set(hosting.hosted)
            stale += any(hosting.stall_clock_start(p) is not None for p in set(range(8)) - hosted)
    finally:
        stop.set()
        resetter.join()
        sys.setswitchinterval(interval)
    assert not errors
    assert stale == 0, f"{stale} times a partition not hosted kept a stall clock"


def test_given_up_twice_within_the_grace_period_it_is_dropped_a_grace_after_the_last(
    node: Node,
) -> None:
    async def scenario() -> list[frozenset[int]]:
        seen = []
        node._host({0: "active", 1: "active"})
        node._host({0: "active"})  # 1 given up
        await asyncio.sleep(GRACE_S * 0.6)
        node._host({0: "active", 1: "standby"})  # back
        node._host({0: "active"})  # given up again: a whole grace period from now
        await asyncio.sleep(GRACE_S * 0.6)  # past the first deadline
        seen.append(node.store.partitions())
        await asyncio.sleep(GRACE_S * 0.7)
        seen.append(node.store.partitions())
        return seen

    assert asyncio.run(scenario()) == [{0, 1}, {0}]
    assert node.hosting.pending_drops == {}


def test_partitions_given_up_at_different_times_are_each_dropped_at_their_own(
    node: Node,
) -> None:
    async def scenario() -> list[frozenset[int]]:
        seen = []
        node._host({0: "active", 1: "active", 2: "active"})
        node._host({0: "active", 2: "active"})  # 1 given up
        await asyncio.sleep(GRACE_S / 2)
        node._host({0: "active"})  # 2 given up half a grace period later
        await asyncio.sleep(GRACE_S * 0.7)  # past 1's deadline, not 2's
        seen.append(node.store.partitions())
        await asyncio.sleep(GRACE_S * 0.6)
        seen.append(node.store.partitions())
        return seen

    assert asyncio.run(scenario()) == [{0, 2}, {0}]


@pytest.mark.parametrize("step_ms", [10_000, -10_000])
def test_a_step_of_the_shared_clock_moves_no_drop(
    node: Node, monkeypatch: pytest.MonkeyPatch, step_ms: int
) -> None:
    """The shared clock steps when it syncs to Redis time (the first sync by however far this
    host's clock is off). The drop deadlines are on the monotonic clock: a step forward drops
    nothing early (a partition that comes back within the grace period finds its data), a
    step back delays nothing, and one drop takes a timer check or two, not a busy loop."""
    offset = {"ms": 0}
    monkeypatch.setattr("materializer.node.now_ms", lambda: now_ms() + offset["ms"])
    checks = 0
    drop_due = node._drop_due

    def counted() -> None:
        nonlocal checks
        checks += 1
        drop_due()

    monkeypatch.setattr(node, "_drop_due", counted)

    async def scenario() -> list[frozenset[int]]:
        seen = []
        node._host({0: "active", 1: "active"})
        node._host({0: "active"})  # 1 given up
        offset["ms"] = step_ms  # the shared clock steps right after
        node._host({0: "active"})  # an assignment after the step (the timer is armed again)
        await asyncio.sleep(GRACE_S / 2)
        seen.append(node.store.partitions())  # within the grace period
        await asyncio.sleep(GRACE_S / 2 + 0.1)
        seen.append(node.store.partitions())  # past it
        return seen

    assert asyncio.run(scenario()) == [{0, 1}, {0}]
    assert checks <= 3, f"{checks} timer checks for one drop"
