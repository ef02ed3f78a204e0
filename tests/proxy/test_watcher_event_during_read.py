"""An event that lands while the watcher is reading the head (its pipelines in flight) is not
lost: what the read returned may predate it, so the head is read again on the next step
instead of when the periodic assignment read comes round (seconds later)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from common.clock import SharedClock
from common.contract import Assignment, Event, Keys, decode_assignment, encode
from proxy.watcher import TableWatcher
from tests.proxy.test_watcher_scale import publish

pytestmark = pytest.mark.integration


def _after_execute(connection: aioredis.Redis, number: int, hook: Callable[[], None]) -> None:
    """Run `hook` once, right after the `number`th pipeline the connection executes (from
    1) has its replies: the read is still in flight, the watcher has not seen them yet."""
    real_pipeline = connection.pipeline
    executed = 0

    def pipeline(*args: Any, **kwargs: Any) -> Any:
        pipe = real_pipeline(*args, **kwargs)
        real_execute = pipe.execute

        async def execute(*e_args: Any, **e_kwargs: Any) -> Any:
            nonlocal executed
            replies = await real_execute(*e_args, **e_kwargs)
            executed += 1
            if executed == number:
                hook()
            return replies

        pipe.execute = execute
        return pipe

    connection.pipeline = pipeline  # type: ignore[method-assign]


def _next_generation(client: redis.Redis, keys: Keys) -> Assignment:
    """The assignment again as generation 2 (the same placements: the nodes' hostings match)."""
    raw = client.get(keys.assignment)
    assert isinstance(raw, bytes)
    old = decode_assignment(raw)
    new = Assignment(2, old.leader, int(time.time() * 1000), old.stores)
    client.set(keys.assignment, encode(new))
    return new


@pytest.mark.parametrize("during", ["assignment", "alive"])
def test_an_assignment_event_during_a_head_read_is_read_on_the_next_step(redis_server, during):
    keys = Keys(f"during-{uuid.uuid4().hex[:8]}")
    client = redis.Redis.from_url(redis_server.url)
    publish(client, keys, 4, 8, int(time.time() * 1000))

    async def scenario() -> None:
        connection = aioredis.Redis.from_url(redis_server.url)
        watcher = TableWatcher(
            connection, keys, refresh_interval_ms=60_000, networks=None, clock=SharedClock()
        )
        try:
            await watcher.refresh()
            assert watcher.snapshot.generation == 1

            def assignment_moves() -> None:
                moved = _next_generation(client, keys)
                watcher._note(encode(Event("assignment", generation=moved.generation)))

            # The head read's first pipeline reads the assignment, its second liveness.
            _after_execute(connection, 1 if during == "assignment" else 2, assignment_moves)
            await watcher._read_head()
            await watcher._step()
            assert watcher.snapshot.generation == 2, "the event was lost: read seconds later"
        finally:
            await connection.aclose()

    try:
        asyncio.run(scenario())
    finally:
        client.close()
