"""The routing snapshot, built from contract values without any I/O."""

from __future__ import annotations

from common.contract import (
    Assignment,
    Hosting,
    NodeInfo,
    PartitionAssignment,
    PartitionReport,
    StoreInfo,
)
from partitioner import partition
from proxy.choice import LagBudget, choose_replicas
from proxy.routing import EMPTY, build_snapshot

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
