"""The watcher's sweep applies a confirmation of the body it applied last (the steady state)
as a shift of the node's times (`TableBuilder.shift_node`): the table it gives is exactly the
one applying the body whole gives, whatever came in between (new bodies, equal or not, node
reads, times from the future, times going back)."""

from __future__ import annotations

import redis.asyncio as aioredis
from hypothesis import given, settings
from hypothesis import strategies as st

from common.clock import CLOCK_TOLERANCE_MS, SharedClock
from common.contract import (
    Assignment,
    Hosting,
    Keys,
    NodeInfo,
    NodeReport,
    PartitionAssignment,
    PartitionReport,
    StoreInfo,
    encode,
    lag_field,
)
from proxy.choice import LagBudget
from proxy.routing import ChoiceStability, RoutingSnapshot
from proxy.watcher import TableWatcher
from tests.proxy.test_routing_shift import (
    _judged_at_one_moment,  # noqa: F401 (a fixture: the shifts here are compared alike)
    assert_names_at_least_as_much,
    clocks_of,
    in_place_partitions,
    kept_clocks,
)

NODE_IDS = ("a", "b")
PARTITIONS = 4


NOW = 9_000_000
STABILITY = ChoiceStability(LagBudget(5, 1_000), "reject", 3_000)

entries = st.lists(
    st.one_of(
        st.none(),
        st.tuples(
            st.one_of(st.none(), st.integers(0, 9)),  # lag
            st.one_of(st.none(), st.integers(-2 * CLOCK_TOLERANCE_MS, 4_000)),  # caught up ago
            st.none(),
        ),
    ),
    min_size=PARTITIONS,
    max_size=PARTITIONS,
)
actions = st.one_of(
    # A sweep's confirmation: at_ms moves (back now and then), the proxy's clock too.
    st.tuples(st.just("confirm"), st.sampled_from(NODE_IDS), st.integers(-200, 1_500)),
    # A sweep's confirmation stamped ahead of the proxy's clock (a writer's clock ahead).
    st.tuples(st.just("ahead"), st.sampled_from(NODE_IDS), st.integers(0, 2 * CLOCK_TOLERANCE_MS)),
    st.tuples(st.just("body"), st.sampled_from(NODE_IDS), entries),  # a new body read
    st.tuples(st.just("same body"), st.sampled_from(NODE_IDS)),  # an equal one, a new object
    st.tuples(st.just("node read"), st.sampled_from(NODE_IDS), st.integers(0, 50)),
)


class FixedClock(SharedClock):
    """The proxy's clock at a moment the test sets (`at`)."""

    def __init__(self) -> None:
        super().__init__()
        self.at = NOW

    def now_ms(self) -> int:
        return self.at


class Watched:
    """A watcher fed by hand (no Redis round trip is made): what its sweep and node reads
    would apply."""

    def __init__(self, *, fast: bool) -> None:
        self.fast = fast
        self.watcher = TableWatcher(
            aioredis.Redis(),  # never connected: nothing here reads Redis
            Keys("shift"),
            refresh_interval_ms=1_000,
            networks=None,
            clock=(clock := FixedClock()),
        )
        self.clock = clock
        self.watcher.keep_choices(STABILITY, lambda _snapshot, _store, _parts: None)
        table = self.watcher._table
        table.set_stores({"s": StoreInfo("s", "t", PARTITIONS)})
        placed = dict.fromkeys(range(PARTITIONS), PartitionAssignment("a", ("b",)))
        table.set_assignment(Assignment(1, "a", 0, {"s": placed}))
        table.set_alive(set(NODE_IDS))

    def node_read(self, node_id: str, end: int, at: int) -> None:
        """What `_apply_node` makes of a node read: new info and end offsets."""
        roles = _roles(node_id)
        raw_lag = {
            lag_field("s", p): encode(PartitionReport(end, end + 1, None, at - 10, at))
            for p in range(PARTITIONS)
        }
        self.watcher._apply_node(
            node_id,
            encode(NodeInfo(node_id, f"http://10.0.0.1:{8000 + NODE_IDS.index(node_id)}", 0)),
            encode(Hosting(node_id, 1, {"s": roles}, at)),
            raw_lag,
            at,
        )

    def confirm(self, node_id: str, body: NodeReport, at_ms: int, at: int) -> None:
        if not self.fast:
            self.watcher._applied.clear()  # every body applied whole
        self.clock.at = max(self.clock.at, at)
        self.watcher._apply_report(node_id, body, at_ms, at)

    def snapshot(self, now: int) -> RoutingSnapshot:
        table = self.watcher._table
        for _ in table.rebuild(now):
            pass
        return table.snapshot(now)


def _roles(node_id: str) -> dict[str, tuple[int, ...]]:
    everything = tuple(range(PARTITIONS))
    return (
        {"active": everything, "standby": ()}
        if node_id == "a"
        else {
            "active": (),
            "standby": everything,
        }
    )


def _body(node_id: str, lags: list[tuple[int | None, int | None, None] | None]) -> NodeReport:
    return NodeReport(node_id, 1, 1, {"s": _roles(node_id)}, {"s": tuple(lags)})


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(actions, min_size=1, max_size=6), min_size=1, max_size=6))
def test_a_confirmation_applied_as_a_shift_gives_the_table_a_whole_body_gives(batches):
    fast, slow = Watched(fast=True), Watched(fast=False)
    steady = [(0, 5, None)] * PARTITIONS
    bodies = {node_id: _body(node_id, steady) for node_id in NODE_IDS}
    at_ms = dict.fromkeys(NODE_IDS, NOW)
    now = NOW
    for watched in (fast, slow):
        for node_id in NODE_IDS:
            watched.node_read(node_id, 100, now)
            watched.confirm(node_id, bodies[node_id], now, now)
        watched.snapshot(now)
    for batch in batches:
        # One moment for the whole batch: the shift judges what later times change as of its
        # moment, the whole apply at the rebuild's, so the two must be the same to agree (a
        # later rebuild may call "changed" a partition whose cached choice expired meanwhile).
        now += sum(max(action[2], 0) for action in batch if action[0] == "confirm")
        clocks = clocks_of(fast.watcher._table)
        confirmed = {action[1] for action in batch if action[0] in ("confirm", "ahead")}
        for action in batch:
            kind, node_id = action[0], action[1]
            if kind in ("confirm", "ahead"):
                at_ms[node_id] = (
                    at_ms[node_id] + action[2] if kind == "confirm" else now + action[2]
                )
            elif kind == "body":
                bodies[node_id] = _body(node_id, action[2])
                continue
            elif kind == "same body":
                body = bodies[node_id]
                bodies[node_id] = NodeReport(
                    body.node_id, body.generation, body.version, body.stores, body.lags
                )
                continue
            else:
                for watched in (fast, slow):
                    watched.node_read(node_id, 100 + action[2], now)
                continue
            for watched in (fast, slow):
                watched.confirm(node_id, bodies[node_id], at_ms[node_id], now)
        fast_table = fast.watcher._table
        # A confirmation that keeps a node's clock (moved in place, or by 0) names nothing,
        # where the whole apply replaces the clock and names the node's equal rows renewed.
        kept = kept_clocks(fast_table, clocks) & confirmed
        in_place = in_place_partitions(fast_table, kept)
        built, expected = fast.snapshot(now), slow.snapshot(now)
        assert built.stores["s"].replicas == expected.stores["s"].replicas
        assert_names_at_least_as_much(built, expected, in_place)
        fast_table, slow_table = fast.watcher._table, slow.watcher._table
        assert {n: fast_table.report_fields(n) for n in fast_table.reports} == {
            n: slow_table.report_fields(n) for n in slow_table.reports
        }


def test_a_steady_confirmation_takes_the_shift():
    """The case the shift is for: the same body confirmed later moves every time, and the
    table holds exactly the times a whole apply gives. (200 ms later: judged two clock steps
    ahead, `judging_moment`, the caught-up time 5 ms before stays inside the 1 s budget.)"""
    watched = Watched(fast=True)
    body = _body("a", [(0, 5, None)] * PARTITIONS)
    watched.node_read("a", 100, NOW)
    watched.confirm("a", body, NOW, NOW)
    table = watched.watcher._table
    held, before = table.reports["a"], watched.snapshot(NOW).stores["s"].replicas
    watched.confirm("a", body, NOW + 200, NOW + 200)
    assert watched.watcher._applied["a"].fields is table.reports["a"] is held
    assert table.report_fields("a")[("s", 0)] == (0, NOW + 195, NOW + 200, 101)  # end - lag
    # Nothing that moving the times could change: its clock moved, no row was rebuilt.
    after = watched.snapshot(NOW + 200).stores["s"].replicas
    assert all(a is b for a, b in zip(after, before, strict=True))
    assert after[0][0].times == (NOW + 195, NOW + 200)


def test_a_confirmation_is_judged_as_of_the_clock_not_the_sweeps_earlier_at():
    """The sweep's `at` is taken before its reports are applied, with yields to requests in
    between: the shift is judged as of the proxy's clock when it is applied. Here a's report
    (stamped NOW) is fresh at `at` but stale on the clock: no clock moves in place (the rows
    are rebuilt and compared), whatever `at` says."""
    watched = Watched(fast=True)
    body = _body("a", [(0, 5, None)] * PARTITIONS)
    watched.node_read("a", 100, NOW)
    watched.confirm("a", body, NOW, NOW)
    table = watched.watcher._table
    before = watched.snapshot(NOW).stores["s"].replicas
    watched.clock.at = NOW + 3_500  # requests since saw a's report 3.5 s old: stale
    watched.confirm("a", body, NOW + 700, NOW + 700)
    assert not table.clocks_moved_in_place, "judged as of `at` (a fresh), not the clock (a stale)"
    after = watched.snapshot(NOW + 3_500).stores["s"].replicas
    assert all(a is not b for a, b in zip(after, before, strict=True))
