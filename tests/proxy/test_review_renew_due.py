"""Review of f6e641d (`RequestHandler.renew_due`): kept choices left for later on a replaced
report clock are renewed when half their limit remains.

What must hold: a due renewal never brings back a choice the table changed or forgot, never
reads another snapshot than the one in use, keeps the candidates and their order, reads the
current clocks, and the queue drains. What the change set out to do (a kept choice on a
replaced clock does not expire while its replicas are fresh) is checked in two cases the
queue misses: the two `test_gap_*` tests fail on f6e641d."""

from __future__ import annotations

import asyncio
from unittest.mock import patch

from common.contract import Hosting, PartitionReport, StoreInfo
from proxy._hotpath import Cached
from proxy.choice import LagBudget, choose_replicas
from proxy.handler import RequestHandler
from proxy.routing import RoutingSnapshot, TableBuilder
from tests.proxy.test_routing_choice_stability import (
    STALE_MS,
    _cluster,
    _confirm_in_place,
    _handler_and_table,
)

T = 70_000_000  # every moment below is T + something (now_ms is patched to it)
NODES = [f"n{i}" for i in range(4)]
P = 3  # the partition whose choice is followed


def _at(moment: int):
    return patch("proxy.handler.now_ms", lambda: moment)


def _swap(table: TableBuilder, handler: RequestHandler, at: int) -> RoutingSnapshot:
    """What the watcher does, as of `at`: rebuild, swap in, renew what the snapshot names."""
    with _at(at):
        list(table.rebuild(at))
        snapshot = table.snapshot(at)
        handler.use_snapshot(snapshot)
        for name, partitions in snapshot.renewed.items():
            handler.renew_choices(snapshot, name, sorted(partitions))
    return snapshot


def _due(handler: RequestHandler, at: int, limit: int = 32) -> None:
    """The watcher's step: renew_due until it says none are left."""
    with _at(at):
        while handler.renew_due(handler.snapshot, limit):
            pass


def _cache(handler: RequestHandler, snapshot: RoutingSnapshot, at: int) -> Cached:
    with _at(at):
        handler._choice(snapshot.stores["s"], "s", P, None)
    cached = handler._choices["s"][P]
    assert cached is not None
    return cached


def _node_read(table: TableBuilder, node_id: str, at: int, stamp: int, lag: int = 0) -> None:
    """The node's whole state set again (`set_node`, as a node read or a changed body does):
    every report as of `at`, its hosting stamped `stamp`. A new report clock."""
    hosting = table.hostings[node_id]
    reports = {
        where: PartitionReport(100 - lag, 100, at, at, at) for where in table.reports[node_id]
    }
    table.set_node(
        node_id,
        table.nodes[node_id],
        Hosting(node_id, hosting.generation, hosting.stores, stamp),
        reports,
    )


def _nodes_of(snapshot: RoutingSnapshot) -> list[str]:
    return [r.node_id for r in snapshot.stores["s"].replicas[P]]


def _names(cached: Cached) -> list[str]:
    return [c.target.node_id for c in cached.candidates]


async def _queued_choice() -> tuple[RequestHandler, TableBuilder, Cached]:
    """A choice cached at T from reports 500 ms old (expiring at T + 2,501), then a node read
    of every node at T + 100 (the same lags, reports 100 ms newer, new clocks): the choice is
    kept and queued, due at T + 1,001."""
    handler, table = _handler_and_table(NODES)
    _cluster(table, NODES, 8, 0, T - 500)
    snapshot = _swap(table, handler, T)
    first = _cache(handler, snapshot, T)
    assert first.expires_ms == T + 2_501
    _cluster(table, NODES, 8, 0, T - 400)
    snapshot = _swap(table, handler, T + 100)
    assert P in snapshot.renewed.get("s", ())
    assert handler._choices["s"][P] is first
    assert handler._queued[("s", P)] is first
    return handler, table, first


# -- what held ----------------------------------------------------------------------------------


def test_a_queued_choice_is_queued_once_and_the_queue_drains():
    asyncio.run(_queued_once())


async def _queued_once() -> None:
    handler, _table, first = await _queued_choice()
    snapshot = handler.snapshot
    with _at(T + 200):
        for _ in range(50):  # every later report that leaves it alone names it again
            handler.renew_choices(snapshot, "s", list(range(8)))
    assert sum(1 for entry in handler._due if entry[3] == P) == 1
    _due(handler, T + 1_000)
    assert handler._choices["s"][P] is first, "not due before half its limit remains"
    _due(handler, T + 1_001)
    renewed = handler._choices["s"][P]
    assert renewed is not None
    assert renewed is not first
    assert not handler._due
    assert not handler._queued


def test_a_renewed_choice_keeps_its_candidates_in_order_and_reads_the_current_replicas():
    asyncio.run(_same_candidates())


async def _same_candidates() -> None:
    handler, table, first = await _queued_choice()
    _confirm_in_place(table, NODES, 600, T + 500)  # the new clocks move: T - 400 reads T + 200
    _due(handler, T + 1_100)
    renewed = handler._choices["s"][P]
    assert renewed is not None
    assert renewed is not first
    assert _names(renewed) == _names(first)
    assert [r.node_id for r in renewed.choice.candidates] == [
        r.node_id for r in first.choice.candidates
    ]
    assert renewed.spread_width == first.spread_width
    row = handler.snapshot.stores["s"].replicas[P]
    by_node = {r.node_id: r for r in row}
    for candidate in renewed.candidates:
        assert candidate.replica is by_node[candidate.target.node_id], "the row's replica"
        assert candidate.clock is by_node[candidate.target.node_id].clock
        # The answers' time lag: from the current caught-up time, never a later one.
        assert candidate.replica.caught_up_at_ms == T + 200
    assert renewed.live(T + 3_200)
    assert not renewed.live(T + 3_201)
    budget = handler.policy.budget
    for at in (T + 1_100, T + 3_000, T + 3_200):
        fresh = choose_replicas(row, budget, now_ms=at, stale_after_ms=STALE_MS)
        assert [r.node_id for r in fresh.candidates] == _names(renewed), at


def test_renew_due_leaves_a_partition_a_later_snapshot_changed_forgotten():
    asyncio.run(_changed_stays_forgotten())


async def _changed_stays_forgotten() -> None:
    handler, table, _first = await _queued_choice()
    _cluster(table, NODES, 8, 5_000, T - 300)  # over the budget: every choice changes
    snapshot = _swap(table, handler, T + 200)
    assert P in (snapshot.changed or {}).get("s", ())
    assert handler._choices["s"][P] is None
    _due(handler, T + 1_500)
    assert handler._choices["s"][P] is None, "resurrected a changed choice"
    assert not handler._due
    assert not handler._queued


def test_renew_due_leaves_forgotten_choices_forgotten():
    asyncio.run(_forgotten_stays_forgotten())


async def _forgotten_stays_forgotten() -> None:
    handler, _table, _first = await _queued_choice()
    handler.forget_choices()  # the ejected set changed
    _due(handler, T + 1_500)
    assert handler._choices["s"][P] is None
    assert not handler._due


def test_renew_due_after_a_store_shrank_neither_fails_nor_renews():
    asyncio.run(_store_shrank())


async def _store_shrank() -> None:
    handler, table, _first = await _queued_choice()
    snapshot = handler.snapshot
    with _at(T + 200):
        for partition in range(8):
            handler._choice(snapshot.stores["s"], "s", partition, None)
    _cluster(table, NODES, 8, 0, T - 300)  # every node read again: every choice queued
    _swap(table, handler, T + 300)
    assert len(handler._queued) == 8
    table.set_stores({"s": StoreInfo("s", "t", 2)})  # repartitioned: 2 partitions
    _swap(table, handler, T + 400)
    assert len(handler._choices["s"]) == 2
    _due(handler, T + 3_000)
    assert handler._choices["s"] == [None, None]
    assert not handler._due
    assert not handler._queued


def test_renew_due_with_a_snapshot_not_in_use_renews_nothing():
    asyncio.run(_older_snapshot())


async def _older_snapshot() -> None:
    handler, table, first = await _queued_choice()
    older = handler.snapshot
    _cluster(table, NODES, 8, 0, T - 350)
    _swap(table, handler, T + 150)
    with _at(T + 1_100):
        assert handler.renew_due(older, 32) is False
    assert handler._choices["s"][P] is first, "nothing renewed from a snapshot not in use"
    assert handler._queued.get(("s", P)) is first, "still queued for the one in use"
    _due(handler, T + 1_100)
    renewed = handler._choices["s"][P]
    assert renewed is not None
    assert renewed is not first
    current = handler.snapshot.stores["s"].replicas[P]
    assert all(any(c.replica is r for r in current) for c in renewed.candidates)


def test_renew_due_counts_its_limit_and_says_when_more_are_due():
    asyncio.run(_limit())


async def _limit() -> None:
    handler, table, _first = await _queued_choice()
    snapshot = handler.snapshot
    with _at(T + 200):
        for partition in range(8):
            handler._choice(snapshot.stores["s"], "s", partition, None)
    _cluster(table, NODES, 8, 0, T - 300)
    _swap(table, handler, T + 300)
    assert len(handler._queued) == 8
    _confirm_in_place(table, NODES, 600, T + 500)
    calls = 0
    with _at(T + 2_000):
        while handler.renew_due(handler.snapshot, 3):
            calls += 1
    assert calls == 2, "8 due, 3 at a time: more are due twice"
    assert not handler._due
    for partition in range(8):
        cached = handler._choices["s"][partition]
        assert cached is not None
        assert cached.live(T + 3_000), partition


# -- once gaps: kept choices on replaced clocks that expired with fresh replicas --------------


def test_a_due_choice_that_could_not_be_extended_yet_still_follows_the_new_clock():
    asyncio.run(_not_extended_yet())


async def _not_extended_yet() -> None:
    """The node read replaces one node's clock; the other replica of the row holds the
    earliest expiry and is not confirmed before the choice is due. At its turn `renew_due`
    finds nothing to extend (the current row expires when the choice does) and still moves
    the choice onto the current clocks: confirmations then move them in place, and the
    choice lives as long as the table gives it (T + 3,501), not T + 2,501 on the old clock."""
    handler, table = _handler_and_table(NODES)
    _cluster(table, NODES, 8, 0, T - 500)
    snapshot = _swap(table, handler, T)
    first = _cache(handler, snapshot, T)
    active, standby = _nodes_of(snapshot)
    _node_read(table, active, T - 400, T - 400)  # one node read: a new clock, 100 ms newer
    snapshot = _swap(table, handler, T + 100)
    assert P in snapshot.renewed.get("s", ())
    assert handler._queued.get(("s", P)) is first, "queued: it reads a replaced clock"
    _due(handler, T + 1_001)
    assert not handler._due, "its turn came"
    _confirm_in_place(table, [active, standby], 1_000, T + 1_100)
    assert table.clocks_moved_in_place >= 2
    for at in range(T + 1_200, T + 2_700, 100):  # the watcher's steps
        _due(handler, at)
    row = handler.snapshot.stores["s"].replicas[P]
    assert min(r.reported_at_ms for r in row) == T + 500, "fresh until T + 3,501"
    cached = handler._choices["s"][P]
    assert cached is not None
    assert cached.live(T + 2_600), "expired reading the replaced clock, replicas fresh"


def test_a_clock_replaced_by_a_node_read_that_changes_no_row_still_moves_kept_choices():
    asyncio.run(_replaced_unnamed())


async def _replaced_unnamed() -> None:
    """A node read whose reports say what the table holds (its hosting stamped anew) gives
    the node a new clock (`set_node`); the rows are equal, yet their replicas read the new
    clock, so the partition is named renewed (not changed) and the kept choice queued.
    Confirmations move the new clock in place; the choice lives while its replicas are fresh."""
    handler, table = _handler_and_table(NODES)
    _cluster(table, NODES, 8, 0, T - 500)
    snapshot = _swap(table, handler, T)
    first = _cache(handler, snapshot, T)
    for node_id in NODES:
        _node_read(table, node_id, T - 500, T + 50)  # same reports, hosting stamped later
    snapshot = _swap(table, handler, T + 100)
    assert P in snapshot.renewed.get("s", ())
    assert P not in (snapshot.changed or {}).get("s", ())
    assert handler._choices["s"][P] is first
    assert handler._queued.get(("s", P)) is first, "queued: it reads a replaced clock"
    _confirm_in_place(table, NODES, 1_000, T + 600)
    assert table.clocks_moved_in_place >= len(NODES)
    for at in range(T + 700, T + 2_700, 100):
        _due(handler, at)
    row = handler.snapshot.stores["s"].replicas[P]
    assert min(r.reported_at_ms for r in row) == T + 500, "fresh until T + 3,501"
    budget: LagBudget = handler.policy.budget
    fresh = choose_replicas(row, budget, now_ms=T + 2_600, stale_after_ms=STALE_MS)
    assert [r.node_id for r in fresh.candidates] == _names(first)
    cached = handler._choices["s"][P]
    assert cached is not None
    assert cached.live(T + 2_600), "expired reading the replaced clock, replicas fresh"
