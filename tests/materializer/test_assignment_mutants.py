"""The leader's assignment pinned where mutants of materializer/assignment.py survived the
property tests (scripts/mutation, docs/testing.md): small clusters whose one right answer is
known, checked exactly.
"""

from __future__ import annotations

from common.contract import Assignment, PartitionAssignment
from materializer.assignment import LagReports, Member, compute_assignment

NOW = 10_000_000
GRACE = 600_000


def alive(*nodes: str) -> dict[str, Member]:
    return {n: Member(n, alive=True) for n in nodes}


def dead_for_good(node: str) -> Member:
    return Member(node, alive=False, dead_since_ms=NOW - 2 * GRACE)


def one_partition(active: str | None, *standbys: str, generation: int = 1) -> Assignment:
    return Assignment(
        generation, "x", NOW - 1_000, {"s": {0: PartitionAssignment(active, standbys)}}
    )


def assign(
    members: dict[str, Member],
    previous: Assignment | None,
    lag: LagReports,
    *,
    partitions: int = 1,
    standbys: int = 2,
    **options: int,
) -> Assignment:
    return compute_assignment(
        {"s": partitions},
        members,
        previous,
        lag,
        standbys=standbys,
        grace_ms=GRACE,
        now_ms=NOW,
        leader="a",
        **options,
    )


def test_the_standby_with_the_least_lag_takes_over_a_lost_active() -> None:
    """b sorts first by name; c is 5 records behind, b 500: c takes over."""
    members = alive("b", "c", "d") | {"a": dead_for_good("a")}
    lag = {("s", 0, "b"): 500, ("s", 0, "c"): 5}
    result = assign(members, one_partition("a", "b", "c"), lag)
    assert result.stores["s"][0].active == "c"


def test_a_standby_whose_lag_is_unknown_comes_after_any_known_lag() -> None:
    members = alive("b", "c", "d") | {"a": dead_for_good("a")}
    lag = {("s", 0, "b"): None, ("s", 0, "c"): 1_000}
    result = assign(members, one_partition("a", "b", "c"), lag)
    assert result.stores["s"][0].active == "c"


def test_by_default_only_a_standby_with_no_lag_takes_over_an_active() -> None:
    members = alive("a", "b")
    placed = {p: PartitionAssignment("a", ("b",)) for p in range(4)}
    previous = Assignment(1, "a", NOW - 1_000, {"s": placed})
    lag = {("s", p, n): 0 if n == "a" else 1 for p in range(4) for n in ("a", "b")}
    result = assign(members, previous, lag, partitions=4, standbys=1)
    assert [placed.active for placed in result.stores["s"].values()] == ["a"] * 4


def test_a_node_dead_for_exactly_the_grace_period_is_gone() -> None:
    members = alive("b") | {"a": Member("a", alive=False, dead_since_ms=NOW - GRACE)}
    result = assign(members, one_partition("a", "b"), {}, standbys=1)
    assert result.stores["s"][0] == PartitionAssignment("b", ())


def test_a_new_assignment_names_its_leader_and_when_it_was_computed() -> None:
    result = assign(alive("a", "b"), one_partition("a", "b", generation=4), {})
    assert (result.generation, result.leader, result.computed_at_ms) == (4, "x", NOW - 1_000)
    moved = compute_assignment(
        {"s": 1},
        alive("a", "b"),
        one_partition("a", generation=4),
        {},
        standbys=1,
        grace_ms=GRACE,
        now_ms=NOW,
        leader="b",
    )
    assert (moved.generation, moved.leader, moved.computed_at_ms) == (5, "b", NOW)


def test_a_store_added_since_the_last_assignment_is_placed() -> None:
    result = assign(alive("a", "b"), one_partition("a", "b"), {}, standbys=1)
    both = compute_assignment(
        {"s": 1, "t": 1},
        alive("a", "b"),
        result,
        {},
        standbys=1,
        grace_ms=GRACE,
        now_ms=NOW,
        leader="a",
    )
    assert both.stores["s"][0] == PartitionAssignment("a", ("b",))
    assert both.stores["t"][0] == PartitionAssignment("b", ("a",))


def warm_ups(actives: dict[int, str], nodes: tuple[str, ...]) -> dict[int, tuple[str, ...]]:
    """Without standbys, the warm-up replicas placed for `actives` (partition -> node)."""
    placed = {p: PartitionAssignment(node, ()) for p, node in actives.items()}
    previous = Assignment(1, "a", NOW - 1_000, {"s": placed})
    result = assign(alive(*nodes), previous, {}, partitions=len(actives), standbys=0)
    assert {p: pa.active for p, pa in result.stores["s"].items()} == actives  # none caught up
    return {p: pa.standbys for p, pa in result.stores["s"].items() if pa.standbys}


def test_warm_ups_go_to_the_fewest_actives_for_partitions_of_the_most_each_planned_once() -> None:
    # a has 4 actives, b 1, c none: c warms up a's first partition, then (a 3, b 1, c 1 as
    # if moved) b warms up a's next one; b's own partition is never a candidate.
    assert warm_ups({0: "b", 1: "a", 2: "a", 3: "a", 4: "a"}, ("a", "b", "c")) == {
        1: ("c",),
        2: ("b",),
    }


def test_warm_ups_stop_once_the_planned_moves_leave_a_gap_below_two() -> None:
    # a 3, b 1, c 0: one warm-up (on c) leaves a 2, b 1, c 1.
    assert warm_ups({0: "a", 1: "a", 2: "a", 3: "b"}, ("a", "b", "c")) == {0: ("c",)}
    # a 4, b 1, c 2: one warm-up (on b) leaves a 3, b 2, c 2.
    actives = {0: "a", 1: "a", 2: "a", 3: "a", 4: "b", 5: "c", 6: "c"}
    assert warm_ups(actives, ("a", "b", "c")) == {0: ("b",)}


def test_a_trimmed_standby_is_the_one_on_the_node_with_the_most_replicas() -> None:
    # Two standbys each, one wanted. 0: every node holds 2 replicas, the tie goes to the
    # last name (c); 1: then a holds 2 and c 1: a's goes, not the last name's (c).
    previous = Assignment(
        1,
        "a",
        NOW - 1_000,
        {"s": {0: PartitionAssignment("a", ("c", "b")), 1: PartitionAssignment("b", ("c", "a"))}},
    )
    result = assign(alive("a", "b", "c"), previous, {}, partitions=2, standbys=1)
    assert result.stores["s"] == {
        0: PartitionAssignment("a", ("b",)),
        1: PartitionAssignment("b", ("c",)),
    }


def test_a_new_standby_goes_to_the_node_with_the_fewest_replicas_not_actives() -> None:
    # Before the top-up a holds 1 replica (0 actives), b 1 (1 active), c 2 (2 actives). By
    # replicas, 1's standby is a (b and c are ruled out as 1's active and by count); 2's is
    # then b (a 2, b 1), where fewest actives would pick a again.
    previous = Assignment(
        1,
        "a",
        NOW - 1_000,
        {
            "s": {
                0: PartitionAssignment("c", ("a",)),
                1: PartitionAssignment("b", ()),
                2: PartitionAssignment("c", ()),
            }
        },
    )
    result = assign(alive("a", "b", "c"), previous, {}, partitions=3, standbys=1)
    assert result.stores["s"] == {
        0: PartitionAssignment("c", ("a",)),
        1: PartitionAssignment("b", ("a",)),
        2: PartitionAssignment("c", ("b",)),
    }


def test_replica_counts_one_apart_are_balanced_enough() -> None:
    # a 1 replica, b 1, c 0 after the top-up: moving b's standby to c would only swap the
    # gap round, and move data for nothing.
    result = assign(alive("a", "b", "c"), one_partition("a"), {}, standbys=1)
    assert result.stores["s"][0] == PartitionAssignment("a", ("b",))


def test_an_active_in_its_grace_period_does_not_stop_balancing_the_others() -> None:
    """Partition 0's active is on c, dead but within its grace period (not counted): the
    scan for a swap goes on to 1 and 2, both active on b with a caught-up standby on a."""
    members = alive("a", "b") | {"c": Member("c", alive=False, dead_since_ms=NOW - GRACE // 2)}
    previous = Assignment(
        1,
        "a",
        NOW - 1_000,
        {
            "s": {0: PartitionAssignment("c", ("a",))}
            | {p: PartitionAssignment("b", ("a",)) for p in (1, 2)}
        },
    )
    lag = {("s", p, "a"): 0 for p in (1, 2)}
    result = assign(members, previous, lag, partitions=3, standbys=1)
    assert [result.stores["s"][p].active for p in range(3)] == ["c", "a", "b"]


def test_a_balancing_swap_takes_the_first_partition_of_equal_gaps_and_keeps_the_old_active() -> (
    None
):
    members = alive("a", "b")
    placed = {p: PartitionAssignment("a", ("b",)) for p in (0, 1)}
    previous = Assignment(1, "a", NOW - 1_000, {"s": placed})
    lag = {("s", p, "b"): 0 for p in (0, 1)}
    result = assign(members, previous, lag, partitions=2, standbys=1)
    assert result.stores["s"] == {
        0: PartitionAssignment("b", ("a",)),
        1: PartitionAssignment("a", ("b",)),
    }
