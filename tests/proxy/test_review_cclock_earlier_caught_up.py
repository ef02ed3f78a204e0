"""Review (91e5b33) side finding, older than that commit (the renewal skip in
`RequestHandler.renew_choices`, unchanged by it): without a time budget, a new report whose
caught-up time is EARLIER than the one a cached choice was computed from is named renewed
(`ChoiceStability._same_time_side` returns True when `max_ms` is None), and a kept choice
whose lags are unchanged is not renewed, so its answers' `x-kroute-time-lag-ms` (C:
`candidate_caught_up_at`, Python: `replica.time_lag_ms`) is smaller than the served rows' truth.
Failed on 91e5b33 and 04389e0. Low severity: a node's caught-up time moves back only after its
store was reset (or a misbehaving writer). Fixed: without a budget, a caught-up time that moved
earlier or was lost makes the partition changed (`ChoiceStability._same_time_side`)."""

from __future__ import annotations

import asyncio
from unittest.mock import patch

from common.contract import Assignment, StoreInfo
from proxy.choice import LagBudget
from proxy.routing import TableBuilder
from tests.proxy.test_review2_renew import START, _handler_with
from tests.proxy.test_review_cclock_differential import NODE_IDS, PLACED, _set


def test_a_kept_choice_never_names_a_later_caught_up_time_than_the_served_rows():
    asyncio.run(_check())


async def _check() -> None:
    handler = _handler_with(LagBudget())  # no time budget
    table = TableBuilder(handler.choice_stability)
    table.set_stores({"s": StoreInfo("s", "t", 2)})
    table.set_assignment(Assignment(1, "a", 0, {"s": PLACED}))
    now = START
    for node_id in NODE_IDS:
        _set(table, node_id, ((0, 0, 0), (0, 0, 0)), now)
    table.set_alive(set(NODE_IDS))
    with patch("proxy.handler.now_ms", lambda: now):
        list(table.rebuild(now))
        handler.use_snapshot(table.snapshot(now))
        handler._choice(handler.snapshot.stores["s"], "s", 0, None)
        # a's new report: caught up 10 ms before the time the cached choice names
        _set(table, "a", ((0, 10, 0), (0, 10, 0)), now)
        list(table.rebuild(now))
        snapshot = table.snapshot(now)
        handler.use_snapshot(snapshot)
        for name, partitions in snapshot.renewed.items():
            handler.renew_choices(snapshot, name, sorted(partitions))
        handler._choice(snapshot.stores["s"], "s", 0, None)  # kept, or computed again
    cached = handler._choices["s"][0]
    assert cached is not None
    served = {r.node_id: r for r in snapshot.stores["s"].replicas[0]}
    for candidate in cached.candidates:
        truth = served[candidate.replica.node_id].caught_up_at_ms
        assert candidate.caught_up_at_ms <= truth, "time lag header smaller than the truth"
