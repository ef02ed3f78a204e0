"""Review 2 of the per-node report clocks: `shift_node` judges in place whether later times
keep every choice (`_later_keeps_choices`) by building the node's whole report map
(`report_fields`) and checking the order of every row it is placed on, in one stretch: the
watcher calls it from `_apply_report` with no yield inside. Its cost follows the node's share
of the table, which in a small cluster is the table: 3 nodes and 20,000 partitions measured
80-250 ms per confirmation here (the path without the judgement: 0.7-1.7 ms), on the loop,
every sweep round, for every node. The rebuild steps (`STEP_PARTITIONS`) exist to bound such
stretches; this one was not bounded. A node placed on more than IN_PLACE_MAX_PARTITIONS now
takes the rebuild path, in steps."""

from __future__ import annotations

from unittest.mock import patch

from common.contract import (
    Assignment,
    Hosting,
    NodeInfo,
    PartitionAssignment,
    PartitionReport,
    StoreInfo,
)
from proxy.choice import LagBudget
from proxy.routing import IN_PLACE_MAX_PARTITIONS, ChoiceStability, TableBuilder

N = 2_000
T0 = 9_000_000


def test_one_confirmation_does_not_look_at_every_row_of_its_node_in_one_stretch() -> None:
    stability = ChoiceStability(LagBudget(5, 10_000), "reject", 3_000, True)
    table = TableBuilder(stability)
    table.set_stores({"s": StoreInfo("s", "t", N)})
    placed = {p: PartitionAssignment("a", ("b", "c")) for p in range(N)}
    table.set_assignment(Assignment(1, "a", 0, {"s": placed}))
    table.set_alive({"a", "b", "c"})
    hostings = {}
    for node_id, role, caught_up in (
        ("a", "active", T0),
        ("b", "standby", T0 - 5),
        ("c", "standby", T0 - 10),
    ):
        hostings[node_id] = Hosting(node_id, 1, {"s": {role: tuple(range(N))}}, T0)  # type: ignore[dict-item]
        reports = {("s", p): PartitionReport(100, 101, None, caught_up, T0) for p in range(N)}
        table.set_node(
            node_id, NodeInfo(node_id, f"http://{node_id}:1", 0), hostings[node_id], reports
        )
    list(table.rebuild(T0))
    table.snapshot(T0)
    rows_looked_at = 0
    keeps_order = ChoiceStability.later_times_keep_order

    def counting(self, row, node_id):  # type: ignore[no-untyped-def]
        nonlocal rows_looked_at
        rows_looked_at += 1
        return keeps_order(self, row, node_id)

    with patch.object(ChoiceStability, "later_times_keep_order", counting):
        table.shift_node("b", 100, hostings["b"], T0 + 10)
    assert rows_looked_at <= IN_PLACE_MAX_PARTITIONS, f"{rows_looked_at} rows in one stretch"
    assert "b" in table._shifted, "too big to judge in one stretch: the rebuild path, in steps"
