"""The sweep's compact read (`report_at:<id>` in one MGET, then the `report:<id>` bodies whose
version changed in another): the same table as from the legacy keys, positions from the
slower node read, an unchanged body never read again, schema-1 writers as before, hostile
values skipped."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable, Mapping

import pytest
import redis
import redis.asyncio as aioredis

from common.clock import SharedClock
from common.contract import (
    Assignment,
    Event,
    Hosting,
    Keys,
    NodeInfo,
    PartitionReport,
    ReportBodies,
    StoreInfo,
    as_text,
    decode_hosting,
    decode_node,
    decode_node_report,
    decode_report,
    decode_report_at,
    encode,
    write_node_report,
)
from kroute.static_cluster import round_robin
from proxy import watcher as watcher_module
from proxy.main import _stopped as stopped_within_timeout
from proxy.routing import build_snapshot
from proxy.watcher import TableWatcher

pytestmark = pytest.mark.integration

NODES = ("n0", "n1", "n2")
PARTITIONS = 6
EXPIRE_MS = 60_000
# What each test cluster's writer last wrote as its nodes' report:<id> (by cluster name).
BODIES: defaultdict[str, ReportBodies] = defaultdict(ReportBodies)


def _reports(node_id: str, hosted: Mapping[str, tuple[int, ...]], at: int, lag: int) -> dict:  # type: ignore[type-arg]
    """Every kind of report: caught up, lagging with no times, and no report at all."""
    reports = {}
    for p in (*hosted["active"], *hosted["standby"]):
        position = 1_000 + 10 * p
        if p % 3 == 0:
            reports[("s", p)] = PartitionReport(position, position + lag, at - 7, at - 3, at)
        elif p % 3 == 1:
            reports[("s", p)] = PartitionReport(position, position + 40 + lag, None, None, at)
    return reports  # p % 3 == 2: no report, unknown lag


def write_node(
    client: redis.Redis,
    keys: Keys,
    node_id: str,
    at: int,
    *,
    lag: int = 0,
    moved: int = 0,
    compact: bool = True,
) -> None:
    """The node's hosting and reports (positions `moved` further on), as kroute nodes write
    them (`write_node_report`), or as a schema-1 writer does (no `report:<id>` and no
    `report_at:<id>`)."""
    placed = round_robin(PARTITIONS, list(NODES), 1)
    roles = Assignment(1, NODES[0], at, {"s": placed}).for_node(node_id)["s"]
    hosted = {r: tuple(ps) for r, ps in roles.items()}
    reports = {
        where: PartitionReport(r.current_offset + moved, (r.end_offset or 0) + moved, *_times(r))
        for where, r in _reports(node_id, hosted, at, lag).items()
    }
    hosting = Hosting(node_id, 1, {"s": hosted}, at)  # type: ignore[dict-item]
    pipe = client.pipeline(transaction=True)
    write_node_report(pipe, keys, hosting, reports, EXPIRE_MS, bodies=BODIES[keys.cluster])
    if not compact:
        pipe.delete(keys.report(node_id), keys.report_at(node_id))
    pipe.execute()


def _times(r: PartitionReport) -> tuple[int | None, int | None, int]:
    return r.newest_record_ms, r.caught_up_at_ms, r.updated_at_ms


def compact_cluster(client: redis.Redis) -> Keys:
    """A fresh cluster in Redis whose every node writes the compact report."""
    keys = Keys(f"compact-{uuid.uuid4().hex[:8]}")
    publish(client, keys, int(time.time() * 1000), compact=dict.fromkeys(NODES, True))
    return keys


def publish(client: redis.Redis, keys: Keys, at: int, *, compact: Mapping[str, bool]) -> None:
    placed = round_robin(PARTITIONS, list(NODES), 1)
    client.sadd(keys.stores, "s")
    client.set(keys.store("s"), encode(StoreInfo("s", "t", PARTITIONS)))
    for index, node_id in enumerate(NODES):
        client.sadd(keys.nodes, node_id)
        url = f"http://127.0.0.1:{21000 + index}"
        client.set(keys.node(node_id), encode(NodeInfo(node_id, url, at)))
        client.set(keys.alive(node_id), "1", px=EXPIRE_MS)
        write_node(client, keys, node_id, at, compact=compact[node_id])
    client.set(keys.assignment, encode(Assignment(1, NODES[0], at, {"s": placed})))


def legacy_rows(client: redis.Redis, keys: Keys) -> object:
    """The table a build from the legacy keys (node, hosting, lag) gives."""
    nodes, hostings, reports = {}, {}, {}
    for node_id in NODES:
        nodes[node_id] = decode_node(client.get(keys.node(node_id)) or b"")
        hostings[node_id] = decode_hosting(client.get(keys.hosting(node_id)) or b"")
        for name, raw in client.hgetall(keys.lag(node_id)).items():
            store, _, partition = as_text(name).rpartition("/")
            reports[(node_id, store, int(partition))] = decode_report(raw)
    placed = round_robin(PARTITIONS, list(NODES), 1)
    snapshot = build_snapshot(
        stores={"s": StoreInfo("s", "t", PARTITIONS)},
        assignment=Assignment(1, NODES[0], 0, {"s": placed}),
        hostings=hostings,
        reports=reports,
        nodes=nodes,
        alive=frozenset(NODES),
        built_at_ms=0,
    )
    return snapshot.stores["s"].replicas


def watch(
    redis_url: str, keys: Keys, scenario: Callable[[TableWatcher], Awaitable[None]]
) -> TableWatcher:
    async def run() -> TableWatcher:
        connection = aioredis.Redis.from_url(redis_url)
        watcher = TableWatcher(
            connection,
            keys,
            refresh_interval_ms=300,
            networks=None,
            clock=SharedClock(),
            lag_read_interval_ms=200,
        )
        running = asyncio.create_task(watcher.run())
        try:
            await watcher.refresh()
            # and the full read its subscription asks for: from here on, only the sweep
            await until(lambda: watcher.stats.full_reads >= 2, "no subscription")
            await scenario(watcher)
            assert not running.done(), running
            return watcher
        finally:
            running.cancel()
            # Bounded, each stuck task's stack logged: a CI run once hung here until pytest's
            # 300 s timeout, with nothing to say which loop outlived its cancellation.
            assert await stopped_within_timeout([running]), "the watcher outlived its cancel"
            await connection.aclose()

    return asyncio.run(run())


async def until(condition: Callable[[], bool], what: str, limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


def whole_reads(watcher: TableWatcher) -> int:
    """Nodes read whole (node, hosting, lag), not from `report:<id>` alone."""
    return watcher.stats.node_reads - watcher.stats.report_reads


def lag_of(watcher: TableWatcher, partition: int, node_id: str) -> int | None:
    row = watcher.snapshot.stores["s"].replicas[partition]
    return next(r.lag for r in row if r.node_id == node_id)


def reported_at(watcher: TableWatcher, partition: int, node_id: str) -> int | None:
    row = watcher.snapshot.stores["s"].replicas[partition]
    return next(r.reported_at_ms for r in row if r.node_id == node_id)


def position_of(watcher: TableWatcher, partition: int, node_id: str) -> int | None:
    row = watcher.snapshot.stores["s"].replicas[partition]
    return next(r.position for r in row if r.node_id == node_id)


@pytest.fixture
def rare_node_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """No node read by the watcher's own round within a test: what the sweep brings is what
    `report:<id>` says."""
    monkeypatch.setattr(watcher_module, "NODE_READ_S", 3600.0)


@pytest.fixture
def client(redis_server) -> redis.Redis:  # type: ignore[no-untyped-def]
    connection = redis.Redis.from_url(redis_server.url)
    yield connection  # type: ignore[misc]
    connection.close()


def test_the_sweep_builds_from_report_the_table_the_legacy_keys_give(
    redis_server, client, rare_node_reads
):
    keys = compact_cluster(client)

    async def scenario(watcher: TableWatcher) -> None:
        whole, full = whole_reads(watcher), watcher.stats.full_reads
        at = int(time.time() * 1000)
        for node_id in NODES:  # new lags and times, the same ends (positions end - lag)
            write_node(client, keys, node_id, at, lag=5, moved=-5)
        legacy = legacy_rows(client, keys)
        await until(
            lambda: watcher.snapshot.stores["s"].replicas == legacy,
            "the table never became what the legacy keys give",
        )
        # Every read since came from report:<id> alone.
        assert (whole_reads(watcher), watcher.stats.full_reads) == (whole, full)
        assert watcher.stats.report_reads >= len(NODES)

    watch(redis_server.url, keys, scenario)


def test_positions_come_from_the_node_read_and_lags_from_the_report(
    redis_server, client, rare_node_reads
):
    keys = compact_cluster(client)

    async def scenario(watcher: TableWatcher) -> None:
        before = position_of(watcher, 0, "n0")
        assert before == 1_000
        write_node(client, keys, "n0", int(time.time() * 1000), lag=3, moved=50)
        await until(lambda: lag_of(watcher, 0, "n0") == 3, "the lag never reached the table")
        # The end read (1,000) less the lag: a lower bound of 1,050, until a node read.
        assert position_of(watcher, 0, "n0") == before - 3
        client.publish(keys.events, encode(Event("hosting", node_id="n0")))
        await until(lambda: position_of(watcher, 0, "n0") == 1_050, "no node read on the event")
        assert lag_of(watcher, 0, "n0") == 3

    watch(redis_server.url, keys, scenario)


def test_a_writer_without_report_is_read_as_before(redis_server, client, rare_node_reads):
    keys = Keys(f"compact-{uuid.uuid4().hex[:8]}")
    publish(client, keys, int(time.time() * 1000), compact={"n0": False, "n1": True, "n2": True})

    async def scenario(watcher: TableWatcher) -> None:
        reads = watcher.stats.node_reads - watcher.stats.report_reads
        write_node(client, keys, "n0", int(time.time() * 1000), lag=9, moved=20, compact=False)
        await until(lambda: lag_of(watcher, 0, "n0") == 9, "the legacy report never arrived")
        assert position_of(watcher, 0, "n0") == 1_020  # read whole: positions too
        assert watcher.stats.node_reads - watcher.stats.report_reads > reads

    watch(redis_server.url, keys, scenario)


def _hostile(body: dict, how: str) -> bytes:  # type: ignore[type-arg]
    store = body["stores"]["s"]
    if how == "not JSON":
        return b'{"v":1,'
    if how == "misaligned":
        store["lag"] = store["lag"][:-1]
    elif how == "negative lag":
        store["lag"][0] = [-5, 0, 0]
    elif how == "another version":
        body["v"] = 2
    elif how == "another node":
        body["node_id"] = "n1"
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    "how", ["not JSON", "misaligned", "negative lag", "another version", "another node"]
)
def test_a_hostile_report_is_skipped_and_the_legacy_keys_read(
    redis_server, client, rare_node_reads, how
):
    keys = compact_cluster(client)

    async def scenario(watcher: TableWatcher) -> None:
        write_node(client, keys, "n0", int(time.time() * 1000), lag=11)
        body = json.loads(client.get(keys.report("n0")) or b"{}")
        client.set(keys.report("n0"), _hostile(body, how))  # lag:n0 says 11
        whole = whole_reads(watcher)
        await until(lambda: lag_of(watcher, 0, "n0") == 11, "the legacy keys were not read")
        await asyncio.sleep(0.5)  # sweeps of the hostile value: never applied
        assert lag_of(watcher, 0, "n0") == 11
        assert whole_reads(watcher) > whole, "n0 read whole instead"

    watch(redis_server.url, keys, scenario)


def test_a_report_from_the_future_is_no_report(redis_server, client, rare_node_reads):
    keys = compact_cluster(client)

    async def scenario(watcher: TableWatcher) -> None:
        assert lag_of(watcher, 0, "n0") == 0
        whole = whole_reads(watcher)
        # The writer's clock a minute ahead: its report would understate staleness.
        write_node(client, keys, "n0", int(time.time() * 1000) + 60_000, lag=13)
        await until(lambda: lag_of(watcher, 0, "n0") is None, "the future report was applied")
        await asyncio.sleep(0.5)
        assert lag_of(watcher, 0, "n0") is None
        assert whole_reads(watcher) == whole, "the sweep judged report:<id> itself"

    watch(redis_server.url, keys, scenario)


# -- report_at:<id>: a body read only when its version changes ------------------------------------


async def bodies_known(watcher: TableWatcher) -> None:
    """Until the sweep holds every node's body (the full reads read the legacy keys)."""
    await until(lambda: set(watcher._bodies) == set(NODES), "bodies never read")


def version_of(client: redis.Redis, keys: Keys, node_id: str) -> int:
    return decode_report_at(client.get(keys.report_at(node_id)) or b"")[0]


class BodyReads:
    """Counts the watcher's MGETs of `report:<id>` bodies (by the nodes they ask for)."""

    def __init__(self, watcher: TableWatcher, keys: Keys) -> None:
        self.nodes: list[str] = []
        mget = watcher.redis.mget
        prefix = keys.report("")

        async def counting(names, *args):  # type: ignore[no-untyped-def]
            self.nodes += [n.removeprefix(prefix) for n in names if n.startswith(prefix)]
            return await mget(names, *args)

        watcher.redis.mget = counting  # type: ignore[method-assign]


def test_an_unchanged_body_is_not_read_again_and_its_times_advance(
    redis_server, client, rare_node_reads
):
    keys = compact_cluster(client)

    async def scenario(watcher: TableWatcher) -> None:
        await bodies_known(watcher)
        reads = BodyReads(watcher, keys)
        version = version_of(client, keys, "n0")
        confirms, whole = watcher.stats.report_confirms, whole_reads(watcher)
        before = reported_at(watcher, 0, "n0") or 0
        at = before + 400
        write_node(client, keys, "n0", at)  # the same lags and ages, 400 ms later
        assert version_of(client, keys, "n0") == version, "the writer made a new version"
        await until(lambda: reported_at(watcher, 0, "n0") == at, "the time never advanced")
        row = next(r for r in watcher.snapshot.stores["s"].replicas[0] if r.node_id == "n0")
        assert row.caught_up_at_ms == at - 3  # caught up 3 ms before, as written
        assert row.lag == 0
        assert "n0" not in reads.nodes, "an unchanged body was read again"
        assert watcher.stats.report_confirms > confirms
        assert whole_reads(watcher) == whole

    watch(redis_server.url, keys, scenario)


def test_a_changed_body_is_read(redis_server, client, rare_node_reads):
    keys = compact_cluster(client)

    async def scenario(watcher: TableWatcher) -> None:
        await bodies_known(watcher)
        reads = BodyReads(watcher, keys)
        version = version_of(client, keys, "n0")
        write_node(client, keys, "n0", int(time.time() * 1000), lag=6)
        assert version_of(client, keys, "n0") > version
        await until(lambda: lag_of(watcher, 0, "n0") == 6, "the new body was never applied")
        assert reads.nodes.count("n0") == 1, reads.nodes  # once: then it is known
        await asyncio.sleep(0.5)
        assert reads.nodes.count("n0") == 1, reads.nodes

    watch(redis_server.url, keys, scenario)


def test_a_body_written_between_the_sweeps_two_reads_is_applied_with_its_own_time(
    redis_server, client, rare_node_reads
):
    """A node whose body changes on every report (a lagging replica) writes again between
    the sweep's read of `report_at:<id>` and its read of the body: the body is applied at
    once, as of the time written with it, not left for the next round."""
    keys = compact_cluster(client)
    stamp_prefix = keys.report_at("")

    async def scenario(watcher: TableWatcher) -> None:
        await bodies_known(watcher)
        held = version_of(client, keys, "n0")
        mget = watcher.redis.mget
        raced: list[int] = []

        async def writing_between(names, *args):  # type: ignore[no-untyped-def]
            replies = await mget(names, *args)
            stamps_only = all(n.startswith(stamp_prefix) for n in names)
            if stamps_only and keys.report_at("n0") in names and not raced:
                stamp = decode_report_at(replies[names.index(keys.report_at("n0"))])
                if stamp[0] != held:  # the sweep will now read n0's body: write again first
                    at = int(time.time() * 1000)
                    write_node(client, keys, "n0", at, lag=8)
                    raced.append(at)
            return replies

        watcher.redis.mget = writing_between  # type: ignore[method-assign]
        write_node(client, keys, "n0", int(time.time() * 1000), lag=6)
        await until(lambda: bool(raced), "the sweep never read the new stamp")
        await until(lambda: lag_of(watcher, 0, "n0") == 8, "the newest body never applied")
        assert reported_at(watcher, 0, "n0") == raced[0]
        assert watcher.stats.unpaired_bodies == 0, "a body was read apart from its stamp"

    watch(redis_server.url, keys, scenario)


def test_a_body_report_at_does_not_name_is_not_applied_until_it_does(
    redis_server, client, rare_node_reads
):
    keys = compact_cluster(client)

    async def scenario(watcher: TableWatcher) -> None:
        reads = BodyReads(watcher, keys)
        whole = whole_reads(watcher)
        body = json.loads(client.get(keys.report("n0")) or b"{}")
        body["stores"]["s"]["lag"][0] = [7, 0, 0]
        body["version"] += 10
        at = int(time.time() * 1000)
        # The body of a newer version, confirmed for another: as of when it holds is unknown.
        client.set(keys.report("n0"), json.dumps(body), px=EXPIRE_MS)
        client.set(keys.report_at("n0"), f"{body['version'] - 1} {at}", px=EXPIRE_MS)
        await until(lambda: reads.nodes.count("n0") >= 3, "the body was not read again")
        assert lag_of(watcher, 0, "n0") == 0, "a body applied with another version's time"
        assert whole_reads(watcher) == whole
        client.set(keys.report_at("n0"), f"{body['version']} {at + 100}", px=EXPIRE_MS)
        await until(lambda: lag_of(watcher, 0, "n0") == 7, "the confirmed body never applied")
        assert reported_at(watcher, 0, "n0") == at + 100
        assert decode_node_report(client.get(keys.report("n0")) or b"").version == body["version"]

    watch(redis_server.url, keys, scenario)


@pytest.mark.parametrize("how", ["missing", "abc", "1", "negative version", "negative time"])
def test_without_a_usable_report_at_the_legacy_keys_are_read(
    redis_server, client, rare_node_reads, how
):
    keys = compact_cluster(client)

    async def scenario(watcher: TableWatcher) -> None:
        whole = whole_reads(watcher)
        at = int(time.time() * 1000)
        write_node(client, keys, "n0", at, lag=9, moved=20)  # lag:n0 has the positions
        version = version_of(client, keys, "n0")
        if how == "missing":
            client.delete(keys.report_at("n0"))
        else:
            value = {"abc": "abc", "1": "1", "negative version": f"-{version} {at}",
                     "negative time": f"{version} -{at}"}[how]  # fmt: skip
            client.set(keys.report_at("n0"), value, px=EXPIRE_MS)
        # Only a node read brings positions (the sweep of report:<id> keeps the last ones).
        await until(lambda: position_of(watcher, 0, "n0") == 1_020, "the legacy keys not read")
        assert lag_of(watcher, 0, "n0") == 9
        assert whole_reads(watcher) > whole

    watch(redis_server.url, keys, scenario)


def test_a_report_at_from_the_future_is_no_report(redis_server, client, rare_node_reads):
    keys = compact_cluster(client)

    async def scenario(watcher: TableWatcher) -> None:
        await bodies_known(watcher)
        assert lag_of(watcher, 0, "n0") == 0
        whole = whole_reads(watcher)
        version = version_of(client, keys, "n0")
        # The known body, confirmed by a writer whose clock is a minute ahead.
        ahead = int(time.time() * 1000) + 60_000
        client.set(keys.report_at("n0"), f"{version} {ahead}", px=EXPIRE_MS)
        await until(lambda: lag_of(watcher, 0, "n0") is None, "the future report was applied")
        await asyncio.sleep(0.5)
        assert lag_of(watcher, 0, "n0") is None
        assert whole_reads(watcher) == whole, "the sweep judged report_at:<id> itself"

    watch(redis_server.url, keys, scenario)
