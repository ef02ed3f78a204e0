"""The proxy's routing table: an immutable snapshot built from what Redis holds (pure).

The watcher reads the contract's keys, decodes them and hands them to a `TableBuilder`, which
keeps every partition's replicas and recomputes only the partitions an update touches (a node's
report touches the partitions the assignment gives it); `TableBuilder.snapshot` is then swapped
in with one assignment, so a request reads the current snapshot once and sees one consistent
view (aiokafka's cluster metadata does the same). `build_snapshot` builds one from scratch (the
builder's results equal it). Nothing here does I/O.

A node serves a partition in the snapshot only when the assignment places it there *and* the
node's own hosting report says it serves it in that role: a node still applying a new assignment
is not sent requests for partitions it has not started reading.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from common.contract import (
    Assignment,
    Hosting,
    NodeInfo,
    PartitionAssignment,
    PartitionReport,
    StoreInfo,
)
from partitioner import KeyPartitioner
from proxy.choice import Replica

# No LRU in front of the hash: measured here with 100,000 distinct keys, a miss in
# functools.lru_cache costs ~780 ns against ~250 ns for serialize + murmur2 + modulo, and a
# hit saves under 200 ns. Predictable beats lucky on the hot path.
PARTITION_CACHE = 0


@dataclass(frozen=True)
class StoreRoute:
    info: StoreInfo
    partitioner: KeyPartitioner
    replicas: tuple[tuple[Replica, ...], ...]  # indexed by partition


@dataclass(frozen=True)
class RoutingSnapshot:
    generation: int
    built_at_ms: int
    stores: Mapping[str, StoreRoute] = field(default_factory=dict)
    node_urls: Mapping[str, str] = field(default_factory=dict)  # every registered node
    alive: frozenset[str] = frozenset()
    # The partitions whose replicas may differ from the previous snapshot's (None: any may):
    # what a cache of choices needs to forget. `node_urls` is the previous snapshot's own
    # object when no node's URL changed.
    changed: Mapping[str, frozenset[int]] | None = None

    def live_urls(self) -> tuple[str, ...]:
        """Where requests that match no keyed route may go: any live registered node."""
        return tuple(url for node, url in sorted(self.node_urls.items()) if node in self.alive)


EMPTY = RoutingSnapshot(generation=0, built_at_ms=0)


def build_snapshot(
    *,
    stores: Mapping[str, StoreInfo],
    assignment: Assignment | None,
    hostings: Mapping[str, Hosting],
    reports: Mapping[tuple[str, str, int], PartitionReport],  # (node, store, partition)
    nodes: Mapping[str, NodeInfo],
    alive: frozenset[str],
    built_at_ms: int,
) -> RoutingSnapshot:
    routes: dict[str, StoreRoute] = {}
    for name, info in sorted(stores.items()):
        placements = assignment.stores.get(name, {}) if assignment else {}
        routes[name] = StoreRoute(
            info=info,
            partitioner=_partitioner(info),
            replicas=tuple(
                _replicas(
                    name,
                    partition,
                    placements.get(partition),
                    nodes=nodes,
                    hostings=hostings,
                    report_of=lambda node_id, store, p: _fields(reports.get((node_id, store, p))),
                    alive=alive,
                )
                for partition in range(info.partitions)
            ),
        )
    return RoutingSnapshot(
        generation=assignment.generation if assignment else 0,
        built_at_ms=built_at_ms,
        stores=routes,
        node_urls={node_id: info.url for node_id, info in nodes.items()},
        alive=alive,
    )


def _partitioner(info: StoreInfo) -> KeyPartitioner:
    return KeyPartitioner(
        info.key_format, info.partitioner, info.partitions, cache_size=PARTITION_CACHE
    )


def _replicas(
    store: str,
    partition: int,
    placed: PartitionAssignment | None,
    *,
    nodes: Mapping[str, NodeInfo],
    hostings: Mapping[str, Hosting],
    report_of: Callable[[str, str, int], ReportFields | None],
    alive: frozenset[str] | set[str],
) -> tuple[Replica, ...]:
    """One partition's replicas: placed by the assignment and served in that role."""
    if placed is None:
        return ()
    replicas: list[Replica] = []
    for node_id in placed.replicas():
        role = placed.role_of(node_id)
        node = nodes.get(node_id)
        hosting = hostings.get(node_id)
        if role is None or node is None or hosting is None:
            continue
        if partition not in hosting.stores.get(store, {}).get(role, ()):
            continue  # assigned, not yet served in that role
        lag, caught_up_at_ms, reported_at_ms, position = (
            report_of(node_id, store, partition) or _NO_REPORT
        )
        replicas.append(
            Replica(
                node_id=node_id,
                url=node.url,
                role=role,
                alive=node_id in alive,
                lag=lag,
                caught_up_at_ms=caught_up_at_ms,
                reported_at_ms=reported_at_ms,
                position=position,
            )
        )
    return tuple(replicas)


# What a replica's row takes from its report: lag, caught up at, reported at, position. Kept as
# a tuple of integers, which the garbage collector stops tracking: the table holds one per
# replica and replaces them all every few hundred milliseconds, and tracked objects would make
# every full collection (an event-loop stall) longer and more frequent.
ReportFields = tuple[int | None, int | None, int | None, int | None]
_NO_REPORT: ReportFields = (None, None, None, None)


def _fields(report: PartitionReport | None) -> ReportFields | None:
    return None if report is None else _fields_of(report)


def _fields_of(report: PartitionReport) -> ReportFields:
    return (report.lag, report.caught_up_at_ms, report.updated_at_ms, report.current_offset)


NodeReports = Mapping[tuple[str, int], PartitionReport]  # one node's: (store, partition)
# How many partitions one step of a rebuild recomputes: ~1 ms of work between two yields.
STEP_PARTITIONS = 256


class TableBuilder:
    """The table's inputs and every partition's replicas, kept current by small updates.

    Updates record what changed and which partitions it touches; `rebuild` recomputes those
    partitions in steps of `STEP_PARTITIONS` (a generator: the caller may yield to its event
    loop between steps), and `snapshot` copies the rows into an immutable `RoutingSnapshot`.
    A node's update touches only the partitions the assignment places on it, so its cost
    follows that node's share of the table, not the table. A new assignment or store touches
    everything (rare: a rebalance)."""

    def __init__(self) -> None:
        self.stores: dict[str, StoreInfo] = {}
        self.assignment: Assignment | None = None
        self.nodes: dict[str, NodeInfo] = {}
        self.alive: set[str] = set()
        self.hostings: dict[str, Hosting] = {}
        self.reports: dict[str, dict[tuple[str, int], ReportFields]] = {}
        self._rows: dict[str, list[tuple[Replica, ...]]] = {}
        self._partitioners: dict[str, KeyPartitioner] = {}
        self._made: dict[tuple[str, str, int], KeyPartitioner] = {}
        self._placed_on: dict[str, set[tuple[str, int]]] = {}  # node -> where it is placed
        self._touched: set[tuple[str, int]] = set()
        self._everything = True
        self._node_urls: Mapping[str, str] = {}
        self._alive_frozen: frozenset[str] = frozenset()
        self._changed: dict[str, set[int]] | None = None  # since the last snapshot
        # A node's URL, liveness or membership changed: the snapshot's node_urls and alive
        # differ even when the node is placed nowhere (no partition touched).
        self._membership_changed = False

    # -- updates -----------------------------------------------------------------------------

    def set_stores(self, stores: Mapping[str, StoreInfo]) -> None:
        if stores != self.stores:
            self.stores = dict(stores)
            self._everything = True

    def set_assignment(self, assignment: Assignment | None) -> None:
        if assignment != self.assignment:
            self.assignment = assignment
            self._everything = True

    def set_alive(self, alive: set[str] | frozenset[str]) -> None:
        for node_id in alive ^ self.alive:
            self._touch(node_id)
            self._membership_changed = True
        self.alive = set(alive)

    def set_node(
        self,
        node_id: str,
        info: NodeInfo | None,
        hosting: Hosting | None,
        reports: NodeReports,
    ) -> None:
        """A node's whole state (None: unknown or not routable); touches its partitions only
        when something in it differs."""
        fields = {where: _fields_of(report) for where, report in reports.items()}
        if info != self.nodes.get(node_id):
            if info is None:
                self.nodes.pop(node_id, None)
            else:
                self.nodes[node_id] = info
            self._node_urls = {}  # rebuilt at the next snapshot
            self._membership_changed = True
        elif hosting == self.hostings.get(node_id) and fields == self.reports.get(node_id, {}):
            return
        if hosting is None:
            self.hostings.pop(node_id, None)
        else:
            self.hostings[node_id] = hosting
        self.reports[node_id] = fields
        self._touch(node_id)

    def forget_node(self, node_id: str) -> None:
        self.set_node(node_id, None, None, {})
        self.reports.pop(node_id, None)
        if node_id in self.alive:
            self.alive.discard(node_id)
            self._membership_changed = True

    def _touch(self, node_id: str) -> None:
        self._touched.update(self._placed_on.get(node_id, ()))

    # -- recomputing -------------------------------------------------------------------------

    @property
    def pending(self) -> bool:
        return self._everything or bool(self._touched) or self._membership_changed

    def rebuild(self) -> Iterator[int]:
        """Recompute what updates touched; yields after every step (the partitions done)."""
        if self._everything:
            yield from self._rebuild_everything()
            return
        touched, self._touched = sorted(self._touched), set()
        if self._changed is not None:
            for store, partition in touched:
                self._changed.setdefault(store, set()).add(partition)
        for start in range(0, len(touched), STEP_PARTITIONS):
            for store, partition in touched[start : start + STEP_PARTITIONS]:
                self._recompute(store, partition)
            yield min(start + STEP_PARTITIONS, len(touched))

    def _rebuild_everything(self) -> Iterator[int]:
        self._everything = False
        self._touched = set()
        self._changed = None
        self._placed_on = {}
        self._partitioners = {name: self._partitioner(info) for name, info in self.stores.items()}
        self._rows = {name: [()] * info.partitions for name, info in self.stores.items()}
        done = 0
        for name, info in sorted(self.stores.items()):
            placements = self.assignment.stores.get(name, {}) if self.assignment else {}
            for partition in range(info.partitions):
                placed = placements.get(partition)
                for node_id in placed.replicas() if placed else ():
                    self._placed_on.setdefault(node_id, set()).add((name, partition))
                self._recompute(name, partition)
                done += 1
                if done % STEP_PARTITIONS == 0:
                    yield done
        yield done

    def _partitioner(self, info: StoreInfo) -> KeyPartitioner:
        """The store's partitioner, reused while its partitioning stays the same."""
        how = (info.key_format, info.partitioner, info.partitions)
        if how not in self._made:
            self._made[how] = _partitioner(info)
        return self._made[how]

    def _recompute(self, store: str, partition: int) -> None:
        rows = self._rows.get(store)
        if rows is None or partition >= len(rows):
            return
        placements = self.assignment.stores.get(store, {}) if self.assignment else {}
        rows[partition] = _replicas(
            store,
            partition,
            placements.get(partition),
            nodes=self.nodes,
            hostings=self.hostings,
            report_of=self._report,
            alive=self.alive,
        )

    def _report(self, node_id: str, store: str, partition: int) -> ReportFields | None:
        return self.reports.get(node_id, {}).get((store, partition))

    # -- publishing --------------------------------------------------------------------------

    def snapshot(self, built_at_ms: int) -> RoutingSnapshot:
        """The current rows as an immutable snapshot: copies row references (fast), builds
        nothing; call after `rebuild` has run to the end."""
        if not self._node_urls and self.nodes:
            self._node_urls = {node_id: info.url for node_id, info in self.nodes.items()}
        self._membership_changed = False
        if self._alive_frozen != self.alive:
            self._alive_frozen = frozenset(self.alive)
        changed, self._changed = self._changed, {}
        return RoutingSnapshot(
            generation=self.assignment.generation if self.assignment else 0,
            built_at_ms=built_at_ms,
            stores={
                name: StoreRoute(
                    info=info,
                    partitioner=self._partitioners[name],
                    replicas=tuple(self._rows[name]),
                )
                for name, info in sorted(self.stores.items())
            },
            node_urls=self._node_urls,
            alive=self._alive_frozen,
            changed=None
            if changed is None
            else {store: frozenset(parts) for store, parts in changed.items()},
        )
