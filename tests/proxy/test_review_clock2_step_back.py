"""Review 2 of the per-node report clocks: `_apply_report` judged a confirmation as of
`max(at, self.clock.now_ms())`, "no earlier than any request so far"; it now judges it two
clock steps ahead of that (`proxy.watcher.judging_moment`). The shared clock does not
promise that: a sync sample within `max_step_ms` (250 ms) of the estimate is taken silently
(`SharedClock.observe` -> `_set`), backwards too. After such a step the watcher's now is earlier
than a request already answered: a standby the request refused ("lag report too old") reads
fresh again at the watcher's now, its clock moves in place, and the refusal stays cached while
the rows, from then on, accept it."""

from __future__ import annotations

import asyncio
from unittest.mock import patch

from common.clock import SharedClock
from proxy.watcher import judging_moment
from tests.proxy.test_review2_renew import _handler_with
from tests.proxy.test_review_clock_late_at import (
    BUDGET,
    T0,
    active_and_old_standby,
    assert_cached_is_what_the_rows_give,
    hosting,
)


class _Monotonic:
    def __init__(self) -> None:
        self.s = 100.0

    def __call__(self) -> float:
        return self.s


def test_a_clock_stepped_back_within_max_step_lets_a_refused_replica_move_in_place() -> None:
    asyncio.run(_check())


async def _check() -> None:
    mono = _Monotonic()
    clock = SharedClock(wall=lambda: T0 / 1000, monotonic=mono)
    clock.observe((T0 // 1000, 0), mono.s, mono.s)  # synced: now_ms() == T0
    handler = _handler_with(BUDGET)
    table = active_and_old_standby(handler)
    with patch("proxy.handler.now_ms", clock.now_ms):
        list(table.rebuild(clock.now_ms()))
        snapshot = table.snapshot(clock.now_ms())
        handler.use_snapshot(snapshot)
        mono.s += 0.050  # T0 + 50: b's report is 3,040 ms old, refused
        handler._choice(snapshot.stores["s"], "s", 0, None)
    request_at = clock.now_ms()
    cached = handler._choices["s"][0]
    assert cached is not None
    assert [r.node_id for r in cached.choice.candidates] == ["a"]

    # A sync sample 200 ms behind the estimate (a round trip's midpoint error): taken silently.
    mono.s += 0.001
    assert clock.observe(((T0 + 51 - 200) // 1000, (T0 + 51 - 200) % 1000 * 1000), mono.s, mono.s)
    assert max(T0, clock.now_ms()) < request_at  # the clock alone is behind the request
    now = judging_moment(T0, clock)  # what _apply_report gives (its `at` was T0)
    table.shift_node("b", 500, hosting("b", "standby"), now)
    # Time runs on past the request's moment (the cached choice lives until T0 + 3,001).
    mono.s += 0.300
    assert_cached_is_what_the_rows_give(handler, table, clock.now_ms())
