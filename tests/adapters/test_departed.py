"""Writers without a leader forget departed nodes (docs/redis-contract.md, "Departed nodes"):
the Faust and fixed-placement adapters after their grace period, the static cluster fixture at
once. Real redis-server; fake workers (`fake_workers.py`), Kafka offsets stubbed."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from redis.asyncio.client import PubSub

from common.contract import Keys, StoreInfo
from common.departed import DEFAULT_GRACE_MS, per_node_keys
from kroute.adapters.faust import FaustAdapter, node_id_for
from kroute.adapters.fixed import FixedPlacement
from kroute.embedded import RedisHandle
from kroute.static_cluster import StaticCluster
from materializer.cluster import ClusterTiming
from tests.adapters.fake_workers import STARTED, FakeWorker, start_workers
from tests.adapters.test_faust_hostile import CL, make_adapter, route, run, serve
from tests.adapters.test_fixed_hostile import run as run_fixed
from tests.adapters.test_fixed_hostile import spec_for

pytestmark = pytest.mark.integration
GRACE_MS = 1_000
PAST_GRACE_S = GRACE_MS / 1000 + 0.3


def test_the_default_grace_period_is_the_leaders() -> None:
    assert ClusterTiming().grace_ms == DEFAULT_GRACE_MS


async def registered(client: aioredis.Redis, keys: Keys) -> set[str]:
    return {n.decode() for n in await client.smembers(keys.nodes)}


async def keys_left(client: aioredis.Redis, keys: Keys, node_id: str) -> set[str]:
    return {key for key in per_node_keys(keys, node_id) if await client.exists(key)}


def node_ids(messages: list[dict[str, Any]]) -> list[str]:
    """The node ids `node` events name, in order (the other events are left out)."""
    bodies = [json.loads(m["data"]) for m in messages if m["type"] == "message"]
    return [body["node_id"] for body in bodies if body["type"] == "node"]


async def node_events(events: PubSub) -> list[str]:
    """The node ids of the `node` events published since the last call."""
    messages = []
    while (message := await events.get_message(timeout=0.2)) is not None:
        messages.append(message)
    return node_ids(messages)


async def listening(client: aioredis.Redis, keys: Keys) -> PubSub:
    events = client.pubsub()
    await events.subscribe(keys.events)
    await node_events(events)  # the subscription's confirmation
    return events


def test_a_faust_worker_gone_past_the_grace_period_is_forgotten_and_found_again(
    redis_server: RedisHandle,
) -> None:
    async def test(url: str, cluster: str) -> None:
        keys = Keys(cluster)
        w1, w2 = await start_workers(2)
        both = route([w1, w2], [[0, 1], [2, 3]])
        serve([w1, w2], both)
        adapter = make_adapter(url, [w1.url], cluster, forget_after_ms=GRACE_MS)
        client = aioredis.Redis.from_url(url)
        events = await listening(client, keys)
        gone = node_id_for(w2.url)
        try:
            for _ in range(2):  # found in w1's router, then probed
                await adapter.step()
            described = await keys_left(client, keys, gone)
            assert {keys.node(gone), keys.hosting(gone), keys.report(gone)} <= described

            await w2.stop()  # its pod is replaced; Faust rebalances its partitions to w1
            serve([w1], {w1.url: {CL: [0, 1, 2, 3]}})
            for _ in range(2):
                await adapter.step()
            # Within the grace period nothing is removed.
            assert gone in await registered(client, keys)
            assert {keys.node(gone), keys.hosting(gone)} <= await keys_left(client, keys, gone)
            assert await client.hexists(keys.dead_since, gone)
            assert await node_events(events) == []

            await asyncio.sleep(PAST_GRACE_S)
            await adapter.step()
            assert await registered(client, keys) == {node_id_for(w1.url)}
            assert await keys_left(client, keys, gone) == set()
            assert not await client.hexists(keys.dead_since, gone)
            assert await node_events(events) == [gone]
            assert w2.url not in adapter.known  # no longer probed

            back = await FakeWorker(port=w2.port).start()  # the same worker comes back
            STARTED.append(back)
            serve([w1, back], both)
            for _ in range(2):
                await adapter.step()
            assert gone in await registered(client, keys)
            assert {keys.node(gone), keys.alive(gone)} <= await keys_left(client, keys, gone)
        finally:
            await events.aclose()
            await adapter.close()
            await client.aclose()

    run(redis_server, test)


def test_a_dead_faust_worker_still_placed_is_kept(redis_server: RedisHandle) -> None:
    async def test(url: str, cluster: str) -> None:
        keys = Keys(cluster)
        w1, w2 = await start_workers(2)
        serve([w1, w2], route([w1, w2], [[0, 1], [2, 3]]))
        adapter = make_adapter(url, [w1.url], cluster, forget_after_ms=GRACE_MS)
        client = aioredis.Redis.from_url(url)
        gone = node_id_for(w2.url)
        try:
            for _ in range(2):
                await adapter.step()
            await w2.stop()  # dead, but Faust has not rebalanced: w1 still names it the owner
            await adapter.step()
            await asyncio.sleep(PAST_GRACE_S)
            await adapter.step()
            assert gone in await registered(client, keys)
            assert keys.node(gone) in await keys_left(client, keys, gone)

            serve([w1], {w1.url: {CL: [0, 1, 2, 3]}})  # rebalanced: placed nowhere, long gone
            await adapter.step()
            assert gone not in await registered(client, keys)
        finally:
            await adapter.close()
            await client.aclose()

    run(redis_server, test)


def test_a_faust_worker_back_within_the_grace_period_starts_over(
    redis_server: RedisHandle,
) -> None:
    async def test(url: str, cluster: str) -> None:
        keys = Keys(cluster)
        w1, w2 = await start_workers(2)
        both = route([w1, w2], [[0, 1], [2, 3]])
        serve([w1, w2], both)
        adapter = make_adapter(url, [w1.url], cluster, forget_after_ms=GRACE_MS)
        client = aioredis.Redis.from_url(url)
        blinked = node_id_for(w2.url)
        try:
            for _ in range(2):
                await adapter.step()
            await w2.stop()
            await adapter.step()
            assert await client.hexists(keys.dead_since, blinked)
            back = await FakeWorker(port=w2.port).start()  # restarted before the grace ended
            STARTED.append(back)
            serve([w1, back], both)
            await adapter.step()
            assert not await client.hexists(keys.dead_since, blinked)
            assert blinked in await registered(client, keys)
        finally:
            await adapter.close()
            await client.aclose()

    run(redis_server, test)


def test_an_id_an_earlier_faust_adapter_wrote_is_forgotten(redis_server: RedisHandle) -> None:
    async def test(url: str, cluster: str) -> None:
        keys = Keys(cluster)
        (w1,) = await start_workers(1)
        serve([w1], {w1.url: {CL: [0, 1, 2, 3]}})
        client = aioredis.Redis.from_url(url)
        await client.sadd(keys.nodes, "old-pod")  # an earlier run's worker, replaced since
        await client.set(keys.node("old-pod"), "{}")
        await client.set(keys.hosting("old-pod"), "{}")
        adapter: FaustAdapter = make_adapter(url, [w1.url], cluster, forget_after_ms=GRACE_MS)
        try:
            for _ in range(2):
                await adapter.step()
                assert "old-pod" in await registered(client, keys)
            await asyncio.sleep(PAST_GRACE_S)
            await adapter.step()
            assert await registered(client, keys) == {node_id_for(w1.url)}
            assert await keys_left(client, keys, "old-pod") == set()
        finally:
            await adapter.close()
            await client.aclose()

    run(redis_server, test)


def test_a_node_out_of_the_placement_file_is_forgotten_after_the_grace_period(
    redis_server: RedisHandle,
) -> None:
    async def test(url: str, keys: Keys) -> None:
        (a,) = await start_workers(1)
        nodes = {"a": a.url, "b": "http://127.0.0.1:9"}  # b never answers: dead, still placed
        client = aioredis.Redis.from_url(url)
        await client.sadd(keys.nodes, "old")  # an earlier file's node
        await client.set(keys.node("old"), "{}")
        await client.set(keys.hosting("old"), "{}")
        await client.set(keys.report_at("old"), "1 1")
        events = await listening(client, keys)
        adapter = FixedPlacement(spec_for(nodes, forget_after_ms=GRACE_MS), client, keys)
        try:
            for _ in range(2):  # within the grace period nothing is removed
                await adapter.probe_and_heartbeat()
                assert await registered(client, keys) == {"a", "b", "old"}
                assert keys.node("old") in await keys_left(client, keys, "old")
            assert await client.hexists(keys.dead_since, "old")
            assert await node_events(events) == []

            await asyncio.sleep(PAST_GRACE_S)
            await adapter.probe_and_heartbeat()
            assert await registered(client, keys) == {"a", "b"}  # b: named by the file
            assert await keys_left(client, keys, "old") == set()
            assert await node_events(events) == ["old"]

            again = FixedPlacement(
                spec_for({**nodes, "old": a.url}, forget_after_ms=GRACE_MS), client, keys
            )
            await adapter.lease.release()  # a new file names it again
            await again.probe_and_heartbeat()
            assert await registered(client, keys) == {"a", "b", "old"}
            await again.close()
        finally:
            await events.aclose()
            await adapter.close()
            await client.aclose()

    run_fixed(redis_server, test)


def test_the_static_cluster_forgets_a_node_left_out_at_once(redis_server: RedisHandle) -> None:
    keys = Keys(f"s-{uuid.uuid4().hex[:8]}")
    client = redis.Redis.from_url(redis_server.url)
    events = client.pubsub()
    try:
        urls = {"a": "http://127.0.0.1:1", "b": "http://127.0.0.1:2"}
        cluster = StaticCluster(keys, urls).add_store(StoreInfo("s", "t", 2))
        cluster.publish(client)
        events.subscribe(keys.events)
        cluster.node_urls = {"a": urls["a"]}
        cluster.publish(client)
        assert client.smembers(keys.nodes) == {b"a"}
        assert not any(client.exists(key) for key in per_node_keys(keys, "b"))
        messages = []
        while (message := events.get_message(timeout=0.5)) is not None:
            messages.append(message)
        assert node_ids(messages) == ["b"]
    finally:
        events.close()
        client.close()
