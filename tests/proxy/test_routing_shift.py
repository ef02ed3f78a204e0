"""A node confirming its unchanged report later (`TableBuilder.shift_node`, the steady state)
gives exactly what `set_node` with the same reports, every time moved, gives: the same rows,
the same partitions named changed and renewed, after any mix of other updates. A confirmation
that moves the node's clock in place names nothing: its partitions' rows read the moved times
at once, and so do the request path's cached choices (their expiry, `Cached.live`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from unittest.mock import patch

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from common.contract import (
    Assignment,
    Hosting,
    NodeInfo,
    PartitionAssignment,
    PartitionReport,
    StoreInfo,
)
from proxy.choice import LagBudget
from proxy.routing import ChoiceStability, RoutingSnapshot, TableBuilder

NODE_IDS = ("a", "b", "c")
PARTITIONS = 6
NOW = 7_000_000
STALE_MS = 3_000
# A small budget and stale time, and times around them: moving a report's times can make it
# fresh again or bring it back inside the time budget (a changed choice), or not (renewed).
STABILITY = ChoiceStability(LagBudget(5, 1_000), "reject", STALE_MS)


@pytest.fixture(autouse=True, scope="module")
def _judged_at_one_moment() -> Iterator[None]:
    """A rebuild also judges its rows a while ahead (`JUDGED_AHEAD_MS`: requests read the old
    rows until its swap), a clock moved in place at once; the shift and the whole apply are
    compared judged at the same moment (tests/proxy/test_choice_made_during_rebuild.py covers
    the look-ahead)."""
    with patch("proxy.routing.JUDGED_AHEAD_MS", 0):
        yield


placements = st.builds(
    PartitionAssignment,
    st.sampled_from((None, *NODE_IDS)),
    st.lists(st.sampled_from(NODE_IDS), max_size=2, unique=True).map(tuple),
)
times = st.integers(-5_000, 500)  # relative to the moment of the update
lag_reports = st.dictionaries(
    st.integers(0, PARTITIONS - 1),
    st.tuples(st.integers(0, 9), st.one_of(st.none(), times), times),  # lag, caught up, at
    max_size=PARTITIONS,
)
updates = st.one_of(
    st.tuples(
        st.just("node"),
        st.sampled_from(NODE_IDS),
        st.sets(st.integers(0, PARTITIONS - 1)),  # active partitions it says it serves
        st.sets(st.integers(0, PARTITIONS - 1)),  # standby ones
        lag_reports,
        st.integers(1, 3),  # port: a URL change now and then
    ),
    st.tuples(st.just("shift"), st.sampled_from(NODE_IDS), st.integers(-300, 3_000)),
    st.tuples(st.just("shift"), st.sampled_from(NODE_IDS), st.just(0)),
    st.tuples(st.just("alive"), st.sets(st.sampled_from(NODE_IDS))),
    st.tuples(st.just("forget"), st.sampled_from(NODE_IDS)),
    st.tuples(st.just("assignment"), st.integers(1, 3), st.lists(placements, max_size=6)),
)


def _as_report(fields: tuple[int | None, int | None, int | None, int | None]) -> PartitionReport:
    """The PartitionReport a builder turns into these fields (lag, caught up, at, position)."""
    lag, caught_up, reported, position = fields
    assert position is not None
    assert reported is not None
    return PartitionReport(
        position, None if lag is None else position + lag, None, caught_up, reported
    )


class Pair:
    """Two builders given the same updates, but shifts: `fast` takes `shift_node`, `slow` the
    same reports moved, through `set_node`."""

    def __init__(self) -> None:
        self.fast = TableBuilder(STABILITY)
        self.slow = TableBuilder(STABILITY)
        self.in_place: set[str] = set()  # nodes whose clock moved in place since the snapshots
        self.kept: set[str] = set()  # nodes whose clock a shift kept (moved or not) since then
        for table in (self.fast, self.slow):
            table.set_stores({"s": StoreInfo("s", "t", PARTITIONS)})
            table.set_alive(set(NODE_IDS))

    def both(self) -> tuple[TableBuilder, TableBuilder]:
        return self.fast, self.slow

    def apply(self, update: tuple, at: int) -> None:  # type: ignore[type-arg]
        kind = update[0]
        if kind == "node":
            _, node_id, active, standby, lags, port = update
            info = NodeInfo(node_id, f"http://10.0.0.{NODE_IDS.index(node_id)}:{port}", 0)
            stores = {"s": {"active": tuple(sorted(active)), "standby": tuple(sorted(standby))}}
            reports = {
                ("s", p): PartitionReport(
                    100, 100 + lag, None, None if cu is None else at + cu, at + reported
                )
                for p, (lag, cu, reported) in lags.items()
            }
            for table in self.both():
                table.set_node(node_id, info, Hosting(node_id, 1, stores, at), reports)
        elif kind == "shift":
            self._shift(update[1], update[2], at)
        elif kind == "alive":
            for table in self.both():
                table.set_alive(update[1])
        elif kind == "forget":
            for table in self.both():
                table.forget_node(update[1])
        else:
            _, generation, placed = update
            assignment = Assignment(generation, "a", 0, {"s": dict(enumerate(placed))})
            for table in self.both():
                table.set_assignment(assignment)

    def _shift(self, node_id: str, delta: int, at: int) -> None:
        slow = self.slow
        hosting, info = slow.hostings.get(node_id), slow.nodes.get(node_id)
        if hosting is None or info is None or node_id not in slow.reports:
            return  # nothing confirmed: the watcher shifts only what a body gave
        confirmed = replace(hosting, updated_at_ms=at)
        moved = {
            where: _as_report(
                (
                    lag,
                    None if cu is None else cu + delta,
                    None if rep is None else rep + delta,
                    position,
                )
            )
            for where, (lag, cu, rep, position) in slow.report_fields(node_id).items()
        }
        slow.set_node(node_id, info, confirmed, moved)
        clock = self.fast._clocks.get(node_id)
        held = self.fast.shift_node(node_id, delta, confirmed, at)
        assert held is self.fast.reports[node_id]
        if clock is not None and self.fast._clocks.get(node_id) is clock:
            # Kept (moved in place, or not moved at all): the whole apply replaces the clock
            # and names the node's equal rows renewed; the shift's rows read the same clock.
            self.kept.add(node_id)
            if delta:
                self.in_place.add(node_id)

    def in_place_partitions(self) -> set[tuple[str, int]]:
        return in_place_partitions(self.fast, self.in_place)

    def kept_partitions(self) -> set[tuple[str, int]]:
        return in_place_partitions(self.fast, self.kept)

    def snapshots(self, now: int) -> tuple[RoutingSnapshot, RoutingSnapshot]:
        self.in_place, self.kept = set(), set()
        built = []
        for table in self.both():
            for _ in table.rebuild(now):
                pass
            built.append(table.snapshot(now))
        return built[0], built[1]

    def rows(self) -> list[object]:
        return [list(rows) for rows in self.fast._rows.values()]


@settings(max_examples=400, deadline=None)
@given(
    st.lists(
        st.tuples(st.lists(updates, min_size=1, max_size=5), st.integers(0, 2_000)),
        min_size=1,
        max_size=8,
    )
)
@example(  # found by CI: a shift by 0 keeps the clock, the whole apply replaces it
    [
        (
            [
                ("node", "a", set(), set(), {}, 1),
                ("assignment", 1, [PartitionAssignment(None, ("c",))]),
                ("node", "c", set(), {0}, {0: (0, None, 0)}, 1),
            ],
            0,
        ),
        ([("shift", "c", 0)], 1),
    ]
)
def test_a_shift_gives_what_the_same_reports_moved_give(batches):
    pair = Pair()
    pair.apply(("assignment", 1, [PartitionAssignment("a", ("b",))] * PARTITIONS), NOW)
    now = NOW
    for batch, elapsed in batches:
        now += elapsed
        for update in batch:
            pair.apply(update, now)
        before, pending = pair.rows(), pair.fast.pending
        in_place, kept = pair.in_place_partitions(), pair.kept_partitions()
        fast, slow = pair.snapshots(now)
        # The watcher rebuilds only a pending table: a shift that moves a time must make it
        # so, unless it moved a clock in place (which needs no rebuild).
        assert pending or pair.rows() == before or in_place
        assert {n: r.replicas for n, r in fast.stores.items()} == {
            n: r.replicas for n, r in slow.stores.items()
        }
        assert_names_at_least_as_much(fast, slow, kept)
        assert fast.node_urls == slow.node_urls
        assert fast.alive == slow.alive
        assert {n: pair.fast.report_fields(n) for n in pair.fast.reports} == {
            n: pair.slow.report_fields(n) for n in pair.slow.reports
        }
        assert pair.fast.hostings == pair.slow.hostings


def in_place_partitions(table: TableBuilder, nodes: set[str]) -> set[tuple[str, int]]:
    """Where the rows hold a replica of one of `nodes` (whose clocks moved in place since the
    last snapshot): the whole apply names these renewed, the shift nothing."""
    return {
        (store, p)
        for store, rows in table._rows.items()
        for p, row in enumerate(rows)
        if any(r.node_id in nodes and r.has_times for r in row)
    }


def clocks_of(table: TableBuilder) -> dict[str, tuple[object, int]]:
    return {node_id: (clock, clock.shift_ms) for node_id, clock in table._clocks.items()}


def kept_clocks(table: TableBuilder, before: dict[str, tuple[object, int]]) -> set[str]:
    """The nodes whose clock is the same object as `before` (moved since or not)."""
    return {
        node_id
        for node_id, clock in table._clocks.items()
        if node_id in before and before[node_id][0] is clock
    }


def _named(parts: dict[str, frozenset[int]] | None) -> set[tuple[str, int]]:
    assert parts is not None
    return {(store, p) for store, ps in parts.items() for p in ps}


def assert_names_at_least_as_much(
    fast: RoutingSnapshot, slow: RoutingSnapshot, in_place: set[tuple[str, int]] = frozenset()
) -> None:
    """The shift names what the whole apply names, or more cautiously: every partition the
    whole apply names changed it names changed, and it names renewed only what the whole
    apply names renewed, except partitions `in_place` (holding a replica whose clock a shift
    kept, moved in place or not moved at all: their rows and cached choices read it, nothing
    to renew, where the whole apply replaced the clock and names equal rows renewed). (A
    clock moved in place is compared later from its moved times, not the times the last
    rebuild left: a report older than those then reads as a change.)"""
    if fast.changed is None or slow.changed is None:
        assert fast.changed is slow.changed is None
        return
    assert _named(slow.changed) <= _named(fast.changed)
    assert _named(fast.renewed) <= _named(slow.renewed)
    assert _named(slow.renewed) <= _named(fast.renewed) | _named(fast.changed) | in_place


def _steady_pair() -> Pair:
    pair = Pair()
    pair.apply(("assignment", 1, [PartitionAssignment("a", ("b",))] * PARTITIONS), NOW)
    for node_id in ("a", "b"):
        lags = {p: (0, -5, 0) for p in range(PARTITIONS)}
        everything = set(range(PARTITIONS))
        active, standby = (everything, set()) if node_id == "a" else (set(), everything)
        pair.apply(("node", node_id, active, standby, lags, 1), NOW)
    pair.snapshots(NOW)
    return pair


def test_a_shift_in_place_names_nothing_and_moves_every_row_of_the_node():
    pair = _steady_pair()
    before = pair.fast.snapshot(NOW).stores["s"].replicas
    pair.apply(("shift", "a", 700), NOW + 700)
    assert pair.in_place == {"a"}
    assert pair.fast.clocks_moved_in_place == 1
    assert not pair.fast.pending, "nothing to rebuild: the rows read the clock"
    after = pair.fast._rows["s"]
    for p in range(PARTITIONS):
        active, standby = after[p]
        assert active is before[p][0], "no row rebuilt"
        assert standby is before[p][1], "no row rebuilt"
        assert (active.reported_at_ms, active.caught_up_at_ms) == (NOW + 700, NOW + 695)
    fast, slow = pair.snapshots(NOW + 700)
    assert fast.changed == slow.changed == {}
    assert fast.renewed == {}
    assert slow.renewed == {"s": frozenset(range(PARTITIONS))}, "the whole apply renews"


def test_a_shift_on_the_rebuild_path_renews_every_partition_and_keeps_the_other_replicas():
    pair = _steady_pair()
    pair.fast.withhold()  # rows not served: no clock moves in place
    before = pair.fast.snapshot(NOW).stores["s"].replicas
    pair.fast.withhold()
    pair.apply(("shift", "a", 700), NOW + 700)
    assert not pair.in_place
    assert pair.fast.pending
    fast, slow = pair.snapshots(NOW + 700)
    assert fast.changed == slow.changed == {}
    assert fast.renewed == slow.renewed == {"s": frozenset(range(PARTITIONS))}
    after = fast.stores["s"].replicas
    for p in range(PARTITIONS):
        active, standby = after[p]
        assert (active.reported_at_ms, active.caught_up_at_ms) == (NOW + 700, NOW + 695)
        assert standby is before[p][1], "the standby's replica is kept, not rebuilt"


def test_a_shift_that_makes_a_stale_report_fresh_changes_the_choice():
    pair = _steady_pair()
    pair.apply(("shift", "a", -STALE_MS - 1), NOW)  # a's reports now too old to count
    pair.snapshots(NOW)
    pair.apply(("shift", "a", STALE_MS + 1), NOW)
    fast, slow = pair.snapshots(NOW)
    assert fast.changed == slow.changed == {"s": frozenset(range(PARTITIONS))}
    assert fast.renewed == slow.renewed == {}


def test_a_shift_of_what_the_table_does_not_hold_is_refused():
    pair = _steady_pair()
    with pytest.raises(ValueError, match="not the hosting"):
        pair.fast.shift_node("c", 10, Hosting("c", 1, {}, NOW))
    other = Hosting("a", 1, {"s": {"active": (0,), "standby": ()}}, NOW)
    with pytest.raises(ValueError, match="not the hosting"):
        pair.fast.shift_node("a", 10, other)


def test_clocks_moved_on_thousands_of_partitions_touch_no_row_and_name_nothing():
    """50 nodes on 100 partitions each confirm: their clocks move, no row is rebuilt and no
    partition named (the rows and cached choices read the clocks): nothing is left for a
    rebuild to do, at any size."""
    nodes, each = [f"n{i:02d}" for i in range(50)], 100
    partitions = len(nodes) * each
    table = TableBuilder(STABILITY)
    table.set_stores({"s": StoreInfo("s", "t", partitions)})
    placed = {p: PartitionAssignment(nodes[p // each], ()) for p in range(partitions)}
    table.set_assignment(Assignment(1, nodes[0], 0, {"s": placed}))
    table.set_alive(set(nodes))
    hostings = {}
    for i, node_id in enumerate(nodes):
        mine = range(i * each, (i + 1) * each)
        hostings[node_id] = Hosting(node_id, 1, {"s": {"active": tuple(mine)}}, NOW)
        reports = {("s", p): _as_report((0, NOW - 5, NOW, 100)) for p in mine}
        table.set_node(
            node_id, NodeInfo(node_id, "http://10.0.0.1:1", 0), hostings[node_id], reports
        )
    for _ in table.rebuild(NOW):
        pass
    before = table.snapshot(NOW).stores["s"].replicas
    for node_id in nodes:
        confirmed = replace(hostings[node_id], updated_at_ms=NOW + 100)
        table.shift_node(node_id, 100, confirmed, NOW + 100)
    assert table.clocks_moved_in_place == len(nodes)
    assert not table.pending
    assert list(table.rebuild(NOW + 100)) == []
    after = table.snapshot(NOW + 100)
    assert after.renewed == {}
    assert after.changed == {}
    assert all(a is b for a, b in zip(after.stores["s"].replicas, before, strict=True))
    assert after.stores["s"].replicas[0][0].times == (NOW + 95, NOW + 100)


def test_no_clock_moves_in_place_while_a_rebuild_runs_or_its_snapshot_is_withheld():
    """A moved clock moves the served rows' times at once, judged on the builder's rows: only
    when those are the rows served. Not during a rebuild (its yields let updates in), not
    while the caller holds the last snapshot back (it serves an older one)."""
    for withheld in (False, True):
        pair = _steady_pair()
        table = pair.fast
        hosting = table.hostings["a"]
        if withheld:
            table.withhold()
        else:
            table.set_node("b", table.nodes["b"], table.hostings["b"], {})  # something to do
            steps = table.rebuild(NOW)
            next(steps)
        table.shift_node("a", 100, replace(hosting, updated_at_ms=NOW + 100), NOW + 100)
        assert not table.clocks_moved_in_place, "moved in place though the rows are not served"
        assert "a" in table._shifted
        table.snapshot(NOW + 100) if withheld else list(steps)


def test_a_shift_and_its_reverse_on_the_rebuild_path_name_the_node_partitions_renewed():
    """Moved back to where they were, the rows are equal to the last snapshot's but sit on
    the node's new clock: the choices kept from that snapshot read the replaced clock, which
    nothing moves any more, so they are named renewed (else they expire early)."""
    pair = _steady_pair()
    pair.fast.withhold()  # rows not served: no clock moves in place
    clock = pair.fast._clocks["a"]
    pair.apply(("shift", "a", 500), NOW + 500)
    pair.apply(("shift", "a", -500), NOW + 500)
    assert pair.fast._clocks["a"] is not clock
    fast, slow = pair.snapshots(NOW + 500)
    assert fast.changed == slow.changed == {}
    assert fast.renewed == slow.renewed == {"s": frozenset(range(PARTITIONS))}
