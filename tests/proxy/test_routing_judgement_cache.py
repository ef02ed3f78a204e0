"""What the in-place judgement keeps between confirmations (`TableBuilder._standing_until`,
`_order_rows_of`) follows the reports and rows it was made from: a node's new reports, or a
row rebuilt with another standby in it, are judged as they are now, not as they were when the
last confirmation was judged."""

from __future__ import annotations

from common.contract import (
    Assignment,
    Hosting,
    NodeInfo,
    PartitionAssignment,
    PartitionReport,
    StoreInfo,
)
from proxy.choice import LagBudget
from proxy.routing import ChoiceStability, TableBuilder

T0 = 9_000_000
PARTITIONS = 4
STABILITY = ChoiceStability(LagBudget(5, 1_000), "reject", 3_000, True)


def _table() -> TableBuilder:
    table = TableBuilder(STABILITY)
    table.set_stores({"s": StoreInfo("s", "t", PARTITIONS)})
    placed = {p: PartitionAssignment("a", ("b", "c")) for p in range(PARTITIONS)}
    table.set_assignment(Assignment(1, "a", 0, {"s": placed}))
    table.set_alive({"a", "b", "c"})
    return table


def _set(table: TableBuilder, node_id: str, role: str, caught_up: int, at: int) -> Hosting:
    hosting = Hosting(node_id, 1, {"s": {role: tuple(range(PARTITIONS))}}, at)  # type: ignore[dict-item]
    reports = {("s", p): PartitionReport(100, 100, None, caught_up, at) for p in range(PARTITIONS)}
    table.set_node(node_id, NodeInfo(node_id, f"http://{node_id}:1", 0), hosting, reports)
    return hosting


def _serve(table: TableBuilder, now: int) -> None:
    list(table.rebuild(now))
    table.snapshot(now)


def _moved_in_place(table: TableBuilder, node_id: str, hosting: Hosting, now: int) -> bool:
    before = table.clocks_moved_in_place
    table.shift_node(node_id, 100, hosting, now)
    return table.clocks_moved_in_place > before


def test_a_node_with_new_reports_is_judged_on_them():
    table = _table()
    _set(table, "a", "active", T0, T0)
    hosting = _set(table, "b", "standby", T0, T0)
    _serve(table, T0)
    assert _moved_in_place(table, "b", hosting, T0 + 10), "fresh and inside the budget"
    _serve(table, T0 + 10)
    # b's new reports: caught up 5 s ago, past the 1 s budget. Later times could bring it
    # back inside: not in place.
    hosting = _set(table, "b", "standby", T0 - 5_000, T0 + 20)
    _serve(table, T0 + 20)
    assert not _moved_in_place(table, "b", hosting, T0 + 30)
    assert "b" in table._shifted, "the rebuild path"


def test_a_row_rebuilt_with_a_second_standby_is_judged_again():
    table = _table()
    _set(table, "a", "active", T0, T0)
    hosting = _set(table, "b", "standby", T0 - 200, T0)
    _serve(table, T0)
    assert _moved_in_place(table, "b", hosting, T0 + 10), "the only standby: no order to keep"
    _serve(table, T0 + 10)
    # c arrives, caught up later than b: b now sorts behind an alike standby, and later times
    # could move it ahead: not in place.
    _set(table, "c", "standby", T0, T0 + 20)
    _serve(table, T0 + 20)
    assert not _moved_in_place(table, "b", hosting, T0 + 30)
    assert "b" in table._shifted, "the rebuild path"
