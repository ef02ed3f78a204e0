"""Choices the request path makes from the old rows while a rebuild runs (issue 22).

The watcher judges a rebuilt row against the old one (`ChoiceStability.same`) when the rebuild
begins, then yields to the event loop between steps until it swaps the snapshot in; requests
meanwhile go on caching choices from the old rows. Found at 1,000 nodes / 20,000 partitions:
a proxy loaded from its start answered 503 "lag report too old" for a fixed set of partitions
for over a minute, while a request that skipped the cache (a freshness header) was served.
Their old reports went stale between the judgement and the swap, the choice cached then
refused both replicas, and the partitions were named renewed, so the refusal was renewed
from the new, fresh rows again and again.

The invariant: a cached choice is what the current rows give until it expires, unless the
snapshot that replaced its rows named its partition changed."""

from __future__ import annotations

import asyncio
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
from proxy.choice import LagBudget, choice_expires_at, choose_replicas
from proxy.routing import JUDGED_AHEAD_MS, ChoiceStability, RoutingSnapshot, TableBuilder
from tests.proxy.test_review2_renew import (
    START,
    _handler_with,
    apply_step,
    assert_cache_exact,
    budgets,
    steps,
    swap_in,
    three_node_table,
)
from tests.proxy.test_review_clock_midrebuild import STALE_MS, _drain

NOW = 9_000_000
BUDGET = LagBudget(5, 60_000)


def _table(budget: LagBudget, placed: PartitionAssignment) -> TableBuilder:
    table = TableBuilder(ChoiceStability(budget, "reject", STALE_MS))
    table.set_stores({"s": StoreInfo("s", "t", 1)})
    table.set_assignment(Assignment(1, "a", 0, {"s": {0: placed}}))
    table.set_alive(set(placed.replicas()))
    return table


def _set_report(  # noqa: PLR0917 (one report, as the contract has it)
    table: TableBuilder,
    node_id: str,
    role: str,
    reported_at: int,
    position: int,
    caught_up_at: int | None = None,
    lag: int = 0,
) -> None:
    table.set_node(
        node_id,
        NodeInfo(node_id, f"http://{node_id}:1", 0),
        Hosting(node_id, 1, {"s": {role: (0,)}}, reported_at),  # type: ignore[dict-item]
        {("s", 0): PartitionReport(position, position + lag, None, caught_up_at, reported_at)},
    )


def _one_partition_on_a(reported_at: int) -> TableBuilder:
    """Caught up (lag 0, no caught-up time): only the report's age decides its standing."""
    table = _table(BUDGET, PartitionAssignment("a", ()))
    _set_report(table, "a", "active", reported_at, 100)
    return table


def _choose(snapshot: RoutingSnapshot, at: int):  # type: ignore[no-untyped-def]
    return choose_replicas(
        snapshot.stores["s"].replicas[0], BUDGET, now_ms=at, stale_after_ms=STALE_MS
    )


def _named_changed(snapshot: RoutingSnapshot) -> bool:
    return snapshot.changed is None or 0 in snapshot.changed.get("s", frozenset())


def test_a_report_going_stale_soon_after_the_judgement_names_its_partition_changed():
    """Fresh when the rebuild begins, stale 600 ms later while requests still read the old
    rows: the choice cached then refuses the replica, which the new row serves."""
    table = _one_partition_on_a(reported_at=NOW - STALE_MS + 500)
    _drain(table.rebuild(NOW))
    old = table.snapshot(NOW)
    _set_report(table, "a", "active", NOW, 101)  # a newer report: the row is rebuilt
    _drain(table.rebuild(NOW))
    new = table.snapshot(NOW).as_swapped_at(NOW + 600)

    cached = _choose(old, NOW + 600)  # a request before the swap
    assert cached.candidates == ()
    assert [r.reason for r in cached.rejected] == ["lag report too old"]
    assert _named_changed(new) or _choose(new, NOW + 600) == cached, (
        "the refusal cached from the old rows would be kept, renewed from rows that serve"
    )


def test_a_swap_later_than_the_judgement_covers_names_the_renewed_partitions_changed():
    """The old report goes stale 1,500 ms after the rebuild began, past what it judged: a
    swap within that keeps the renewal, a later one names the partition changed."""
    table = _one_partition_on_a(reported_at=NOW - STALE_MS + JUDGED_AHEAD_MS + 500)
    _drain(table.rebuild(NOW))
    old = table.snapshot(NOW)
    _set_report(table, "a", "active", NOW, 101)
    _drain(table.rebuild(NOW))
    built = table.snapshot(NOW)
    assert built.renewed == {"s": frozenset({0})}, "both fresh over the judged moments: renewed"
    assert built.renewed_until_ms == NOW + JUDGED_AHEAD_MS

    in_time = built.as_swapped_at(NOW + JUDGED_AHEAD_MS)
    assert in_time is built, "swapped in within the judged moments: renewals stand"

    late = NOW + JUDGED_AHEAD_MS + 600
    cached = _choose(old, late)  # a request before the late swap
    assert cached.candidates == ()
    swapped = built.as_swapped_at(late)
    assert _named_changed(swapped) or _choose(swapped, late) == cached
    assert swapped.renewed == {}


def test_a_snapshot_that_renews_nothing_is_swapped_in_as_built_whenever():
    table = _one_partition_on_a(reported_at=NOW)
    _drain(table.rebuild(NOW))
    table.snapshot(NOW)
    _drain(table.rebuild(NOW))
    built = table.snapshot(NOW)
    assert built.renewed_until_ms is None
    assert built.as_swapped_at(NOW + 3_600_000) is built


def _seen(choice) -> tuple[list[str], list[str]]:  # type: ignore[no-untyped-def]
    return [r.node_id for r in choice.candidates], [r.node_id for r in choice.rejected]


def _kept_choice_holds(
    table: TableBuilder, update, budget: LagBudget, request_at: int, swap_at: int
) -> bool:  # type: ignore[no-untyped-def]
    """Rows built at NOW, `update` rebuilt from NOW on, a choice cached from the old rows at
    `request_at`, the new snapshot swapped in at `swap_at`: whether the partition is named
    changed, or the cached choice is the one the new rows give from the swap until the
    cached choice's replicas next flip (checked at every 50 ms for 2 s)."""
    _drain(table.rebuild(NOW))
    old = table.snapshot(NOW)
    update()
    _drain(table.rebuild(NOW))
    swapped = table.snapshot(NOW).as_swapped_at(swap_at)
    if _named_changed(swapped):
        return True
    cached = choose_replicas(
        old.stores["s"].replicas[0], budget, now_ms=request_at, stale_after_ms=STALE_MS
    )
    expires = choice_expires_at(
        old.stores["s"].replicas[0], budget, now_ms=request_at, stale_after_ms=STALE_MS
    )
    row = swapped.stores["s"].replicas[0]
    return all(
        _seen(choose_replicas(row, budget, now_ms=at, stale_after_ms=STALE_MS)) == _seen(cached)
        for at in range(swap_at, min(swap_at + 2_000, expires), 50)
    )


def test_reports_going_stale_at_different_moments_inside_the_window_name_it_changed():
    """Old report stale after +200, the new one after +800: both fresh at the start, both stale
    a second later, yet from +200 to +800 the old rows refuse what the new ones serve."""
    table = _table(BUDGET, PartitionAssignment("a", ()))
    _set_report(table, "a", "active", NOW - STALE_MS + 200, 100)
    update = lambda: _set_report(table, "a", "active", NOW - STALE_MS + 800, 101)  # noqa: E731
    assert _kept_choice_holds(table, update, BUDGET, NOW + 500, NOW + 600)


def test_a_standby_going_stale_inside_the_window_reorders_and_names_it_changed():
    unlimited = LagBudget()
    table = _table(unlimited, PartitionAssignment("a", ("b", "c")))
    _set_report(table, "a", "active", NOW, 100, caught_up_at=NOW)
    _set_report(table, "b", "standby", NOW - STALE_MS + 200, 100, caught_up_at=NOW - STALE_MS + 200)
    _set_report(table, "c", "standby", NOW, 100, caught_up_at=NOW - 5_000)

    def update() -> None:
        _set_report(table, "b", "standby", NOW - STALE_MS + 800, 101, NOW - STALE_MS + 800)

    assert _kept_choice_holds(table, update, unlimited, NOW + 500, NOW + 600)


def test_a_time_lag_leaving_the_budget_inside_the_window_names_it_changed():
    """Lag 3, caught up 1,800 ms ago against a 2 s budget (over it at +201); the new report
    caught up 1,200 ms ago (over it at +801)."""
    budget = LagBudget(None, 2_000)
    table = _table(budget, PartitionAssignment("a", ()))
    _set_report(table, "a", "active", NOW, 100, caught_up_at=NOW - 1_800, lag=3)
    update = lambda: _set_report(table, "a", "active", NOW, 101, NOW - 1_200, lag=3)  # noqa: E731
    assert _kept_choice_holds(table, update, budget, NOW + 500, NOW + 600)


# What the request path does, against `choose_replicas` on the rows (the differential of
# test_review2_renew, with requests between a rebuild's judgement and its swap).
swap_delays = st.sampled_from((0, 0, 300, 900, JUDGED_AHEAD_MS, 1_600, 4_000))


@settings(max_examples=800, deadline=None)
@given(budgets, st.lists(st.tuples(steps, swap_delays), min_size=2, max_size=16))
def test_a_choice_made_while_a_rebuild_ran_is_the_choice_the_rows_give(budget, chain):
    asyncio.run(_check(budget, chain))  # the upstream pool wants a running loop


async def _check(budget: LagBudget, chain: list) -> None:  # type: ignore[type-arg]
    handler = _handler_with(budget)
    now = START
    table = three_node_table(handler, now)
    snapshot = None
    for (new_reports, passing, alive, request), delay in chain:
        now += passing
        apply_step(table, new_reports, alive, now)
        _drain(table.rebuild(now))  # judged now
        built = table.snapshot(now)
        now += delay  # the rebuild's steps and yields: requests read the old rows meanwhile
        with patch("proxy.handler.now_ms", lambda at=now: at):
            if request and snapshot is not None:
                handler._choice(snapshot.stores["s"], "s", 0, None)
            snapshot = built.as_swapped_at(now)
            swap_in(handler, snapshot, request)
        assert_cache_exact(handler, snapshot, budget, now)
