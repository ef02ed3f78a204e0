"""The proxy's mirror of a table built in another process (proxy.table_feed) serves what the
builder serves: after any mix of updates, each snapshot the mirror makes from the encoder's
messages (pickled, as they cross the socket) has the builder's rows, as they read now (clocks
moved in place included, also between snapshots), the same partitions named changed and
renewed, and, for what did not change, the same objects as its own last snapshot (the
request path compares `node_urls` by identity; unchanged rows are not sent again)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.contract import PartitionAssignment, StoreInfo
from proxy.choice import Replica, ReportClock
from proxy.routing import RoutingSnapshot, TableBuilder
from proxy.table_feed import ClockMessage, FeedEncoder, FeedMirror, dumps, loads
from tests.proxy.test_routing_shift import NOW, PARTITIONS, Pair, updates


class Fed:
    """A builder (`Pair.fast`, given updates as the watcher gives them), its encoder, and a
    mirror fed through pickled messages."""

    def __init__(self) -> None:
        self.pair = Pair()
        self.table: TableBuilder = self.pair.fast
        self.table.recording_moves = True  # as the table process's builder does
        self.encoder = FeedEncoder()
        self.mirror = FeedMirror()
        self.served: RoutingSnapshot | None = None  # the builder's last snapshot
        self.messages = 0

    def publish(self, now: int) -> tuple[RoutingSnapshot, RoutingSnapshot]:
        table = self.table
        for _ in table.rebuild(now):
            pass
        snapshot = table.snapshot(now)
        table.take_clocks_moved()  # as the table process does: the snapshot looks at all
        message = loads(dumps(self.encoder.snapshot(snapshot, table.clocks.values())))
        self.served = snapshot
        self.messages += 1
        return snapshot, self.mirror.apply(message)

    def flush(self) -> None:
        """What the table process sends after a step: the clocks the builder moved in place."""
        moved_clocks = self.encoder.moved_clocks(self.table.take_clocks_moved())
        moved = loads(dumps(ClockMessage(moved_clocks)))
        self.mirror.move_clocks(moved.clocks)


def _rows(snapshot: RoutingSnapshot) -> dict[str, tuple[tuple[Replica, ...], ...]]:
    return {name: route.replicas for name, route in snapshot.stores.items()}


def _served_now(fed: Fed) -> None:
    """The mirror's rows read what the builder's served rows read (values, times included)."""
    assert fed.served is not None
    assert _rows(fed.mirror.snapshot) == _rows(fed.served)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.lists(updates, min_size=1, max_size=5), st.integers(0, 2_000), st.booleans()),
        min_size=1,
        max_size=10,
    )
)
def test_the_mirror_serves_what_the_builder_serves(batches):
    fed = Fed()
    fed.pair.apply(("assignment", 1, [PartitionAssignment("a", ("b",))] * PARTITIONS), NOW)
    built, mirrored = fed.publish(NOW)
    assert mirrored.changed is None, "a new mirror's first snapshot forgets every choice"
    now = NOW
    for batch, elapsed, publish in batches:
        now += elapsed
        for update in batch:
            fed.pair.apply(update, now)
        if not publish:
            # Between snapshots only clocks move (in place): the served rows read them.
            fed.flush()
            _served_now(fed)
            continue
        before_built, before_mirrored = fed.served, fed.mirror.snapshot
        built, mirrored = fed.publish(now)
        assert _rows(mirrored) == _rows(built)
        assert mirrored.changed == built.changed
        assert mirrored.renewed == built.renewed
        assert mirrored.renewed_until_ms == built.renewed_until_ms
        assert (mirrored.generation, mirrored.built_at_ms) == (built.generation, built.built_at_ms)
        assert dict(mirrored.node_urls) == dict(built.node_urls)
        assert mirrored.alive == built.alive
        assert before_built is not None
        if built.node_urls is before_built.node_urls:
            assert mirrored.node_urls is before_mirrored.node_urls
        for name, route in built.stores.items():
            old = before_built.stores.get(name)
            if old is None or old.info != route.info:
                continue
            for p, row in enumerate(route.replicas):
                if row is old.replicas[p]:
                    assert (
                        mirrored.stores[name].replicas[p]
                        is before_mirrored.stores[name].replicas[p]
                    )


def _steady() -> Fed:
    fed = Fed()
    fed.pair.apply(("assignment", 1, [PartitionAssignment("a", ("b",))] * PARTITIONS), NOW)
    for node_id in ("a", "b"):
        lags = {p: (0, -5, 0) for p in range(PARTITIONS)}
        everything = set(range(PARTITIONS))
        active, standby = (everything, set()) if node_id == "a" else (set(), everything)
        fed.pair.apply(("node", node_id, active, standby, lags, 1), NOW)
    fed.publish(NOW)
    return fed


def test_a_clock_moved_in_place_moves_the_mirrors_rows_without_a_row_sent():
    fed = _steady()
    rows_before = fed.mirror.snapshot.stores["s"].replicas
    fed.pair.apply(("shift", "a", 700), NOW + 700)
    assert fed.pair.in_place == {"a"}, "the premise: the builder moved a's clock in place"
    moved = fed.encoder.moved_clocks(fed.table.take_clocks_moved())
    assert len(moved) == 1, "one clock moved: one number sent"
    assert fed.table.take_clocks_moved() == [], "each move is taken once"
    fed.mirror.move_clocks(moved)
    after = fed.mirror.snapshot.stores["s"].replicas
    assert after is rows_before
    assert {row[0].reported_at_ms for row in after} == {NOW + 700}
    assert {row[1].reported_at_ms for row in after} == {NOW}, "b's clock did not move"
    _served_now(fed)


def test_a_clock_moved_then_replaced_by_a_new_one_that_moves_sends_both_moves(monkeypatch):
    # Judged for now, not a second ahead: a's clock moves in place at once.
    monkeypatch.setattr("proxy.routing.JUDGED_AHEAD_MS", 0)
    fed = _steady()
    first = fed.table.clocks["a"]
    fed.pair.apply(("shift", "a", 700), NOW + 700)
    assert fed.table.clocks["a"] is first, "the premise: moved in place"
    fed.pair.apply(("shift", "a", -100), NOW + 700)  # back in time: a new clock
    second = fed.table.clocks["a"]
    fed.pair.apply(("shift", "a", 200), NOW + 800)
    assert second is not first, "the premise: a new clock"
    assert fed.table.clocks["a"] is second, "the premise: moved in place too"
    fed.flush()
    _served_now(fed)  # the served rows are on the first clock, moved: so are the mirror's


def test_a_builder_no_one_reads_the_moves_of_records_none():
    fed = _steady()
    fed.table.recording_moves = False  # the proxy's own watcher (no table process)
    fed.pair.apply(("shift", "a", 700), NOW + 700)
    assert fed.pair.in_place == {"a"}, "the premise: moved in place"
    assert fed.table.take_clocks_moved() == []


def test_only_the_rows_that_changed_are_sent():
    fed = _steady()
    lags = {p: (0, -5, 0) for p in range(PARTITIONS)}
    lags[3] = (7, -5, 0)
    fed.pair.apply(("node", "b", set(), set(range(PARTITIONS)), lags, 1), NOW + 100)
    for _ in fed.table.rebuild(NOW + 100):
        pass
    message = fed.encoder.snapshot(fed.table.snapshot(NOW + 100), fed.table.clocks.values())
    sent = message.stores["s"]
    assert sent.info is None, "the store is known: its info is not sent again"
    # b got a new clock (a node read): every row holding b is rebuilt on it, nothing else.
    assert set(sent.rows) == set(range(PARTITIONS))
    assert message.node_urls is None, "no URL changed"
    assert message.alive is None
    assert len(message.dropped) == 1, "b's old clock no longer moves"


def test_a_store_that_goes_is_gone_from_the_mirror():
    fed = _steady()
    fed.table.set_stores({"s": StoreInfo("s", "t", PARTITIONS), "u": StoreInfo("u", "u", 2)})
    fed.publish(NOW + 10)
    assert set(fed.mirror.snapshot.stores) == {"s", "u"}
    fed.table.set_stores({"u": StoreInfo("u", "u", 3)})
    built, mirrored = fed.publish(NOW + 20)
    assert set(mirrored.stores) == {"u"}
    assert len(mirrored.stores["u"].replicas) == 3
    assert _rows(mirrored) == _rows(built)


def test_a_new_table_process_starts_the_mirror_over():
    fed = _steady()
    fed.mirror.restart()
    fed.encoder = FeedEncoder()  # the new process's
    fed.pair.apply(("shift", "a", 700), NOW + 700)
    built, mirrored = fed.publish(NOW + 700)
    assert mirrored.changed is None, "every cached choice forgotten"
    assert mirrored.renewed == {}
    assert _rows(mirrored) == _rows(built)
    fed.pair.apply(("shift", "a", 300), NOW + 1_000)
    fed.flush()
    _served_now(fed)


@pytest.mark.parametrize("shift", [0, 250])
def test_a_replica_made_from_what_it_was_given_reads_the_same(shift):
    clock = ReportClock(shift)
    replica = Replica("n", "http://x:1", "active", True, 3, 1_000, 2_000, 40, clock)
    assert Replica(*replica.as_given(), clock) == replica
    assert replica.reported_at_ms == 2_000 + shift
