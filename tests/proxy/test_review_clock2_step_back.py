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
from common.contract import (
    Assignment,
    Hosting,
    NodeInfo,
    PartitionAssignment,
    PartitionReport,
    StoreInfo,
)
from proxy.choice import LagBudget, choose_replicas
from proxy.routing import TableBuilder
from proxy.watcher import judging_moment
from tests.proxy.test_review2_renew import _handler_with

T0 = 9_000_000
STALE_MS = 3_000
BUDGET = LagBudget(5, 1_000)


class _Monotonic:
    def __init__(self) -> None:
        self.s = 100.0

    def __call__(self) -> float:
        return self.s


def _hosting(node_id: str, role: str) -> Hosting:
    return Hosting(node_id, 1, {"s": {role: (0,)}}, T0)  # type: ignore[dict-item]


def test_a_clock_stepped_back_within_max_step_lets_a_refused_replica_move_in_place() -> None:
    asyncio.run(_check())


async def _check() -> None:
    mono = _Monotonic()
    clock = SharedClock(wall=lambda: T0 / 1000, monotonic=mono)
    clock.observe((T0 // 1000, 0), mono.s, mono.s)  # synced: now_ms() == T0
    handler = _handler_with(BUDGET)
    table = TableBuilder(handler.choice_stability)
    table.set_stores({"s": StoreInfo("s", "t", 1)})
    table.set_assignment(Assignment(1, "a", 0, {"s": {0: PartitionAssignment("a", ("b",))}}))
    table.set_alive({"a", "b"})
    for node_id, role, reported in (("a", "active", T0), ("b", "standby", T0 - STALE_MS + 10)):
        table.set_node(
            node_id,
            NodeInfo(node_id, f"http://{node_id}:1", 0),
            _hosting(node_id, role),
            {("s", 0): PartitionReport(100, 100, None, None, reported)},
        )
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
    table.shift_node("b", 500, _hosting("b", "standby"), now)
    # Time runs on past the request's moment (the cached choice lives until T0 + 3,001).
    mono.s += 0.300
    with patch("proxy.handler.now_ms", clock.now_ms):
        at = clock.now_ms()
        list(table.rebuild(at))
        snapshot = table.snapshot(at)
        handler.use_snapshot(snapshot)
        for name, partitions in snapshot.renewed.items():
            handler.renew_choices(snapshot, name, sorted(partitions))
    cached = handler._choices["s"][0]
    if cached is None or cached.expires_ms <= at:
        return
    rows_give = choose_replicas(
        snapshot.stores["s"].replicas[0], BUDGET, now_ms=at, stale_after_ms=STALE_MS
    )
    assert [r.node_id for r in cached.choice.candidates] == [
        r.node_id for r in rows_give.candidates
    ], f"at {at - request_at} ms after the request, cached until {cached.expires_ms - at} ms on"
