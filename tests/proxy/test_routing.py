"""The routing snapshot, built from contract values without any I/O; at the end, the watcher
that builds it from a real redis-server, on Redis time."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid

import pytest
import redis
import redis.asyncio as aioredis

from common.clock import SharedClock, now_ms
from common.contract import (
    Assignment,
    Hosting,
    Keys,
    NodeInfo,
    PartitionAssignment,
    PartitionReport,
    StoreInfo,
    encode,
)
from partitioner import partition
from proxy import handler as handler_module
from proxy._hotpath import Candidate, Hub
from proxy.choice import LagBudget, Replica, choose_replicas
from proxy.exchange import ExchangeContext
from proxy.handler import ChoicePolicy, RequestHandler
from proxy.health import Ejections
from proxy.http import ClientRequest
from proxy.metrics import ProxyMetrics
from proxy.retry_budget import RetryBudget
from proxy.routes import RouteTable
from proxy.routing import EMPTY, build_snapshot
from proxy.settings import DEFAULT_ROUTES, parse_routes
from proxy.upstream import UpstreamPool
from proxy.watcher import TableWatcher

NOW = 5_000_000
STORE = StoreInfo("customers", "bookings", 3, "string", "murmur2", "json")
NODES = {
    n: NodeInfo(n, f"http://10.0.0.{i}:8081", 0) for i, n in enumerate(("a", "b", "c"), start=1)
}
ASSIGNMENT = Assignment(
    7,
    "a",
    NOW,
    {
        "customers": {
            0: PartitionAssignment("a", ("b",)),
            1: PartitionAssignment("b", ("c",)),
            2: PartitionAssignment("c", ("a",)),
        }
    },
)


def hosting(node, active, standby):
    return Hosting(
        node, 7, {"customers": {"active": tuple(active), "standby": tuple(standby)}}, NOW
    )


def report(lag, caught_up_ago=0):
    return PartitionReport(100 - lag, 100, NOW, NOW - caught_up_ago, NOW)


def snapshot(hostings, alive=frozenset({"a", "b", "c"}), reports=None):
    return build_snapshot(
        stores={"customers": STORE},
        assignment=ASSIGNMENT,
        hostings=hostings,
        reports=reports or {},
        nodes=NODES,
        alive=alive,
        built_at_ms=NOW,
    )


ALL_HOSTING = {
    "a": hosting("a", [0], [2]),
    "b": hosting("b", [1], [0]),
    "c": hosting("c", [2], [1]),
}


def test_replicas_per_partition_with_roles_urls_and_lag():
    reports = {
        ("a", "customers", 0): report(0),
        ("b", "customers", 0): report(40, caught_up_ago=2_000),
    }
    built = snapshot(ALL_HOSTING, reports=reports)
    route = built.stores["customers"]
    assert built.generation == 7
    assert [(r.node_id, r.role, r.url) for r in route.replicas[0]] == [
        ("a", "active", "http://10.0.0.1:8081"),
        ("b", "standby", "http://10.0.0.2:8081"),
    ]
    assert route.replicas[0][1].lag == 40
    assert route.replicas[0][1].time_lag_ms(NOW) == 2_000
    assert route.replicas[1][0].lag is None  # no report: unknown, never zero
    assert route.partitioner.partition_of("customer-42") == partition(b"customer-42", 3)


def test_a_replica_is_listed_only_when_the_node_reports_serving_it():
    applying = dict(ALL_HOSTING, c=hosting("c", [], []))  # c has not started on its partitions yet
    route = snapshot(applying).stores["customers"]
    assert [r.node_id for r in route.replicas[2]] == ["a"]
    assert [r.node_id for r in route.replicas[1]] == ["b"]


def test_dead_nodes_stay_listed_as_dead_so_a_503_can_name_them():
    built = snapshot(ALL_HOSTING, alive=frozenset({"a", "c"}))
    choice = choose_replicas(built.stores["customers"].replicas[1], LagBudget(), now_ms=NOW)
    assert [r.node_id for r in choice.candidates] == ["c"]
    assert [(r.node_id, r.reason) for r in choice.rejected] == [("b", "dead")]
    assert built.live_urls() == ("http://10.0.0.1:8081", "http://10.0.0.3:8081")


def test_before_any_assignment_there_is_nothing_to_route():
    built = build_snapshot(
        stores={"customers": STORE},
        assignment=None,
        hostings={},
        reports={},
        nodes={},
        alive=frozenset(),
        built_at_ms=NOW,
    )
    assert built.stores["customers"].replicas == ((), (), ())
    assert EMPTY.stores == {}


# -- the handler spreads a partition's reads over its in-sync replicas ------------------------


def first_tried(monkeypatch: pytest.MonkeyPatch, *, spread: bool, reads: int) -> list[str]:
    """The node each of `reads` lookups of one key is sent to first, as the request handler
    hands its candidates to the exchange (which would forward them; here it only records)."""
    tried: list[str] = []

    class RecordedExchange:
        def __init__(self, *_args: object, targets: tuple[Candidate, ...], **_kw: object) -> None:
            tried.append(targets[0].target.node_id)

        def start(self) -> None:
            pass

    monkeypatch.setattr(handler_module, "Exchange", RecordedExchange)
    key = next(f"k{i}" for i in range(100) if partition(f"k{i}".encode(), 3) == 0)
    asyncio.run(_read_key(key, spread, reads))
    return tried


def a_hub(spread: bool) -> Hub:
    return Hub(
        status_lines={200: b"HTTP/1.1 200 OK\r\n"},
        request_drop=(b"connection",),
        response_drop=(b"connection",),
        python_only=(b"content-length",),
        id_prefix=b"test",
        response_timeout_s=1.0,
        idle_timeout_s=1.0,
        max_response_bytes=1_000,
        max_request_bytes=1_000,
        max_headers=10,
        idle_per_origin=1,
        spread=int(spread),
    )


async def _read_key(key: str, spread: bool, reads: int) -> None:
    hub = a_hub(spread)
    pool = UpstreamPool(
        hub=hub,
        connect_timeout_s=1.0,
        response_timeout_s=1.0,
        idle_per_origin=1,
        max_response_bytes=1_000,
    )
    metrics = ProxyMetrics()
    context = ExchangeContext(
        pool=pool,
        ejections=Ejections(eject_ms=1_000, probe_interval_ms=1_000, probe_timeout_s=1.0),
        metrics=metrics,
        refresh_table=lambda: None,
        retry_budget=RetryBudget(percent=20, min_per_s=1, burst=10),
    )
    policy = ChoicePolicy(LagBudget(), "reject", 3_000, spread)
    routes = RouteTable(parse_routes(DEFAULT_ROUTES))
    handler = RequestHandler(
        routes=routes, policy=policy, context=context, metrics=metrics, hub=hub
    )
    now = now_ms()
    caught_up = PartitionReport(100, 100, now, now - 10, now)  # a and b: in sync, just reported
    handler.use_snapshot(
        build_snapshot(
            stores={"customers": STORE},
            assignment=ASSIGNMENT,
            hostings=ALL_HOSTING,
            reports={("a", "customers", 0): caught_up, ("b", "customers", 0): caught_up},
            nodes=NODES,
            alive=frozenset({"a", "b", "c"}),
            built_at_ms=now,
        )
    )
    path = f"/stores/customers/keys/{key}"
    for i in range(reads):
        request = ClientRequest(
            method="GET",
            target=path,
            path=path,
            query=None,
            headers=[],
            body=b"",
            client_ip="127.0.0.1",
            keep_alive=True,
            request_id=b"spread-%d" % i,
            received_at=time.perf_counter(),
        )
        handler.handle(request, client=None)  # type: ignore[arg-type]


def test_with_spread_on_the_handler_rotates_reads_over_the_in_sync_replicas(monkeypatch):
    """Partition 0's active (a) and standby (b) are both in sync: with KROUTE_SPREAD each gets
    every other read first; without it the active gets them all."""
    spread = first_tried(monkeypatch, spread=True, reads=6)
    assert sorted(spread) == ["a", "a", "a", "b", "b", "b"]
    assert all(x != y for x, y in itertools.pairwise(spread))
    assert first_tried(monkeypatch, spread=False, reads=6) == ["a"] * 6


# -- the watcher against a real redis-server: one clock for writers and readers -------------


def publish_one_replica(url: str, keys: Keys, report: PartitionReport) -> None:
    """A writer outside kroute (one that keeps no shared clock) publishes partition 0 of a
    one-partition store on node "a", with `report` as its lag report."""
    store = StoreInfo("customers", "bookings", 1, "string", "murmur2", "json")
    client = redis.Redis.from_url(url)
    try:
        pipe = client.pipeline(transaction=True)
        pipe.sadd(keys.stores, store.name)
        pipe.set(keys.store(store.name), encode(store))
        pipe.sadd(keys.nodes, "a")
        pipe.set(keys.node("a"), encode(NodeInfo("a", "http://127.0.0.1:1", 0)))
        pipe.set(keys.alive("a"), "1")
        pipe.set(
            keys.hosting("a"),
            encode(Hosting("a", 1, {"customers": {"active": (0,), "standby": ()}}, 0)),
        )
        pipe.hset(keys.lag("a"), "customers/0", encode(report))
        pipe.set(
            keys.assignment,
            encode(Assignment(1, "a", 0, {"customers": {0: PartitionAssignment("a")}})),
        )
        pipe.execute()
    finally:
        client.close()


def watched(url: str, keys: Keys) -> tuple[Replica, int, SharedClock]:
    async def read() -> tuple[Replica, int, SharedClock]:
        client = aioredis.Redis.from_url(url)
        try:
            clock = SharedClock(skew_ms=-3_000)  # the proxy's own host clock is off too
            watcher = TableWatcher(
                client, keys, refresh_interval_ms=1000, networks=None, clock=clock
            )
            await watcher.refresh()
            (replica,) = watcher.snapshot.stores["customers"].replicas[0]
            return replica, clock.now_ms(), clock
        finally:
            await client.aclose()

    return asyncio.run(read())


@pytest.mark.integration
def test_the_watcher_refuses_reports_stamped_in_its_future(redis_server):
    # A writer 5 s ahead, caught up 5.4 s ago: its "caught up at" reads 400 ms ago.
    keys = Keys(f"t-{uuid.uuid4().hex[:8]}")
    true_now = int(time.time() * 1000)
    ahead = true_now + 5_000
    publish_one_replica(redis_server.url, keys, PartitionReport(10, 10, None, ahead - 5_400, ahead))
    replica, now, _clock = watched(redis_server.url, keys)
    assert replica.lag is None, "its report counts as missing"
    assert replica.caught_up_at_ms is None
    refused = choose_replicas((replica,), LagBudget(None, 1_000), now_ms=now)
    assert refused.candidates == ()
    assert "unknown" in refused.rejected[0].reason


@pytest.mark.integration
def test_the_watcher_reads_redis_time_and_accepts_reports_within_the_tolerance(redis_server):
    keys = Keys(f"t-{uuid.uuid4().hex[:8]}")
    true_now = int(time.time() * 1000)
    publish_one_replica(
        redis_server.url, keys, PartitionReport(10, 10, None, true_now - 200, true_now + 100)
    )
    replica, now, clock = watched(redis_server.url, keys)
    assert clock.synced
    assert abs(now - time.time() * 1000) < 500, "the proxy's -3 s clock was replaced"
    assert replica.lag == 0
    time_lag = replica.time_lag_ms(now)
    assert time_lag is not None
    assert 200 <= time_lag < 1_000
    assert choose_replicas((replica,), LagBudget(None, 1_000), now_ms=now).candidates
