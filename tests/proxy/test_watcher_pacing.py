"""The watcher's table work leaves the event loop to requests for several turns after each
stretch (`PAUSE_PER_STRETCH` times the stretch), within a budget per step, so a request's
turns (client head, to the node, answer, to the client) do not each wait behind a stretch.
How much that does for latency is benchmarks/control_plane_bench.py's to measure; here, that
other tasks get the loop for many turns after a stretch, and only one once the budget is
spent."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from common.clock import SharedClock
from common.contract import Keys
from proxy.watcher import PAUSE_PER_STRETCH, STEP_PAUSE_BUDGET_S, TableWatcher

STRETCH_S = 0.002


def watcher() -> TableWatcher:
    # Never connected: only the pacing is exercised.
    connection = aioredis.Redis.from_url("redis://127.0.0.1:1")
    return TableWatcher(
        connection, Keys("pacing"), refresh_interval_ms=1000, networks=None, clock=SharedClock()
    )


async def turns_during_one_yield(table: TableWatcher) -> int:
    """How many loop turns another task got while the watcher yielded after a busy stretch."""
    turns = 0
    stop = False

    async def request() -> None:
        nonlocal turns
        while not stop:
            turns += 1
            await asyncio.sleep(0)

    other = asyncio.create_task(request())
    await asyncio.sleep(0)  # the other task is running
    table._hold()
    busy_until = time.perf_counter() + STRETCH_S
    while time.perf_counter() < busy_until:
        pass  # a stretch of table work
    turns = 0
    await table._yield()
    seen = turns
    stop = True
    await other
    return seen


def test_after_a_stretch_requests_get_the_loop_for_many_turns():
    table = watcher()
    table._pause_left_s = STEP_PAUSE_BUDGET_S
    seen = asyncio.run(turns_during_one_yield(table))
    assert seen >= 10, f"only {seen} turns for requests after a {STRETCH_S * 1000} ms stretch"
    left = STEP_PAUSE_BUDGET_S - table._pause_left_s
    assert left == pytest.approx(STRETCH_S * PAUSE_PER_STRETCH, rel=0.5), "the pause is spent"


def test_past_the_step_budget_a_stretch_ends_with_a_bare_yield():
    table = watcher()
    table._pause_left_s = 0.0  # a large step that has used its budget
    seen = asyncio.run(turns_during_one_yield(table))
    assert seen <= 2, f"{seen} turns: the watcher paused past its budget"


def test_a_pause_never_exceeds_what_is_left_of_the_budget():
    table = watcher()
    table._pause_left_s = 0.001
    assert table._pause_after(0.01) == pytest.approx(0.001)
    table._pause_left_s = -0.002  # a late timer overspent it
    assert table._pause_after(0.01) == 0.0
    table._pause_left_s = STEP_PAUSE_BUDGET_S
    assert table._pause_after(0.001) == pytest.approx(0.001 * PAUSE_PER_STRETCH)


def test_the_budget_pays_for_the_time_a_pause_took():
    """On a busy loop a timer fires late: the step's delay is what the budget bounds, so it
    is charged the time the pause took, not the time asked."""
    table = watcher()
    table._pause_left_s = STEP_PAUSE_BUDGET_S

    async def yield_on_a_busy_loop() -> None:
        async def hog() -> None:
            await asyncio.sleep(0)
            busy_until = time.perf_counter() + 0.02
            while time.perf_counter() < busy_until:
                pass  # a request that holds the loop 20 ms

        other = asyncio.create_task(hog())
        table._hold()
        busy_until = time.perf_counter() + STRETCH_S
        while time.perf_counter() < busy_until:
            pass
        await table._yield()  # asks for about 4 ms, gets the loop back after the hog's 20
        await other

    asyncio.run(yield_on_a_busy_loop())
    spent = STEP_PAUSE_BUDGET_S - table._pause_left_s
    assert spent >= 0.015, f"charged {spent * 1000:.1f} ms for a pause that took about 20 ms"
