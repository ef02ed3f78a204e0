"""The watcher on a real redis-server tells the request path which cached choices a report
changed and which it left standing (to renew), and freezes the heap after each swap."""

from __future__ import annotations

import asyncio
import gc
import time
import uuid

import pytest
import redis
import redis.asyncio as aioredis

from common.clock import SharedClock
from common.contract import Keys
from proxy.choice import LagBudget
from proxy.routing import ChoiceStability, RoutingSnapshot
from proxy.watcher import TableWatcher
from tests.proxy.test_watcher_scale import publish, report_lag

pytestmark = pytest.mark.integration


def _watch(url: str, keys: Keys, client: redis.Redis, lag: int) -> tuple[set[int], set[int]]:
    """Partition 7's report on node-0007 (its active) rewritten with `lag`, later: which
    partitions the swaps named as changed, and which were handed over to renew."""
    changed: set[int] = set()
    renewed: set[int] = set()

    def renew(snapshot: RoutingSnapshot, store: str, partitions: list[int]) -> None:
        assert store == "s"
        renewed.update(partitions)

    def swapped(snapshot: RoutingSnapshot) -> None:
        if snapshot.changed is not None:
            changed.update(snapshot.changed.get("s", ()))

    async def watch() -> None:
        connection = aioredis.Redis.from_url(url)
        watcher = TableWatcher(
            connection, keys, refresh_interval_ms=1000, networks=None, clock=SharedClock()
        )
        stability = ChoiceStability(LagBudget(100, None), "reject", 3_000)
        watcher.keep_choices(stability, renew)
        watcher.on_snapshot = swapped
        running = asyncio.create_task(watcher.run())
        try:
            await watcher.refresh()
            await asyncio.sleep(1.2)  # the full read run() starts with (the subscription's)
            changed.clear()
            renewed.clear()
            report_lag(client, keys, "node-0007", 7, lag=lag, at=int(time.time() * 1000))
            deadline = time.monotonic() + 5
            while watcher.snapshot.stores["s"].replicas[7][0].lag != lag:
                assert time.monotonic() < deadline, "the report never reached the table"
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)  # the renewal steps after the swap
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            await connection.aclose()

    asyncio.run(watch())
    return changed, renewed


def test_a_report_inside_the_budget_is_renewed_and_one_over_it_is_changed(redis_server):
    keys = Keys(f"choices-{uuid.uuid4().hex[:8]}")
    client = redis.Redis.from_url(redis_server.url)
    try:
        publish(client, keys, 20, 40, int(time.time() * 1000))
        changed, renewed = _watch(redis_server.url, keys, client, lag=50)
        assert 7 in renewed, "inside the budget of 100: the cached choice stays, renewed"
        assert 7 not in changed
        changed, renewed = _watch(redis_server.url, keys, client, lag=500)
        assert 7 in changed, "over the budget: the standby goes first now"
        assert 7 not in renewed
    finally:
        client.close()


def test_the_proxy_freezes_its_heap_after_a_swap(redis_server):
    keys = Keys(f"freeze-{uuid.uuid4().hex[:8]}")
    client = redis.Redis.from_url(redis_server.url)
    publish(client, keys, 4, 8, int(time.time() * 1000))

    async def build(freeze: bool) -> int:
        connection = aioredis.Redis.from_url(redis_server.url)
        try:
            watcher = TableWatcher(
                connection, keys, refresh_interval_ms=1000, networks=None, clock=SharedClock()
            )
            watcher.freeze_heap = freeze
            await watcher.refresh()
            return gc.get_freeze_count()
        finally:
            await connection.aclose()

    try:
        gc.unfreeze()
        assert asyncio.run(build(False)) == 0, "a watcher in a test leaves the heap alone"
        assert asyncio.run(build(True)) > 0
    finally:
        gc.unfreeze()  # this test process's heap goes back to the collector
        client.close()


def test_the_watcher_asks_for_due_renewals_on_every_step_until_none_are_left(redis_server):
    """Choices the request path left for later on a replaced clock are renewed when their
    turn comes only if the watcher asks (`renew_due`) on its steps, with the snapshot in use,
    again while more are due, and even when no report changes anything."""
    keys = Keys(f"choices-due-{uuid.uuid4().hex[:8]}")
    client = redis.Redis.from_url(redis_server.url)
    calls: list[tuple[bool, int]] = []
    more_due = [3]

    async def watch() -> None:
        connection = aioredis.Redis.from_url(redis_server.url)
        watcher = TableWatcher(
            connection, keys, refresh_interval_ms=1000, networks=None, clock=SharedClock()
        )

        def renew_due(snapshot: RoutingSnapshot, most: int) -> bool:
            calls.append((snapshot is watcher.snapshot, most))
            more_due[0] -= 1
            return more_due[0] >= 0

        stability = ChoiceStability(LagBudget(100, None), "reject", 3_000)
        watcher.keep_choices(stability, lambda *_: None, renew_due)
        running = asyncio.create_task(watcher.run())
        try:
            await watcher.refresh()
            await asyncio.sleep(1.5)
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            await connection.aclose()

    try:
        publish(client, keys, 4, 8, int(time.time() * 1000))
        asyncio.run(watch())
    finally:
        client.close()
    assert len(calls) >= 8, "asked on every step (every 0.1 s), not only after a swap"
    assert all(current for current, _ in calls), "always with the snapshot in use"
    assert all(most > 0 for _, most in calls)
