"""The proxy's side of freshness bounds, unit by unit (proxy.freshness, choice by position)."""

from __future__ import annotations

import pytest

from proxy.choice import LagBudget, Replica, Role, choose_replicas
from proxy.errors import BadRequest
from proxy.freshness import (
    NodeRefusal,
    min_offset_of,
    node_budget,
    node_budget_lines,
    refusal_of,
    unmet,
    with_budget,
)

NOW = 1_000_000


def replica(node: str, role: Role, position: int | None, lag: int = 0) -> Replica:
    return Replica(node, f"http://{node}", role, True, lag, NOW - 100, NOW - 50, position)


def test_replicas_whose_reports_reached_the_offset_come_first_the_others_after():
    active = replica("a", "active", 100)
    standby = replica("b", "standby", 150)
    behind = replica("c", "standby", 90)
    choice = choose_replicas((active, standby, behind), LagBudget(), now_ms=NOW, min_offset=120)
    assert [r.node_id for r in choice.candidates] == ["b", "a", "c"]
    assert choice.rejected == ()  # reports lag behind the nodes: behind is never refused here
    assert choice.spread_width == 1  # only b has reached it: reads do not rotate onto a or c
    # Without a bound: the active first, as ever; both in-sync ones may share reads.
    plain = choose_replicas((active, standby, behind), LagBudget(), now_ms=NOW)
    assert [r.node_id for r in plain.candidates] == ["a", "b", "c"]
    assert plain.spread_width == 3


def test_a_replica_that_never_reported_its_position_has_not_reached_any_offset():
    unknown = replica("a", "active", None)
    assert not unknown.has_reached(0)
    assert unknown.has_reached(None)
    assert replica("b", "standby", 1).has_reached(0)  # position 1: offset 0 applied
    assert not replica("b", "standby", 0).has_reached(0)


def test_min_offsets_are_read_for_the_keys_partition_and_malformed_ones_are_400():
    assert min_offset_of(None, 3) is None
    assert min_offset_of(b"41", 3) == 41
    assert min_offset_of(b"1:5,3:9", 3) == 9
    assert min_offset_of(b"1:5", 3) is None
    with pytest.raises(BadRequest) as caught:
        min_offset_of(b"3:nine", 3)
    assert caught.value.extra == {"header": "x-kroute-min-offset", "value": "3:nine"}
    assert "offset 'nine'" in caught.value.detail


def test_the_node_is_sent_the_budget_the_proxy_applies_not_the_clients():
    headers = [(b"x-kroute-max-lag", b"1000"), (b"accept", b"*/*"), (b"x-kroute-max-lag-ms", b"9")]
    sent = with_budget(headers, LagBudget(100, None))
    assert sent == [(b"accept", b"*/*"), (b"x-kroute-max-lag", b"100")]
    assert with_budget(headers, LagBudget(5, 9))[-2:] == [
        (b"x-kroute-max-lag", b"5"),
        (b"x-kroute-max-lag-ms", b"9"),
    ]


def test_a_configured_budget_goes_to_the_node_unless_unknown_lag_is_accepted():
    budget = LagBudget(100, 2_000)
    assert node_budget(budget, "reject") == budget
    # A node refuses a read whose lag it does not know; a proxy that accepts unknown lag would
    # have its choice overruled, so it sends no budget of its own.
    assert node_budget(budget, "accept") is None
    assert node_budget(LagBudget(), "reject") is None
    assert node_budget_lines(None) == b""
    assert node_budget_lines(budget) == b"x-kroute-max-lag: 100\r\nx-kroute-max-lag-ms: 2000\r\n"
    assert node_budget_lines(LagBudget(None, 5)) == b"x-kroute-max-lag-ms: 5\r\n"
    # The C path's lines are the Python path's headers, in the same place and order.
    expected = [(b"x-kroute-max-lag", b"100"), (b"x-kroute-max-lag-ms", b"2000")]
    assert with_budget([(b"accept", b"*/*")], budget) == [(b"accept", b"*/*"), *expected]


def test_a_refusal_is_read_from_the_nodes_header_lines():
    lines = b"content-type: application/json\r\nX-Kroute-Refused: lag 40 over budget 10 \r\n"
    lines += b"x-kroute-position: 3:77\r\n"
    assert refusal_of(lines) == NodeRefusal("lag 40 over budget 10", 77)
    assert refusal_of(b"x-kroute-refused: unknown lag\r\n") == NodeRefusal("unknown lag", None)
    assert refusal_of(b"content-type: application/json\r\nx-kroute-position: 3:7\r\n") is None


def test_the_503_names_the_offset_asked_and_the_furthest_position_known():
    refusals = [
        NodeRefusal("position 70 short of min offset 80", 70),
        NodeRefusal("lag 9 over budget 1", 75),
    ]
    error, detail, extra = unmet(refusals, 80, [replica("a", "active", 72), None])
    assert error == "position_not_reached"
    assert extra == {"min_offset": 80, "best_applied_offset": 75}
    assert "offset 80" in detail
    assert "up to 75" in detail
    error, _, extra = unmet([NodeRefusal("lag 9 over budget 1", 75)], None, [])
    assert (error, extra) == ("beyond_budget", {})
