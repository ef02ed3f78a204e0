"""The watcher's table work leaves the event loop to requests for several turns after each
stretch (`PAUSE_PER_STRETCH` times the stretch), within a budget per step, so a request's
turns (client head, to the node, answer, to the client) do not each wait behind a stretch.
How much that does for latency is benchmarks/control_plane_bench.py's to measure; here, that
other tasks get the loop for many turns after a stretch, and only one once the budget is
spent."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from collections.abc import Callable

import pytest
import redis.asyncio as aioredis

from common.clock import SharedClock
from common.contract import Keys
from proxy.watcher import (
    FULL_COLLECT_S,
    MAX_STRETCH_S,
    PAUSE_PER_STRETCH,
    STEP_PAUSE_BUDGET_S,
    TABLE_SHARE,
    TableWatcher,
    stretch_limit,
)
from proxy.watcher import STRETCH_S as SHORTEST_STRETCH_S

STRETCH_S = 0.002  # the table work these tests do in one stretch


def spin(seconds: float, clock: Callable[[], float] = time.perf_counter) -> None:
    """Hold the loop for `seconds` of `clock` (time.thread_time: of CPU time, which a loaded
    machine may stretch over more wall time)."""
    until = clock() + seconds
    while clock() < until:
        pass


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
    spin(STRETCH_S)  # a stretch of table work
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
    # At least most of the pause asked for (a loaded machine fires the timer late: more).
    assert left >= STRETCH_S * PAUSE_PER_STRETCH * 0.5, "the pause is spent"


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
            spin(0.02)  # a request that holds the loop 20 ms

        other = asyncio.create_task(hog())
        table._hold()
        spin(STRETCH_S)
        await table._yield()  # asks for about 4 ms, gets the loop back after the hog's 20
        await other

    asyncio.run(yield_on_a_busy_loop())
    spent = STEP_PAUSE_BUDGET_S - table._pause_left_s
    assert spent >= 0.015, f"charged {spent * 1000:.1f} ms for a pause that took about 20 ms"


def test_a_stretch_lasts_longer_the_later_requests_gave_the_loop_back():
    """On a saturated loop each yield waits for a round of requests: the table's next stretch
    is its share of that wait, so it keeps up with the nodes' reports; between the floor (a
    loop with time to spare) and a cap (a request never waits behind more than that)."""
    floor = SHORTEST_STRETCH_S
    assert stretch_limit(0.0) == floor
    assert stretch_limit(-0.001) == floor  # a timer that fired early
    assert stretch_limit(floor / TABLE_SHARE / 2) == floor
    assert stretch_limit(0.003) == pytest.approx(0.003 * TABLE_SHARE)
    assert floor < 0.003 * TABLE_SHARE < MAX_STRETCH_S
    assert stretch_limit(0.5) == MAX_STRETCH_S


def test_a_yield_that_came_back_late_lengthens_the_next_stretch_and_one_on_time_restores_it():
    table = watcher()
    table._pause_left_s = 0.0  # bare yields, as on a saturated loop past its budget

    async def two_yields() -> tuple[float, float]:
        async def hog() -> None:
            spin(0.003, time.thread_time)  # a round of requests using 3 ms of CPU

        other = asyncio.create_task(hog())
        table._hold()
        await table._yield()  # back after the hog's 3 ms
        after_busy = table._stretch_limit_s
        await other
        await table._yield()  # nothing else to run: back at once
        return after_busy, table._stretch_limit_s

    after_busy, after_idle = asyncio.run(two_yields())
    assert after_busy >= 0.0025 * TABLE_SHARE, after_busy
    assert after_idle == SHORTEST_STRETCH_S


def test_a_yield_the_loop_thread_spent_off_the_core_leaves_the_stretch_short():
    """A yield that came back late because the thread did not run (another process had the
    core; here, a callback blocked without CPU) is not requests' time."""
    table = watcher()
    table._pause_left_s = 0.0

    async def one_yield() -> float:
        async def blocked() -> None:
            time.sleep(0.005)  # noqa: ASYNC251 (the point: the thread runs nothing meanwhile)

        other = asyncio.create_task(blocked())
        table._hold()
        await table._yield()
        await other
        return table._stretch_limit_s

    assert asyncio.run(one_yield()) == SHORTEST_STRETCH_S


def test_a_pause_the_watcher_asked_for_does_not_lengthen_its_stretches():
    """Its own pause is not requests' time: stretches would otherwise grow on an idle loop
    (each pause twice the stretch before it)."""
    table = watcher()
    table._pause_left_s = STEP_PAUSE_BUDGET_S

    async def stretches() -> list[float]:
        limits = []
        for _ in range(5):
            table._hold()
            spin(table._stretch_limit_s)
            await table._yield()
            limits.append(table._stretch_limit_s)
        return limits

    limits = asyncio.run(stretches())
    assert limits == [SHORTEST_STRETCH_S] * 5, limits  # (CPU time: none ran meanwhile)


def test_readers_in_flight_do_not_lengthen_each_others_stretches():
    """The watcher reads with a few pipelines in flight, each reader pacing itself: while one
    yields, the others' stretches run. They are the watcher's time, not requests': counted as
    requests', four readers on an idle loop pushed each other's stretches to the cap."""
    table = watcher()
    table._pause_left_s = 0.0  # bare yields: only the readers take turns

    async def reader(limits: list[float]) -> None:
        table._hold()
        for _ in range(10):
            spin(SHORTEST_STRETCH_S / 10, time.thread_time)  # one small step of table work
            await table._pace()
            limits.append(table._stretch_limit_s)
        table._end_stretch()

    async def readers() -> list[float]:
        limits: list[float] = []
        await asyncio.gather(*(reader(limits) for _ in range(4)))
        return limits

    limits = asyncio.run(readers())
    assert max(limits) == SHORTEST_STRETCH_S, limits


def test_pacing_yields_once_the_stretch_has_lasted_its_limit():
    """`_pace` ends a stretch at the current limit: a lengthened limit lets a stretch run on,
    past the shortest one, and the shortest one ends it there."""
    table = watcher()
    table._pause_left_s = 0.0

    async def one_stretch(limit_s: float) -> tuple[int, float]:
        """How many steps of 0.1 ms the stretch took, and how long it lasted."""
        table._stretch_limit_s = limit_s
        table._end_stretch()  # (the last call's, left open by its yield: a new one starts)
        table._hold()
        started, counted = time.perf_counter(), table.stats.hold_s
        steps = 0
        while table.stats.hold_s == counted:  # until _pace yielded (and counted the stretch)
            spin(SHORTEST_STRETCH_S / 5)
            steps += 1
            lasted = time.perf_counter() - started
            await table._pace()
        return steps, lasted

    steps, _ = asyncio.run(one_stretch(SHORTEST_STRETCH_S))
    assert steps <= 5, f"{steps} steps of 0.1 ms in a stretch of 0.5"  # (a late step: fewer)
    _, lasted = asyncio.run(one_stretch(4 * SHORTEST_STRETCH_S))
    assert lasted >= 3 * SHORTEST_STRETCH_S, f"yielded after {lasted * 1000:.2f} ms"


def test_a_stretch_ends_before_a_step_like_the_last_would_take_it_past_its_limit():
    """Steps of 0.3 ms under a 1 ms limit: the stretch yields after the third (0.9 ms), not
    after a fourth that would hold the loop for 1.2 ms."""
    table = watcher()
    table._pause_left_s = 0.0

    async def one_stretch() -> tuple[int, float]:
        table._stretch_limit_s = 0.001
        table._hold()
        counted = table.stats.hold_s
        steps = 0
        while table.stats.hold_s == counted:
            spin(0.0003, time.thread_time)
            steps += 1
            await table._pace()
        return steps, table.stats.max_hold_ms

    steps, held_ms = asyncio.run(one_stretch())
    assert steps <= 3, f"{steps} steps of 0.3 ms in a stretch limited to 1 ms"
    assert held_ms < 1.0, f"the stretch held the loop for {held_ms:.2f} ms"


def test_with_a_frozen_heap_each_yield_takes_what_the_stretch_made_out_of_the_collector():
    """In the proxy (`freeze_heap`) a yield freezes the heap: the rows and reports a stretch
    made are not walked by the collector's young passes they would survive (5-55 ms each
    under wrk at 1,000 nodes), only by the full pass every FULL_COLLECT_S."""
    table = watcher()
    table.freeze_heap = True
    table._pause_left_s = 0.0

    async def one_stretch() -> list[list[int]]:
        table._hold()
        made = [[n] for n in range(100)]  # containers: tracked by the collector
        await table._yield()
        return made

    try:
        made = asyncio.run(one_stretch())
        walked = {id(o) for generation in range(3) for o in gc.get_objects(generation)}
    finally:
        gc.unfreeze()
    assert all(gc.is_tracked(m) for m in made)
    assert not any(id(m) in walked for m in made), "left to the collector's passes"


class _InACycle:
    """Garbage only the collector frees: it refers to itself."""

    def __init__(self) -> None:
        self.me = self


def test_with_a_frozen_heap_a_yield_runs_the_full_collection_when_it_is_due():
    """Frozen at every yield, cyclic garbage waits for the full collection every
    FULL_COLLECT_S; a yield runs it when due, so a table that never swaps (a steady cluster)
    still frees it."""
    table = watcher()
    table.freeze_heap = True
    table._pause_left_s = 0.0
    cycle = _InACycle()
    gone = weakref.ref(cycle)
    gc.freeze()  # as a yield before it became garbage did
    del cycle

    async def one_stretch() -> None:
        table._hold()
        await table._yield()

    try:
        asyncio.run(one_stretch())
        assert gone() is not None, "frozen garbage stays until the full collection is due"
        table._full_collect_s = time.monotonic() - FULL_COLLECT_S
        asyncio.run(one_stretch())
    finally:
        gc.unfreeze()
    assert gone() is None, "the full collection did not run"
