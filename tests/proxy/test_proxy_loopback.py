"""The proxy process over real sockets: routing, provenance, failover, budgets, Redis outages.

Stand-in nodes (echo backends) are published in a real redis-server, so every routing decision
here is checked against what reached which backend. Tests that change the cluster restore it.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
import uuid

import httpx
import pytest

from common.contract import Event, PartitionAssignment, encode
from kroute.proxies import start_proxy
from partitioner import partition, serialize_key
from tests.proxy.conftest import PARTITIONS, PROXY_SETTINGS, StandIns
from tests.proxy.echo_backend import EchoBackend

pytestmark = pytest.mark.integration


def owner(stand_ins: StandIns, store: str, key: str) -> tuple[int, PartitionAssignment]:
    info = stand_ins.cluster.stores[store]
    chosen = partition(serialize_key(key, info.key_format), PARTITIONS)
    return chosen, stand_ins.cluster.placements[store][chosen]


# The proxy tells time by Redis's clock, through an offset it measured over a round trip to
# Redis: under load (the sanitizer tier) its reading can differ from ours by a few ms.
CLOCK_SLACK_MS = 50


def published_for_ms(stand_ins: StandIns) -> int:
    """How long ago the stand-ins' reports said they were caught up (an upper bound)."""
    return int(time.time() * 1000) - stand_ins.published_at_ms + 1 + CLOCK_SLACK_MS


@pytest.mark.parametrize(
    ("store", "keys"),
    [
        ("customers", [f"customer-{i}" for i in range(60)] + ["", "ä/ö", "emoji-🚀"]),
        ("cards", [str(n) for n in (0, 1, -1, 2**63 - 1, -(2**63), *range(1000, 1040))]),
        ("devices", [str(uuid.UUID(int=i * 7919 + 1)) for i in range(40)]),
    ],
)
def test_every_key_goes_to_its_partitions_active(stand_ins, store, keys):
    for key in keys:
        chosen, placed = owner(stand_ins, store, key)
        path = f"/stores/{store}/keys/{httpx.URL(path='/' + key).raw_path.decode()[1:]}"
        if "/" in key:
            path = f"/stores/{store}/keys/{key.replace('/', '%2F')}"
        response = stand_ins.proxy.get(path)
        assert response.status_code == 200, response.text
        assert response.headers["x-backend"] == placed.active, (key, chosen)
        assert response.headers["x-kroute-node"] == placed.active
        assert response.headers["x-kroute-partition"] == str(chosen)
        assert response.headers["x-kroute-role"] == "active"
        assert response.headers["x-kroute-lag"] == "0"
        # Lag 0 at the last report, which was published before this test: the bound is the
        # report's age, never 0 by itself (records could have arrived since).
        assert 0 <= int(response.headers["x-kroute-time-lag-ms"]) <= published_for_ms(stand_ins)


def test_keys_from_query_and_header_routes(stand_ins):
    for key in ("alice", "bob", "carol"):
        _, placed = owner(stand_ins, "customers", key)
        response = stand_ins.proxy.get("/lookup", params={"id": key})
        assert response.headers["x-backend"] == placed.active
    for number in ("7", "-42", "123456789"):
        _, placed = owner(stand_ins, "cards", number)
        response = stand_ins.proxy.get("/check", headers={"x-card": number})
        assert response.headers["x-backend"] == placed.active
    missing = stand_ins.proxy.get("/lookup")
    assert missing.status_code == 400
    assert missing.json()["error"] == "invalid_key"
    assert "id" in missing.json()["detail"]


def test_forwarded_request_is_rewritten_for_the_node(stand_ins):
    response = stand_ins.proxy.get(
        "/stores/customers/keys/alice",
        headers={
            "x-forwarded-for": "10.1.1.1",
            "connection": "keep-alive, x-secret",
            "x-secret": "hop",
            "te": "trailers",
            "x-request-id": "req-123",
            "x-custom": "kept",
        },
    )
    echoed = dict(response.json()["headers"])
    assert echoed["x-forwarded-for"] == "10.1.1.1, 127.0.0.1"
    assert echoed["x-forwarded-proto"] == "http"
    assert echoed["x-custom"] == "kept"
    assert echoed["x-request-id"] == "req-123"
    assert "x-secret" not in echoed
    assert "te" not in echoed
    assert echoed["host"].startswith("127.0.0.1:")
    assert response.headers["x-request-id"] == "req-123"
    # The node's own provenance headers are replaced by the proxy's; hop-by-hop ones dropped.
    assert response.headers.get_list("x-kroute-node") == [response.headers["x-backend"]]
    assert "keep-alive" not in response.headers


def test_unkeyed_requests_go_round_robin_to_live_nodes(stand_ins):
    answers = [
        stand_ins.proxy.get(f"/anything/{i}", headers={"x-request-id": f"u{i}"}) for i in range(9)
    ]
    assert {a.json()["node"] for a in answers} == set(stand_ins.backends)
    for i, answer in enumerate(answers):  # provenance on unkeyed answers too, well formed
        assert answer.headers["x-kroute-node"] == answer.headers["x-backend"]
        assert answer.headers["x-request-id"] == f"u{i}"
        assert not any(
            name.endswith("x-request-id") and name != "x-request-id" for name in answer.headers
        )
    posted = stand_ins.proxy.client.post(stand_ins.proxy.url + "/orders", content=b"x" * 100)
    assert posted.status_code == 200
    assert posted.json()["body"] == "x" * 100


def test_head_gets_headers_only(stand_ins):
    response = stand_ins.proxy.client.head(stand_ins.proxy.url + "/stores/customers/keys/alice")
    assert response.status_code == 200
    assert response.content == b""
    assert int(response.headers["content-length"]) > 0


def test_unknown_store_invalid_key_bad_budget_and_method(stand_ins):
    before = stand_ins.received()
    unknown = stand_ins.proxy.get("/stores/nope/keys/a")
    assert unknown.status_code == 404
    assert unknown.json()["error"] == "unknown_store"
    assert sorted(unknown.json()["stores"]) == ["cards", "customers", "devices"]
    bad_int = stand_ins.proxy.get("/stores/cards/keys/12x")
    assert bad_int.status_code == 400
    assert bad_int.json()["error"] == "invalid_key"
    assert bad_int.json()["key_format"] == "int64"
    bad_uuid = stand_ins.proxy.get("/stores/devices/keys/not-a-uuid")
    assert bad_uuid.status_code == 400
    budget = stand_ins.proxy.get("/stores/customers/keys/a", headers={"x-kroute-max-lag": "-1"})
    assert budget.status_code == 400
    assert budget.json()["header"] == "x-kroute-max-lag"
    post = stand_ins.proxy.client.post(stand_ins.proxy.url + "/stores/customers/keys/a")
    assert post.status_code == 405
    assert post.headers["allow"] == "GET, HEAD"
    assert stand_ins.received() == before, "a rejected request reached a node"


def set_lag(stand_ins: StandIns, lags: dict[tuple[str, str, int], int]) -> None:
    cluster = stand_ins.cluster
    cluster.lag = dict(lags)
    cluster.lagging_since_ms = {k: int(time.time() * 1000) - 5_000 for k in lags}
    cluster.generation += 1
    cluster.publish(stand_ins.redis)
    # Lag reports are read by the proxy's sweep, or at once for a node a `lag` event names (as
    # kroute's nodes send when a report changes what they serve): name each one changed here.
    for node_id in {node for node, _, _ in lags}:
        stand_ins.redis.publish(cluster.keys.events, encode(Event("lag", node_id=node_id)))
    time.sleep(0.5)  # the proxy reads them on the events


def test_lag_budget_per_request_and_the_503_that_says_why(stand_ins):
    key = "budget-key"
    chosen, placed = owner(stand_ins, "customers", key)
    standby = placed.standbys[0]
    assert placed.active is not None
    set_lag(
        stand_ins,
        {(placed.active, "customers", chosen): 500, (standby, "customers", chosen): 40},
    )
    try:
        path = f"/stores/customers/keys/{key}"
        unlimited = stand_ins.proxy.get(path)
        assert unlimited.headers["x-backend"] == placed.active  # no budget: the active
        within = stand_ins.proxy.get(path, headers={"x-kroute-max-lag": "100"})
        assert within.headers["x-backend"] == standby
        assert within.headers["x-kroute-role"] == "standby"
        assert within.headers["x-kroute-lag"] == "40"
        assert int(within.headers["x-kroute-time-lag-ms"]) >= 5_000
        before = stand_ins.received()
        none = stand_ins.proxy.get(path, headers={"x-kroute-max-lag": "10"})
        assert none.status_code == 503
        body = none.json()
        assert body["error"] == "no_replica"
        assert body["partition"] == chosen
        assert body["budget"] == {"max_lag": 10, "max_lag_ms": None}
        reasons = {r["node"]: r["reason"] for r in body["replicas"]}
        assert reasons == {
            placed.active: "lag 500 over budget 10",
            standby: "lag 40 over budget 10",
        }
        by_time = stand_ins.proxy.get(path, headers={"x-kroute-max-lag-ms": "1000"})
        assert by_time.status_code == 503
        assert "time lag" in by_time.json()["replicas"][0]["reason"]
        assert stand_ins.received() == before
    finally:
        set_lag(stand_ins, {})


class Load:
    """Keyed GETs from several threads until stopped; every outcome is kept."""

    def __init__(self, url: str, keys: list[str], threads: int = 6) -> None:
        self.url, self.keys = url, keys
        self.statuses: list[int] = []
        self.errors: list[str] = []
        self.backends: list[str] = []
        self._stop = threading.Event()
        self._pool = concurrent.futures.ThreadPoolExecutor(threads)
        self._futures = [self._pool.submit(self._run, i) for i in range(threads)]

    def _run(self, offset: int) -> None:
        with httpx.Client(timeout=5, trust_env=False) as client:
            i = offset
            while not self._stop.is_set():
                key = self.keys[i % len(self.keys)]
                i += 7
                try:
                    response = client.get(f"{self.url}/stores/customers/keys/{key}")
                    self.statuses.append(response.status_code)
                    self.backends.append(response.headers.get("x-backend", ""))
                    if response.status_code != 200:
                        self.errors.append(response.text)
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))

    def stop(self) -> None:
        self._stop.set()
        for future in self._futures:
            future.result()
        self._pool.shutdown()


def test_a_dying_node_under_load_fails_no_request(stand_ins):
    keys = [f"load-{i}" for i in range(200)]
    victim = "n1"
    load = Load(stand_ins.proxy.url, keys)
    time.sleep(0.5)
    stand_ins.backends[victim].stop()  # refuses and resets like a killed process
    time.sleep(1.5)
    served_during = len(load.statuses)
    stand_ins.backends[victim].restart()
    time.sleep(1.0)
    load.stop()
    assert load.errors == []
    assert served_during > 100
    status = stand_ins.proxy.status()
    assert status["nodes"][victim]["failures"] >= 1
    metrics = stand_ins.proxy.admin("/metrics").text
    assert "kroute_proxy_failovers_total" in metrics
    # Back in rotation after the probe: the victim answers again for its partitions.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if stand_ins.proxy.status()["nodes"][victim]["ejected_since_ms"] is None:
            break
        time.sleep(0.1)
    assert stand_ins.proxy.status()["nodes"][victim]["ejected_since_ms"] is None


def test_misdirected_answer_refreshes_and_tries_the_next_replica(stand_ins):
    key = "misdirected-key"
    _, placed = owner(stand_ins, "customers", key)
    assert placed.active is not None
    stand_ins.backends[placed.active].mode = "421"
    try:
        response = stand_ins.proxy.get(f"/stores/customers/keys/{key}")
    finally:
        stand_ins.backends[placed.active].mode = "ok"
    assert response.status_code == 200
    assert response.headers["x-backend"] == placed.standbys[0]
    assert response.headers["x-kroute-attempts"] == "2"
    assert (
        f'kroute_proxy_misdirected_total{{node="{placed.active}"}}'
        in stand_ins.proxy.admin("/metrics").text
    )


def test_a_hung_node_times_out_and_the_standby_answers(stand_ins):
    key = "hung-key"
    _, placed = owner(stand_ins, "customers", key)
    assert placed.active is not None
    stand_ins.backends[placed.active].mode = "hang"
    try:
        started = time.monotonic()
        response = stand_ins.proxy.get(f"/stores/customers/keys/{key}")
        elapsed = time.monotonic() - started
    finally:
        stand_ins.backends[placed.active].mode = "ok"
    assert response.status_code == 200
    assert response.headers["x-backend"] == placed.standbys[0]
    assert 0.9 < elapsed < 3.0  # one upstream timeout (1 s), then the standby
    time.sleep(1.0)  # let the probe bring it back for the tests after this one


@pytest.mark.parametrize(
    "headers",
    [{}, {"x-kroute-max-lag-ms": "600000", "x-request-id": "kept-close"}],
    ids=["c-path", "python-path"],
)
def test_a_kept_connection_the_node_closes_unanswered_is_resent_not_failed_over(stand_ins, headers):
    """A node's keep-alive timeout may close a pooled connection just as a request goes out
    on it: that is not the node failing, so the same node answers over a new connection."""
    key = "kept-close-key"
    _, placed = owner(stand_ins, "customers", key)
    node = placed.active
    assert node is not None
    failures_before = stand_ins.proxy.status()["nodes"][node]["failures"]
    stand_ins.backends[node].mode = "close-kept"
    try:
        answers = [
            stand_ins.proxy.get(f"/stores/customers/keys/{key}", headers=headers)
            for _ in range(3)  # the first may open a connection; the rest reuse kept ones
        ]
    finally:
        stand_ins.backends[node].mode = "ok"
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert [a.headers["x-backend"] for a in answers] == [node] * 3
    assert all("x-kroute-attempts" not in a.headers for a in answers)
    status = stand_ins.proxy.status()["nodes"][node]
    assert status["failures"] == failures_before
    assert status["ejected_since_ms"] is None
    metrics = stand_ins.proxy.admin("/metrics").text
    resent = [
        line for line in metrics.splitlines()
        if line.startswith("kroute_proxy_resent_after_kept_close_total ")
    ]  # fmt: skip
    assert resent
    assert float(resent[0].split()[1]) >= 2


def test_idle_connections_to_nodes_are_closed_before_the_nodes_close_them(stand_ins):
    key = "idle-close-key"
    _, placed = owner(stand_ins, "customers", key)
    backend = stand_ins.backends[placed.active]
    assert stand_ins.proxy.get(f"/stores/customers/keys/{key}").status_code == 200
    assert backend.transports, "the proxy keeps the connection it used"
    deadline = time.monotonic() + 3.0  # upstream_idle_timeout_ms is 1000 here
    while backend.transports and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not backend.transports


def test_redis_stopped_and_restarted_under_load(stand_ins):
    keys = [f"redis-{i}" for i in range(100)]
    load = Load(stand_ins.proxy.url, keys, threads=4)
    time.sleep(0.3)
    port = stand_ins.redis_server.port
    stand_ins.redis_server.process.stop()
    deadline = time.monotonic() + 5
    while not stand_ins.proxy.status()["proxy"]["degraded"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stand_ins.proxy.status()["proxy"]["degraded"] is True
    served_while_down = len(load.statuses)
    time.sleep(1.0)
    assert len(load.statuses) > served_while_down  # still routing on the last table
    restarted = stand_ins.services.start_redis(port=port)  # empty: the data is gone
    stand_ins.redis_server = restarted
    stand_ins.publish()  # nodes re-register (stand-ins: published again)
    deadline = time.monotonic() + 10
    while stand_ins.proxy.status()["proxy"]["degraded"] and time.monotonic() < deadline:
        time.sleep(0.1)
    load.stop()
    assert stand_ins.proxy.status()["proxy"]["degraded"] is False
    assert load.errors == []
    assert stand_ins.proxy.status()["generation"] == stand_ins.cluster.generation


def test_admin_listener_health_metrics_and_status(stand_ins):
    proxy = stand_ins.proxy
    assert proxy.admin("/health/live").status_code == 200
    ready = proxy.admin("/health/ready")
    assert ready.status_code == 200
    assert ready.json()["nodes_alive"] == 3
    metrics = proxy.admin("/metrics").text
    for name in (
        "kroute_proxy_responses_total",
        "kroute_proxy_request_duration_seconds_bucket",
        "kroute_proxy_replica_choices_total",
        "kroute_proxy_table_age_seconds",
        "kroute_proxy_no_replica_total",
    ):
        assert name in metrics
    status = proxy.status()
    assert set(status["nodes"]) == {"n0", "n1", "n2"}
    customers = status["stores"]["customers"]
    assert customers["partitions"] == PARTITIONS
    assert [r["role"] for r in customers["partition_map"][0]["replicas"]] == ["active", "standby"]
    page = proxy.admin("/cluster")
    assert page.status_code == 200
    assert "kroute cluster status" in page.text
    assert proxy.admin("/nope").status_code == 404


def test_unknown_lag_is_rejected_under_a_budget_by_default(stand_ins):
    key = "unknown-lag"
    chosen, placed = owner(stand_ins, "customers", key)
    keys = stand_ins.cluster.keys
    for node in placed.replicas():
        stand_ins.redis.hdel(keys.lag(node), f"customers/{chosen}")
        # as a writer of lag:<id> alone leaves it
        stand_ins.redis.delete(keys.report(node), keys.report_at(node))
    stand_ins.redis.publish(keys.events, json.dumps({"v": 1, "type": "lag"}))
    time.sleep(0.5)
    try:
        limited = stand_ins.proxy.get(
            f"/stores/customers/keys/{key}", headers={"x-kroute-max-lag": "5"}
        )
        assert limited.status_code == 503
        assert {r["reason"] for r in limited.json()["replicas"]} == {"unknown lag"}
        unlimited = stand_ins.proxy.get(f"/stores/customers/keys/{key}")
        assert unlimited.status_code == 200
        assert unlimited.headers["x-kroute-lag"] == "unknown"
    finally:
        stand_ins.publish()
        time.sleep(0.3)


def test_without_standby_reads_a_dead_active_is_a_503(stand_ins):
    """KROUTE_STANDBY_READS=false: the behaviour before KIP-535, the benchmarks' baseline."""
    key = "actives-only"
    _, placed = owner(stand_ins, "customers", key)
    assert placed.active is not None
    actives_only = start_proxy(
        stand_ins.services,
        stand_ins.redis_server.url,
        name="proxy-actives-only",
        cluster=stand_ins.cluster.keys.cluster,
        standby_reads="false",
        **PROXY_SETTINGS,
    )
    path = f"/stores/customers/keys/{key}"
    try:
        assert actives_only.get(path).headers["x-kroute-node"] == placed.active
        stand_ins.cluster.alive.discard(placed.active)
        stand_ins.publish()
        time.sleep(0.5)
        refused = actives_only.get(path)
        assert refused.status_code == 503
        reasons = {r["node"]: r["reason"] for r in refused.json()["replicas"]}
        assert reasons == {placed.active: "dead", placed.standbys[0]: "standby reads are off"}
        assert stand_ins.proxy.get(path).headers["x-kroute-role"] == "standby"
    finally:
        stand_ins.cluster.alive.add(placed.active)
        stand_ins.publish()
        actives_only.process.stop()
        actives_only.close()
        time.sleep(0.3)


def test_the_only_live_replica_is_tried_while_ejected_rather_than_refused(stand_ins):
    """The active is dead and the standby failed one request and was ejected: while it is
    ejected it is still the last resort, so reads succeed as soon as it answers again."""
    key = "last-resort"
    _, placed = owner(stand_ins, "customers", key)
    active, standby = placed.active, placed.standbys[0]
    assert active is not None
    proxy = start_proxy(
        stand_ins.services,
        stand_ins.redis_server.url,
        name="proxy-long-ejections",
        cluster=stand_ins.cluster.keys.cluster,
        **{**PROXY_SETTINGS, "eject_ms": "20000"},
    )
    path = f"/stores/customers/keys/{key}"
    try:
        stand_ins.cluster.alive.discard(active)
        stand_ins.publish()
        time.sleep(0.5)
        stand_ins.backends[standby].mode = "close"
        try:
            failed = proxy.get(path)
        finally:
            stand_ins.backends[standby].mode = "ok"
        assert failed.status_code == 503
        assert proxy.status()["nodes"][standby]["ejected_since_ms"] is not None
        answers = [proxy.get(path) for _ in range(3)]
        assert [a.status_code for a in answers] == [200, 200, 200]
        assert {a.headers["x-backend"] for a in answers} == {standby}
        assert proxy.status()["nodes"][standby]["ejected_since_ms"] is not None
    finally:
        stand_ins.cluster.alive.add(active)
        stand_ins.publish()
        proxy.process.stop()
        proxy.close()
        time.sleep(0.3)


def test_an_ejected_node_restarted_on_another_port_comes_back(stand_ins):
    """The probe asks the address the node registers now, not the one it was ejected at."""
    key = "moved-node"
    _, placed = owner(stand_ins, "customers", key)
    victim = placed.active
    assert victim is not None
    original_urls = dict(stand_ins.cluster.node_urls)
    stand_ins.backends[victim].stop()
    replacement = EchoBackend(victim).start()
    path = f"/stores/customers/keys/{key}"
    try:
        assert stand_ins.proxy.get(path).headers["x-backend"] == placed.standbys[0]
        assert stand_ins.proxy.status()["nodes"][victim]["ejected_since_ms"] is not None
        stand_ins.cluster.node_urls = {**original_urls, victim: replacement.url}
        stand_ins.publish()
        deadline = time.monotonic() + 5
        while stand_ins.proxy.status()["nodes"][victim]["ejected_since_ms"] is not None:
            assert time.monotonic() < deadline, "the node stayed ejected at its old address"
            time.sleep(0.1)
        assert stand_ins.proxy.get(path).headers["x-backend"] == victim
        assert replacement.requests  # answered from its new address
    finally:
        stand_ins.cluster.node_urls = original_urls
        stand_ins.backends[victim].restart()
        stand_ins.publish()
        replacement.shutdown()
        time.sleep(0.3)


@pytest.mark.parametrize("hot_path", ["true", "false"])
def test_spreading_reads_never_tries_an_ejected_replica_first(stand_ins, hot_path):
    """With KROUTE_SPREAD, reads rotate over the in-sync replicas that are not ejected: a
    standby that failed stays behind the active (both the C and the Python path)."""
    key = "spread-key"
    _, placed = owner(stand_ins, "customers", key)
    standby = placed.standbys[0]
    proxy = start_proxy(
        stand_ins.services,
        stand_ins.redis_server.url,
        name=f"proxy-spread-{hot_path}",
        cluster=stand_ins.cluster.keys.cluster,
        **{**PROXY_SETTINGS, "eject_ms": "20000", "spread": "true", "hot_path": hot_path},
    )
    path = f"/stores/customers/keys/{key}"
    stopped = False
    try:
        spread = {proxy.get(path).headers["x-backend"] for _ in range(12)}
        assert spread == {placed.active, standby}  # both share reads while healthy
        stand_ins.backends[standby].stop()
        stopped = True
        for _ in range(20):  # the standby fails a read and is ejected (alive by heartbeat)
            proxy.get(path)
            if proxy.status()["nodes"][standby]["ejected_since_ms"] is not None:
                break
        assert proxy.status()["nodes"][standby]["ejected_since_ms"] is not None
        answers = [proxy.get(path) for _ in range(12)]
        assert [a.status_code for a in answers] == [200] * 12
        assert {a.headers["x-backend"] for a in answers} == {placed.active}
        assert all("x-kroute-attempts" not in a.headers for a in answers)  # never tried first
    finally:
        if stopped:  # restarting a running stand-in would hide the failure behind EADDRINUSE
            stand_ins.backends[standby].restart()
        proxy.process.stop()
        proxy.close()
        time.sleep(0.3)
