"""The watcher reads in several pipelines at once (`_in_flight`): when one fails, the others
stop before the error reaches the step, instead of going on reading and applying chunks beside
the next step (a full read, after an error)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable

import pytest
import redis.asyncio as aioredis

from common.clock import SharedClock
from common.contract import Keys
from proxy.watcher import PIPELINES_IN_FLIGHT, TableWatcher

FIRST_IN_FLIGHT = [f"node-{i}" for i in range(PIPELINES_IN_FLIGHT - 1)]


def _read_after_a_failure(read: Callable[[list[str]], Awaitable[None]]) -> None:
    """`_in_flight` over a failing chunk and twice as many others as there are readers."""

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
            await asyncio.sleep(0.3)  # what a reader left running would apply meanwhile
        finally:
            await connection.aclose()

    asyncio.run(scenario())


async def _fail(chunk: list[str]) -> None:
    if chunk == ["fails"]:
        await asyncio.sleep(0.01)
        raise aioredis.ConnectionError("connection lost")


def test_a_failing_reader_stops_its_siblings_before_the_error_goes_on() -> None:
    applied: list[str] = []

    async def read(chunk: list[str]) -> None:
        await _fail(chunk)
        await asyncio.sleep(0.05)  # a slower pipeline, still in flight when the first fails
        applied.extend(chunk)

    _read_after_a_failure(read)
    assert applied == [], "readers went on after one of them failed"


def test_a_reader_whose_cancellation_was_swallowed_takes_no_further_chunk() -> None:
    """On Python 3.11 redis-py's `wait_for` can drop a cancellation (the read returns): the
    chunk in flight is applied, but no reader takes another."""
    applied: list[str] = []

    async def read(chunk: list[str]) -> None:
        await _fail(chunk)
        with contextlib.suppress(asyncio.CancelledError):  # swallowed, as that wait_for does
            await asyncio.sleep(0.05)
        applied.extend(chunk)

    _read_after_a_failure(read)
    assert set(applied) <= set(FIRST_IN_FLIGHT), f"chunks read after the failure: {applied}"
