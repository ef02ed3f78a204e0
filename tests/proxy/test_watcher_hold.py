"""A Redis restarted empty: the watcher keeps its last table, says it is degraded, and does not
pass the held table off as freshly read until it accepts what Redis holds.

Found in review: with nothing pending (an empty Redis sends no reports, so nothing is), the
next publish cleared the degraded flag and re-stamped the held table as just refreshed, and
never looked at the smaller table again, so a real shrink was never accepted."""

from __future__ import annotations

import asyncio

import redis
import redis.asyncio as aioredis

from common.contract import Keys
from proxy.watcher import TableWatcher
from tests.proxy.test_watcher_compact import compact_cluster

HOLD_MS = 600


def placed(watcher: TableWatcher) -> int:
    return sum(sum(map(len, route.replicas)) for route in watcher.snapshot.stores.values())


async def through_a_restart_empty(url: str, keys: Keys, client: redis.Redis) -> None:
    connection = aioredis.Redis.from_url(url)
    watcher = TableWatcher(
        connection, keys, refresh_interval_ms=50, networks=None, hold_smaller_table_ms=HOLD_MS
    )
    try:
        await watcher.refresh()
        full, built_at = placed(watcher), watcher.snapshot.built_at_ms
        assert full > 0
        assert not watcher.degraded

        for key in client.scan_iter(f"*{keys.cluster}*"):  # Redis came back empty
            client.delete(key)
        await watcher.refresh()
        assert watcher.degraded, "holding the last table"
        for _ in range(5):  # nothing pending: what the loop does meanwhile
            await asyncio.sleep(0.06)
            await watcher._publish()
            assert watcher.degraded, "still holding: not refreshed from Redis"
            assert placed(watcher) == full
            assert watcher.snapshot.built_at_ms == built_at, "the held table re-stamped fresh"

        await asyncio.sleep(HOLD_MS / 1000)
        await watcher._publish()
        assert placed(watcher) == 0, "after the hold, what Redis holds is accepted"
        assert not watcher.degraded
    finally:
        await connection.aclose()


def test_a_held_table_stays_degraded_and_is_not_restamped_until_accepted(redis_server):  # type: ignore[no-untyped-def]
    client = redis.Redis.from_url(redis_server.url)
    try:
        keys = compact_cluster(client)
        asyncio.run(through_a_restart_empty(redis_server.url, keys, client))
    finally:
        client.close()
