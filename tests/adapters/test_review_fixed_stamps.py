"""`kroute adapt fixed` writes each node's last lag reports again on every health round, until
the next lag round: their times must be mapped when written, not once when read, or reports
read before a backward clock step (a Redis failover to a host whose clock is behind) are
published fresher than they are for as long as no new lag round succeeds (a broker down).
Real redis-server; Kafka's answers stubbed."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
import redis.asyncio as aioredis

from common.contract import Keys, decode_report
from kroute.adapters import fixed
from kroute.adapters.fixed import FixedPlacement, PlacementFile
from kroute.embedded import RedisHandle

pytestmark = pytest.mark.integration

BACK_MS = 1_500


def spec() -> PlacementFile:
    return PlacementFile.model_validate({
        "nodes": {"a": "http://127.0.0.1:9"},
        "stores": {"s": {"topic": "t", "partitions": 1, "placement": {"0": {"active": "a"}}}},
        "health": {"interval_ms": 200, "timeout_ms": 100},
        "lag": {"source": "consumer_group", "bootstrap_servers": "127.0.0.1:1", "group": "g"},
    })  # fmt: skip


def step_back(adapter: FixedPlacement) -> None:
    """Redis time seen BACK_MS lower, confirmed as often as the clock asks."""
    clock = adapter.clock
    for _ in range(clock.confirmations):
        sent = clock.stopwatch()
        now = clock.now_ms() - BACK_MS
        clock.observe((now // 1000, now % 1000 * 1000), sent, clock.stopwatch())


def test_reports_written_again_after_a_backward_clock_step_are_not_fresher_than_true(
    redis_server: RedisHandle, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def ends(*_: Any, **__: Any) -> dict[int, int]:
        return {0: 50}

    monkeypatch.setattr(fixed, "fetch_high_watermarks", ends)

    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_server.url)
        keys = Keys(f"stamps-{uuid.uuid4().hex[:8]}")
        adapter = FixedPlacement(spec(), client, keys)

        async def no_clients(_: Any) -> tuple[None, None]:
            return None, None

        async def committed(*_: Any) -> dict[tuple[str, str, int], int]:
            return {("a", "s", 0): 50}  # caught up

        monkeypatch.setattr(adapter, "_clients", no_clients)
        monkeypatch.setattr(adapter, "_committed", committed)
        try:
            await adapter.probe_and_heartbeat()  # syncs and takes the lease
            assert adapter.lease.held
            await adapter.report_lag()  # read at Redis time T, caught up then
            step_back(adapter)
            await adapter.probe_and_heartbeat()  # the same reports, written again
            raw = await client.hget(keys.lag("a"), "s/0")
            assert raw is not None
            report = decode_report(raw)
            # Read before the step: on the clock now in use it is BACK_MS older than stamped.
            now = adapter.clock.now_ms()
            assert report.updated_at_ms <= now, "a report from the future"
            assert report.caught_up_at_ms is not None
            assert report.caught_up_at_ms <= now, "caught up in the future"
        finally:
            await adapter.close()
            await client.aclose()

    asyncio.run(scenario())
