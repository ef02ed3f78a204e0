"""Issue 18 item 5: fronting a partitioned service that says "not mine" its own way.

Three real uvicorn processes serve `tests.proxy.foreign_app`: a service that answers 404 for a
key of a partition it does not hold, 503 while it rebalances, and has its health check at
/ready (its /health/live is a 404). They are nodes n0-n2 of one cluster whose table in Redis
makes every node a replica of every partition (an active and two standbys). The service's own
placement is set per test and differs from the table, as it does after a rebalance the table
has not caught up with. Two proxies (the C path and the Python path) stand in front, with
KROUTE_RETRY_STATUSES=421,404,503 and KROUTE_HEALTH_PATH=/ready.

Every request carries a unique id that the service echoes (`x-echo-id` and the JSON body), and
every answer is checked to be its own request's, from the node that holds the key.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
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
from tests.proxy.third_party import (
    CONFORMANCE_SETTINGS,
    PATHS,
    STORE,
    ThirdPartyServer,
    start_uvicorn,
    until,
)

pytestmark = pytest.mark.integration

ON_BOTH_PATHS = pytest.mark.parametrize("path", PATHS)
NODES = ("n0", "n1", "n2")
PARTITIONS = 6
UPSTREAM_TIMEOUT_MS = 2000
SETTINGS: dict[str, Any] = {
    **CONFORMANCE_SETTINGS,
    "retry_statuses": "421,404,503",
    "health_path": "/ready",
    "upstream_timeout_ms": str(UPSTREAM_TIMEOUT_MS),
    # Up to two retries per request here, by design: the budget must not be what is tested.
    "min_retries_per_s": "100000",
    "retry_burst": "100000",
}
# The service's placement after "its" rebalance: n0 holds nothing (and rebalances), n1 the
# even partitions, n2 the odd ones; the table in Redis still deals actives round robin.
MOVED = {p: "n1" if p % 2 == 0 else "n2" for p in range(PARTITIONS)}


@dataclass
class Service:
    servers: dict[str, ThirdPartyServer]
    proxies: dict[str, ProxyHandle]
    partitioner: KeyPartitioner
    http: httpx.Client

    def control(self, node: str, **state: Any) -> dict[str, Any]:
        """Set a node's whole state (what is not given is the default): answers it."""
        state = {"node": node, "partitions": PARTITIONS, **state}
        response = self.http.post(self.servers[node].url + "/_control", json=state)
        response.raise_for_status()
        return dict(response.json())

    def hits(self, node: str) -> dict[str, int]:
        """How often each path other than lookups was asked on `node` since its last control."""
        return dict(self.http.get(self.servers[node].url + "/_control").json()["hits"])

    def place(self, owners: dict[int, str], **states: dict[str, Any]) -> None:
        """The service's own placement, and any node's extra state (rebalancing, hang...)."""
        for node in NODES:
            owned = sorted(p for p, owner in owners.items() if owner == node)
            self.control(node, owned=owned, **states.get(node, {}))

    def key_in(self, partition: int, prefix: str = "k") -> str:
        while True:
            key = f"{prefix}-{uuid.uuid4().hex[:10]}"
            if self.partitioner.partition_of(key) == partition:
                return key

    def node_status(self, path: str, node: str) -> dict[str, Any]:
        return dict(self.proxies[path].status()["nodes"][node])

    def ejections(self, path: str) -> int:
        log = self.proxies[path].process.log_path.read_text(errors="replace")
        return log.count("node ejected")


@pytest.fixture(scope="module")
def service(embedded: EmbeddedServices, redis_server: RedisHandle) -> Iterator[Service]:
    servers = {node: start_uvicorn(embedded, "tests.proxy.foreign_app:app") for node in NODES}
    client = redis.Redis.from_url(redis_server.url)
    keys = Keys(f"foreign-{uuid.uuid4().hex[:8]}")
    cluster = StaticCluster(keys, {node: server.url for node, server in servers.items()})
    cluster.add_store(StoreInfo(STORE, STORE, PARTITIONS, "string"), standbys=2)
    cluster.publish(client)
    proxies: dict[str, ProxyHandle] = {}
    http = httpx.Client(timeout=10, trust_env=False)
    try:
        for path in PATHS:
            proxies[path] = start_proxy(
                embedded,
                redis_server.url,
                name=f"proxy-foreign-{path}-{keys.cluster}",
                cluster=keys.cluster,
                hot_path="true" if path == "c" else "false",
                **SETTINGS,
            )
        yield Service(servers, proxies, KeyPartitioner("string", "murmur2", PARTITIONS), http)
    finally:
        for handle in proxies.values():
            handle.process.stop()
            handle.close()
        for server in servers.values():
            server.stop()
        http.close()
        client.close()


def lookup(
    client: httpx.Client, key: str, method: str = "GET"
) -> tuple[str, httpx.Response | Exception]:
    rid = f"r-{uuid.uuid4().hex[:12]}"
    try:
        response = client.request(
            method, f"/stores/{STORE}/keys/{key}", headers={"x-request-id": rid}
        )
    except httpx.HTTPError as exc:
        return rid, exc
    return rid, response


def whose(response: httpx.Response, rid: str, method: str) -> str | None:
    """None if the answer is `rid`'s own; else whose it is (the worst finding)."""
    echo = response.headers.get("x-echo-id")
    if echo != rid:
        return f"WRONG CLIENT: request {rid} got the answer of {echo!r} ({response.status_code})"
    if method == "GET" and response.json().get("id") != rid:
        return f"WRONG CLIENT: request {rid}'s body is {response.text[:120]!r}"
    return None


def owned_answer_problem(
    service: Service, key: str, rid: str, method: str, answer: httpx.Response | Exception
) -> str | None:
    """None if `key`'s lookup got its own 200 from the node that holds the key."""
    if isinstance(answer, Exception):
        return f"FAILED: {method} {key} (id {rid}): {answer!r}"
    if problem := whose(answer, rid, method):
        return problem
    if answer.status_code != 200:
        return f"FAILED: {method} {key} (id {rid}): {answer.status_code} {answer.text[:160]!r}"
    owner = MOVED[service.partitioner.partition_of(key)]
    node = answer.headers.get("x-kroute-node")
    if node != owner or (method == "GET" and answer.json()["node"] != owner):
        return f"WRONG NODE: {key} (id {rid}) answered by {node}, held by {owner}"
    return None


@pytest.fixture
def rebalanced(service: Service) -> Iterator[Service]:
    """The service moved its partitions away from the table, and n0 is still rebalancing."""
    service.place(MOVED, n0={"rebalancing": True})
    yield service
    service.place(MOVED)


@ON_BOTH_PATHS
def test_requests_land_on_the_replica_that_holds_the_key(rebalanced: Service, path: str) -> None:
    """404 "not mine" and 503 "rebalancing" are retried on the next replica, under concurrency,
    and every client gets its own answer from the holder; no node is ejected for them."""
    service = rebalanced
    proxy = service.proxies[path]
    ejected_before = service.ejections(path)
    clients, per_client = 16, 20

    def session(seed: int) -> list[tuple[str, str | None]]:
        results = []
        with httpx.Client(base_url=proxy.url, timeout=20, trust_env=False) as client:
            for i in range(per_client):
                key = service.key_in((seed + i) % PARTITIONS, f"c{seed}")
                method = "HEAD" if i % 5 == 4 else "GET"
                rid, answer = lookup(client, key, method)
                attempts = (
                    ""
                    if isinstance(answer, Exception)
                    else answer.headers.get("x-kroute-attempts", "1")
                )
                results.append((attempts, owned_answer_problem(service, key, rid, method, answer)))
        return results

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = [r for rs in pool.map(session, range(clients)) for r in rs]
    problems = [p for _, p in results if p]
    assert not problems, f"{len(problems)} of {len(results)}:\n" + "\n".join(problems[:15])
    attempts = {a for a, _ in results}
    assert {"2", "3"} <= attempts, f"the table sends some keys straight to the holder: {attempts}"
    for node in NODES:
        assert service.node_status(path, node)["ejected_since_ms"] is None, node
    assert service.ejections(path) == ejected_before, "a retry status must not eject a node"
    metrics = proxy.admin("/metrics").text
    assert 'kroute_proxy_misdirected_total{node="n0"}' in metrics
    if path == "c":  # the C path forwarded the lookups; the retry statuses went to Python
        hot = next(line for line in metrics.splitlines() if line.startswith("kroute_proxy_hot"))
        assert float(hot.split()[-1]) > 0, hot


@ON_BOTH_PATHS
@pytest.mark.parametrize("case", ["absent-key", "all-rebalancing"])
def test_when_every_replica_answers_a_retry_status_the_last_answer_is_passed_on(
    service: Service, path: str, case: str
) -> None:
    """A key no replica has is the service's own 404 (not a proxy 503); a partition whose
    replicas all rebalance is the service's own 503. Each replica was asked once."""
    if case == "absent-key":
        service.place(MOVED)
    else:
        service.place(MOVED, **{node: {"rebalancing": True} for node in NODES})
    try:
        for partition in range(PARTITIONS):
            key = service.key_in(partition, "absent")
            with httpx.Client(base_url=service.proxies[path].url, timeout=20) as client:
                rid, answer = lookup(client, key)
            assert not isinstance(answer, Exception), answer
            assert whose(answer, rid, "GET") is None, whose(answer, rid, "GET")
            want = (
                (404, {"no_such_key", "not_mine"})
                if case == "absent-key"
                else (503, {"rebalancing"})
            )
            assert answer.status_code == want[0], answer.text
            assert answer.json()["error"] in want[1], answer.text
            assert answer.headers["x-kroute-attempts"] == "3"
            assert answer.headers["x-kroute-partition"] == str(partition)
            assert answer.headers["x-kroute-node"] == answer.json()["node"]
    finally:
        service.place(MOVED)


@ON_BOTH_PATHS
def test_an_ejected_node_is_probed_at_the_health_path(service: Service, path: str) -> None:
    """n2 hangs, so a lookup times out on it and it is ejected. Its /ready answers 503: it
    stays out (its /health/live, a 404, would have let it back: the probes never ask it).
    Once /ready answers 200 it is back, and answers for the partitions it holds."""
    sick = {"hang": True, "healthy": False}
    service.place(MOVED, n2=sick)
    try:
        key = service.key_in(2)  # the table's active for partition 2 is n2; n1 holds it
        with httpx.Client(base_url=service.proxies[path].url, timeout=20) as client:
            rid, answer = lookup(client, key)
        assert owned_answer_problem(service, key, rid, "GET", answer) is None, answer
        assert service.node_status(path, "n2")["ejected_since_ms"] is not None
        time.sleep(1.5)  # eject_ms (300) and many probes (every 100 ms)
        assert service.node_status(path, "n2")["ejected_since_ms"] is not None, "back while sick"
        hits = service.hits("n2")
        assert hits.get("/ready", 0) >= 3, hits
        assert "/health/live" not in hits, hits
        service.place(MOVED)  # healthy, answering again
        back = until(lambda: service.node_status(path, "n2")["ejected_since_ms"] is None, 10)
        assert back, service.node_status(path, "n2")
        key = service.key_in(3)  # held by n2
        with httpx.Client(base_url=service.proxies[path].url, timeout=20) as client:
            rid, answer = lookup(client, key)
        assert owned_answer_problem(service, key, rid, "GET", answer) is None, answer
    finally:
        with contextlib.suppress(httpx.HTTPError):
            service.place(MOVED)
