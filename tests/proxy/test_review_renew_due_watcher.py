"""Review of f6e641d: an exception out of the request path's `renew_due` must neither stop the
watcher's loop nor pass silently nor wedge it: it is counted and said like any failed step,
the loop keeps asking on its next steps, and the table recovers (degraded cleared) once
renew_due stops failing."""

from __future__ import annotations

import asyncio
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
from tests.proxy.test_watcher_scale import publish

pytestmark = pytest.mark.integration


def test_a_failing_renew_due_is_counted_and_the_loop_goes_on(redis_server):
    keys = Keys(f"review-due-{uuid.uuid4().hex[:8]}")
    client = redis.Redis.from_url(redis_server.url)
    calls: list[float] = []
    seen: dict[str, object] = {}

    async def watch() -> None:
        connection = aioredis.Redis.from_url(redis_server.url)
        watcher = TableWatcher(
            connection, keys, refresh_interval_ms=500, networks=None, clock=SharedClock()
        )

        def renew_due(snapshot: RoutingSnapshot, most: int) -> bool:
            calls.append(time.monotonic())
            if len(calls) <= 3:
                raise RuntimeError("renew_due broke")
            return False

        stability = ChoiceStability(LagBudget(100, None), "reject", 3_000)
        watcher.keep_choices(stability, lambda *_: None, renew_due)
        running = asyncio.create_task(watcher.run())
        try:
            await watcher.refresh()
            # Until asked 10 times (bounded: a loaded machine runs the steps late, not fewer).
            deadline = time.monotonic() + 30.0
            while time.monotonic() < deadline and len(calls) < 10:
                await asyncio.sleep(0.1)
                if len(calls) >= 3 and "failures" not in seen:
                    seen["failures"] = watcher.refresh_failures
                    seen["error"] = watcher.last_error
            seen["done"] = running.done()
            seen["degraded"] = watcher.degraded
            seen["loaded"] = watcher.loaded
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            await connection.aclose()

    try:
        publish(client, keys, 4, 8, int(time.time() * 1000))
        asyncio.run(watch())
    finally:
        client.close()
    assert seen.get("done") is False, "the watcher's loop died"
    assert seen.get("failures", 0) >= 3, "each failure counted"  # type: ignore[operator]
    assert seen.get("error") == "renew_due broke"
    assert len(calls) >= 10, "asked again on the following steps"
    assert seen.get("degraded") is False, "recovered once renew_due stopped failing"
    assert seen.get("loaded") is True
