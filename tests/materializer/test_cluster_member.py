"""A ClusterMember's leader step against a real redis-server, without nodes or Spark."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis

from common.contract import (
    Assignment,
    Hosting,
    Keys,
    NodeInfo,
    PartitionAssignment,
    StoreInfo,
    decode_assignment,
)
from materializer.cluster import ClusterMember, ClusterTiming

pytestmark = pytest.mark.integration

LAST = Assignment(
    4,
    "b",
    0,
    {"customers": {0: PartitionAssignment("a", ("b",)), 1: PartitionAssignment("b", ("a",))}},
)


def member(url: str, keys: Keys, assignment: Assignment | None) -> ClusterMember:
    client = aioredis.Redis.from_url(url)
    return ClusterMember(
        redis=client,
        keys=keys,
        node=NodeInfo("a", "http://127.0.0.1:1", 0),
        store=StoreInfo("customers", "bookings", 2),
        timing=ClusterTiming(grace_ms=600_000, standbys=1),
        hosting=lambda: Hosting("a", 4, {}, 0),
        reports=dict,
        on_assignment=lambda _assignment: None,
        assignment=assignment,
    )


def test_a_leader_facing_an_emptied_redis_keeps_the_last_assignment(redis_server):
    keys = Keys(f"t-{uuid.uuid4().hex[:8]}")

    async def scenario() -> Assignment:
        leader = member(redis_server.url, keys, LAST)  # Redis holds nothing for this cluster
        try:
            await leader.lead()  # takes the lease, computes, writes (the key is missing)
            raw = await leader.redis.get(keys.assignment)
            assert raw is not None
            return decode_assignment(raw)
        finally:
            await leader.redis.aclose()

    written = asyncio.run(scenario())
    assert written.stores == LAST.stores, "no store or node forgotten before it re-registered"
    assert written.generation == LAST.generation


def test_only_the_lease_holder_writes_the_assignment(redis_server):
    keys = Keys(f"t-{uuid.uuid4().hex[:8]}")

    async def scenario() -> tuple[bool, bytes | None]:
        leader = member(redis_server.url, keys, None)
        try:
            await leader.redis.set(keys.leader, "someone-else", px=10_000)
            await leader.heartbeat()
            await leader.lead()
            return leader.is_leader, await leader.redis.get(keys.assignment)
        finally:
            await leader.redis.aclose()

    is_leader, assignment = asyncio.run(scenario())
    assert not is_leader
    assert assignment is None


def test_a_restarted_node_replaces_the_reports_its_last_run_left(redis_server):
    # The last run reported partition 0 caught up; this run has not measured anything yet
    # (restoring a lost store, say). Proxies must not take the old report for a current one.
    keys = Keys(f"t-{uuid.uuid4().hex[:8]}")

    async def scenario() -> dict[bytes, bytes]:
        restarted = member(redis_server.url, keys, None)
        try:
            await restarted.redis.hset(keys.lag("a"), "customers/0", b"caught up, last run")
            await restarted.report()
            return await restarted.redis.hgetall(keys.lag("a"))
        finally:
            await restarted.redis.aclose()

    assert asyncio.run(scenario()) == {}
