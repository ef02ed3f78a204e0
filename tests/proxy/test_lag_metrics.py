"""Per-replica lag gauges on the proxy: from the routing table at scrape time, one series per
replica in the table, NaN when unknown; then a real proxy process following a cluster's
lag reports in real Redis (stand-in nodes), its /metrics read with Prometheus's own parser."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator

import pytest

from common.contract import (
    Assignment,
    Hosting,
    NodeInfo,
    PartitionAssignment,
    PartitionReport,
    StoreInfo,
    lag_field,
)
from kroute.embedded import EmbeddedServices
from kroute.static_cluster import round_robin
from proxy.lag_metrics import GAUGES, replica_gauge_lines
from proxy.routing import EMPTY, RoutingSnapshot, build_snapshot
from tests.prometheus_checks import assert_follows_conventions, families, sample_values
from tests.proxy.conftest import PARTITIONS, PROXY_SETTINGS, StandIns, running_stand_ins
from tests.proxy.echo_backend import EchoBackend

LAG = "kroute_proxy_replica_lag_offsets"
TIME_LAG = "kroute_proxy_replica_time_lag_seconds"
AGE = "kroute_proxy_replica_report_age_seconds"
ALIVE = "kroute_proxy_replica_alive"
STORES = 3  # the stand-ins publish customers, cards and devices
NOW = 5_000_000


def scrape(table: RoutingSnapshot, now_ms: int = NOW) -> str:
    return "".join(replica_gauge_lines(table, now_ms))


def labels(partition: int, node: str, role: str, store: str = "customers") -> tuple:
    return tuple(
        sorted({"store": store, "partition": str(partition), "node": node, "role": role}.items())
    )


# -- the collector over a routing snapshot (no I/O) ---------------------------------------------


def hosting(node: str, active: int, standby: int) -> Hosting:
    return Hosting(node, 7, {"customers": {"active": (active,), "standby": (standby,)}}, NOW)


def hosting_everything() -> dict[str, Hosting]:
    """Three partitions, each with an active and a standby, every node serving what it is
    assigned."""
    return {"a": hosting("a", 0, 2), "b": hosting("b", 1, 0), "c": hosting("c", 2, 1)}


def report(lag: int, caught_up_ago: int = 0) -> PartitionReport:
    return PartitionReport(100 - lag, 100, NOW, NOW - caught_up_ago, NOW)


def snapshot(
    hostings: dict[str, Hosting],
    alive: frozenset[str] = frozenset({"a", "b", "c"}),
    reports: dict[tuple[str, str, int], PartitionReport] | None = None,
) -> RoutingSnapshot:
    placed = {
        p: PartitionAssignment(active, (standby,))
        for p, active, standby in ((0, "a", "b"), (1, "b", "c"), (2, "c", "a"))
    }
    return build_snapshot(
        stores={"customers": StoreInfo("customers", "bookings", 3)},
        assignment=Assignment(7, "a", NOW, {"customers": placed}),
        hostings=hostings,
        reports=reports or {},
        nodes={n: NodeInfo(n, f"http://127.0.0.1:{8081 + i}", 0) for i, n in enumerate("abc")},
        alive=alive,
        built_at_ms=NOW,
    )


def test_one_series_per_replica_in_the_table_with_its_reported_lag():
    reports = {
        ("a", "customers", 0): report(0),
        ("b", "customers", 0): report(40, caught_up_ago=5_000),
        ("b", "customers", 1): report(0),
        ("c", "customers", 1): report(3, caught_up_ago=1_500),
        ("c", "customers", 2): report(0),
        ("a", "customers", 2): report(0),
    }
    text = scrape(snapshot(hosting_everything(), reports=reports))
    lag = sample_values(text, LAG)
    assert len(lag) == 3 * 2, "partitions x replicas per partition"
    assert lag[labels(0, "b", "standby")] == 40
    assert lag[labels(0, "a", "active")] == 0
    assert sample_values(text, TIME_LAG)[labels(0, "b", "standby")] == 5.0
    assert sample_values(text, TIME_LAG)[labels(1, "c", "standby")] == 1.5
    assert sample_values(text, AGE)[labels(0, "b", "standby")] == 0.0
    assert sample_values(text, ALIVE)[labels(0, "b", "standby")] == 1.0


def test_unknown_lag_is_nan_and_the_series_stays():
    text = scrape(snapshot(hosting_everything(), alive=frozenset({"a", "b"}), reports={}))
    for name in (LAG, TIME_LAG, AGE):
        values = sample_values(text, name)
        assert len(values) == 6
        assert all(math.isnan(v) for v in values.values()), name
    assert sample_values(text, ALIVE)[labels(2, "c", "active")] == 0.0


def test_a_replica_that_leaves_the_table_leaves_the_metrics():
    everything = hosting_everything()
    before = scrape(snapshot(everything))
    assert any(dict(k)["node"] == "c" for k in sample_values(before, LAG))
    without_c = {node: h for node, h in everything.items() if node != "c"}  # c stopped hosting
    after = scrape(snapshot(without_c))
    for gauge in GAUGES:
        series = sample_values(after, gauge.name)
        assert len(series) == 4
        assert not [k for k in series if dict(k)["node"] == "c"], gauge.name


def test_an_empty_table_exports_the_families_with_no_series():
    text = scrape(EMPTY)
    assert set(families(text)) == {gauge.name for gauge in GAUGES}
    assert all(not family.samples for family in families(text).values())
    assert_follows_conventions(text)


# -- a real proxy process, reading real Redis ---------------------------------------------------


@pytest.fixture(scope="module")
def cluster(embedded: EmbeddedServices) -> Iterator[StandIns]:
    redis_server = embedded.start_redis()
    backends = {f"n{i}": EchoBackend(f"n{i}").start() for i in range(3)}
    with running_stand_ins(embedded, redis_server, backends, **PROXY_SETTINGS) as running:
        yield running


def metrics_until(stand_ins: StandIns, done: Callable[[str], bool], timeout_s: float = 10) -> str:
    """The proxy's /metrics, scraped until `done` holds for it (the table follows Redis within
    the refresh interval, 200 ms here, or at once on the published event)."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = stand_ins.proxy.admin("/metrics")
        assert response.status_code == 200
        if done(response.text) or time.monotonic() > deadline:
            return response.text
        time.sleep(0.05)


@pytest.mark.integration
def test_a_real_proxy_exports_each_replicas_lag_as_the_cluster_reports_it(cluster: StandIns):
    placed = cluster.cluster.placements["customers"][3]
    standby = placed.standbys[0]
    series = labels(3, standby, "standby")
    cluster.cluster.lag[(standby, "customers", 3)] = 40
    cluster.cluster.lagging_since_ms[(standby, "customers", 3)] = int(time.time() * 1000) - 5_000
    cluster.publish()
    text = metrics_until(cluster, lambda t: sample_values(t, LAG).get(series) == 40)
    assert sample_values(text, LAG)[series] == 40
    assert sample_values(text, TIME_LAG)[series] >= 5.0
    assert 0 <= sample_values(text, AGE)[series] < 5.0
    assert sample_values(text, LAG)[labels(3, placed.active, "active")] == 0
    for gauge in GAUGES:
        assert len(sample_values(text, gauge.name)) == STORES * PARTITIONS * 2, gauge.name
    assert_follows_conventions(text)

    cluster.cluster.lag[(standby, "customers", 3)] = 0  # it caught up
    cluster.publish()
    text = metrics_until(cluster, lambda t: sample_values(t, LAG).get(series) == 0)
    assert sample_values(text, LAG)[series] == 0
    assert sample_values(text, TIME_LAG)[series] < 5.0


@pytest.mark.integration
def test_a_real_proxy_shows_unknown_lag_as_nan_and_drops_departed_replicas(cluster: StandIns):
    # A report that vanishes: the replica stays in the table, its lag is unknown.
    field = lag_field("customers", 5)
    node = cluster.cluster.placements["customers"][5].active
    cluster.publish()
    cluster.redis.hdel(cluster.cluster.keys.lag(node), field)
    keys = cluster.cluster.keys
    cluster.redis.delete(keys.report(node), keys.report_at(node))  # lag:<id> alone says it
    series = labels(5, node, "active")
    text = metrics_until(cluster, lambda t: math.isnan(sample_values(t, LAG).get(series, 0)))
    assert math.isnan(sample_values(text, LAG)[series])
    assert math.isnan(sample_values(text, AGE)[series])

    # n2 leaves: the partitions are dealt over n0 and n1 only, and n2's series go.
    remaining = ["n0", "n1"]
    for store, info in cluster.cluster.stores.items():
        cluster.cluster.placements[store] = round_robin(info.partitions, remaining)
    cluster.cluster.generation += 1
    cluster.publish()

    def without_n2(text: str) -> bool:
        return not any(dict(k)["node"] == "n2" for k in sample_values(text, LAG))

    text = metrics_until(cluster, without_n2)
    for gauge in GAUGES:
        values = sample_values(text, gauge.name)
        assert not [k for k in values if dict(k)["node"] == "n2"], gauge.name
        assert len(values) == STORES * PARTITIONS * 2, "still two replicas per partition"
    assert_follows_conventions(text)
