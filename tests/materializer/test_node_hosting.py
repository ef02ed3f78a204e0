"""The node carries out what its hosting state machine (materializer.hosting) decides: store
partitions added at once, a partition given up dropped from disk after the grace period, one
assigned back within it kept (no Spark, no broker)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from materializer.node import Node
from materializer.settings import NodeSettings

GRACE_S = 0.3


@pytest.fixture
def node(tmp_path: Path):
    settings = NodeSettings.from_env(
        {
            "KROUTE_BOOTSTRAP_SERVERS": "127.0.0.1:9",
            "KROUTE_TOPIC": "bookings",
            "KROUTE_DATA_DIR": str(tmp_path),
            "KROUTE_GRACE_PERIOD_S": str(GRACE_S),
        }
    )
    built = Node(settings, java=None)  # type: ignore[arg-type] - Spark is never started here
    yield built
    built.store.close()


def test_a_partition_given_up_leaves_the_disk_after_the_grace_period_unless_it_comes_back(node):
    async def scenario() -> list[set[int]]:
        seen = []
        assert node._host({0: "active", 1: "active", 2: "standby"})
        seen.append(node.store.partitions())
        assert node._host({0: "active"})  # gives up 1 and 2
        await asyncio.sleep(GRACE_S / 3)
        seen.append(node.store.partitions())  # both still on disk
        assert node._host({0: "active", 2: "active"})  # 2 is back within the grace period
        await asyncio.sleep(GRACE_S)
        seen.append(node.store.partitions())
        return seen

    assert asyncio.run(scenario()) == [{0, 1, 2}, {0, 1, 2}, {0, 2}]
    assert node.hosting.hosted == (0, 2)
    assert node.state.hosted == (0, 2), "the HTTP app reads the same hosting"
    assert node.state.role_of(2) == "active"


def test_a_role_swap_is_no_change_and_needs_no_new_plan(node):
    async def scenario() -> tuple[bool, bool]:
        first = node._host({0: "active", 1: "standby"})
        return first, node._host({0: "standby", 1: "active"})

    assert asyncio.run(scenario()) == (True, False)
    assert node._hosting().stores == {"bookings": {"active": (1,), "standby": (0,)}}
