"""The assignment at scale: the incremental load counting gives exactly the assignment the
original counting (every placement counted again for every choice) gave, and a cluster of
hundreds of nodes and thousands of partitions is placed in seconds, not minutes."""

from __future__ import annotations

import time
from collections.abc import Mapping

from hypothesis import given, settings

from common.contract import Assignment, PartitionAssignment
from materializer import assignment as module
from materializer.assignment import LagReports, Member, PartitionId, compute_assignment
from tests.materializer.test_assignment import GRACE, NOW, Cluster, clusters

Placements = Mapping[PartitionId, module._Placement]


# -- the original implementation, kept as the reference ---------------------------------------


def _loads(placements: Placements, nodes: list[str]) -> dict[str, tuple[int, int]]:
    actives = dict.fromkeys(nodes, 0)
    replicas = dict.fromkeys(nodes, 0)
    for placement in placements.values():
        if placement.active in actives:
            actives[placement.active] += 1
        for node in placement.replicas():
            if node in replicas:
                replicas[node] += 1
    return {n: (actives[n], replicas[n]) for n in nodes}


def _least_loaded(candidates: list[str], placements: Placements, by_actives: bool) -> str:
    loads = _loads(placements, candidates)
    return min(candidates, key=lambda n: (loads[n] if by_actives else loads[n][::-1], n))


def _promote(pid, placement, alive, lag: LagReports, placements: Placements) -> None:
    live_standbys = [n for n in placement.standbys if n in alive]
    if live_standbys:

        def lag_of(node: str) -> tuple[int, str]:
            reported = lag.get((pid[0], pid[1], node))
            return (reported if reported is not None else 2**62, node)

        chosen = min(live_standbys, key=lag_of)
        placement.standbys.remove(chosen)
    else:
        chosen = _least_loaded(alive, placements, by_actives=True)
    placement.active = chosen


def _top_up_or_trim(placement, wanted: int, alive: list[str], placements: Placements) -> None:
    while len(placement.standbys) > wanted:
        removable = [n for n in placement.standbys if n in alive]
        if not removable:
            break
        loads = _loads(placements, removable)
        placement.standbys.remove(max(removable, key=lambda n: (loads[n][1], n)))
    while len(placement.standbys) < wanted:
        free = [n for n in alive if n not in placement.replicas()]
        if not free:
            return
        placement.standbys.append(_least_loaded(free, placements, by_actives=False))


def _balance_standbys(placements: Placements, alive: list[str]) -> None:
    for _ in range(len(placements) * max(1, len(alive))):
        loads = _loads(placements, alive)
        heaviest = max(alive, key=lambda n: (loads[n][1], n))
        lightest = min(alive, key=lambda n: (loads[n][1], n))
        if loads[heaviest][1] - loads[lightest][1] <= 1:
            return
        movable = [
            p
            for _, p in sorted(placements.items())
            if heaviest in p.standbys and lightest not in p.replicas()
        ]
        if not movable:
            return
        movable[0].standbys[movable[0].standbys.index(heaviest)] = lightest


def _balance_actives(placements: Placements, alive: list[str], lag: LagReports, limit: int) -> None:
    for _ in range(len(placements) * max(1, len(alive))):
        loads = _loads(placements, alive)
        best = None
        for (store, partition), placement in sorted(placements.items()):
            if placement.active not in loads:
                continue
            for standby in placement.standbys:
                reported = lag.get((store, partition, standby))
                if standby not in loads or reported is None or reported > limit:
                    continue
                gap = loads[placement.active][0] - loads[standby][0]
                if gap >= 2 and (best is None or gap > best[0]):
                    best = (gap, placement.active, standby, placement)
        if best is None:
            return
        _, active, standby, placement = best
        placement.standbys[placement.standbys.index(standby)] = active
        placement.active = standby


def reference(cluster: Cluster) -> Assignment:
    members, previous = cluster.members, cluster.previous
    alive = sorted(n for n, m in members.items() if m.alive)
    holders = set(alive) | {
        n for n, m in members.items() if not m.alive and NOW - m.dead_since_ms < GRACE
    }
    placements = {
        pid: module._sticky(previous, pid, holders)
        for pid in module._all_partitions(cluster.stores)
    }
    wanted = max(0, min(cluster.standbys, len(holders) - 1))
    for pid, placement in sorted(placements.items()):
        if placement.active is None and alive:
            _promote(pid, placement, alive, cluster.lag, placements)
        _top_up_or_trim(placement, wanted, alive, placements)
    if alive:
        _balance_standbys(placements, alive)
        _balance_actives(placements, alive, cluster.lag, cluster.caught_up_lag)
    stores: dict[str, dict[int, PartitionAssignment]] = {}
    for (store, partition), placement in sorted(placements.items()):
        stores.setdefault(store, {})[partition] = PartitionAssignment(
            placement.active, tuple(placement.standbys)
        )
    return Assignment(0, "n0", NOW, stores)


@settings(max_examples=400, deadline=None)
@given(clusters())
def test_the_incremental_counting_gives_the_original_assignment(cluster):
    for previous in (cluster.previous, None):  # after failures, and from nothing
        cluster_now = Cluster(
            cluster.stores,
            cluster.members,
            previous,  # type: ignore[arg-type]
            cluster.lag,
            cluster.standbys,
            cluster.caught_up_lag,
        )
        computed = compute_assignment(
            cluster.stores,
            cluster.members,
            previous,
            cluster.lag,
            standbys=cluster.standbys,
            grace_ms=GRACE,
            now_ms=NOW,
            leader="n0",
            caught_up_lag=cluster.caught_up_lag,
        )
        assert {s: dict(p) for s, p in computed.stores.items()} == {
            s: dict(p) for s, p in reference(cluster_now).stores.items()
        }


def test_300_nodes_and_6000_partitions_are_placed_in_seconds():
    # The original counting took 21 s for 100 nodes / 2,000 partitions from nothing (it grows
    # with the square of the partitions); this is 3x the partitions.
    nodes = {f"n{i:03d}": Member(f"n{i:03d}", alive=True) for i in range(300)}
    started = time.perf_counter()
    first = compute_assignment(
        {"s": 6_000}, nodes, None, {}, standbys=1, grace_ms=GRACE, now_ms=NOW, leader="n000"
    )
    took = time.perf_counter() - started
    actives = [p.active for p in first.stores["s"].values()]
    assert {actives.count(n) for n in nodes} == {20}, "balanced: 20 actives each"
    assert took < 15, f"{took:.1f} s"
