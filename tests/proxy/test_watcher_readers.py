"""The watcher reads in several pipelines at once (`_in_flight`): when one fails, the others
stop before the error reaches the step, instead of going on reading and applying chunks beside
the next step (a full read, after an error)."""

from __future__ import annotations

import asyncio
from collections import deque

import pytest
import redis.asyncio as aioredis

from common.clock import SharedClock
from common.contract import Keys
from proxy.watcher import PIPELINES_IN_FLIGHT, TableWatcher


def test_a_failing_reader_stops_its_siblings_before_the_error_goes_on():
    applied: list[str] = []

    async def read(chunk: list[str]) -> None:
        if chunk == ["fails"]:
            await asyncio.sleep(0.01)
            raise aioredis.ConnectionError("connection lost")
        await asyncio.sleep(0.05)  # a slower pipeline, still in flight when the first fails
        applied.extend(chunk)

    async def scenario() -> None:
        connection = aioredis.Redis()  # never connects: the reads here are `read`'s own
        watcher = TableWatcher(
            connection, Keys("readers"), refresh_interval_ms=1000, networks=None,
            clock=SharedClock(),
        )  # fmt: skip
        chunks = deque([["fails"], *([f"node-{i}"] for i in range(2 * PIPELINES_IN_FLIGHT))])
        try:
            with pytest.raises(aioredis.ConnectionError):
                await watcher._in_flight(read, chunks)
            await asyncio.sleep(0.2)  # what a sibling left running would apply meanwhile
        finally:
            await connection.aclose()

    asyncio.run(scenario())
    assert applied == [], "readers went on after one of them failed"
