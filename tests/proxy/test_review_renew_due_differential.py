"""Review of f6e641d: `renew_due` called between the table's steps (as the watcher does on
each of its steps, at any moment) must leave the request path's cache exact: a cached
choice is the choice the current rows give at every moment until it expires, whatever chain
of node reads (new clocks), in-place confirmations, kept and changed snapshots came since
it was computed. The differential of tests/proxy/test_review2_renew.py, with due renewals
at random moments in between, and the queue checked to drain."""

from __future__ import annotations

import asyncio
from unittest.mock import patch

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.choice import LagBudget
from tests.proxy.test_review2_renew import (
    NODE_IDS,
    START,
    _assert_exact_until_it_expires,
    _handler_with,
    apply_step,
    budgets,
    reports,
    three_node_table,
)

sweep = st.just([(node_id, 0, 0, 0) for node_id in NODE_IDS])
# In-place confirmations of every node (the clocks a node read gave move), most steps.
shifts = st.just([(node_id, "shift", 500, 0) for node_id in NODE_IDS])
steps = st.tuples(
    st.one_of(sweep, shifts, shifts, st.lists(reports, max_size=3)),
    st.integers(0, 1_600),  # time passing before the snapshot
    st.one_of(st.just(frozenset(NODE_IDS)), st.frozensets(st.sampled_from(NODE_IDS))),
    st.sampled_from((True, True, False)),  # a request: caches a choice if none is valid
    st.lists(st.integers(0, 1_600), max_size=3),  # due renewals this long after the swap
    st.sampled_from((1, 32)),  # the most renewed per call
)


@settings(max_examples=300, deadline=None)
@given(budgets, st.lists(steps, min_size=2, max_size=14))
def test_a_choice_renew_due_renews_is_the_choice_the_current_rows_give(budget, chain):
    asyncio.run(_check(budget, chain))  # the upstream pool wants a running loop


async def _check(budget: LagBudget, chain: list) -> None:
    handler = _handler_with(budget)
    now = START
    table = three_node_table(handler, now)
    last_due = now
    for new_reports, passing, alive, request, dues, limit in chain:
        now = max(now + passing, last_due)
        apply_step(table, new_reports, alive, now)
        with patch("proxy.handler.now_ms", lambda at=now: at):
            for _ in table.rebuild(now):
                pass
            snapshot = table.snapshot(now)
            handler.use_snapshot(snapshot)
            for name, partitions in snapshot.renewed.items():
                handler.renew_choices(snapshot, name, sorted(partitions))
            if request:
                handler._choice(snapshot.stores["s"], "s", 0, None)
        row = snapshot.stores["s"].replicas[0]
        cached = handler._choices["s"][0]
        if cached is not None:
            _assert_exact_until_it_expires(cached, row, budget, now)
        for after in sorted(dues):
            at = now + after
            with patch("proxy.handler.now_ms", lambda at=at: at):
                while handler.renew_due(snapshot, limit):
                    pass
            cached = handler._choices["s"][0]
            if cached is not None and cached.live(at):
                _assert_exact_until_it_expires(cached, row, budget, at)
            last_due = max(last_due, at)
    # The queue drains: once every due time has passed, nothing is left in it.
    end = now + 120_000
    with patch("proxy.handler.now_ms", lambda: end):
        while handler.renew_due(handler.snapshot, 32):
            pass
    assert not handler._due
    assert not handler._queued
