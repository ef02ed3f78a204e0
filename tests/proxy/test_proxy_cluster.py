"""The proxy in front of three real materializer nodes (real Tansu, redis-server and Spark).

Tests run in file order on one cluster: owners answer every key; then an active is killed
under load; then, with that node still dead (inside its grace period), a survivor's Spark is
paused so its lag grows, and lag budgets decide who may answer.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from kroute.cluster_harness import spark_jvm_pid
from kroute.proxies import ProxyHandle
from partitioner import partition
from tests.browser import rendered_dom, screenshot
from tests.cluster_helpers import (
    NODE_NAMES,
    PARTITIONS,
    Cluster,
    cluster_proxy,
    running_cluster,
)
from tests.proxy.test_proxy_loopback import Load

pytestmark = pytest.mark.integration

GRACE_S = 120  # nothing moves during the tests: failover is the standbys' job
SEED_KEYS = [f"seed-{i}" for i in range(0, 1200, 7)]


@pytest.fixture(scope="module")
def cluster(embedded, broker, tmp_path_factory) -> Iterator[Cluster]:
    with running_cluster(embedded, broker, tmp_path_factory.mktemp("proxied"), GRACE_S) as built:
        yield built


@pytest.fixture(scope="module")
def proxy(embedded, cluster) -> Iterator[ProxyHandle]:
    with cluster_proxy(
        embedded,
        cluster,
        refresh_interval_ms="200",
        eject_ms="500",
        probe_interval_ms="100",
        wait_ready=False,
    ) as handle:
        yield handle


def active_of(cluster: Cluster, key: str) -> tuple[int, str]:
    chosen = partition(key.encode(), PARTITIONS)
    active = cluster.assignment().stores["customers"][chosen].active
    assert active is not None
    return chosen, active


def wait_until_proxy_sees(proxy: ProxyHandle, generation: int, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proxy.is_ready() and proxy.status()["generation"] == generation:
            return
        time.sleep(0.2)
    raise AssertionError(f"proxy did not load generation {generation}: {proxy.status()}")


def test_every_key_is_answered_by_its_partitions_owner(cluster, proxy):
    assignment = cluster.wait_settled(set(NODE_NAMES))
    wait_until_proxy_sees(proxy, assignment.generation)
    for key in SEED_KEYS:
        chosen, active = active_of(cluster, key)
        response = proxy.get(f"/stores/customers/keys/{key}")
        assert response.status_code == 200, response.text
        assert response.headers["x-kroute-node"] == active
        assert response.headers["x-kroute-partition"] == str(chosen)
        assert response.headers["x-kroute-role"] == "active"
        assert "x-kroute-forwarded-by" not in response.headers  # no hop inside the cluster
        body = response.json()
        assert (body["node"], body["partition"], body["role"]) == (active, chosen, "active")
        assert body["key"] == key


def node_states(dom: str) -> dict[str, str]:
    """node -> alive/dead, as the status page rendered them."""
    return dict(re.findall(r'data-node="([^"]+)" data-state="(alive|dead)"', dom))


def replica_states(dom: str) -> dict[str, set[str]]:
    """node -> the states its replicas were rendered in, across the partition map."""
    states: dict[str, set[str]] = {}
    for node, state in re.findall(
        r'data-replica="([\w.-]+)" data-replica-state="(alive|dead)"', dom
    ):
        states.setdefault(node, set()).add(state)
    return states


def test_the_status_page_renders_the_running_cluster_in_a_browser(cluster, proxy, tmp_path):
    page = f"{proxy.admin_url}/cluster"
    dom = rendered_dom(page, tmp_path / "profile")
    assert node_states(dom) == dict.fromkeys(NODE_NAMES, "alive")
    assert replica_states(dom) == {n: {"alive"} for n in NODE_NAMES}
    assert "customers (topic" in dom
    assert dom.count('class="bar"') >= PARTITIONS * 2  # a lag bar per replica
    assert "s ago" in dom  # each node's last report
    screenshot(page, "status-page-cluster-running.png", tmp_path / "profile")


def test_kill_9_of_an_active_under_load_fails_no_read(cluster, proxy):
    victim = "b"
    victim_partitions = set(cluster.assignment().for_node(victim)["customers"]["active"])
    load = Load(proxy.url, SEED_KEYS, threads=4)
    time.sleep(1.0)
    cluster.nodes[victim].process.signal(signal.SIGKILL)
    cluster.dead = victim
    time.sleep(4.0)  # past the heartbeat TTL: the table says dead, not just the ejection
    load.stop()
    assert load.errors == [], load.errors[:3]
    assert len(load.statuses) > 200
    for key in SEED_KEYS:
        chosen, _ = active_of(cluster, key)
        if chosen in victim_partitions:
            response = proxy.get(f"/stores/customers/keys/{key}")
            assert response.status_code == 200
            assert response.headers["x-kroute-role"] == "standby"
            assert response.headers["x-kroute-node"] != victim
    status = proxy.status()
    assert status["nodes"][victim]["alive"] is False


def test_the_status_page_shows_the_killed_node_dead(cluster, proxy, tmp_path):
    page = f"{proxy.admin_url}/cluster"
    dom = rendered_dom(page, tmp_path / "profile")
    assert node_states(dom) == {n: "dead" if n == cluster.dead else "alive" for n in NODE_NAMES}
    assert replica_states(dom) == {
        n: {"dead"} if n == cluster.dead else {"alive"} for n in NODE_NAMES
    }
    screenshot(page, "status-page-node-killed.png", tmp_path / "profile")


def check_refusal_reasons(reasons: dict[str, str], paused: str) -> None:
    """A zero budget is exact: any live replica still reading is refused too, with its lag."""
    for node, reason in reasons.items():
        if node == "b":
            assert reason == "dead"
        elif node == paused:
            assert reason.startswith("lag ")
            assert reason.endswith("over budget 0")
        else:
            assert "lag" in reason, reason


def zero_lag_replicas(proxy: ProxyHandle, dead: str) -> dict[int, set[str]]:
    """partition -> the live replicas the proxy's table shows at lag 0."""
    return {
        entry["partition"]: {
            replica["node"]
            for replica in entry["replicas"]
            if replica["node"] != dead and replica["lag"] == 0
        }
        for entry in proxy.status()["stores"]["customers"]["partition_map"]
    }


def wait_until_caught_up(cluster, proxy: ProxyHandle, nodes: set[str]) -> None:
    """Until `nodes` have read to the broker's end offsets and the proxy shows them at lag 0.
    Reports of lag 0 alone do not do: one may be measured against an end offset read before
    the last produce, and the node's own check would then see the lag the report did not."""
    ends = cluster.ends()
    assignment = cluster.assignment()
    deadline = time.monotonic() + 60
    behind: list[str | None] = [None]
    while time.monotonic() < deadline:
        behind = [cluster.node_behind(n, assignment, ends) for n in sorted(nodes)]
        if not any(behind):
            break
        time.sleep(0.2)
    assert not any(behind), behind
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        lags = [
            replica["lag"]
            for entry in proxy.status()["stores"]["customers"]["partition_map"]
            for replica in entry["replicas"]
            if replica["node"] in nodes
        ]
        if lags and all(lag == 0 for lag in lags):
            return
        time.sleep(0.2)


def test_a_lagging_replica_never_answers_beyond_the_budget(cluster, proxy):
    paused = "a"
    assignment = cluster.assignment()
    jvm = spark_jvm_pid(cluster.nodes[paused])
    os.kill(jvm, signal.SIGSTOP)  # Spark stops; the node keeps serving and reporting lag
    try:
        cluster.produce(600, "lagging")
        deadline = time.monotonic() + 30
        lagging: set[int] = set()
        while time.monotonic() < deadline and not lagging:
            placed = proxy.status()["stores"]["customers"]["partition_map"]
            lagging = {
                entry["partition"]
                for entry in placed
                for replica in entry["replicas"]
                if replica["node"] == paused and (replica["lag"] or 0) > 0
            }
            time.sleep(0.2)
        assert lagging, "the paused node never reported lag"
        # The other live replicas finish reading the new records (a zero budget is exact).
        wait_until_caught_up(cluster, proxy, cluster.alive - {paused})
        # Who may answer within a zero budget, per partition: the live replicas whose lag the
        # proxy's table says is 0 now (the paused node's reports only grow once the producer
        # stopped). A partition with none must be refused; one with any must be answered.
        allowed = zero_lag_replicas(proxy, dead="b")
        placements = assignment.stores["customers"]
        with_c = {p for p, placed in placements.items() if "c" in placed.replicas()}
        assert all("c" in allowed[p] for p in with_c), ("c did not catch up", allowed)
        # Nobody may answer only where the paused node is the one live replica.
        for p in (p for p, nodes in allowed.items() if not nodes):
            assert set(placements[p].replicas()) == {paused, "b"}, (p, allowed)
        answered_by: dict[str, int] = {}  # node -> keys it answered
        for key in SEED_KEYS:
            response = proxy.get(f"/stores/customers/keys/{key}", headers={"x-kroute-max-lag": "0"})
            chosen = partition(key.encode(), PARTITIONS)
            if allowed[chosen]:
                assert response.status_code == 200, (key, chosen, response.text)
                node = response.headers["x-kroute-node"]
                assert node in allowed[chosen], (key, chosen, node, allowed[chosen])
                assert response.json()["key"] == key
                if chosen in lagging:
                    assert node != paused, f"{key} answered by the lagging node"
                answered_by[node] = answered_by.get(node, 0) + 1
            else:
                assert response.status_code == 503, response.text
                body = response.json()
                assert body["error"] == "no_replica"
                reasons = {r["node"]: r["reason"] for r in body["replicas"]}
                assert set(reasons) == set(placements[chosen].replicas())
                check_refusal_reasons(reasons, paused)
        # Liveness as well as safety: every key with a caught-up live replica was answered (by
        # one), the survivor c among them; only partitions whose only live replica is the
        # paused node (b, their other, is dead) were refused, each with the 503 that says why.
        assert answered_by.get("c", 0) > 0, answered_by
        only_paused = {
            p
            for p, placed in placements.items()
            if set(placed.replicas()) == {paused, "b"} and p in lagging
        }
        # Without a budget the same keys are answered (by the lagging replica, visibly).
        for key in SEED_KEYS:
            if partition(key.encode(), PARTITIONS) in only_paused:
                response = proxy.get(f"/stores/customers/keys/{key}")
                assert response.status_code == 200
                assert response.headers["x-kroute-node"] == paused
                assert int(response.headers["x-kroute-lag"]) > 0
                break
    finally:
        os.kill(jvm, signal.SIGCONT)


def test_redis_restarted_empty_while_serving(cluster, proxy):
    # Settled first: run alone, the nodes may not have read the seed records yet (404s). Only
    # the live ones: an earlier test in this module may have killed one (`cluster.dead`).
    wait_until_proxy_sees(proxy, cluster.wait_settled(cluster.alive).generation)
    port = cluster.redis_server.port
    load = Load(proxy.url, SEED_KEYS, threads=3)
    time.sleep(0.5)
    cluster.redis_server.process.stop()
    time.sleep(1.0)
    cluster.redis_server = cluster.services.start_redis(port=port)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            status = proxy.status()
        except httpx.HTTPError:
            status = {"proxy": {"degraded": True}}
        if not status["proxy"]["degraded"] and status["nodes"].get("a", {}).get("alive"):
            break
        time.sleep(0.3)
    load.stop()
    assert not proxy.status()["proxy"]["degraded"]
    assert load.errors == [], load.errors[:3]
    assert len(load.statuses) > 50, "hardly anything was answered"  # 503s are errors above
