"""The routing table as a feed of changes, from the process that builds it to the proxy (pure).

With `KROUTE_TABLE_PROCESS` on, a table process reads Redis and builds the table
(proxy.table_process); the proxy's event loop only applies what changed. `FeedEncoder` (in
the table process) turns each snapshot it swaps in into the rows that differ from the last
one it sent, and, between snapshots, the report clocks that moved in place; `FeedMirror` (in
the proxy) applies them to its own copy and makes the same `RoutingSnapshot` from it.

Clocks: a node's replicas read their times through its `ReportClock`, which the builder
moves in place when a confirmation changes no choice (no row rebuilt, no snapshot). Each
clock gets a number; rows name their replicas' clocks by number, a message carries the new
and moved clocks' shifts, and the mirror moves its own clock of that number in place, so the
proxy's rows and cached choices read the move, as they would in one process. A clock that is
no longer a node's current one never moves again: its number is dropped on both sides (rows
still on it keep reading it; they are rebuilt on the new clock before the next snapshot).

Rows are sent as tuples of plain values (`Replica.as_given` and the clock's number) and the
message is pickled: a row the encoder sent before is not sent again while it is the same
object, and `node_urls` and `alive` are sent only when they are other objects, so the
mirror's snapshot keeps the identities the request path compares (`node_urls is`).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from common.contract import StoreInfo
from partitioner import KeyPartitioner
from proxy.choice import Replica, ReportClock
from proxy.routing import EMPTY, RoutingSnapshot, StoreRoute, partitioner_of

NO_CLOCK = -1
# (node id, url, role, alive, lag, caught up at, reported at, position, clock number)
EncodedReplica = tuple[Any, ...]
EncodedRow = tuple[EncodedReplica, ...]
Row = tuple[Replica, ...]


@dataclass
class StoreRows:
    """One store in a snapshot message: its info when new or changed (all its rows then),
    else the rows that changed, by partition."""

    info: StoreInfo | None
    rows: dict[int, EncodedRow]


@dataclass
class SnapshotMessage:
    generation: int
    built_at_ms: int
    stores: dict[str, StoreRows]  # every store the snapshot has
    node_urls: Mapping[str, str] | None  # None: the same as the last one sent
    alive: frozenset[str] | None  # None: the same as the last one sent
    changed: Mapping[str, frozenset[int]] | None
    renewed: Mapping[str, frozenset[int]]
    renewed_until_ms: int | None
    clocks: dict[int, int] = field(default_factory=dict)  # number -> shift, new or moved
    dropped: list[int] = field(default_factory=list)  # numbers no longer moved
    placed: int = 0  # replicas in the rows (the builder's count)


@dataclass
class ClockMessage:
    """Clocks moved in place since the last message (no snapshot: no row changed)."""

    clocks: dict[int, int]


def dumps(message: object) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def loads(frame: bytes) -> Any:
    # Only ever from the table process this proxy started, over a socket pair of its own.
    return pickle.loads(frame)  # noqa: S301


class FeedEncoder:
    """The table process's side: what the mirror needs to have what this process serves."""

    def __init__(self) -> None:
        self._numbers: dict[int, tuple[ReportClock, int]] = {}  # id(clock) -> (clock, number)
        self._sent_shifts: dict[int, int] = {}  # number -> shift the mirror has
        self._next_number = 0
        self._infos: dict[str, StoreInfo] = {}
        self._rows: dict[str, tuple[Row, ...]] = {}
        self._node_urls: Mapping[str, str] | None = None
        self._alive: frozenset[str] | None = None

    def snapshot(
        self, snapshot: RoutingSnapshot, current: Iterable[ReportClock]
    ) -> SnapshotMessage:
        """The message that makes the mirror's snapshot this one; `current`: the builder's
        clocks (`TableBuilder.clocks`), the only ones still moving."""
        stores = {name: self._store(name, route) for name, route in snapshot.stores.items()}
        for gone in self._rows.keys() - snapshot.stores.keys():
            del self._rows[gone], self._infos[gone]
        message = SnapshotMessage(
            generation=snapshot.generation,
            built_at_ms=snapshot.built_at_ms,
            stores=stores,
            node_urls=None if snapshot.node_urls is self._node_urls else dict(snapshot.node_urls),
            alive=None if snapshot.alive is self._alive else snapshot.alive,
            changed=snapshot.changed,
            renewed=snapshot.renewed,
            renewed_until_ms=snapshot.renewed_until_ms,
        )
        self._node_urls, self._alive = snapshot.node_urls, snapshot.alive
        message.clocks = self.moved_clocks()
        message.dropped = self._drop_all_but(current)
        return message

    def moved_clocks(self, among: Iterable[ReportClock] | None = None) -> dict[int, int]:
        """Clocks whose shift differs from what the mirror has (new ones included): of those
        `among` (the builder's `take_clocks_moved`, between snapshots), or of all."""
        moved = {}
        sent, numbers = self._sent_shifts, self._numbers
        if among is None:
            candidates: Iterable[tuple[ReportClock, int]] = numbers.values()
        else:  # a clock not numbered yet has no row sent: the next snapshot numbers it
            candidates = (known for clock in among if (known := numbers.get(id(clock))))
        for clock, number in candidates:
            shift = clock.shift_ms
            if sent.get(number) != shift:
                moved[number] = sent[number] = shift
        return moved

    def _store(self, name: str, route: StoreRoute) -> StoreRows:
        rows, before = route.replicas, self._rows.get(name)
        if self._infos.get(name) != route.info or before is None or len(before) != len(rows):
            self._infos[name], self._rows[name] = route.info, rows
            return StoreRows(route.info, {p: self._row(row) for p, row in enumerate(rows)})
        self._rows[name] = rows
        return StoreRows(
            None, {p: self._row(row) for p, row in enumerate(rows) if row is not before[p]}
        )

    def _row(self, row: Row) -> EncodedRow:
        return tuple((*replica.as_given(), self._number(replica.clock)) for replica in row)

    def _number(self, clock: ReportClock | None) -> int:
        if clock is None:
            return NO_CLOCK
        known = self._numbers.get(id(clock))
        if known is not None and known[0] is clock:
            return known[1]
        number = self._next_number
        self._next_number += 1
        self._numbers[id(clock)] = (clock, number)
        return number

    def _drop_all_but(self, current: Iterable[ReportClock]) -> list[int]:
        keep = {id(clock) for clock in current}
        dropped = [key for key in self._numbers if key not in keep]
        numbers = []
        for key in dropped:
            _clock, number = self._numbers.pop(key)
            self._sent_shifts.pop(number, None)
            numbers.append(number)
        return numbers


class FeedMirror:
    """The proxy's side: its own copy of the table process's rows and clocks."""

    def __init__(self) -> None:
        self.snapshot: RoutingSnapshot = EMPTY
        self._clocks: dict[int, ReportClock] = {}
        self._rows: dict[str, list[Row]] = {}
        self._partitioners: dict[str, KeyPartitioner] = {}
        self._infos: dict[str, StoreInfo] = {}
        self._fresh = True

    def restart(self) -> None:
        """A new table process: it numbers clocks afresh and sends everything again; the
        first snapshot from it names every partition changed."""
        self._clocks = {}
        self._fresh = True

    @property
    def clock_count(self) -> int:
        return len(self._clocks)

    def move_clocks(self, clocks: Mapping[int, int]) -> None:
        """Move (or make) the numbered clocks: the rows and cached choices on them read it."""
        known = self._clocks
        for number, shift in clocks.items():
            clock = known.get(number)
            if clock is None:
                known[number] = ReportClock(shift)
            else:
                clock.shift_ms = shift

    def apply(self, message: SnapshotMessage) -> RoutingSnapshot:
        """The snapshot `message` describes (also kept as `snapshot`)."""
        self.move_clocks(message.clocks)
        stores = {name: self._store(name, rows) for name, rows in message.stores.items()}
        for gone in self._rows.keys() - message.stores.keys():
            del self._rows[gone], self._infos[gone], self._partitioners[gone]
        for number in message.dropped:
            self._clocks.pop(number, None)
        previous = self.snapshot
        changed = None if self._fresh else message.changed
        self._fresh = False
        self.snapshot = RoutingSnapshot(
            generation=message.generation,
            built_at_ms=message.built_at_ms,
            stores=stores,
            node_urls=previous.node_urls if message.node_urls is None else message.node_urls,
            alive=previous.alive if message.alive is None else message.alive,
            changed=changed,
            renewed={} if changed is None else message.renewed,
            renewed_until_ms=message.renewed_until_ms,
        )
        return self.snapshot

    def _store(self, name: str, sent: StoreRows) -> StoreRoute:
        if sent.info is not None:
            self._infos[name] = sent.info
            self._partitioners[name] = partitioner_of(sent.info)
            self._rows[name] = [()] * sent.info.partitions
        rows = self._rows[name]
        for partition, row in sent.rows.items():
            rows[partition] = self._row(row)
        return StoreRoute(self._infos[name], self._partitioners[name], tuple(rows))

    def _row(self, row: EncodedRow) -> Row:
        clocks = self._clocks
        return tuple(
            Replica(node, url, role, alive, lag, caught_up, reported, position, clocks.get(number))
            for node, url, role, alive, lag, caught_up, reported, position, number in row
        )
