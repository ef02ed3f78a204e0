"""Review of the per-node report clocks (issue 22): updates that land between two steps of a
rebuild (the watcher yields there), and a clock moved back when it is replaced.

Each test states the invariant it checks: a cached choice is what `choose_replicas` gives on
the current rows until it expires unless the snapshot named its partition changed, and rows
show the times the reports say (moved only by confirmations the watcher applied)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from unittest.mock import patch

from common.contract import (
    Assignment,
    Hosting,
    NodeInfo,
    PartitionAssignment,
    PartitionReport,
    StoreInfo,
)
from proxy.choice import LagBudget, choice_expires_at, choose_replicas
from proxy.routing import STEP_PARTITIONS, ChoiceStability, TableBuilder
from tests.proxy.test_review2_renew import _handler_with

NOW = 7_000_000
STALE_MS = 3_000
BUDGET = LagBudget(5, 1_000)
STABILITY = ChoiceStability(BUDGET, "reject", STALE_MS)


def _info(node_id: str) -> NodeInfo:
    return NodeInfo(node_id, f"http://10.0.0.{ord(node_id)}:8080", 0)


def _hosting(
    node_id: str, active: range | tuple[int, ...], standby: tuple[int, ...] = ()
) -> Hosting:
    return Hosting(node_id, 1, {"s": {"active": tuple(active), "standby": standby}}, NOW)


def _reports(
    partitions: range | tuple[int, ...], reported_at: int, position: int = 100
) -> dict[tuple[str, int], PartitionReport]:
    """Lag 0 and no caught-up time: only the report's age decides its standing."""
    return {
        ("s", p): PartitionReport(position, position, None, None, reported_at) for p in partitions
    }


def _drain(steps: Iterator[int]) -> None:
    for _ in steps:
        pass


def _choose(row: tuple, now: int):  # type: ignore[no-untyped-def, type-arg]
    return choose_replicas(row, BUDGET, now_ms=now, stale_after_ms=STALE_MS)


def test_a_shift_right_after_a_set_node_that_landed_mid_rebuild_moves_served_rows_unseen():
    """set_node lands between two steps of a full rebuild: the rest of that rebuild builds the
    node's rows on its new clock, and those rows are served. The node is then in `_rows_behind`,
    so the next confirmation moves that clock in place with no check: a stale replica in the
    served rows becomes fresh. The next rebuild recomputes those rows on the same clock, finds
    them equal to what is served (values read now) and names nothing, so the choice cached
    from them (the replica refused, "lag report too old") is kept for a minute."""
    partitions = STEP_PARTITIONS + 8
    table = TableBuilder(STABILITY)
    table.set_stores({"s": StoreInfo("s", "t", partitions)})
    table.set_assignment(
        Assignment(1, "a", 0, {"s": {p: PartitionAssignment("a", ()) for p in range(partitions)}})
    )
    table.set_alive({"a"})
    stale = NOW - STALE_MS - 500  # stale now; fresh again 1,000 ms later
    table.set_node(
        "a", _info("a"), _hosting("a", range(partitions)), _reports(range(partitions), stale)
    )
    steps = table.rebuild(NOW)
    next(steps)  # the first STEP_PARTITIONS partitions, then the watcher yields
    # A node read (same times, the store moved on) lands while the rebuild is paused.
    table.set_node(
        "a", _info("a"), _hosting("a", range(partitions)), _reports(range(partitions), stale, 101)
    )
    _drain(steps)
    served = table.snapshot(NOW)
    last = partitions - 1  # built after the set_node, on its new clock
    cached = _choose(served.stores["s"].replicas[last], NOW)
    expires = choice_expires_at(
        served.stores["s"].replicas[last], BUDGET, now_ms=NOW, stale_after_ms=STALE_MS
    )
    assert cached.candidates == ()
    assert expires > NOW + 1_000

    table.shift_node("a", 1_000, _hosting("a", range(partitions)), NOW)  # a confirmation
    _drain(table.rebuild(NOW))
    after = table.snapshot(NOW)
    named_changed = last in (after.changed or {}).get("s", frozenset())
    now_choice = _choose(after.stores["s"].replicas[last], NOW)
    assert named_changed or now_choice == cached, (
        "a cached choice outlives a change of its rows no snapshot named: "
        f"cached {cached}, rows now give {now_choice}"
    )


def test_a_set_node_mid_rebuild_puts_old_report_times_on_the_new_clock():
    """A shift that failed the checks moved node a to a new clock (shift -300) and queued its
    rows for `_move_times`; a set_node for a lands after the rebuild's first step (the touched
    partitions of another node). `_move_times` then puts a's old replicas (their times as first
    given) on the set_node's fresh clock (shift 0): the served rows show a 300 ms later than
    any report now says, here fresh instead of stale."""
    table = TableBuilder(STABILITY)
    table.set_stores({"s": StoreInfo("s", "t", 6)})
    placed = {p: PartitionAssignment("a", ()) for p in range(3)}
    placed |= {p: PartitionAssignment("c", ()) for p in range(3, 6)}
    table.set_assignment(Assignment(1, "a", 0, {"s": placed}))
    table.set_alive({"a", "c"})
    given = NOW - STALE_MS + 100  # fresh now; 300 ms earlier it is stale
    table.set_node("a", _info("a"), _hosting("a", range(3)), _reports(range(3), given))
    table.set_node("c", _info("c"), _hosting("c", range(3, 6)), _reports(range(3, 6), NOW))
    _drain(table.rebuild(NOW))
    table.snapshot(NOW)

    table.shift_node("a", -300, _hosting("a", range(3)), NOW)  # later times would not do: rebuilt
    truth = given - 300
    assert table.report_fields("a")[("s", 0)][2] == truth
    table.set_node("c", _info("c"), _hosting("c", range(3, 6)), _reports(range(3, 6), NOW, 101))
    steps = table.rebuild(NOW)
    next(steps)  # c's touched partitions; a's moved ones come after the watcher yields
    table.set_node("a", _info("a"), _hosting("a", range(3)), _reports(range(3), truth, 101))
    _drain(steps)
    served = table.snapshot(NOW)
    replica = served.stores["s"].replicas[0][0]
    assert replica.reported_at_ms == truth, (
        f"the served row says a reported at {replica.reported_at_ms}, every report says {truth}"
    )


def test_a_replaced_clock_does_not_move_the_served_rows_back():
    """A confirmation moved a's clock in place (no row touched, the served rows read the later
    times at once, and requests cache choices from them). A node read for a then replaces
    the clock, and `_retire_clock` rolls the old one back: the rows being served show earlier
    times again, though no confirmation said so, until the next rebuild swaps them out."""
    table = TableBuilder(STABILITY)
    table.set_stores({"s": StoreInfo("s", "t", 2)})
    table.set_assignment(
        Assignment(1, "a", 0, {"s": {p: PartitionAssignment("a", ("b",)) for p in range(2)}})
    )
    table.set_alive({"a", "b"})
    table.set_node("a", _info("a"), _hosting("a", range(2)), _reports(range(2), NOW - 100))
    table.set_node("b", _info("b"), _hosting("b", (), (0, 1)), _reports(range(2), NOW - 100))
    _drain(table.rebuild(NOW))
    served = table.snapshot(NOW)
    replica = served.stores["s"].replicas[0][0]
    assert replica.node_id == "a"

    table.shift_node("a", 700, _hosting("a", range(2)), NOW + 700)
    seen = replica.reported_at_ms
    assert seen == NOW + 600, "moved in place, as the change intends"
    # A node read: same times as now held, one position moved on.
    table.set_node("a", _info("a"), _hosting("a", range(2)), _reports(range(2), NOW + 600, 101))
    assert replica.reported_at_ms >= seen, (
        f"the served replica's report went back from {seen} to {replica.reported_at_ms}"
    )


def test_the_request_path_keeps_the_refusal_after_the_unchecked_move():
    """The first test through the handler: the choice `_choice` caches from the snapshot
    served after the paused rebuild is still in use after the next swap (nothing named its
    partition changed), refusing the replica every current row shows fresh."""
    asyncio.run(_request_path_keeps_the_refusal())  # the upstream pool wants a running loop


async def _request_path_keeps_the_refusal() -> None:
    handler = _handler_with(BUDGET)
    partitions = STEP_PARTITIONS + 8
    table = TableBuilder(handler.choice_stability)
    table.set_stores({"s": StoreInfo("s", "t", partitions)})
    table.set_assignment(
        Assignment(1, "a", 0, {"s": {p: PartitionAssignment("a", ()) for p in range(partitions)}})
    )
    table.set_alive({"a"})
    stale = NOW - STALE_MS - 500
    hosting = _hosting("a", range(partitions))
    table.set_node("a", _info("a"), hosting, _reports(range(partitions), stale))
    last = partitions - 1
    with patch("proxy.handler.now_ms", lambda: NOW):
        steps = table.rebuild(NOW)
        next(steps)
        table.set_node("a", _info("a"), hosting, _reports(range(partitions), stale, 101))
        _drain(steps)
        snapshot = table.snapshot(NOW)
        handler.use_snapshot(snapshot)
        handler._choice(snapshot.stores["s"], "s", last, None)

        table.shift_node("a", 1_000, hosting, NOW)
        _drain(table.rebuild(NOW))
        snapshot = table.snapshot(NOW)
        handler.use_snapshot(snapshot)
        for name, renewed in snapshot.renewed.items():
            handler.renew_choices(snapshot, name, sorted(renewed))
    cached = handler._choices["s"][last]
    if cached is None or cached.expires_ms <= NOW:
        return  # dropped (its partition named changed) or expired: nothing served from it
    fresh = _choose(snapshot.stores["s"].replicas[last], NOW)
    assert [r.node_id for r in cached.choice.candidates] == [r.node_id for r in fresh.candidates]


def test_a_shift_during_a_full_rebuild_reorders_the_rows_still_served():
    """A full rebuild (a new assignment) starts over `_placed_on` and fills it step by step,
    while the previous snapshot is still served, its rows reading the same clocks. A shift
    landing after the first step checks the order only in the rows rebuilt so far: b, placed
    only further on, passes with no row looked at, its clock moves in place, and in the rows
    being served b, a standby behind the alike standby c, now sorts before it: the cached
    choice (c then b) is not what those rows give until the swap."""
    partitions = STEP_PARTITIONS + 8
    table = TableBuilder(STABILITY)
    table.set_stores({"s": StoreInfo("s", "t", partitions)})
    placed = {p: PartitionAssignment("a", ()) for p in range(STEP_PARTITIONS)}
    placed |= {p: PartitionAssignment("a", ("b", "c")) for p in range(STEP_PARTITIONS, partitions)}
    table.set_assignment(Assignment(1, "a", 0, {"s": placed}))
    table.set_alive({"a", "b", "c"})
    later = tuple(range(STEP_PARTITIONS, partitions))
    table.set_node(
        "a", _info("a"), _hosting("a", range(partitions)), _reports(range(partitions), NOW)
    )
    for node_id, caught_up in (("b", NOW - 800), ("c", NOW - 500)):
        reports = {("s", p): PartitionReport(100, 100, None, caught_up, NOW) for p in later}
        table.set_node(node_id, _info(node_id), _hosting(node_id, (), later), reports)
    _drain(table.rebuild(NOW))
    served = table.snapshot(NOW)
    row = served.stores["s"].replicas[partitions - 1]
    cached = _choose(row, NOW)
    assert [r.node_id for r in cached.candidates] == ["a", "c", "b"]

    table.set_assignment(Assignment(2, "a", 0, {"s": placed}))  # a rebalance: rebuilt whole
    steps = table.rebuild(NOW)
    next(steps)  # p0..p31 rebuilt; the snapshot above is still the one served
    table.shift_node("b", 400, _hosting("b", (), later), NOW)
    now_choice = _choose(row, NOW)
    assert [r.node_id for r in now_choice.candidates] == [r.node_id for r in cached.candidates], (
        "the served rows reorder under a cached choice before any swap"
    )
