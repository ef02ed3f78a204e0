"""A cancelled watcher stops even when a library swallowed the cancellation: Python 3.11's
`asyncio.wait_for` (which redis-py sends every command through when a socket timeout is set)
can drop a cancellation that lands as the result does (CPython gh-86296). The task still
counts it, and the watcher's loops check that each round."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from common.clock import SharedClock
from common.contract import Keys
from proxy.watcher import TableWatcher


def never_connected_watcher() -> TableWatcher:
    connection = aioredis.Redis.from_url("redis://127.0.0.1:1", socket_connect_timeout=0.1)
    return TableWatcher(
        connection, Keys("cancel"), refresh_interval_ms=100, networks=None, clock=SharedClock()
    )


@pytest.mark.timeout(60)  # failing, asyncio.run's own shutdown waits on the surviving loop
def test_a_cancellation_a_library_swallowed_still_stops_the_watcher():
    table = never_connected_watcher()
    swallowed = 0
    stepping = asyncio.Event()

    async def swallowing_step() -> None:
        nonlocal swallowed
        stepping.set()
        try:
            await asyncio.sleep(1.0)
        except asyncio.CancelledError:
            swallowed += 1  # as wait_for can: the step returns as if nothing happened

    table._step = swallowing_step  # type: ignore[method-assign]

    async def cancel_while_stepping() -> bool:
        running = asyncio.create_task(table.run())
        await stepping.wait()  # the cancellation lands in the step, which swallows it
        running.cancel()
        done, _ = await asyncio.wait({running}, timeout=5)
        return bool(done)

    assert asyncio.run(cancel_while_stepping()), "the watcher outlived its cancellation"
    assert swallowed == 1
