"""Issue 19 items 1 and 2: hedged reads for slow nodes, and outlier ejection on 5xx answers.

Three real uvicorn processes serve `tests.proxy.slow_app` as nodes n0-n2 of one cluster in real
Redis: every node a replica of every partition (an active and two standbys, actives dealt
round robin, so n0 is the active of partitions 0 and 3). A node is made slow by SIGSTOP (the
real thing: its process stops, its kernel still accepts and buffers) or by a delay, and broken
by answering 500. Each test starts its own proxies, one with the C path and one without
(`PATHS`), so no ejection leaks from one test into the next.

Every request carries a unique id that the node echoes (header and body), and every answer is
checked to be its own request's: a hedge's loser answering late must never reach a client.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import re
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import redis

from common.contract import Keys, StoreInfo
from kroute.embedded import EmbeddedServices, RedisHandle
from kroute.proxies import ProxyHandle, start_proxy
from kroute.static_cluster import StaticCluster
from partitioner import KeyPartitioner
from tests.proxy.third_party import PATHS, STORE, ThirdPartyServer, start_uvicorn

pytestmark = pytest.mark.integration

ON_BOTH_PATHS = pytest.mark.parametrize("path", PATHS)
NODES = ("n0", "n1", "n2")
PARTITIONS = 6
N0_ACTIVE = (0, 3)  # round robin over n0, n1, n2
N1_ACTIVE = (1, 4)
TIMEOUT_MS = 1500  # KROUTE_UPSTREAM_TIMEOUT_MS: what a request waits without hedging
HEDGE_MS = 40
BASE: dict[str, str] = {
    "upstream_timeout_ms": str(TIMEOUT_MS),
    "lag_report_stale_ms": "600000",
    "refresh_interval_ms": "200",
    "probe_interval_ms": "100",
    "log_level": "warning",
    "retry_budget_percent": "100",
    "min_retries_per_s": "100000",
    "retry_burst": "100000",
}


@dataclass
class Cluster:
    embedded: EmbeddedServices
    redis_url: str
    cluster: str
    servers: dict[str, ThirdPartyServer]
    partitioner: KeyPartitioner
    http: httpx.Client

    def control(self, node: str, **state: Any) -> None:
        response = self.http.post(
            self.servers[node].url + "/_control", json={"node": node, **state}
        )
        response.raise_for_status()

    def lookups(self, node: str) -> int:
        return int(self.http.get(self.servers[node].url + "/_control").json()["lookups"])

    def key_in(self, partitions: tuple[int, ...], prefix: str = "k") -> str:
        while True:
            key = f"{prefix}-{uuid.uuid4().hex[:10]}"
            if self.partitioner.partition_of(key) in partitions:
                return key

    @contextlib.contextmanager
    def proxy(self, path: str, **settings: str) -> Iterator[ProxyHandle]:
        handle = start_proxy(
            self.embedded,
            self.redis_url,
            name=f"proxy-hedging-{path}-{uuid.uuid4().hex[:6]}",
            cluster=self.cluster,
            hot_path="true" if path == "c" else "false",
            **{**BASE, **settings},
        )
        try:
            yield handle
        finally:
            handle.process.stop()
            handle.close()

    @contextlib.contextmanager
    def stopped(self, node: str) -> Iterator[None]:
        """The node's process is stopped (SIGSTOP) and always continued after."""
        self.servers[node].process.signal(signal.SIGSTOP)
        try:
            yield
        finally:
            self.servers[node].process.signal(signal.SIGCONT)


@pytest.fixture(scope="module")
def cluster(embedded: EmbeddedServices, redis_server: RedisHandle) -> Iterator[Cluster]:
    servers = {node: start_uvicorn(embedded, "tests.proxy.slow_app:app") for node in NODES}
    client = redis.Redis.from_url(redis_server.url)
    keys = Keys(f"hedging-{uuid.uuid4().hex[:8]}")
    static = StaticCluster(keys, {node: server.url for node, server in servers.items()})
    static.add_store(StoreInfo(STORE, STORE, PARTITIONS, "string"), standbys=2)
    static.publish(client)
    http = httpx.Client(timeout=10, trust_env=False)
    try:
        yield Cluster(
            embedded,
            redis_server.url,
            keys.cluster,
            servers,
            KeyPartitioner("string", "murmur2", PARTITIONS),
            http,
        )
    finally:
        for server in servers.values():
            server.stop()
        http.close()
        client.close()


@pytest.fixture(autouse=True)
def healthy(cluster: Cluster) -> Iterator[None]:
    for node in NODES:
        cluster.control(node)
    yield
    for node in NODES:
        cluster.control(node)


@dataclass
class Lookup:
    key: str
    rid: str
    seconds: float
    status: int | None  # None: the request failed
    node: str | None
    problem: str | None  # not this request's own answer, or not an answer at all


def lookup(client: httpx.Client, key: str) -> Lookup:
    rid = f"r-{uuid.uuid4().hex[:12]}"
    started = time.monotonic()
    try:
        response = client.get(f"/stores/{STORE}/keys/{key}", headers={"x-request-id": rid})
    except httpx.HTTPError as exc:
        return Lookup(key, rid, time.monotonic() - started, None, None, f"FAILED: {exc!r}")
    seconds = time.monotonic() - started
    echo, body_id = response.headers.get("x-echo-id"), response.json().get("id")
    problem = None
    if echo != rid or body_id != rid:
        problem = f"WRONG CLIENT: {rid} got the answer of {echo!r} (body {body_id!r})"
    node = response.headers.get("x-kroute-node")
    return Lookup(key, rid, seconds, response.status_code, node, problem)


def lookup_loop(
    cluster: Cluster, proxy: ProxyHandle, clients: int, seconds: float, partitions: tuple[int, ...]
) -> list[Lookup]:
    """`clients` keep-alive connections asking keys of `partitions` back to back."""

    def session(_: int) -> list[Lookup]:
        results = []
        ends = time.monotonic() + seconds
        with httpx.Client(base_url=proxy.url, timeout=10, trust_env=False) as client:
            while time.monotonic() < ends:
                results.append(lookup(client, cluster.key_in(partitions)))
        return results

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        return [r for rs in pool.map(session, range(clients)) for r in rs]


def counter(proxy: ProxyHandle, name: str) -> float:
    text = proxy.admin("/metrics").text
    found = re.search(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, flags=re.MULTILINE)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


def problems(results: list[Lookup]) -> list[str]:
    found = [r.problem for r in results if r.problem]
    found += [f"{r.rid}: status {r.status}" for r in results if not r.problem and r.status != 200]
    return found


# -- hedged reads -------------------------------------------------------------------------------


@ON_BOTH_PATHS
def test_sigstop_of_the_active_costs_no_request_the_timeout_with_hedging(
    cluster: Cluster, path: str
) -> None:
    """n0 is stopped under a lookup loop of its partitions: every lookup is answered, its own,
    well under the timeout (the hedge goes to a standby after 40 ms); n0 loses its races and
    is ejected after 5 of them, so the rest go to a standby first and cost no hedge."""
    with cluster.proxy(path, hedge_after_ms=str(HEDGE_MS)) as proxy:
        lookup_loop(cluster, proxy, clients=4, seconds=0.5, partitions=N0_ACTIVE)  # warm pool
        with cluster.stopped("n0"):
            results = lookup_loop(cluster, proxy, clients=4, seconds=3, partitions=N0_ACTIVE)
            ejected = proxy.status()["nodes"]["n0"]["ejected_since_ms"]  # probes fail meanwhile
        assert ejected is not None
        assert not problems(results), problems(results)[:10]
        slowest = max(r.seconds for r in results)
        assert slowest < TIMEOUT_MS / 1000 / 2, f"a request waited {slowest:.3f} s"
        assert {r.node for r in results} <= {"n1", "n2"}
        hedges = counter(proxy, "kroute_proxy_hedges_sent_total")
        won = counter(proxy, "kroute_proxy_hedges_won_total")
        assert won >= 1, won
        assert hedges < len(results) / 4, f"{hedges} hedges for {len(results)} lookups"
        assert counter(proxy, "kroute_proxy_outlier_ejections_total") == 1


@ON_BOTH_PATHS
@pytest.mark.parametrize("per_try_ms", [None, 300])
def test_sigstop_of_the_active_without_hedging(
    cluster: Cluster, path: str, per_try_ms: int | None
) -> None:
    """Today's behaviour: the lookups in flight on the stopped n0 wait the whole timeout (the
    per-try timeout when set), then fail over; every answer is still its own and correct."""
    settings = {} if per_try_ms is None else {"per_try_timeout_ms": str(per_try_ms)}
    wait_s = (per_try_ms or TIMEOUT_MS) / 1000
    with cluster.proxy(path, **settings) as proxy:
        lookup_loop(cluster, proxy, clients=4, seconds=0.5, partitions=N0_ACTIVE)
        with cluster.stopped("n0"):
            results = lookup_loop(cluster, proxy, clients=4, seconds=2, partitions=N0_ACTIVE)
        assert not problems(results), problems(results)[:10]
        slowest = max(r.seconds for r in results)
        assert wait_s * 0.9 <= slowest < wait_s + 0.5, slowest
        assert counter(proxy, "kroute_proxy_hedges_sent_total") == 0


@ON_BOTH_PATHS
def test_a_hedge_losers_late_answer_never_reaches_a_client(cluster: Cluster, path: str) -> None:
    """n0 answers every lookup after 250 ms: each lookup of its partitions is hedged and a
    standby wins; n0's answers still arrive, late, on connections the proxy closed. Under 12
    keep-alive connections, every client gets its own answer (ids checked), and n0 is asked
    (it is the active: no ejection on lost races here)."""
    cluster.control("n0", delay_ms=250)
    with cluster.proxy(path, hedge_after_ms=str(HEDGE_MS), eject_consecutive_5xx="0") as proxy:
        results = lookup_loop(cluster, proxy, clients=12, seconds=3, partitions=(*N0_ACTIVE, 1))
        time.sleep(0.5)  # n0's last late answers arrive
        assert not problems(results), problems(results)[:10]
        hedged = [r for r in results if cluster.partitioner.partition_of(r.key) in N0_ACTIVE]
        assert {r.node for r in hedged} <= {"n1", "n2"}
        won = counter(proxy, "kroute_proxy_hedges_won_total")
        assert won == len(hedged), (won, len(hedged))
        assert cluster.lookups("n0") >= won
        assert max(r.seconds for r in results) < TIMEOUT_MS / 1000 / 2
        # The late answers were never read: the proxy's connections to n0 are gone or idle.
        assert counter(proxy, "kroute_proxy_upstream_connections_busy") == 0


@ON_BOTH_PATHS
def test_hedges_are_limited_by_the_retry_budget(cluster: Cluster, path: str) -> None:
    """A budget of 3 retries and no refill: 3 lookups are hedged (fast, from a standby); the
    others wait for slow n0."""
    cluster.control("n0", delay_ms=300)
    budget = {"retry_budget_percent": "0", "min_retries_per_s": "0", "retry_burst": "3"}
    with cluster.proxy(
        path, hedge_after_ms=str(HEDGE_MS), eject_consecutive_5xx="0", **budget
    ) as proxy:
        with httpx.Client(base_url=proxy.url, timeout=10, trust_env=False) as client:
            results = [lookup(client, cluster.key_in(N0_ACTIVE)) for _ in range(12)]
        assert not problems(results), problems(results)
        assert {r.node for r in results[:3]} <= {"n1", "n2"}, results
        assert [r.node for r in results[3:]] == ["n0"] * 9
        assert all(r.seconds >= 0.3 for r in results[3:])
        assert counter(proxy, "kroute_proxy_hedges_sent_total") == 3
        assert counter(proxy, "kroute_proxy_hedges_won_total") == 3
        assert counter(proxy, "kroute_proxy_retry_budget_exhausted_total") == 9


# -- outlier ejection on 5xx ---------------------------------------------------------------------


def statuses(proxy: ProxyHandle, keys: list[str]) -> list[tuple[int | None, str | None]]:
    with httpx.Client(base_url=proxy.url, timeout=10, trust_env=False) as client:
        results = [lookup(client, key) for key in keys]
    assert not [r.problem for r in results if r.problem]
    return [(r.status, r.node) for r in results]


@ON_BOTH_PATHS
def test_consecutive_5xx_eject_a_node(cluster: Cluster, path: str) -> None:
    """n0 answers 500 to every lookup: the first 5 are passed on, then n0 is ejected and its
    partitions are served by a standby."""
    cluster.control("n0", error_status=500)
    with cluster.proxy(path, eject_ms="60000") as proxy:
        got = statuses(proxy, [cluster.key_in(N0_ACTIVE) for _ in range(10)])
        assert got[:5] == [(500, "n0")] * 5, got
        assert all(status == 200 and node != "n0" for status, node in got[5:]), got
        assert proxy.status()["nodes"]["n0"]["ejected_since_ms"] is not None
        assert counter(proxy, "kroute_proxy_outlier_ejections_total") == 1


@ON_BOTH_PATHS
def test_an_answer_below_500_ends_the_streak(cluster: Cluster, path: str) -> None:
    """n0 answers 500 to keys starting with "bad" and 200 to others: 4 bad, 1 good, over and
    over, never 5 in a row, so n0 is never ejected. On the C path the good answers are
    served in C: they must count too."""
    cluster.control("n0", error_status=500, error_prefix="bad")
    with cluster.proxy(path, eject_ms="60000") as proxy:
        keys = []
        for _ in range(4):
            keys += [cluster.key_in(N0_ACTIVE, "bad") for _ in range(4)]
            keys.append(cluster.key_in(N0_ACTIVE, "good"))
        got = statuses(proxy, keys)
        assert [status for status, _ in got] == [500, 500, 500, 500, 200] * 4
        assert {node for _, node in got} == {"n0"}
        assert proxy.status()["nodes"]["n0"]["ejected_since_ms"] is None
        assert counter(proxy, "kroute_proxy_outlier_ejections_total") == 0
        if path == "c":
            assert counter(proxy, "kroute_proxy_hot_path_requests_total") >= 4


@ON_BOTH_PATHS
def test_the_ejection_cap_keeps_most_nodes_in(cluster: Cluster, path: str) -> None:
    """n0 and n1 both answer 500 (a bad deploy on 2 of 3 nodes): with a 50% cap only one of
    them is ejected; the other keeps answering (its 500s passed on), and the refusals are
    counted."""
    cluster.control("n0", error_status=500)
    cluster.control("n1", error_status=500)
    with cluster.proxy(path, eject_ms="60000", max_ejection_percent="50") as proxy:
        keys = [cluster.key_in(N0_ACTIVE if i % 2 else N1_ACTIVE) for i in range(30)]
        statuses(proxy, keys)
        nodes = proxy.status()["nodes"]
        ejected = [n for n in NODES if nodes[n]["ejected_since_ms"] is not None]
        assert len(ejected) == 1, ejected
        assert ejected[0] in {"n0", "n1"}, ejected
        assert counter(proxy, "kroute_proxy_outlier_ejections_total") == 1
        assert counter(proxy, "kroute_proxy_outlier_ejections_capped_total") >= 1
