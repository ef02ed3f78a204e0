"""Review (91e5b33, the C path reads report clocks): a cached choice (`Cached.live`, what both
the C and the Python path ask) is never live at a moment when `choose_replicas` over the rows
the handler serves gives another choice, and a candidate's caught-up time as C reads it
(`Candidate.caught_up_at_ms`, the same `candidate_caught_up_at` the answer's
`x-kroute-time-lag-ms` uses) is the one the Python path reads and never later than its
replica's in the served rows (a time lag never smaller than the truth).

Wider than tests/proxy/test_review2_renew.py: two partitions with the nodes in different
roles (the in-place judgement spans every partition of a node), confirmations judged ahead of
the requests' clock as the watcher does (`judging_moment`), snapshots withheld, publishes
skipped (in-place moves with nothing pending, or with another node's report pending), nodes
forgotten and back, liveness changes, and the cached choices kept across many in-place moves.
Passes on 91e5b33 (and 04389e0): no counterexample found."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from unittest.mock import patch

from hypothesis import given, settings
from hypothesis import strategies as st

from common.contract import Assignment, Hosting, NodeInfo, PartitionAssignment, StoreInfo
from proxy.choice import LagBudget, choose_replicas, expires_at
from proxy.handler import RequestHandler
from proxy.routing import TableBuilder
from tests.proxy.test_review2_renew import STALE_MS, START, _handler_with, _report, _seen

NODE_IDS = ("a", "b", "c")
PLACED = {0: PartitionAssignment("a", ("b", "c")), 1: PartitionAssignment("b", ("c", "a"))}
ROLES = {
    "a": {"active": (0,), "standby": (1,)},
    "b": {"active": (1,), "standby": (0,)},
    "c": {"standby": (0, 1)},
}
ago = st.sampled_from((0, 10, 400, 900, 1_900, 2_990, 4_000))
lag = st.one_of(st.none(), st.sampled_from((0, 0, 1, 5)))
report = st.tuples(lag, st.one_of(st.none(), ago), ago)
ops = st.one_of(
    st.tuples(st.just("report"), st.sampled_from(NODE_IDS), st.tuples(report, report)),
    *[st.tuples(st.just("shift"), st.sampled_from(NODE_IDS),
                st.tuples(st.sampled_from((1, 10, 250, 700, 1_400, 3_000)),
                          st.sampled_from((0, 0, 100, 500))))] * 4,
    st.tuples(st.just("forget"), st.sampled_from(NODE_IDS), st.none()),
    st.tuples(st.just("alive"), st.frozensets(st.sampled_from(NODE_IDS)), st.none()),
)  # fmt: skip
steps = st.tuples(
    st.lists(ops, max_size=4),
    st.integers(0, 1_600),  # time passing first
    st.sampled_from(("publish", "publish", "withhold", "none", "none")),
    st.booleans(),  # requests cache choices
)
budgets = st.sampled_from(
    (LagBudget(), LagBudget(3, None), LagBudget(None, 1_000), LagBudget(5, 2_000))
)


@settings(max_examples=600, deadline=None)
@given(budgets, st.lists(steps, min_size=2, max_size=20))
def test_cached_choices_match_the_served_rows_through_clock_moves(budget, chain):
    asyncio.run(_check(budget, chain))


def _set(table: TableBuilder, node_id: str, reports, now: int) -> None:
    fields = {
        ("s", p): _report(node_id, lag_, caught, ago_, now)
        for p, (lag_, caught, ago_) in zip((0, 1), reports, strict=True)
    }
    hosted = {"s": ROLES[node_id]}
    table.set_node(
        node_id, NodeInfo(node_id, f"http://{node_id}:1", 0),
        Hosting(node_id, 1, hosted, now), fields,  # type: ignore[arg-type]
    )  # fmt: skip


async def _check(budget: LagBudget, chain: list) -> None:  # noqa: PLR0912 (one driver)
    handler = _handler_with(budget)
    table = TableBuilder(handler.choice_stability)
    table.set_stores({"s": StoreInfo("s", "t", 2)})
    table.set_assignment(Assignment(1, "a", 0, {"s": PLACED}))
    now = START
    for node_id in NODE_IDS:
        _set(table, node_id, ((0, 0, 0), (0, 0, 0)), now)
    table.set_alive(set(NODE_IDS))
    latest_request = now
    dropped = False  # a snapshot withheld: the next one swapped in names everything (_swap)
    for operations, passing, publish, request in chain:
        now += passing
        for kind, who, what in operations:
            if kind == "report":
                _set(table, who, what, now)
            elif kind == "forget":
                table.forget_node(who)
            elif kind == "alive":
                table.set_alive(set(who))
            elif who in table.reports and table.hostings.get(who) is not None:
                most, ahead = what
                times = [t for f in table.report_fields(who).values() for t in f[1:3] if t]
                delta = min([most, *(now - t for t in times)])
                if delta > 0:  # judged no earlier than any request so far
                    judged = max(now, latest_request) + ahead
                    table.shift_node(who, delta, table.hostings[who], judged)
        with patch("proxy.handler.now_ms", lambda at=now: at):
            if publish != "none":
                for _ in table.rebuild(now):
                    pass
                snapshot = table.snapshot(now)
                if publish == "withhold":
                    table.withhold()
                    dropped = True
                else:
                    if dropped:
                        snapshot = replace(snapshot, changed=None, renewed={})
                        dropped = False
                    handler.use_snapshot(snapshot)
                    for name, partitions in snapshot.renewed.items():
                        handler.renew_choices(snapshot, name, sorted(partitions))
            served = handler.snapshot.stores.get("s")
            if served is None:
                continue
            if request:
                latest_request = now
                for partition in (0, 1):
                    handler._choice(served, "s", partition, None)
        for partition in (0, 1):
            _assert_exact(handler, partition, budget, now)


def _assert_exact(handler: RequestHandler, partition: int, budget: LagBudget, now: int) -> None:
    cached = handler._choices["s"][partition]
    if cached is None:
        return
    row = handler.snapshot.stores["s"].replicas[partition]
    by_node = {r.node_id: r for r in row}
    for candidate in cached.candidates:
        replica = candidate.replica
        assert candidate.clock is replica.clock
        py = replica.caught_up_at_ms
        assert candidate.caught_up_at_ms == (-1 if py is None else py)  # C reads as Python
        served = by_node[replica.node_id]
        if served.clock is replica.clock and replica.caught_up_at_as_given_ms is not None:
            # On the served clock: the same times as the served replica's, moved alike. (A
            # kept choice on an older report may name an earlier or, without a time budget,
            # a later caught-up time: renewal policy, not the clocks; not checked here.)
            assert served.caught_up_at_as_given_ms is not None
            assert py - replica.caught_up_at_as_given_ms == served.caught_up_at_ms - (
                served.caught_up_at_as_given_ms
            )
    expires = max(cached.expires_ms, expires_at(cached.cap_ms, cached.terms))
    moments = {now, now + 1, cached.expires_ms - 1, cached.expires_ms, expires - 1, expires}
    for replica in row:
        if replica.reported_at_ms is not None:
            moments.add(replica.reported_at_ms + STALE_MS)
            moments.add(replica.reported_at_ms + STALE_MS + 1)
        if budget.max_ms is not None and replica.caught_up_at_ms is not None:
            moments.add(replica.caught_up_at_ms + budget.max_ms)
            moments.add(replica.caught_up_at_ms + budget.max_ms + 1)
    for at in sorted(m for m in moments if now <= m):
        if not cached.live(at):
            break
        fresh = choose_replicas(row, budget, now_ms=at, stale_after_ms=STALE_MS)
        assert _seen(cached.choice) == _seen(fresh), (partition, at - START, now - START)
