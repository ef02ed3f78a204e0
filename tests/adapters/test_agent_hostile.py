"""The agent when Redis fails during a rebalance, and when a rebalance lands while a periodic
report is in flight (review 18). Real redis-server; no Kafka (positions are given)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Collection, Mapping

import pytest
import redis.asyncio as aioredis

from common.contract import StoreInfo, decode_assignment, decode_hosting
from kroute.agent import Agent
from kroute.embedded import RedisHandle, free_port

pytestmark = pytest.mark.integration
STORE = StoreInfo("s", "t", 2)


def agent(url: str, cluster: str, node_id: str) -> Agent:
    made = Agent.connect(
        url, node_id=node_id, url=f"http://127.0.0.1:{free_port()}", store=STORE,
        bootstrap_servers="127.0.0.1:1", cluster=cluster,
    )  # fmt: skip
    made._kafka = object()  # type: ignore[assignment] # never used: no partition is read
    return made


async def at_ten(held: Collection[int]) -> Mapping[int, int]:
    return dict.fromkeys(held, 10)


def test_a_take_that_failed_on_a_redis_error_is_retried(redis_server: RedisHandle) -> None:
    async def test() -> None:
        cluster = f"a-{uuid.uuid4().hex[:8]}"
        dead, survivor = (
            agent(redis_server.url, cluster, "x"),
            agent(redis_server.url, cluster, "b"),
        )
        for member in (dead, survivor):
            await member.clock.sync(member.redis)
        await dead.assigned([0, 1])  # then killed: it never revokes
        good = survivor.redis
        survivor.redis = aioredis.Redis.from_url(
            f"redis://127.0.0.1:{free_port()}", socket_timeout=0.3
        )
        await survivor.assigned([0, 1])  # the group gives b both; Redis blips
        await survivor.redis.aclose()
        survivor.redis = good
        assert survivor.pending_take == {0, 1}
        await survivor.report(at_ten)  # the loop's next report retries the take
        stored = decode_assignment(await good.get(survivor.keys.assignment) or b"")
        assert {p: a.active for p, a in stored.stores["s"].items()} == {0: "b", 1: "b"}
        assert survivor.pending_take == frozenset()
        await dead.redis.aclose()
        await good.aclose()

    asyncio.run(test())


def test_a_report_in_flight_does_not_republish_a_revoked_partition(
    redis_server: RedisHandle,
) -> None:
    async def test() -> None:
        member = agent(redis_server.url, f"a-{uuid.uuid4().hex[:8]}", "a")
        await member.clock.sync(member.redis)
        await member.assigned([0, 1])
        gate = asyncio.Event()

        async def slow(held: Collection[int]) -> Mapping[int, int]:
            await gate.wait()
            return dict.fromkeys(held, 5)

        in_flight = asyncio.create_task(member.report(slow))
        await asyncio.sleep(0.05)
        await member.revoked([1])
        gate.set()
        await in_flight
        hosting = decode_hosting(await member.redis.get(member.keys.hosting("a")) or b"")
        assert hosting.stores["s"]["active"] == (0,)
        assert await member.redis.hkeys(member.keys.lag("a")) == [b"s/0"]
        stored = decode_assignment(await member.redis.get(member.keys.assignment) or b"")
        assert stored.stores["s"][1].active is None
        await member.redis.aclose()

    asyncio.run(test())
