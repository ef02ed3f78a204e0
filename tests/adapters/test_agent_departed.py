"""kroute.agent forgets departed instances (docs/redis-contract.md, "Departed nodes"): real
agents' heartbeats and assignment merges against a real redis-server; no Kafka is needed for
what they write to Redis here."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable

import pytest
import redis
import redis.asyncio as aioredis

from common.contract import Keys, NodeInfo, StoreInfo, as_text
from kroute.agent import Agent, AgentTiming
from kroute.contract_check import check
from kroute.embedded import RedisHandle

pytestmark = pytest.mark.integration

STORE = StoreInfo("customers", "customers", 4)
TIDY_MS = 200
FORGET_AFTER_MS = 400
PORTS = {"live": 21001, "gone": 21002, "placed": 21003, "a": 21004, "b": 21005, "away": 21006}


def agent(url: str, keys: Keys, node_id: str, alive_ttl_ms: int = 2000) -> Agent:
    timing = AgentTiming(
        alive_ttl_ms=alive_ttl_ms, tidy_ms=TIDY_MS, forget_after_ms=FORGET_AFTER_MS
    )
    return Agent(
        redis=aioredis.Redis.from_url(url),
        keys=keys,
        node=NodeInfo(node_id, f"http://127.0.0.1:{PORTS[node_id]}", 0),
        store=STORE,
        bootstrap_servers="127.0.0.1:1",  # not used: nothing here reads Kafka
        timing=timing,
    )


async def described(url: str, keys: Keys, node_id: str, held: set[int]) -> None:
    """An instance that registered, holds `held` and then died (its heartbeat's TTL lapses)."""
    instance = agent(url, keys, node_id, alive_ttl_ms=50)
    await instance.heartbeat()
    instance.held = frozenset(held)
    await instance._publish_holding()
    await instance.redis.aclose()


def run(redis_server: RedisHandle, scenario: Callable[[str, Keys], Awaitable[None]]) -> None:
    asyncio.run(scenario(redis_server.url, Keys(f"departed-{uuid.uuid4().hex[:8]}")))


def registered(client: redis.Redis, keys: Keys) -> set[str]:
    return {as_text(n) for n in client.smembers(keys.nodes)}


def test_a_dead_instance_placed_nowhere_is_forgotten_after_the_grace_period(
    redis_server: RedisHandle,
) -> None:
    client = redis.Redis.from_url(redis_server.url)

    async def scenario(url: str, keys: Keys) -> None:
        live = agent(url, keys, "live")
        await live.heartbeat()
        await described(url, keys, "gone", set())  # its partitions went to others
        await described(url, keys, "placed", {0})  # the assignment still names it
        events = client.pubsub(ignore_subscribe_messages=True)
        events.subscribe(keys.events)
        await asyncio.sleep(0.1)  # both dead now
        assert await live.forget_departed()
        # The grace period starts; nobody is forgotten yet.
        assert registered(client, keys) == {"live", "gone", "placed"}
        assert set(map(as_text, client.hkeys(keys.dead_since))) == {"gone", "placed"}
        await asyncio.sleep((FORGET_AFTER_MS + TIDY_MS) / 1000)
        await live.heartbeat()
        assert await live.forget_departed()
        assert registered(client, keys) == {"live", "placed"}
        gone_keys = [keys.node("gone"), keys.hosting("gone"), keys.lag("gone")]
        assert client.exists(*gone_keys) == 0, "a forgotten instance's keys stayed"
        assert set(map(as_text, client.hkeys(keys.dead_since))) == {"placed"}
        messages = [events.get_message(timeout=1.0) for _ in range(3)]
        named = [json.loads(m["data"]).get("node_id") for m in messages if m is not None]
        assert "gone" in named, "no event told proxies to drop it"
        events.close()
        # What is left passes the contract check.
        report = check(client, keys.cluster)
        assert not report.errors, report.as_text()
        await live.redis.aclose()

    try:
        run(redis_server, scenario)
    finally:
        client.close()


def test_one_agent_looks_per_interval_and_one_that_came_back_loses_its_grace_period(
    redis_server: RedisHandle,
) -> None:
    client = redis.Redis.from_url(redis_server.url)

    async def scenario(url: str, keys: Keys) -> None:
        first, second = agent(url, keys, "a"), agent(url, keys, "b")
        await first.heartbeat()
        await second.heartbeat()
        await described(url, keys, "away", set())
        await asyncio.sleep(0.1)
        took = await asyncio.gather(first.forget_departed(), second.forget_departed())
        assert sorted(took) == [False, True], "the round was not one agent's alone"
        assert set(map(as_text, client.hkeys(keys.dead_since))) == {"away"}
        back = agent(url, keys, "away")
        await back.heartbeat()  # it answers again within the grace period
        await asyncio.sleep((FORGET_AFTER_MS + TIDY_MS) / 1000)
        for instance in (first, second, back):
            await instance.heartbeat()
        assert any(await asyncio.gather(first.forget_departed(), second.forget_departed()))
        assert registered(client, keys) == {"a", "b", "away"}
        assert client.hlen(keys.dead_since) == 0, "it came back: its grace period ends"
        for instance in (first, second, back):
            await instance.redis.aclose()

    try:
        run(redis_server, scenario)
    finally:
        client.close()
