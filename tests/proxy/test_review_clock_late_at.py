"""Review of the per-node report clocks (issue 22): `shift_node` judges whether later times
keep every choice as of the moment it is given. The watcher's `at` is taken once before a
sweep's reports are applied one by one with `await self._pace()` between them, so it is often
earlier than the request path's clock: judged as of `at`, a replica that went stale (or out of
the time budget) in between looked still fresh, its clock moved in place, and the refusal
cached after it went stale was kept. The watcher now gives its clock's now, no earlier than
any request so far; here the builder is given that moment."""

from __future__ import annotations

import asyncio
from unittest.mock import patch

from common.contract import (
    Assignment,
    Hosting,
    NodeInfo,
    PartitionAssignment,
    PartitionReport,
    StoreInfo,
)
from proxy.choice import LagBudget, choose_replicas
from proxy.handler import RequestHandler
from proxy.routing import TableBuilder
from tests.proxy.test_review2_renew import _handler_with

T0 = 9_000_000
STALE_MS = 3_000
BUDGET = LagBudget(5, 1_000)


def hosting(node_id: str, role: str) -> Hosting:
    return Hosting(node_id, 1, {"s": {role: (0,)}}, T0)  # type: ignore[dict-item]


def test_a_confirmation_judged_at_an_earlier_at_keeps_a_refusal_the_rows_no_longer_give():
    asyncio.run(_keeps_the_refusal())  # the upstream pool wants a running loop


def active_and_old_standby(handler: RequestHandler) -> TableBuilder:
    """Active a reporting at T0, standby b 10 ms short of too old then, on one partition."""
    table = TableBuilder(handler.choice_stability)
    table.set_stores({"s": StoreInfo("s", "t", 1)})
    table.set_assignment(Assignment(1, "a", 0, {"s": {0: PartitionAssignment("a", ("b",))}}))
    table.set_alive({"a", "b"})
    for node_id, role, reported in (("a", "active", T0), ("b", "standby", T0 - STALE_MS + 10)):
        table.set_node(
            node_id,
            NodeInfo(node_id, f"http://{node_id}:1", 0),
            hosting(node_id, role),
            # Lag 0, no caught-up time: a time lag of 0, inside the budget.
            {("s", 0): PartitionReport(100, 100, None, None, reported)},
        )
    return table


async def _keeps_the_refusal() -> None:
    handler = _handler_with(BUDGET)
    table = active_and_old_standby(handler)
    with patch("proxy.handler.now_ms", lambda: T0):
        list(table.rebuild(T0))
        snapshot = table.snapshot(T0)
        handler.use_snapshot(snapshot)
    request_at = T0 + 50  # b's report is 3,040 ms old: refused, "lag report too old"
    with patch("proxy.handler.now_ms", lambda: request_at):
        handler._choice(snapshot.stores["s"], "s", 0, None)
    cached = handler._choices["s"][0]
    assert cached is not None
    assert [r.node_id for r in cached.choice.candidates] == ["a"]

    # The sweep took `at` at T0 (before the request), b's confirmation is applied after a pace:
    # the watcher judges it as of its clock's now then (`_apply_report`), which no request
    # so far is later than, not as of `at` (tests/proxy/test_watcher_shift.py checks that).
    table.shift_node("b", 500, hosting("b", "standby"), request_at)
    assert_cached_is_what_the_rows_give(handler, table, T0 + 60)


def assert_cached_is_what_the_rows_give(
    handler: RequestHandler, table: TableBuilder, at: int
) -> None:
    """Rebuild and swap in the table at `at`, renew what it names renewed; the choice cached
    for the partition, unless dropped or expired, is what its rows give at `at`."""
    with patch("proxy.handler.now_ms", lambda: at):
        list(table.rebuild(at))
        snapshot = table.snapshot(at)
        handler.use_snapshot(snapshot)
        for name, partitions in snapshot.renewed.items():
            handler.renew_choices(snapshot, name, sorted(partitions))
    cached = handler._choices["s"][0]
    if cached is None or cached.expires_ms <= at:
        return  # dropped (named changed) or expired: the next request chooses again
    rows_give = choose_replicas(
        snapshot.stores["s"].replicas[0], BUDGET, now_ms=at, stale_after_ms=STALE_MS
    )
    assert [r.node_id for r in cached.choice.candidates] == [
        r.node_id for r in rows_give.candidates
    ], f"cached until {cached.expires_ms - at} ms from now"
