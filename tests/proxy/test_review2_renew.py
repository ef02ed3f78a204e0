"""Review (issue 22, 4bc35e4): a cached choice the request path leaves un-renewed (more than
half the staleness limit to live) must be the choice the current table gives, at every moment
until it expires, whatever chain of kept ("renewed") snapshots came since it was computed:
`ChoiceStability.same` compares each snapshot with the one before it, not with the rows the
cached choice came from. Differential: the handler's cache against `choose_replicas` on the
current rows (lag and time-lag headers aside: they name the report the choice came from)."""

from __future__ import annotations

import asyncio
import re
from unittest.mock import patch

from hypothesis import given, settings
from hypothesis import strategies as st

from common.contract import (
    Assignment,
    Hosting,
    NodeInfo,
    PartitionAssignment,
    PartitionReport,
    StoreInfo,
)
from proxy._hotpath import Cached
from proxy.choice import (
    Choice,
    LagBudget,
    Replica,
    choice_expires_at,
    choose_replicas,
    expires_at,
)
from proxy.handler import ChoicePolicy, RequestHandler
from proxy.routing import RoutingSnapshot, TableBuilder
from tests.proxy.test_routing_choice_stability import _handler

NODE_IDS = ("a", "b", "c")
STALE_MS = 3_000
START = 50_000_000
ROLES = {"a": "active", "b": "standby", "c": "standby"}

# One node's new report: lag, caught up how long ago (None: unknown), reported how long ago;
# most of them a steady node's confirmation (caught up, just now), as at steady state. Lag 0
# without a caught-up time included: its time lag stays 0 while another grows, which
# reordered standbys before a choice expired until standbys were ranked by caught-up time
# (`proxy.choice.staleness_rank`; the two tests below).
any_report = st.tuples(
    st.sampled_from(NODE_IDS),
    st.one_of(st.none(), st.sampled_from((0, 0, 1, 3, 5, 9))),
    st.one_of(st.none(), st.sampled_from((0, 10, 400, 900, 2_990, 4_000))),
    st.sampled_from((0, 10, 400, 1_400, 2_990, 4_000)),
)
confirmation = st.tuples(st.sampled_from(NODE_IDS), st.just(0), st.just(0), st.just(0))
# The same report confirmed later, as the watcher applies it (`TableBuilder.shift_node`):
# every time moved by up to this much (never past now), on the node's clock when nothing
# it changes could change the choice.
shift = st.tuples(
    st.sampled_from(NODE_IDS), st.just("shift"), st.sampled_from((10, 400, 700, 1_400, 3_000)),
    st.just(0),
)  # fmt: skip
reports = st.one_of(*[confirmation] * 2, *[shift] * 2, any_report)
sweep = st.just([(node_id, 0, 0, 0) for node_id in NODE_IDS])  # every node confirms
all_alive = st.just(frozenset(NODE_IDS))
steps = st.tuples(
    st.one_of(sweep, sweep, sweep, st.lists(reports, max_size=3)),
    st.integers(0, 1_600),  # time passing before the snapshot
    st.one_of(*[all_alive] * 6, st.frozensets(st.sampled_from(NODE_IDS))),  # who is alive
    st.sampled_from((True, True, False)),  # a request comes: caches a choice if none is valid
)
budgets = st.sampled_from(
    (LagBudget(), LagBudget(3, None), LagBudget(None, 1_000), LagBudget(5, 2_000))
)


def _seen(choice: Choice) -> tuple[object, ...]:
    reasons = tuple(
        (r.node_id, re.sub(r"time lag \d+ ms", "time lag N ms", r.reason)) for r in choice.rejected
    )
    return tuple(c.node_id for c in choice.candidates), reasons, choice.spread_width


def _handler_with(budget: LagBudget) -> RequestHandler:
    handler = _handler()
    policy = ChoicePolicy(budget, "reject", STALE_MS, spread=False)
    handler.policy = policy
    handler.choice_stability = type(handler.choice_stability)(budget, "reject", STALE_MS, True)
    return handler


def _report(node_id: str, lag: int | None, caught_ago: int | None, ago: int, now: int):
    at = now - ago
    end = None if lag is None else 100 + lag
    caught = None if caught_ago is None else now - caught_ago
    return PartitionReport(100, end, None, caught, at)


@settings(max_examples=800, deadline=None)
@given(budgets, st.lists(steps, min_size=2, max_size=16))
def test_an_unrenewed_choice_is_the_choice_the_current_rows_give(budget, chain):
    asyncio.run(_check(budget, chain))  # the upstream pool wants a running loop


async def _check(budget: LagBudget, chain: list) -> None:
    handler = _handler_with(budget)
    now = START
    table = three_node_table(handler, now)
    for new_reports, passing, alive, request in chain:
        now += passing
        apply_step(table, new_reports, alive, now)
        with patch("proxy.handler.now_ms", lambda at=now: at):
            for _ in table.rebuild(now):
                pass
            snapshot = table.snapshot(now)
            swap_in(handler, snapshot, request)
        assert_cache_exact(handler, snapshot, budget, now)


def swap_in(handler: RequestHandler, snapshot: RoutingSnapshot, request: bool) -> None:
    """The request path takes the snapshot (forgets the choices it names changed, renews
    those it names renewed) and, if a request comes, caches a choice."""
    handler.use_snapshot(snapshot)
    for name, partitions in snapshot.renewed.items():
        handler.renew_choices(snapshot, name, sorted(partitions))
    if request:
        handler._choice(snapshot.stores["s"], "s", 0, None)


def assert_cache_exact(
    handler: RequestHandler, snapshot: RoutingSnapshot, budget: LagBudget, now: int
) -> None:
    cached = handler._choices["s"][0]
    if cached is not None:
        _assert_exact_until_it_expires(cached, snapshot.stores["s"].replicas[0], budget, now)


def three_node_table(handler: RequestHandler, now: int) -> TableBuilder:
    """One partition: a active, b and c standbys, each caught up and reporting at `now`."""
    table = TableBuilder(handler.choice_stability)
    table.set_stores({"s": StoreInfo("s", "t", 1)})
    placed = {0: PartitionAssignment("a", ("b", "c"))}
    table.set_assignment(Assignment(1, "a", 0, {"s": placed}))
    for node_id in NODE_IDS:
        hosted = {"s": {ROLES[node_id]: (0,)}}
        table.set_node(
            node_id,
            NodeInfo(node_id, f"http://{node_id}:1", 0),
            Hosting(node_id, 1, hosted, now),  # type: ignore[dict-item]
            {("s", 0): _report(node_id, 0, 0, 0, now)},
        )
    table.set_alive(set(NODE_IDS))
    return table


def apply_step(table: TableBuilder, new_reports: list, alive: frozenset[str], now: int) -> None:  # type: ignore[type-arg]
    """A step's reports (a "shift" moves the node's times as a confirmation does, any other
    is set whole) and who is alive."""
    for node_id, lag, caught_ago, ago in new_reports:
        if lag == "shift":
            _shift(table, node_id, caught_ago, now)
            continue
        table.set_node(
            node_id,
            table.nodes[node_id],
            table.hostings[node_id],
            {("s", 0): _report(node_id, lag, caught_ago, ago, now)},
        )
    table.set_alive(set(alive))


def _assert_exact_until_it_expires(
    cached: Cached, row: tuple[Replica, ...], budget: LagBudget, now: int
) -> None:
    # Every moment from now until it expires at which the fresh choice may change. Its
    # expiry as the request path reads it (`Cached.live`): computed again from its
    # replicas' clocks, which in-place confirmations moved, once the stored one comes.
    expires = max(cached.expires_ms, expires_at(cached.cap_ms, cached.terms))
    moments = {now, cached.expires_ms - 1, cached.expires_ms, expires - 1, expires}
    for replica in row:
        if replica.reported_at_ms is not None:
            moments.add(replica.reported_at_ms + STALE_MS + 1)
        if budget.max_ms is not None and replica.caught_up_at_ms is not None:
            moments.add(replica.caught_up_at_ms + budget.max_ms + 1)
    for at in sorted(m for m in moments if now <= m):
        if not cached.live(at):
            assert at >= expires, "it expired before its terms said"
            break
        fresh = choose_replicas(row, budget, now_ms=at, stale_after_ms=STALE_MS)
        assert _seen(cached.choice) == _seen(fresh), (at - START, now - START)


def _shift(table: TableBuilder, node_id: str, most: int, now: int) -> None:
    times = [t for f in table.report_fields(node_id).values() for t in f[1:3] if t is not None]
    delta = min([most, *(now - t for t in times)])
    if delta > 0:
        table.shift_node(node_id, delta, table.hostings[node_id], now)


def _standby(node_id: str, caught_up_at_ms: int, now: int) -> Replica:
    return Replica(node_id, f"http://{node_id}:1", "standby", True, 0, caught_up_at_ms, now, 0)


def test_a_caught_up_time_ahead_of_the_clock_ends_the_choice_when_it_starts_to_grow():
    now = START
    dead_active = Replica("a", "http://a:1", "active", False, 0, now, now, 0)
    row = (dead_active, _standby("b", now + 50, now), _standby("c", now + 100, now))
    budget = LagBudget()
    expires = choice_expires_at(row, budget, now_ms=now, stale_after_ms=STALE_MS)
    cached = choose_replicas(row, budget, now_ms=now, stale_after_ms=STALE_MS)
    later = choose_replicas(row, budget, now_ms=now + 75, stale_after_ms=STALE_MS)
    assert now + 75 < expires
    assert [r.node_id for r in cached.candidates] == [r.node_id for r in later.candidates]


def test_a_time_lag_that_grows_past_a_constant_one_ends_the_choice():
    now = START
    active = Replica("a", "http://a:1", "active", True, 0, now, now, 0)
    no_time = Replica("c", "http://c:1", "standby", True, 0, None, now, 0)  # [0, null, null]
    row = (active, _standby("b", now, now), no_time)
    budget = LagBudget()
    expires = choice_expires_at(row, budget, now_ms=now, stale_after_ms=STALE_MS)
    cached = choose_replicas(row, budget, now_ms=now, stale_after_ms=STALE_MS)
    later = choose_replicas(row, budget, now_ms=now + 1, stale_after_ms=STALE_MS)
    assert now + 1 < expires
    assert [r.node_id for r in cached.candidates] == [r.node_id for r in later.candidates]
