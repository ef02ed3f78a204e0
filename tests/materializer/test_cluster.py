"""Three real nodes, real Tansu, real redis-server: membership, assignment, failover, lag.

The tests share one cluster and run in file order: each step starts from where the one before
left it (all three up; then lag under a paused consumer; then a node killed for good; then a
node restarted within its grace period).
"""

from __future__ import annotations

import signal
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from common.contract import Assignment
from kroute.cluster_harness import spark_jvm_pid
from partitioner import partition
from tests.cluster_helpers import (
    NODE_NAMES,
    PARTITIONS,
    Cluster,
    reported_lag,
    running_cluster,
)

pytestmark = pytest.mark.integration

GRACE_S = 8


@pytest.fixture(scope="module")
def cluster(embedded, broker, tmp_path_factory) -> Iterator[Cluster]:
    with running_cluster(embedded, broker, tmp_path_factory.mktemp("cluster"), GRACE_S) as built:
        yield built


def test_three_nodes_share_the_partitions_one_active_one_standby_each(cluster):
    assignment = cluster.wait_settled(set(NODE_NAMES))
    actives: Counter[str] = Counter()
    replicas: Counter[str] = Counter()
    for placed in assignment.stores["customers"].values():
        assert placed.active is not None
        assert len(placed.standbys) == 1
        assert placed.active not in placed.standbys
        actives[placed.active] += 1
        replicas.update(placed.replicas())
    assert sorted(actives.values()) == [2, 2, 2]
    assert sorted(replicas.values()) == [4, 4, 4]
    # Partitions a node gave up while the others joined leave its disk after the grace period.
    deadline = time.monotonic() + GRACE_S + 10
    while time.monotonic() < deadline:
        kept = {n: cluster.nodes[n].metadata()["kept_for_grace"] for n in NODE_NAMES}
        if not any(kept.values()):
            break
        time.sleep(0.5)
    assert not any(kept.values()), kept


def without_time_lag(answer: dict) -> dict:
    assert isinstance(answer.pop("time_lag_ms"), int)
    return answer


def test_owners_serve_their_keys_and_other_nodes_forward_once(cluster):
    assignment = cluster.wait_settled(set(NODE_NAMES))

    def forwarded_in_all() -> int:
        return sum(node.metadata()["forwarded"] for node in cluster.nodes.values())

    before = forwarded_in_all()
    for i in range(0, 1200, 97):
        key = f"seed-{i}"
        placed = assignment.stores["customers"][partition(key.encode(), PARTITIONS)]
        owner = cluster.nodes[placed.active].get(f"/stores/customers/keys/{key}")
        assert owner.status_code == 200
        assert owner.json()["role"] == "active"
        assert "x-kroute-forwarded-by" not in owner.headers
        outsider = next(n for n in NODE_NAMES if n not in placed.replicas())
        forwarded = cluster.nodes[outsider].get(f"/stores/customers/keys/{key}")
        assert forwarded.status_code == 200
        # The time lag is the age of the last caught-up point: it moves between two reads.
        assert without_time_lag(forwarded.json()) == without_time_lag(owner.json())
        assert forwarded.headers["x-kroute-forwarded-by"] == outsider
    assert forwarded_in_all() - before == len(range(0, 1200, 97))  # counted once each
    # A request that was already forwarded is never forwarded again (loop protection).
    key = "seed-0"
    placed = assignment.stores["customers"][partition(key.encode(), PARTITIONS)]
    outsider = next(n for n in NODE_NAMES if n not in placed.replicas())
    again = cluster.nodes[outsider].client.get(
        cluster.nodes[outsider].url + f"/stores/customers/keys/{key}",
        headers={"x-kroute-forwarded-by": "x"},
    )
    assert again.status_code == 421
    assert forwarded_in_all() - before == len(range(0, 1200, 97))  # a refusal is no hop


def test_reported_lag_grows_with_a_paused_consumer_and_returns_to_zero(cluster):
    assignment = cluster.wait_settled(set(NODE_NAMES))
    mine = assignment.for_node("a")["customers"]
    hosted = sorted(mine["active"] + mine["standby"])
    jvm = spark_jvm_pid(cluster.nodes["a"])
    os_kill = __import__("os").kill
    os_kill(jvm, signal.SIGSTOP)  # Spark stops; the node's Python side keeps reporting
    try:
        produced = cluster.produce(600, "paused")
        expected = {p: produced[p] for p in hosted}
        deadline = time.monotonic() + 30
        while reported_lag(cluster, "a", hosted) != expected and time.monotonic() < deadline:
            time.sleep(0.2)
        assert reported_lag(cluster, "a", hosted) == expected
    finally:
        os_kill(jvm, signal.SIGCONT)
    deadline = time.monotonic() + 60
    while set(reported_lag(cluster, "a", hosted).values()) != {0} and time.monotonic() < deadline:
        time.sleep(0.2)
    assert set(reported_lag(cluster, "a", hosted).values()) == {0}


def test_the_killed_leader_is_known_dead_within_seconds_and_its_standbys_serve(cluster):
    before = cluster.wait_settled(cluster.alive)
    leader = cluster.redis.get(cluster.keys.leader)
    assert leader is not None
    cluster.dead = leader.decode()  # kill the leader: leadership must move too
    cluster.nodes[cluster.dead].process.signal(signal.SIGKILL)
    killed_at = time.monotonic()
    while (
        cluster.redis.exists(cluster.keys.alive(cluster.dead)) and time.monotonic() - killed_at < 10
    ):
        time.sleep(0.05)
    detected_after = time.monotonic() - killed_at
    assert detected_after < 2.5, f"dead node noticed after {detected_after:.1f}s"
    # Within the grace period nothing moves, and the standbys answer for its partitions.
    assert cluster.assignment().stores == before.stores
    for p, placed in before.stores["customers"].items():
        if placed.active != cluster.dead:
            continue
        key = next(
            f"seed-{i}" for i in range(1200) if partition(f"seed-{i}".encode(), PARTITIONS) == p
        )
        response = cluster.nodes[placed.standbys[0]].get(f"/stores/customers/keys/{key}")
        assert response.status_code == 200
        assert response.json()["role"] == "standby"
    cluster.nodes.pop(cluster.dead).close()
    deadline = time.monotonic() + 10
    while cluster.redis.get(cluster.keys.leader) in (None, leader) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cluster.redis.get(cluster.keys.leader).decode() in cluster.alive, (
        "a new leader took over"
    )


def test_after_the_grace_period_the_dead_nodes_partitions_move_to_its_standbys(cluster):
    before = cluster.assignment()
    after = cluster.wait_settled(cluster.alive, timeout_s=GRACE_S + 120)
    assert after.leader in cluster.alive
    for p, placed in after.stores["customers"].items():
        assert cluster.dead not in placed.replicas()
        assert len(placed.standbys) == 1
        was = before.stores["customers"][p]
        if was.active == cluster.dead:
            assert placed.active == was.standbys[0], "the standby was promoted"


def test_a_node_restarted_within_its_grace_period_gets_its_partitions_back(cluster):
    before = cluster.wait_settled(cluster.alive)
    name = max(cluster.alive)
    mine = before.for_node(name)["customers"]
    hosted = sorted(mine["active"] + mine["standby"])
    cluster.nodes[name].process.signal(signal.SIGKILL)
    cluster.nodes[name].process.popen.wait(timeout=30)
    cluster.nodes.pop(name).close()
    produced = cluster.produce(400, "while-down")
    restarted = cluster.start(name)
    after = cluster.wait_settled(cluster.alive)
    assert after.stores == before.stores, "nothing moved while it was away"
    ingest = restarted.metadata()["ingest"]
    assert ingest["records"] == sum(produced[p] for p in hosted), "re-read only what it missed"


def test_an_emptied_redis_is_refilled_and_the_assignment_survives(cluster):
    before = cluster.wait_settled(cluster.alive)
    port = cluster.redis_server.port
    cluster.redis_server.process.stop()
    time.sleep(1.0)
    # Meanwhile the nodes keep serving what they have.
    for name in cluster.alive:
        assert cluster.nodes[name].get("/health/live").status_code == 200
    cluster.redis_server = cluster.services.start_redis(port=port)  # restarted, empty
    after = cluster.wait_settled(cluster.alive)

    def holders(assignment: Assignment) -> dict[int, set[str]]:
        return {p: set(placed.replicas()) for p, placed in assignment.stores["customers"].items()}

    # The leader kept the last assignment in memory: no replica moved (roles may be rebalanced
    # between the same two nodes, which needs no restore), and generations only go forward.
    assert holders(after) == holders(before)
    assert after.generation >= before.generation
