"""A partition whose replicas changed but whose choice did not keeps its cached choice: the
table leaves it out of `changed` only when `ChoiceStability.same` says so, and `same` must
never say so when the new replicas give another choice before the old choice expires."""

from __future__ import annotations

import asyncio
import re
from unittest.mock import patch

from hypothesis import given, settings
from hypothesis import strategies as st

from common.clock import now_ms
from common.contract import Assignment, Hosting, NodeInfo, PartitionReport, StoreInfo
from kroute.static_cluster import round_robin
from proxy.choice import Choice, LagBudget, Replica, choice_expires_at, choose_replicas
from proxy.exchange import ExchangeContext
from proxy.handler import ChoicePolicy, RequestHandler
from proxy.health import Ejections
from proxy.metrics import ProxyMetrics
from proxy.retry_budget import RetryBudget
from proxy.routes import RouteTable
from proxy.routing import ChoiceStability, RoutingSnapshot, TableBuilder
from proxy.settings import DEFAULT_ROUTES, parse_routes
from proxy.upstream import UpstreamPool
from tests.proxy.test_routing import a_hub

NOW = 9_000_000
STALE_MS = 3_000
NODE_IDS = ("a", "b", "c")


def _times(now: int) -> st.SearchStrategy[int | None]:
    """Report and caught-up times around `now`: fresh, nearly stale, stale, or none."""
    moments = (now, now - 10, now - 900, now - 2_990, now - 4_000)
    return st.one_of(st.none(), st.sampled_from(moments))


@st.composite
def rows(draw: st.DrawFn) -> tuple[tuple[Replica, ...], tuple[Replica, ...]]:
    """An old row and a new one for the same placement: same nodes and roles, the rest
    drawn from a few close values, so that many pairs give the same choice and many do not."""
    count = draw(st.integers(1, 3))
    roles = ["active" if i == 0 and draw(st.booleans()) else "standby" for i in range(count)]

    def replica(index: int) -> Replica:
        node_id = NODE_IDS[index]
        return Replica(
            node_id=node_id,
            url=f"http://{node_id}:1",
            role=roles[index],  # type: ignore[arg-type]
            alive=draw(st.booleans()) or draw(st.booleans()),
            lag=draw(st.one_of(st.none(), st.sampled_from((0, 0, 1, 3, 5, 9)))),
            caught_up_at_ms=draw(_times(NOW)),
            reported_at_ms=draw(_times(NOW)),
            position=draw(st.one_of(st.none(), st.integers(0, 3))),
        )

    old = tuple(replica(i) for i in range(count))
    new = tuple(replica(i) if draw(st.booleans()) else old[i] for i in range(count))
    return old, new


budgets = st.builds(
    LagBudget,
    st.one_of(st.none(), st.sampled_from((0, 3, 5))),
    st.one_of(st.none(), st.sampled_from((500, 2_000, 5_000))),
)


def _seen(choice: Choice) -> tuple[object, ...]:
    """What a request sees of a choice: who is tried in which order, who is refused and why
    (a time lag in a reason is as of the moment the choice was made, for old and new alike)."""
    reasons = tuple(
        (r.node_id, r.role, re.sub(r"time lag \d+ ms", "time lag N ms", r.reason))
        for r in choice.rejected
    )
    return tuple(c.node_id for c in choice.candidates), reasons, choice.spread_width


def _moments(old: tuple[Replica, ...], new: tuple[Replica, ...], budget: LagBudget, until: int):
    """Every moment in [NOW, until) at which either row's choice may change, and NOW."""
    moments = {NOW}
    for replica in (*old, *new):
        if replica.reported_at_ms is not None:
            moments.add(replica.reported_at_ms + STALE_MS + 1)
        if budget.max_ms is not None and replica.caught_up_at_ms is not None:
            moments.add(replica.caught_up_at_ms + budget.max_ms + 1)
    return sorted(m for m in moments if NOW <= m < until)


@settings(max_examples=1_500, deadline=None)
@given(
    rows(),
    budgets,
    st.sampled_from(("reject", "accept")),
    st.booleans(),
)
def test_same_choice_means_the_same_choice_until_the_old_one_expires(
    pair, budget, unknown, standby
):
    old, new = pair
    stability = ChoiceStability(budget, unknown, STALE_MS, standby)
    if not stability.same(old, new, NOW):
        return
    until = choice_expires_at(old, budget, now_ms=NOW, stale_after_ms=STALE_MS)
    for at in _moments(old, new, budget, until):
        kwargs = {
            "now_ms": at,
            "unknown_lag": unknown,
            "stale_after_ms": STALE_MS,
            "standby_reads": standby,
        }
        assert _seen(choose_replicas(old, budget, **kwargs)) == _seen(
            choose_replicas(new, budget, **kwargs)
        ), at


def test_reports_that_only_move_forward_in_time_keep_every_choice():
    stability = ChoiceStability(LagBudget(1_000, 60_000), "reject", STALE_MS)
    old = (
        Replica("a", "http://a:1", "active", True, 0, NOW - 300, NOW - 300, 10),
        Replica("b", "http://b:1", "standby", True, 0, NOW - 200, NOW - 200, 10),
    )
    moved = tuple(Replica(r.node_id, r.url, r.role, True, 7, NOW - 5, NOW - 5, 20) for r in old)
    assert stability.same(old, moved, NOW), "a new report inside the budget changes nothing"
    over = (moved[0], Replica("b", "http://b:1", "standby", True, 1_001, NOW - 5, NOW - 5, 20))
    assert not stability.same(old, over, NOW), "the standby left the budget"
    older = (Replica("a", "http://a:1", "active", True, 0, NOW - 300, NOW - 900, 10), old[1])
    assert not stability.same(old, older, NOW), "an older report goes stale sooner"
    dead = (old[0], Replica("b", "http://b:1", "standby", False, 0, NOW, NOW, 10))
    assert not stability.same(old, dead, NOW)


def test_a_report_that_changes_the_order_or_a_coming_time_limit_changes_the_choice():
    unlimited = ChoiceStability(LagBudget(), "reject", STALE_MS)
    b, c = (Replica(n, f"http://{n}:1", "standby", True, 0, NOW - 10, NOW, 0) for n in "bc")
    older_c = Replica("c", "http://c:1", "standby", True, 0, NOW - 900, NOW, 0)
    older_b = Replica("b", "http://b:1", "standby", True, 0, NOW - 900, NOW, 0)
    assert unlimited.same((b, older_c), (b, c), NOW), "b and c tie, then b's node id wins"
    assert not unlimited.same((b, older_c), (older_b, c), NOW), "c now goes before b"
    by_time = ChoiceStability(LagBudget(None, 500), "reject", STALE_MS)
    now = (Replica("a", "http://a:1", "active", True, 0, NOW, NOW, 0),)
    earlier = (Replica("a", "http://a:1", "active", True, 0, NOW - 10, NOW, 0),)
    assert not by_time.same(now, earlier, NOW), "it leaves the 500 ms budget 10 ms sooner"
    assert by_time.same(earlier, now, NOW)


def _cluster(table: TableBuilder, nodes: list[str], partitions: int, lag: int, at: int) -> None:
    placed = round_robin(partitions, nodes, 1)
    assignment = Assignment(1, nodes[0], 0, {"s": placed})
    for node_id in nodes:
        roles = assignment.for_node(node_id)["s"]
        hosted = {"s": {role: tuple(ps) for role, ps in roles.items()}}
        reports = {
            ("s", p): PartitionReport(100 - lag, 100, at, at, at)
            for ps in roles.values()
            for p in ps
        }
        info = NodeInfo(node_id, f"http://{node_id}:1", 0)
        table.set_node(node_id, info, Hosting(node_id, 1, hosted, at), reports)


def test_the_table_names_only_partitions_whose_choice_changed():
    """Every node reports again, later: with a ChoiceStability no partition is named (the
    request path keeps its cached choices); without one, every partition is."""
    nodes = [f"n{i}" for i in range(10)]
    stability = ChoiceStability(LagBudget(1_000, 60_000), "reject", STALE_MS)
    for judge, expect_named in ((stability, 0), (None, 200)):
        table = TableBuilder(judge)
        table.set_stores({"s": StoreInfo("s", "t", 200)})
        table.set_assignment(Assignment(1, nodes[0], 0, {"s": round_robin(200, nodes, 1)}))
        table.set_alive(set(nodes))
        _cluster(table, nodes, 200, 0, NOW - 500)
        list(table.rebuild(NOW - 500))
        table.snapshot(NOW - 500)
        _cluster(table, nodes, 200, 3, NOW)
        list(table.rebuild(NOW))
        changed = table.snapshot(NOW).changed
        assert changed is not None
        assert sum(map(len, changed.values())) == expect_named
        _cluster(table, nodes, 200, 2_000, NOW)  # now over the budget: every choice changes
        list(table.rebuild(NOW))
        changed = table.snapshot(NOW).changed
        assert changed is not None
        assert sum(map(len, changed.values())) == 200


# -- the request path keeps (and renews) what a new snapshot left standing --------------------


def _handler() -> RequestHandler:
    hub = a_hub(spread=False)
    pool = UpstreamPool(
        hub=hub, connect_timeout_s=1.0, response_timeout_s=1.0, idle_per_origin=1,
        max_response_bytes=1_000,
    )  # fmt: skip
    metrics = ProxyMetrics()
    context = ExchangeContext(
        pool=pool,
        ejections=Ejections(eject_ms=1_000, probe_interval_ms=1_000, probe_timeout_s=1.0),
        metrics=metrics,
        refresh_table=lambda: None,
        retry_budget=RetryBudget(percent=20, min_per_s=1, burst=10),
    )
    policy = ChoicePolicy(LagBudget(1_000, 60_000), "reject", STALE_MS, spread=False)
    routes = RouteTable(parse_routes(DEFAULT_ROUTES))
    return RequestHandler(routes=routes, policy=policy, context=context, metrics=metrics, hub=hub)


def _swap(table: TableBuilder, handler: RequestHandler, at: int) -> RoutingSnapshot:
    """What the watcher does: rebuild, swap in, then renew step by step."""
    list(table.rebuild(at))
    snapshot = table.snapshot(at)
    handler.use_snapshot(snapshot)
    for name, partitions in snapshot.renewed.items():
        handler.renew_choices(snapshot, name, sorted(partitions))
    return snapshot


def test_a_cached_choice_survives_reports_that_keep_it_and_is_renewed_from_them():
    asyncio.run(_keeps_and_renews())  # the upstream pool wants a running loop


def _handler_and_table(nodes: list[str]) -> tuple[RequestHandler, TableBuilder]:
    """A handler and a builder judging by its stability: one store of 8 partitions over
    `nodes`, one standby each, every node alive."""
    handler = _handler()
    table = TableBuilder(handler.choice_stability)
    table.set_stores({"s": StoreInfo("s", "t", 8)})
    table.set_assignment(Assignment(1, nodes[0], 0, {"s": round_robin(8, nodes, 1)}))
    table.set_alive(set(nodes))
    return handler, table


async def _keeps_and_renews() -> None:
    nodes = [f"n{i}" for i in range(4)]
    handler, table = _handler_and_table(nodes)
    now = now_ms()
    _cluster(table, nodes, 8, 0, now - 2_000)  # reports 2 s old: its choice expires in 1 s
    snapshot = _swap(table, handler, now)
    handler._choice(snapshot.stores["s"], "s", 3, None)
    first = handler._choices["s"][3]
    assert first is not None
    assert [c.replica.caught_up_at_ms for c in first.candidates] == [now - 2_000] * 2

    _cluster(table, nodes, 8, 7, now)  # newer reports, lag 7: inside the budget
    snapshot = _swap(table, handler, now)
    assert snapshot.changed == {}
    assert snapshot.renewed == {"s": frozenset(range(8))}
    renewed = handler._choices["s"][3]
    assert renewed is not None, "the choice was kept"
    assert renewed.expires_ms > first.expires_ms, "and lives as long as the new reports"
    assert [c.target.node_id for c in renewed.candidates] == [
        c.target.node_id for c in first.candidates
    ]
    assert [c.replica.caught_up_at_ms for c in renewed.candidates] == [now] * 2
    assert b"x-kroute-lag: 7\r\n" in renewed.candidates[0].provenance

    _cluster(table, nodes, 8, 5_000, now)  # over the budget: the choice changes
    snapshot = _swap(table, handler, now)
    assert handler._choices["s"][3] is None


def test_a_node_rewriting_its_info_with_the_same_url_changes_nothing():
    """Writers may rewrite `node:<id>` on every heartbeat with a new start time: the table's
    URLs (the request path's targets) stay the same object and no partition is named."""
    nodes = [f"n{i}" for i in range(4)]
    table = TableBuilder()
    table.set_stores({"s": StoreInfo("s", "t", 8)})
    table.set_assignment(Assignment(1, nodes[0], 0, {"s": round_robin(8, nodes, 1)}))
    table.set_alive(set(nodes))
    _cluster(table, nodes, 8, 0, NOW)
    list(table.rebuild(NOW))
    first = table.snapshot(NOW)
    for node_id in nodes:
        table.set_node(
            node_id,
            NodeInfo(node_id, f"http://{node_id}:1", NOW),  # started "now": a heartbeat
            table.hostings[node_id],
            {where: PartitionReport(100, 100, NOW, NOW, NOW) for where in table.reports[node_id]},
        )
    list(table.rebuild(NOW))
    second = table.snapshot(NOW)
    assert second.node_urls is first.node_urls
    assert second.changed == {}
    table.set_node("n1", NodeInfo("n1", "http://n1:2", NOW), table.hostings["n1"], {})
    list(table.rebuild(NOW))
    third = table.snapshot(NOW)
    assert third.node_urls["n1"] == "http://n1:2"
    assert third.changed


def test_a_cached_choice_with_long_to_live_is_left_alone_until_half_its_limit_remains():
    asyncio.run(_renews_only_near_expiry())


async def _renews_only_near_expiry() -> None:
    """Renewing every kept choice on every confirmation cost most of the table's CPU: a
    choice is renewed only when less than half the staleness limit (3 s here) remains."""
    nodes = [f"n{i}" for i in range(4)]
    handler, table = _handler_and_table(nodes)
    now = now_ms()
    _cluster(table, nodes, 8, 0, now - 1_000)  # 1 s old: 2 s to live, more than 1.5 s
    snapshot = _swap(table, handler, now)
    handler._choice(snapshot.stores["s"], "s", 3, None)
    first = handler._choices["s"][3]
    assert first is not None

    _cluster(table, nodes, 8, 0, now)  # a confirmation that moves only times
    snapshot = _swap(table, handler, now)
    assert snapshot.renewed == {"s": frozenset(range(8))}
    assert handler._choices["s"][3] is first, "2 s left: kept as it is, not renewed"

    _cluster(table, nodes, 8, 4, now)  # a lag moved (inside the budget): renewed at once
    snapshot = _swap(table, handler, now)
    moved = handler._choices["s"][3]
    assert moved is not None
    assert moved is not first
    assert b"x-kroute-lag: 4\r\n" in moved.candidates[0].provenance
    first = moved

    _cluster(table, nodes, 8, 4, now + 1)
    with patch("proxy.handler.now_ms", lambda: now + 1_600):  # 1.4 s left (of 3 s): renewed
        snapshot = _swap(table, handler, now + 1_600)
    renewed = handler._choices["s"][3]
    assert renewed is not None
    assert renewed is not first
    assert renewed.expires_ms > first.expires_ms


def test_a_kept_choice_on_a_replaced_clock_is_renewed_before_it_expires():
    asyncio.run(_renews_a_choice_left_on_a_replaced_clock())


def _confirm_in_place(table: TableBuilder, nodes: list[str], delta_ms: int, at: int) -> None:
    """Each node's last report confirmed `delta_ms` later, as the sweep does (clocks move in
    place when that changes no choice)."""
    for node_id in nodes:
        hosting = table.hostings[node_id]
        moved = Hosting(
            node_id, hosting.generation, hosting.stores, hosting.updated_at_ms + delta_ms
        )
        table.shift_node(node_id, delta_ms, moved, at)


async def _renews_a_choice_left_on_a_replaced_clock() -> None:
    """A node read replaces a node's report clock; a kept choice with long to live is left as
    it is (renewed later), still reading the replaced clock, which no confirmation moves any
    more: at 300 nodes / 6,000 partitions such choices expired every few seconds and 2% of
    requests left the C path. It must be renewed (`renew_due`) before it expires."""
    nodes = [f"n{i}" for i in range(4)]
    handler, table = _handler_and_table(nodes)
    now = now_ms()
    _cluster(table, nodes, 8, 0, now - 500)
    snapshot = _swap(table, handler, now)
    handler._choice(snapshot.stores["s"], "s", 3, None)
    first = handler._choices["s"][3]
    assert first is not None

    _cluster(table, nodes, 8, 0, now - 400)  # a node read: the same lags, new report clocks
    snapshot = _swap(table, handler, now)
    assert handler._choices["s"][3] is first, "2.6 s left: not renewed yet"

    moved_before = table.clocks_moved_in_place
    _confirm_in_place(table, nodes, 2_000, now)  # confirmations: the new clocks move
    assert table.clocks_moved_in_place == moved_before + len(nodes), "in place: nothing named"
    assert not first.live(now + 2_600), "the replaced clocks did not move"
    later = now + 1_100  # the first choice's half-life is over (it expires at now + 2,501)
    with patch("proxy.handler.now_ms", lambda: later):
        while handler.renew_due(handler.snapshot, 2):
            pass
    renewed = handler._choices["s"][3]
    assert renewed is not None
    assert renewed.live(now + 2_600), "renewed from the new replicas, whose clock moved"
    assert renewed.live(now + 4_500)
    assert not renewed.live(now + 4_700)
