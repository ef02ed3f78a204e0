"""The table at scale: the incremental builder gives exactly what a build from scratch gives,
and the watcher reads what changed, keeps the event loop free and stays fresh (real Redis)."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Mapping

import pytest
import redis
import redis.asyncio as aioredis
from hypothesis import given, settings
from hypothesis import strategies as st

from common.clock import SharedClock
from common.contract import (
    Assignment,
    Event,
    Hosting,
    Keys,
    NodeInfo,
    PartitionAssignment,
    PartitionReport,
    ReportBodies,
    StoreInfo,
    encode,
    lag_field,
    write_node_report,
)
from kroute.static_cluster import round_robin
from proxy import watcher as watcher_module
from proxy.routing import STEP_PARTITIONS, RoutingSnapshot, TableBuilder, build_snapshot
from proxy.watcher import TableWatcher

NODE_IDS = ("a", "b", "c", "d")
NOW = 7_000_000


def _report(lag: int, at: int = NOW) -> PartitionReport:
    return PartitionReport(100 - lag, 100, at, at - lag, at)


placements = st.builds(
    PartitionAssignment,
    st.sampled_from((None, *NODE_IDS)),
    st.lists(st.sampled_from(NODE_IDS), max_size=2, unique=True).map(tuple),
)
updates = st.one_of(
    st.tuples(st.just("assignment"), st.integers(1, 9), st.lists(placements, max_size=5)),
    st.tuples(st.just("stores"), st.integers(1, 5)),
    st.tuples(st.just("alive"), st.sets(st.sampled_from(NODE_IDS))),
    st.tuples(
        st.just("node"),
        st.sampled_from(NODE_IDS),
        st.booleans(),  # registered (node info present)
        st.sets(st.integers(0, 4)),  # active partitions it says it serves
        st.sets(st.integers(0, 4)),  # standby ones
        st.dictionaries(st.integers(0, 4), st.integers(0, 3), max_size=5),  # lag reports
    ),
    st.tuples(st.just("forget"), st.sampled_from(NODE_IDS)),
)


class Inputs:
    """What build_snapshot is given, kept beside the builder as the reference."""

    def __init__(self) -> None:
        self.stores: dict[str, StoreInfo] = {}
        self.assignment: Assignment | None = None
        self.nodes: dict[str, NodeInfo] = {}
        self.hostings: dict[str, Hosting] = {}
        self.reports: dict[str, dict[tuple[str, int], PartitionReport]] = {}
        self.alive: set[str] = set()

    def built(self) -> RoutingSnapshot:
        flat = {
            (node, store, p): r
            for node, per in self.reports.items()
            for (store, p), r in per.items()
        }
        return build_snapshot(
            stores=self.stores,
            assignment=self.assignment,
            hostings=self.hostings,
            reports=flat,
            nodes=self.nodes,
            alive=frozenset(self.alive),
            built_at_ms=NOW,
        )


def _apply(update: tuple, table: TableBuilder, inputs: Inputs) -> None:  # type: ignore[type-arg]
    kind = update[0]
    if kind == "assignment":
        _, generation, placed = update
        inputs.assignment = Assignment(generation, "a", NOW, {"s": dict(enumerate(placed))})
        table.set_assignment(inputs.assignment)
    elif kind == "stores":
        inputs.stores = {"s": StoreInfo("s", "t", update[1])}
        table.set_stores(inputs.stores)
    elif kind == "alive":
        inputs.alive = set(update[1])
        table.set_alive(inputs.alive)
    elif kind == "node":
        _, node_id, registered, active, standby, lags = update
        info = NodeInfo(node_id, f"http://10.0.0.1:{8000 + NODE_IDS.index(node_id)}", 0)
        hosting = Hosting(
            node_id,
            1,
            {"s": {"active": tuple(sorted(active)), "standby": tuple(sorted(standby))}},
            NOW,
        )
        reports = {("s", p): _report(lag) for p, lag in lags.items()}
        if registered:
            inputs.nodes[node_id] = info
            inputs.hostings[node_id] = hosting
            inputs.reports[node_id] = reports
            table.set_node(node_id, info, hosting, reports)
        else:
            _forget(inputs, node_id)
            table.set_node(node_id, None, None, {})
    else:
        _forget(inputs, update[1])
        inputs.alive.discard(update[1])
        table.forget_node(update[1])


def _forget(inputs: Inputs, node_id: str) -> None:
    inputs.nodes.pop(node_id, None)
    inputs.hostings.pop(node_id, None)
    inputs.reports.pop(node_id, None)


def _rows(snapshot: RoutingSnapshot) -> Mapping[str, object]:
    return {name: (route.info, route.replicas) for name, route in snapshot.stores.items()}


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(updates, min_size=1, max_size=4), min_size=1, max_size=8))
def test_the_builder_always_equals_a_build_from_scratch(batches):
    # Batches of updates, each followed by a rebuild: after every one the incremental table
    # is exactly what build_snapshot makes of the same inputs.
    # Each snapshot also names the partitions that may differ from the previous one (None:
    # any), and every partition that differs is named.
    table, inputs = TableBuilder(), Inputs()
    last = None
    for batch in batches:
        for update in batch:
            _apply(update, table, inputs)
        # As the watcher does: a table with nothing pending keeps its last snapshot, so
        # whatever changed must make the table pending (a node placed nowhere included).
        if table.pending or last is None:
            for _ in table.rebuild():
                pass
            built = table.snapshot(NOW)
            # (kept as rows change: the watcher's check for a smaller table reads it)
            assert table.placed == sum(
                len(row) for route in built.stores.values() for row in route.replicas
            )
        else:
            built = last
        expected = inputs.built()
        assert _rows(built) == _rows(expected)
        if last is not None and built.changed is not None:
            for name, route in built.stores.items():
                before = last.stores[name].replicas
                differs = {p for p, row in enumerate(route.replicas) if row != before[p]}
                assert differs <= built.changed.get(name, frozenset()), (name, differs)
        last = built
        assert dict(built.node_urls) == dict(expected.node_urls)
        assert built.alive == expected.alive
        assert built.generation == expected.generation


def test_a_node_update_recomputes_only_its_partitions():
    table = TableBuilder()
    nodes = [f"n{i:03d}" for i in range(100)]
    placed = round_robin(2_000, nodes, 1)
    table.set_stores({"s": StoreInfo("s", "t", 2_000)})
    table.set_assignment(Assignment(1, nodes[0], NOW, {"s": placed}))
    assert list(table.rebuild())[-1] == 2_000
    mine = {p for p, a in placed.items() if "n007" in a.replicas()}
    table.set_node(
        "n007",
        NodeInfo("n007", "http://10.0.0.7:1", 0),
        Hosting("n007", 1, {"s": {"active": tuple(sorted(mine)), "standby": ()}}, NOW),
        {("s", p): _report(0) for p in mine},
    )
    steps = list(table.rebuild())
    assert steps[-1] == len(mine) == 40, "the 40 partitions n007 is placed on, not 2,000"


def test_the_rows_a_rebuild_replaced_are_released_in_steps():
    """The snapshot swapped out holds the rows a rebuild replaced, and dropped at once it would
    free them all in one go: the builder keeps them until released, STEP_PARTITIONS a step."""
    table = TableBuilder()
    nodes = [f"n{i:03d}" for i in range(100)]
    placed = round_robin(2_000, nodes, 1)
    table.set_stores({"s": StoreInfo("s", "t", 2_000)})
    table.set_assignment(Assignment(1, nodes[0], NOW, {"s": placed}))

    def ten_nodes_report(lag: int) -> None:
        for node_id in nodes[:10]:
            mine = {p for p, a in placed.items() if node_id in a.replicas()}
            table.set_node(
                node_id,
                NodeInfo(node_id, f"http://10.0.0.7:{nodes.index(node_id) + 1}", 0),
                Hosting(node_id, 1, {"s": {"active": tuple(sorted(mine)), "standby": ()}}, NOW),
                {("s", p): _report(lag) for p in mine},
            )
        list(table.rebuild())

    ten_nodes_report(lag=0)
    # (none retired: the rows replaced were empty, before any node served)
    assert not table.release_retired(STEP_PARTITIONS)
    before = table.snapshot(NOW).stores["s"].replicas
    ten_nodes_report(lag=3)
    after = table.snapshot(NOW).stores["s"].replicas
    replaced = [p for p in range(2_000) if after[p] is not before[p]]
    assert len(replaced) > 2 * STEP_PARTITIONS
    # Kept are the rows the last snapshot served, those this one no longer holds.
    assert sorted(map(id, table._retired)) == sorted(id(before[p]) for p in replaced)
    steps = 1
    while table.release_retired(STEP_PARTITIONS):
        steps += 1
    assert steps == -(-len(replaced) // STEP_PARTITIONS)


def test_a_rebuild_of_everything_yields_every_step_of_partitions():
    """The watcher yields to its event loop between the builder's steps, so no stretch on the
    loop grows with the table: a rebuild of 6,000 partitions comes in steps of at most
    STEP_PARTITIONS. (How long a step takes is measured by benchmarks/control_plane_bench.py.)"""
    table = TableBuilder()
    nodes = [f"n{i:03d}" for i in range(300)]
    table.set_stores({"s": StoreInfo("s", "t", 6_000)})
    table.set_assignment(Assignment(1, nodes[0], NOW, {"s": round_robin(6_000, nodes, 1)}))
    done = [0, *table.rebuild()]
    assert done[-1] == 6_000
    assert max(b - a for a, b in itertools.pairwise(done)) <= STEP_PARTITIONS


# -- the watcher on a real redis-server --------------------------------------------------------


def publish(
    client: redis.Redis, keys: Keys, nodes: int, partitions: int, at: int, *, compact: bool = False
) -> None:
    """A cluster with one standby per partition, every replica caught up at `at`; `compact`:
    its nodes also write `report:<id>` and `report_at:<id>`, as kroute nodes do."""
    ids = [f"node-{i:04d}" for i in range(nodes)]
    placed = round_robin(partitions, ids, 1)
    assignment = Assignment(1, ids[0], at, {"s": placed})
    pipe = client.pipeline(transaction=False)
    pipe.sadd(keys.stores, "s")
    pipe.set(keys.store("s"), encode(StoreInfo("s", "t", partitions)))
    for index, node_id in enumerate(ids):
        pipe.sadd(keys.nodes, node_id)
        pipe.set(
            keys.node(node_id), encode(NodeInfo(node_id, f"http://127.0.0.1:{20000 + index}", at))
        )
        pipe.set(keys.alive(node_id), "1", px=60_000)
        roles = assignment.for_node(node_id).get("s", {"active": [], "standby": []})
        hosted = {"s": {r: tuple(ps) for r, ps in roles.items()}}
        hosting = Hosting(node_id, 1, hosted, at)  # type: ignore[arg-type]
        if compact:
            reports = {("s", p): _report(0, at) for ps in roles.values() for p in ps}
            write_node_report(pipe, keys, hosting, reports, 60_000, bodies=ReportBodies())
            continue
        pipe.set(keys.hosting(node_id), encode(hosting))
        fields = {lag_field("s", p): encode(_report(0, at)) for ps in roles.values() for p in ps}
        pipe.hset(keys.lag(node_id), mapping=fields)  # type: ignore[arg-type]
    pipe.set(keys.assignment, encode(assignment))
    pipe.execute()


def report_lag(
    client: redis.Redis, keys: Keys, node_id: str, partition: int, *, lag: int, at: int
) -> None:
    """One node rewrites one report, unannounced (as kroute nodes do every 250 ms)."""
    client.hset(keys.lag(node_id), lag_field("s", partition), encode(_report(lag, at)))


@pytest.mark.integration
def test_a_report_reaches_the_table_within_a_second_without_a_full_read(redis_server):
    keys = Keys(f"scale-{uuid.uuid4().hex[:8]}")
    client = redis.Redis.from_url(redis_server.url)
    at = int(time.time() * 1000)
    publish(client, keys, 50, 600, at)

    async def watch() -> tuple[float, int, int]:
        connection = aioredis.Redis.from_url(redis_server.url)
        watcher = TableWatcher(
            connection, keys, refresh_interval_ms=1000, networks=None, clock=SharedClock()
        )
        running = asyncio.create_task(watcher.run())
        try:
            await watcher.refresh()
            full_reads = watcher.stats.full_reads
            await asyncio.sleep(1.2)  # the full read run() starts with (the subscription's)
            full_reads = watcher.stats.full_reads
            lag = 5 + uuid.uuid4().int % 1000  # a value nobody else writes
            written = time.monotonic()
            report_lag(client, keys, "node-0007", 7, lag=lag, at=int(time.time() * 1000))
            while watcher.snapshot.stores["s"].replicas[7][0].lag != lag:
                assert time.monotonic() - written < 5, "the report never reached the table"
                await asyncio.sleep(0.005)
            return time.monotonic() - written, full_reads, watcher.stats.full_reads
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            await connection.aclose()

    try:
        took, full_before, full_after = asyncio.run(watch())
    finally:
        client.close()
    # The sweep reads every node within 500 ms, swapped in within 200 ms more; the slack is
    # for a shared, busy machine.
    assert took < 2.0, f"the report took {took:.2f} s to reach the table"
    assert full_after == full_before, "the sweep brought it, not a full re-read"


@pytest.mark.integration
def test_a_started_watcher_misses_no_event_before_it_runs_and_reads_everything_once(
    redis_server,
):
    """`start` subscribes before its first read, so `run` need not read everything again (at
    1,000 nodes ~2 s without a sweep, the first read's reports ageing meanwhile); an event
    published between the two is still seen."""
    keys = Keys(f"scale-{uuid.uuid4().hex[:8]}")
    client = redis.Redis.from_url(redis_server.url)
    at = int(time.time() * 1000)
    publish(client, keys, 4, 8, at, compact=True)  # the sweep reads reports, not node info
    moved = f"http://127.0.0.1:{30000 + uuid.uuid4().int % 1000}"

    async def watch() -> tuple[str | None, int]:
        connection = aioredis.Redis.from_url(redis_server.url)
        watcher = TableWatcher(
            connection, keys, refresh_interval_ms=1000, networks=None, clock=SharedClock()
        )
        await watcher.start()
        client.set(keys.node("node-0001"), encode(NodeInfo("node-0001", moved, at)))
        client.publish(keys.events, encode(Event("node", node_id="node-0001")))
        running = asyncio.create_task(watcher.run())
        try:
            await asyncio.sleep(1.5)  # a full read run() asked for would have run by now
            return watcher.snapshot.node_urls.get("node-0001"), watcher.stats.full_reads
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            await connection.aclose()

    try:
        url, full_reads = asyncio.run(watch())
    finally:
        client.close()
    assert url == moved, "the event published before run() was lost"
    assert full_reads == 1, "run() read everything again"


@pytest.mark.integration
def test_a_subscription_redis_has_not_confirmed_is_not_trusted_to_cover_the_first_read(
    redis_server,
):
    """A relay holds SUBSCRIBE back until after the first read (as a resent segment would):
    an event published before it reaches Redis is never delivered, so `start` must not hand
    that subscription to `run` as one that covers its read; `run` reads everything instead."""
    keys = Keys(f"scale-{uuid.uuid4().hex[:8]}")
    client = redis.Redis.from_url(redis_server.url)
    at = int(time.time() * 1000)
    publish(client, keys, 4, 8, at, compact=True)
    moved = f"http://127.0.0.1:{30000 + uuid.uuid4().int % 1000}"

    async def watch() -> str | None:
        release = asyncio.Event()

        async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while data := await reader.read(65536):
                if b"SUBSCRIBE" in data.upper():
                    await release.wait()
                writer.write(data)
                await writer.drain()
            writer.close()

        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            to_reader, to_writer = await asyncio.open_connection("127.0.0.1", redis_server.port)
            writers.extend((writer, to_writer))
            pending.append(asyncio.create_task(relay(to_reader, writer)))
            pending.append(asyncio.create_task(relay(reader, to_writer)))

        pending: list[asyncio.Task[None]] = []
        writers: list[asyncio.StreamWriter] = []
        server = await asyncio.start_server(accept, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        connection = aioredis.Redis.from_url(f"redis://127.0.0.1:{port}", socket_timeout=2)
        watcher = TableWatcher(
            connection, keys, refresh_interval_ms=500, networks=None, clock=SharedClock()
        )
        try:
            await watcher.start()  # the first read done, SUBSCRIBE still held back
            client.set(keys.node("node-0001"), encode(NodeInfo("node-0001", moved, at)))
            client.publish(keys.events, encode(Event("node", node_id="node-0001")))
            release.set()
            running = asyncio.create_task(watcher.run())
            await asyncio.sleep(1.5)
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            return watcher.snapshot.node_urls.get("node-0001")
        finally:
            await connection.aclose()
            server.close()
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for writer in writers:
                writer.close()
            await asyncio.gather(*(w.wait_closed() for w in writers), return_exceptions=True)
            await server.wait_closed()

    try:
        url = asyncio.run(watch())
    finally:
        client.close()
    assert url == moved, "an event published before the subscription reached Redis was lost"


@pytest.mark.integration
def test_the_watcher_follows_sweeps_and_new_assignments_at_6000_partitions(redis_server):
    keys = Keys(f"scale-{uuid.uuid4().hex[:8]}")
    client = redis.Redis.from_url(redis_server.url)
    at = int(time.time() * 1000)
    publish(client, keys, 300, 6_000, at)

    async def watch() -> TableWatcher:
        connection = aioredis.Redis.from_url(redis_server.url)
        watcher = TableWatcher(
            connection, keys, refresh_interval_ms=1000, networks=None, clock=SharedClock()
        )
        running = asyncio.create_task(watcher.run())
        try:
            await watcher.refresh()  # a full read and a build from nothing
            nodes = [f"node-{i:04d}" for i in range(300)]
            for generation in (2, 3, 4):  # then sweeps; a new assignment rebuilds everything
                await asyncio.sleep(1)
                new = Assignment(generation, "node-0000", at, {"s": round_robin(6_000, nodes, 1)})
                client.set(keys.assignment, encode(new))
                client.publish(keys.events, encode(Event("assignment", generation=generation)))
            deadline = time.monotonic() + 30  # a generous wait: the machine may be shared
            while watcher.snapshot.generation != 4 and time.monotonic() < deadline:  # noqa: ASYNC110 - polls what another task swaps in
                await asyncio.sleep(0.05)
            return watcher
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            await connection.aclose()

    try:
        watcher = asyncio.run(watch())
    finally:
        client.close()
    assert watcher.snapshot.generation == 4
    assert sum(map(len, watcher.snapshot.stores["s"].replicas)) == 12_000
    assert watcher.stats.node_reads > 300 * 3, "every node read again by the sweep"
    # How long it held the loop is a benchmark's figure (benchmarks/control_plane_bench.py),
    # not a test's: the builder's steps are tested above, without a clock.


@pytest.mark.integration
@pytest.mark.parametrize(
    "poison",
    ["a lag field whose partition is a digit int() refuses", "an event nested too deep"],
)
def test_a_hostile_value_never_stops_the_table_from_following_reports(redis_server, poison):
    """One bad value (skipped) must not freeze the table: later reports still reach it."""
    keys = Keys(f"poison-{uuid.uuid4().hex[:8]}")
    client = redis.Redis.from_url(redis_server.url)
    at = int(time.time() * 1000)
    publish(client, keys, 4, 8, at)

    async def watch() -> None:
        connection = aioredis.Redis.from_url(redis_server.url)
        watcher = TableWatcher(
            connection, keys, refresh_interval_ms=300, networks=None, clock=SharedClock()
        )
        running = asyncio.create_task(watcher.run())
        try:
            await watcher.refresh()
            if poison.startswith("a lag field"):
                client.hset(keys.lag("node-0001"), "s/\u00b2", encode(_report(0, at)))
            else:
                client.publish(keys.events, b"[" * 100_000)
            await asyncio.sleep(0.5)  # the poison is read
            for attempt in range(3):  # a report after it, and another: both must arrive
                lag = 7 + attempt + uuid.uuid4().int % 1000
                report_lag(client, keys, "node-0001", 1, lag=lag, at=int(time.time() * 1000))
                written = time.monotonic()
                while watcher.snapshot.stores["s"].replicas[1][0].lag != lag:
                    assert not running.done(), running
                    assert time.monotonic() - written < 10, "the table stopped following"
                    await asyncio.sleep(0.01)
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            await connection.aclose()

    try:
        asyncio.run(watch())
    finally:
        client.close()


AN_HOUR_S = 3600.0


@pytest.mark.integration
@pytest.mark.parametrize("compact", [False, True], ids=["legacy keys", "report bodies"])
def test_the_table_hold_counts_the_watchers_own_stretches_and_nothing_else(
    redis_server, monkeypatch, compact
):
    """`hold_s` and `max_hold_ms` are the loop time of the watcher's own stretches. Here each
    turn another task takes on the loop costs an hour of CPU time (as the watcher's clock
    reads it): a stretch left open across any await (a reader task that ended with one open,
    a thread decoding) would count at least one. Counted so, requests under wrk made holds of
    17 ms out of stretches of at most 2 ms. Every report body is decoded in a thread here."""
    keys = Keys(f"hold-{uuid.uuid4().hex[:8]}")
    client = redis.Redis.from_url(redis_server.url)
    at = int(time.time() * 1000)
    publish(client, keys, 60, 720, at, compact=compact)
    monkeypatch.setattr(watcher_module, "THREAD_DECODE_BYTES", 0)
    others_cpu_s = 0.0
    real_thread_time = time.thread_time
    monkeypatch.setattr(time, "thread_time", lambda: real_thread_time() + others_cpu_s)

    async def requests() -> None:
        nonlocal others_cpu_s
        while True:
            others_cpu_s += AN_HOUR_S
            await asyncio.sleep(0)

    async def watch() -> TableWatcher:
        connection = aioredis.Redis.from_url(redis_server.url)
        watcher = TableWatcher(
            connection,
            keys,
            refresh_interval_ms=300,
            networks=None,
            clock=SharedClock(),
            lag_read_interval_ms=200,
        )
        other = asyncio.create_task(requests())
        running = asyncio.create_task(watcher.run())
        try:
            await watcher.refresh()  # a full read, the assignment decoded in a thread
            nodes = [f"node-{i:04d}" for i in range(60)]
            for generation in (2, 3):  # events: nodes read whole in the steps that sweep
                await asyncio.sleep(0.5)
                report_lag(client, keys, "node-0007", 7, lag=generation, at=int(time.time() * 1000))
                client.publish(keys.events, encode(Event("lag", node_id="node-0007")))
                new = Assignment(generation, nodes[0], at, {"s": round_robin(720, nodes, 1)})
                client.set(keys.assignment, encode(new))
                client.publish(keys.events, encode(Event("assignment", generation=generation)))
            deadline = time.monotonic() + 30  # a generous wait: the machine may be shared
            while watcher.snapshot.generation != 3 and time.monotonic() < deadline:  # noqa: ASYNC110 - polls what another task swaps in
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # and a few sweeps more
            return watcher
        finally:
            running.cancel()
            other.cancel()
            await asyncio.gather(running, other, return_exceptions=True)
            await connection.aclose()

    try:
        watcher = asyncio.run(watch())
    finally:
        client.close()
    assert watcher.snapshot.generation == 3, "the steps this test is about never ran"
    assert watcher.stats.node_reads > 60 * 3, "every node read again by the sweep"
    assert (watcher.stats.report_reads > 60) == compact, "the sweep read what was written"
    assert 0 < watcher.stats.hold_s < AN_HOUR_S, f"held {watcher.stats.hold_s:.0f} s"
