"""Property tests of the leader's assignment function (a pure function: plain values in and out)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.contract import Assignment, PartitionAssignment
from materializer.assignment import Member, compute_assignment

NOW = 10_000_000
GRACE = 600_000
NODE_IDS = [f"n{i}" for i in range(6)]
# How far behind a standby may be and still take over an active when balancing: the default
# of compute_assignment, and what the cluster runs with (acceptable_recovery_lag, 10,000).
CAUGHT_UP_LAGS = [0, 1, 10_000]


@dataclass(frozen=True)
class Cluster:
    stores: dict[str, int]
    members: dict[str, Member]
    previous: Assignment
    lag: dict[tuple[str, int, str], int | None]
    standbys: int
    caught_up_lag: int


@st.composite
def clusters(draw):
    count = draw(st.integers(1, 6))
    nodes = NODE_IDS[:count]
    stores = {"customers": draw(st.integers(1, 12))}
    if draw(st.booleans()):
        stores["orders"] = draw(st.integers(1, 5))
    standbys = draw(st.integers(0, 2))
    # The assignment as it stood while everyone was alive (a realistic "previous").
    everyone = {n: Member(n, alive=True) for n in nodes}
    previous = compute_assignment(
        stores,
        everyone,
        None,
        {},
        standbys=standbys,
        grace_ms=GRACE,
        now_ms=NOW - GRACE * 3,
        leader=nodes[0],
    )
    members = {}
    for n in nodes:
        state = draw(st.sampled_from(["alive", "alive", "dead-in-grace", "dead-for-good"]))
        if state == "alive":
            members[n] = Member(n, alive=True)
        else:
            since = NOW - (GRACE // 2 if state == "dead-in-grace" else GRACE * 2)
            members[n] = Member(n, alive=False, dead_since_ms=since)
    caught_up_lag = draw(st.sampled_from(CAUGHT_UP_LAGS))
    # Lag is reported only by nodes that host a replica (as in the real cluster), on both
    # sides of the caught-up limit and at it.
    lags = st.one_of(
        st.none(),
        st.integers(0, 50),
        st.integers(0, 3 * caught_up_lag),
        st.sampled_from([caught_up_lag, caught_up_lag + 1]),
    )
    lag = {
        (store, p, node): draw(lags)
        for store, parts in previous.stores.items()
        for p, placed in parts.items()
        for node in placed.replicas()
    }
    return Cluster(stores, members, previous, lag, standbys, caught_up_lag)


def assign(cluster: Cluster, previous: Assignment | None = None) -> Assignment:
    return compute_assignment(
        cluster.stores,
        cluster.members,
        previous or cluster.previous,
        cluster.lag,
        standbys=cluster.standbys,
        grace_ms=GRACE,
        now_ms=NOW,
        leader="n0",
        caught_up_lag=cluster.caught_up_lag,
    )


def holders(members):
    return {n for n, m in members.items() if m.alive or NOW - m.dead_since_ms < GRACE}


def warm_ups(assignment: Assignment, alive: set[str]) -> int:
    """Live standbys in all: with `standbys=0`, the warm-up replicas."""
    return sum(n in alive for _, _, placed in placements(assignment) for n in placed.standbys)


def placements(assignment: Assignment):
    for store, parts in assignment.stores.items():
        for partition, placed in parts.items():
            yield store, partition, placed


@settings(max_examples=400)
@given(clusters())
def test_replicas_are_distinct_and_only_on_nodes_that_may_hold_them(cluster):
    result = assign(cluster)
    alive = {n for n, m in cluster.members.items() if m.alive}
    assert {(s, p) for s, p, _ in placements(result)} == {
        (s, p) for s, c in cluster.stores.items() for p in range(c)
    }
    for store, partition, placed in placements(result):
        replicas = placed.replicas()
        assert len(replicas) == len(set(replicas)), "two replicas on one node"
        assert set(replicas) <= holders(cluster.members)
        if alive:
            assert placed.active is not None
        before = cluster.previous.stores[store][partition].replicas()
        assert set(replicas) - set(before) <= alive, "new replicas go to live nodes only"
        # Standbys on nodes in their grace period are kept as they were, even above the count.
        live_standbys = [n for n in placed.standbys if n in alive]
        wanted = max(0, min(cluster.standbys, len(holders(cluster.members)) - 1))
        if wanted:
            assert len(live_standbys) <= wanted
    if not max(0, min(cluster.standbys, len(holders(cluster.members)) - 1)):
        # Without standbys, only warm-up replicas (or the actives they replaced): two at most.
        assert warm_ups(result, alive) <= 2


@settings(max_examples=300)
@given(clusters())
def test_nodes_in_their_grace_period_keep_their_partitions_and_roles(cluster):
    result = assign(cluster)
    in_grace = holders(cluster.members) - {n for n, m in cluster.members.items() if m.alive}
    for store, partition, placed in placements(cluster.previous):
        for node in placed.replicas():
            if node in in_grace:
                assert result.stores[store][partition].role_of(node) == placed.role_of(node)


@settings(max_examples=300)
@given(clusters())
def test_a_lost_active_is_replaced_by_a_previous_replica_when_one_lives(cluster):
    result = assign(cluster)
    alive = {n for n, m in cluster.members.items() if m.alive}
    for store, partition, placed in placements(cluster.previous):
        live_replicas = [n for n in placed.replicas() if n in alive]
        if live_replicas:
            assert result.stores[store][partition].active in placed.replicas()


@settings(max_examples=300)
@given(clusters())
def test_the_most_caught_up_standby_is_promoted(cluster):
    alive = {n for n, m in cluster.members.items() if m.alive}
    result = assign(cluster)
    for store, partition, placed in placements(cluster.previous):
        gone = placed.active not in holders(cluster.members)
        live_standbys = [n for n in placed.standbys if n in alive]
        new_active = result.stores[store][partition].active
        if gone and live_standbys and new_active in live_standbys:

            def lag_or_worst(
                node: str, store: str = store, partition: int = partition
            ) -> tuple[int, str]:
                reported = cluster.lag.get((store, partition, node))
                return (2**62 if reported is None else reported, node)

            best = min(live_standbys, key=lag_or_worst)

            reported = cluster.lag.get((store, partition, new_active))
            caught_up = reported is not None and reported <= cluster.caught_up_lag
            assert new_active == best or caught_up  # or moved later to a caught-up replica


def lag_within(cluster: Cluster, store: str, partition: int, node: str) -> bool:
    reported = cluster.lag.get((store, partition, node))
    return reported is not None and reported <= cluster.caught_up_lag


@st.composite
def skewed_clusters(draw):
    """Everyone alive, actives piled on few nodes (as after nodes joined one by one): only
    balancing moves anything, and only onto standbys within `caught_up_lag`."""
    nodes = NODE_IDS[: draw(st.integers(2, 6))]
    partitions = draw(st.integers(1, 12))
    standbys = draw(st.integers(0, 2))
    heavy = nodes[: draw(st.integers(1, len(nodes) - 1))]
    placed = {}
    for p in range(partitions):
        active = draw(st.sampled_from(heavy))
        others = [n for n in nodes if n != active]
        chosen = draw(st.permutations(others))[: min(standbys, len(others))]
        placed[p] = PartitionAssignment(active, tuple(chosen))
    previous = Assignment(1, nodes[0], NOW - 1_000, {"s": placed})
    caught_up_lag = draw(st.sampled_from(CAUGHT_UP_LAGS))
    lags = st.one_of(
        st.none(),
        st.integers(0, 3 * caught_up_lag),
        st.sampled_from([0, caught_up_lag, caught_up_lag + 1]),
    )
    lag = {("s", p, n): draw(lags) for p, pa in placed.items() for n in pa.replicas()}
    members = {n: Member(n, alive=True) for n in nodes}
    return Cluster({"s": partitions}, members, previous, lag, standbys, caught_up_lag)


def active_counts(cluster: Cluster, assignment: Assignment) -> Counter[str]:
    alive = [n for n, m in cluster.members.items() if m.alive]
    counts = Counter(dict.fromkeys(alive, 0))
    counts.update(
        placed.active for _, _, placed in placements(assignment) if placed.active in alive
    )
    return counts


def check_balancing(cluster: Cluster, result: Assignment) -> None:
    """Safety: an active that was not lost moves only onto a replica within `caught_up_lag`.
    Liveness: no such replica is left whose taking over would narrow an active-count gap of
    two or more (the balancing did everything it was allowed to)."""
    keeps = holders(cluster.members)
    for store, partition, placed in placements(result):
        before = cluster.previous.stores[store][partition].active
        if before in keeps and placed.active != before:
            assert lag_within(cluster, store, partition, placed.active), (
                f"{store}/{partition} moved from {before} to {placed.active}, which is behind"
            )
    counts = active_counts(cluster, result)
    for store, partition, placed in placements(result):
        if placed.active not in counts:
            continue
        for standby in placed.standbys:
            if standby in counts and lag_within(cluster, store, partition, standby):
                assert counts[placed.active] - counts[standby] <= 1, (
                    f"{store}/{partition}: {placed.active} has {counts[placed.active]} actives, "
                    f"its caught-up standby {standby} {counts[standby]}"
                )


@settings(max_examples=400)
@given(clusters())
def test_balancing_moves_actives_only_onto_caught_up_replicas_and_as_far_as_they_allow(cluster):
    check_balancing(cluster, assign(cluster))


@settings(max_examples=400)
@given(skewed_clusters())
def test_piled_up_actives_spread_onto_every_caught_up_standby(cluster):
    check_balancing(cluster, assign(cluster))


@pytest.mark.parametrize(("standby_lag", "moves"), [(0, True), (5_000, True), (10_001, False)])
def test_with_the_clusters_caught_up_lag_a_standby_5000_behind_takes_over(standby_lag, moves):
    """The cluster balances with acceptable_recovery_lag = 10,000 (KIP-441's default): a
    standby 5,000 records behind is warm enough to take over half the actives."""
    members = {n: Member(n, alive=True) for n in ("a", "b")}
    previous = Assignment(
        3, "a", NOW, {"s": {p: PartitionAssignment("a", ("b",)) for p in range(4)}}
    )
    lag = {("s", p, n): 0 if n == "a" else standby_lag for p in range(4) for n in ("a", "b")}
    result = compute_assignment(
        {"s": 4},
        members,
        previous,
        lag,
        standbys=1,
        grace_ms=GRACE,
        now_ms=NOW,
        leader="a",
        caught_up_lag=10_000,
    )
    actives = Counter(placed.active for placed in result.stores["s"].values())
    assert sorted(actives.values()) == ([2, 2] if moves else [4])


@settings(max_examples=300)
@given(clusters())
def test_assigning_again_changes_nothing(cluster):
    first = assign(cluster)
    second = assign(cluster, previous=first)
    assert second == first
    assert second.generation == first.generation


@settings(max_examples=300)
@given(st.integers(1, 6), st.integers(1, 40), st.integers(0, 2))
def test_from_scratch_with_everyone_alive_it_is_balanced(node_count, partitions, standbys):
    members = {n: Member(n, alive=True) for n in NODE_IDS[:node_count]}
    result = compute_assignment(
        {"s": partitions},
        members,
        None,
        {},
        standbys=standbys,
        grace_ms=GRACE,
        now_ms=NOW,
        leader="n0",
    )
    actives = {n: 0 for n in members}
    replicas = {n: 0 for n in members}
    for _, _, placed in placements(result):
        actives[placed.active] += 1
        assert len(placed.standbys) == min(standbys, node_count - 1)
        for node in placed.replicas():
            replicas[node] += 1
    assert max(actives.values()) - min(actives.values()) <= 1
    assert max(replicas.values()) - min(replicas.values()) <= 1


def test_a_returning_node_rejoins_without_moving_anything_else():
    members = {n: Member(n, alive=True) for n in ("a", "b", "c")}
    first = compute_assignment(
        {"s": 12}, members, None, {}, standbys=1, grace_ms=GRACE, now_ms=NOW, leader="a"
    )
    members["b"] = Member("b", alive=False, dead_since_ms=NOW)
    during = compute_assignment(
        {"s": 12}, members, first, {}, standbys=1, grace_ms=GRACE, now_ms=NOW + 1000, leader="a"
    )
    assert during.stores == first.stores  # within the grace period nothing moves
    members["b"] = Member("b", alive=True)
    back = compute_assignment(
        {"s": 12}, members, during, {}, standbys=1, grace_ms=GRACE, now_ms=NOW + 2000, leader="a"
    )
    assert back.stores == first.stores


def test_after_the_grace_period_the_dead_nodes_partitions_move():
    members = {n: Member(n, alive=True) for n in ("a", "b", "c")}
    first = compute_assignment(
        {"s": 6}, members, None, {}, standbys=1, grace_ms=GRACE, now_ms=NOW, leader="a"
    )
    members["b"] = Member("b", alive=False, dead_since_ms=NOW)
    lag = {("s", p, n): 0 for p, placed in first.stores["s"].items() for n in placed.replicas()}
    after = compute_assignment(
        {"s": 6},
        members,
        first,
        lag,
        standbys=1,
        grace_ms=GRACE,
        now_ms=NOW + GRACE + 1,
        leader="a",
    )
    for partition, placed in after.stores["s"].items():
        assert "b" not in placed.replicas()
        assert len(placed.standbys) == 1
        was = first.stores["s"][partition]
        if was.active == "b":
            assert placed.active in was.standbys  # the standby took over
    assert after.generation == first.generation + 1


def test_generation_moves_only_when_the_assignment_changes():
    members = {"a": Member("a", alive=True)}
    first = compute_assignment(
        {"s": 2}, members, None, {}, standbys=1, grace_ms=GRACE, now_ms=NOW, leader="a"
    )
    assert first.generation == 1
    assert first.stores["s"][0] == PartitionAssignment("a", ())
    members["b"] = Member("b", alive=True)
    second = compute_assignment(
        {"s": 2}, members, first, {}, standbys=1, grace_ms=GRACE, now_ms=NOW, leader="a"
    )
    assert second.generation == 2
    assert all(placed.standbys == ("b",) for placed in second.stores["s"].values())


def test_nodes_joining_one_by_one_end_up_with_balanced_actives_once_caught_up():
    members: dict[str, Member] = {}
    assignment = None
    for node in ("a", "b", "c"):
        members[node] = Member(node, alive=True)
        for _ in range(4):  # a few leader rounds, every replica reporting lag 0
            lag = {}
            if assignment is not None:
                lag = {
                    ("s", p, n): 0
                    for p, placed in assignment.stores["s"].items()
                    for n in placed.replicas()
                }
            assignment = compute_assignment(
                {"s": 6},
                members,
                assignment,
                lag,
                standbys=1,
                grace_ms=GRACE,
                now_ms=NOW,
                leader="a",
            )
    actives = Counter(placed.active for placed in assignment.stores["s"].values())
    replicas = Counter(n for placed in assignment.stores["s"].values() for n in placed.replicas())
    assert sorted(actives.values()) == [2, 2, 2]
    assert sorted(replicas.values()) == [4, 4, 4]


@settings(max_examples=300)
@given(skewed_clusters())
def test_without_standbys_an_imbalance_gets_warm_ups_and_never_more_than_two(cluster):
    if cluster.standbys:
        return
    result = assign(cluster)
    alive = set(cluster.members)
    counts = active_counts(cluster, result)
    assert warm_ups(result, alive) <= 2
    if max(counts.values()) - min(counts.values()) >= 2:
        assert warm_ups(result, alive) >= 1, "unbalanced, and nothing is warming up"
    assert assign(cluster, previous=result) == result  # placed again, the same, every round


def test_without_standbys_a_joining_node_takes_its_share_once_its_warm_ups_caught_up():
    """KROUTE_STANDBYS=0: a node that joins gets warm-up replicas (two at a time), each
    takes its active over once caught up, and no replica is left over at the end."""
    members = {n: Member(n, alive=True) for n in ("a", "b")}
    assignment = compute_assignment(
        {"s": 6}, members, None, {}, standbys=0, grace_ms=GRACE, now_ms=NOW, leader="a"
    )
    members["c"] = Member("c", alive=True)

    def round_(lag_of_c: int) -> Assignment:
        lag = {
            ("s", p, n): lag_of_c if n == "c" else 0
            for p, placed in assignment.stores["s"].items()
            for n in placed.replicas()
        }
        return compute_assignment(
            {"s": 6},
            members,
            assignment,
            lag,
            standbys=0,
            grace_ms=GRACE,
            now_ms=NOW,
            leader="a",
            caught_up_lag=10,
        )

    assignment = round_(0)
    warming = [p for p, placed in assignment.stores["s"].items() if placed.standbys == ("c",)]
    assert len(warming) == 2, assignment.stores
    assert Counter(placed.active for placed in assignment.stores["s"].values())["c"] == 0
    # Behind: nothing moves, and the assignment stays as it is (no new generation).
    behind = round_(11)
    assert behind == assignment
    for _ in range(4):  # caught up: the warm-ups take over, the old actives are trimmed
        assignment = round_(0)
    actives = Counter(placed.active for placed in assignment.stores["s"].values())
    assert sorted(actives.values()) == [2, 2, 2]
    assert warm_ups(assignment, set(members)) == 0
