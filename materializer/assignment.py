"""Who hosts which partition: the leader's assignment, as a pure function (no I/O).

Rules, in the order they are applied to every partition (KIP-441 in spirit):
1. Sticky. Replicas stay where they were, as long as their node may hold replicas: it is alive,
   or it died less than `grace_ms` ago (a patched VM comes back in 10-15 minutes and should find
   its partitions waiting; meanwhile the proxy serves from the standbys).
2. An active whose node is gone for good is replaced by its most caught-up live standby (least
   offset lag; unknown lag counts as worst); with no standby left, by the least-loaded live node.
3. Standbys are topped up to `standbys` (fewer when there are not enough nodes) on the
   least-loaded live nodes, and trimmed from the most-loaded when there are too many.
   Never two replicas of one partition on one node.
4. Balance. Standbys move from the most- to the least-loaded live node while loads differ by
   more than one. An active moves only onto a replica that is caught up (lag <= `caught_up_lag`),
   by swapping roles, while active counts differ by more than one: a new replica is warmed up
   before it is counted on.
Ties are broken by node id, so the same inputs always give the same assignment.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from common.contract import Assignment, PartitionAssignment

PartitionId = tuple[str, int]  # (store, partition)
LagReports = Mapping[tuple[str, int, str], int | None]  # (store, partition, node) -> offset lag


@dataclass(frozen=True)
class Member:
    node_id: str
    alive: bool
    dead_since_ms: int | None = None  # when it was first seen dead


@dataclass
class _Placement:
    active: str | None
    standbys: list[str]

    def replicas(self) -> list[str]:
        return ([self.active] if self.active else []) + self.standbys


def compute_assignment(
    stores: Mapping[str, int],
    members: Mapping[str, Member],
    previous: Assignment | None,
    lag: LagReports,
    *,
    standbys: int,
    grace_ms: int,
    now_ms: int,
    leader: str,
    caught_up_lag: int = 0,
) -> Assignment:
    alive = sorted(n for n, m in members.items() if m.alive)
    holders = set(alive) | {
        n
        for n, m in members.items()
        if not m.alive and m.dead_since_ms is not None and now_ms - m.dead_since_ms < grace_ms
    }
    placements = {pid: _sticky(previous, pid, holders) for pid in _all_partitions(stores)}
    wanted_standbys = max(0, min(standbys, len(holders) - 1))
    for pid, placement in sorted(placements.items()):
        if placement.active is None and alive:
            _promote(pid, placement, alive, lag, placements)
        _top_up_or_trim(placement, wanted_standbys, alive, placements)
    if alive:
        _balance_standbys(placements, alive)
        _balance_actives(placements, alive, lag, caught_up_lag)
    generation = (previous.generation if previous else 0) + 1
    stores_out: dict[str, dict[int, PartitionAssignment]] = {}
    for (store, partition), placement in sorted(placements.items()):
        stores_out.setdefault(store, {})[partition] = PartitionAssignment(
            placement.active, tuple(placement.standbys)
        )
    if previous is not None and _same(previous, stores_out):
        generation = previous.generation  # nothing changed: keep the generation
        return Assignment(generation, previous.leader, previous.computed_at_ms, previous.stores)
    return Assignment(generation, leader, now_ms, stores_out)


def _all_partitions(stores: Mapping[str, int]) -> list[PartitionId]:
    return [(store, p) for store, count in sorted(stores.items()) for p in range(count)]


def _sticky(previous: Assignment | None, pid: PartitionId, holders: set[str]) -> _Placement:
    placed = previous.stores.get(pid[0], {}).get(pid[1]) if previous else None
    if placed is None:
        return _Placement(None, [])
    active = placed.active if placed.active in holders else None
    kept = [n for n in placed.standbys if n in holders and n != active]
    return _Placement(active, list(dict.fromkeys(kept)))


def _loads(
    placements: Mapping[PartitionId, _Placement], nodes: list[str]
) -> dict[str, tuple[int, int]]:
    """node -> (active count, replica count)."""
    actives = dict.fromkeys(nodes, 0)
    replicas = dict.fromkeys(nodes, 0)
    for placement in placements.values():
        if placement.active in actives:
            actives[placement.active] += 1
        for node in placement.replicas():
            if node in replicas:
                replicas[node] += 1
    return {n: (actives[n], replicas[n]) for n in nodes}


def _least_loaded(
    candidates: list[str], placements: Mapping[PartitionId, _Placement], by_actives: bool
) -> str:
    loads = _loads(placements, candidates)
    return min(candidates, key=lambda n: (loads[n] if by_actives else loads[n][::-1], n))


def _promote(
    pid: PartitionId,
    placement: _Placement,
    alive: list[str],
    lag: LagReports,
    placements: Mapping[PartitionId, _Placement],
) -> None:
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


def _top_up_or_trim(
    placement: _Placement,
    wanted: int,
    alive: list[str],
    placements: Mapping[PartitionId, _Placement],
) -> None:
    while len(placement.standbys) > wanted:
        # Only live nodes' standbys go: a node in its grace period keeps what it had.
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


def _balance_standbys(placements: dict[PartitionId, _Placement], alive: list[str]) -> None:
    for _ in range(len(placements) * max(1, len(alive))):  # bounded: each move narrows the gap
        loads = _loads(placements, alive)
        heaviest = max(alive, key=lambda n: (loads[n][1], n))
        lightest = min(alive, key=lambda n: (loads[n][1], n))
        if loads[heaviest][1] - loads[lightest][1] <= 1:
            return
        movable = [
            (pid, p)
            for pid, p in sorted(placements.items())
            if heaviest in p.standbys and lightest not in p.replicas()
        ]
        if not movable:
            return
        _, placement = movable[0]
        placement.standbys[placement.standbys.index(heaviest)] = lightest


def _balance_actives(
    placements: dict[PartitionId, _Placement], alive: list[str], lag: LagReports, caught_up_lag: int
) -> None:
    """Swap active and standby roles while some swap narrows an active-count gap of 2 or more.

    Only onto a caught-up standby, so a partition never becomes active on a cold replica.
    """
    for _ in range(len(placements) * max(1, len(alive))):  # bounded: each swap narrows a gap
        loads = _loads(placements, alive)
        best: tuple[int, str, str, _Placement] | None = None
        for (store, partition), placement in sorted(placements.items()):
            active = placement.active
            if active not in loads:
                continue
            for standby in placement.standbys:
                reported = lag.get((store, partition, standby))
                if standby not in loads or reported is None or reported > caught_up_lag:
                    continue
                gap = loads[active][0] - loads[standby][0]
                if gap >= 2 and (best is None or gap > best[0]):
                    best = (gap, active, standby, placement)
        if best is None:
            return
        _, active, standby, placement = best
        placement.standbys[placement.standbys.index(standby)] = active
        placement.active = standby


def _same(previous: Assignment, stores: Mapping[str, Mapping[int, PartitionAssignment]]) -> bool:
    return {s: dict(p) for s, p in previous.stores.items()} == {
        s: dict(p) for s, p in stores.items()
    }
