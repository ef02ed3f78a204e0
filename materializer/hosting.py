"""Which partitions this node hosts, and as what: a pure state machine (no I/O, no clock).

`Node` (the composition root) feeds it what happens, with the time it happened (`at_ms`, on the
shared clock), and carries out what it answers: store partitions to add or drop, a timer for the
next drop, a re-plan of the query. The HTTP app and the cluster report read its view (`hosted`,
`role_of`, `as_contract`). Rules:

- Hosted partitions are exactly the ones the last assignment gave this node, sorted.
- A partition given up stays on disk for the grace period, in case it comes back (KIP-441's
  lesson: a node restarted or rebalanced back finds its data): `assign` schedules its drop at
  `drop_clock_ms + grace_ms`, and `due_drops` hands it over for dropping only once that time has
  come and the partition is still not hosted. Assigned back before that, the drop is cancelled:
  nothing to restore. Drop times are on a clock of their own (`drop_clock_ms`, by default
  `at_ms`): the node keeps them on its monotonic clock, as the shared clock steps when it syncs
  to Redis time (a step forward of S would drop a partition S early, before it could come back).
- Each hosted partition has a stall clock start (`stall_clock_start`): when it was last
  (re)hosted or reset. A partition that has just arrived has had no chance to move yet.
- A store position outside the partition's log (`materializer.lag.OutsideLog`) may be a moment's
  dip of the high watermark after a leader change: only a partition seen outside on every check
  for `OUTSIDE_LOG_CONFIRM_MS` is confirmed (`outside_log`), and then reset.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from common.contract import Hosting, Role

# How long a store must stay outside its partition's log before it is rebuilt.
OUTSIDE_LOG_CONFIRM_MS = 2_000


@dataclass(frozen=True)
class Changes:
    """What one assignment changes, for the node to act on."""

    hosted: tuple[int, ...]  # every partition hosted now, sorted
    added: tuple[int, ...]
    removed: tuple[int, ...]
    roles_changed: Mapping[int, Role] = field(default_factory=dict)  # kept, in a new role
    # Given up and assigned back within the grace period: kept on disk, nothing to restore.
    drops_cancelled: tuple[int, ...] = ()
    drops: Mapping[int, int] = field(default_factory=dict)  # removed -> drop from disk at (ms)

    @property
    def changed(self) -> bool:
        """Whether the hosted set changed (a role swap alone needs no new query plan)."""
        return bool(self.added or self.removed)


class HostedPartitions:
    """The node's hosting: see the module docstring. It is changed on the event loop, and by
    `reset` on the pipeline's thread (between batches), so each change is made under one lock:
    a reset that found a partition hosted must not mark it after an assignment on the loop
    gave it up meanwhile (a stall clock kept for a partition not hosted). Readers take the
    views as they are (each a value replaced whole, or a read-only view)."""

    def __init__(
        self,
        *,
        grace_ms: int,
        default_role: Role,
        confirm_outside_ms: int = OUTSIDE_LOG_CONFIRM_MS,
    ) -> None:
        self.grace_ms = grace_ms
        self.default_role = default_role  # the role of a partition assigned without one
        self.confirm_outside_ms = confirm_outside_ms
        self._roles: dict[int, Role] = {}
        self._hosted: tuple[int, ...] = ()
        self._hosted_since: dict[int, int] = {}  # hosted partition -> stall clock start
        self._outside_since: dict[int, int] = {}  # hosted partition -> first seen outside
        self._drop_at: dict[int, int] = {}  # given-up partition -> when to drop it
        self._lock = threading.Lock()  # every change: see the class docstring

    # -- the view the rest of the node reads --------------------------------------------------

    @property
    def hosted(self) -> tuple[int, ...]:
        return self._hosted

    @property
    def roles(self) -> Mapping[int, Role]:
        return MappingProxyType(self._roles)

    @property
    def pending_drops(self) -> Mapping[int, int]:
        """Partitions given up and still on disk -> when they are to be dropped."""
        return MappingProxyType(self._drop_at)

    def role_of(self, partition: int) -> Role:
        return self._roles.get(partition, self.default_role)

    def stall_clock_start(self, partition: int) -> int | None:
        """When the partition was last hosted afresh or reset (None: not hosted)."""
        return self._hosted_since.get(partition)

    def next_drop_at(self) -> int | None:
        """The earliest time a given-up partition is due to be dropped (None: none waits)."""
        return min(self._drop_at.values(), default=None)

    def as_contract(self, node_id: str, store_name: str, generation: int, at_ms: int) -> Hosting:
        """What the node serves, per role, as the cluster report writes it."""
        return Hosting(
            node_id=node_id,
            generation=generation,
            stores={
                store_name: {
                    "active": tuple(p for p in self._hosted if self.role_of(p) == "active"),
                    "standby": tuple(p for p in self._hosted if self.role_of(p) == "standby"),
                }
            },
            updated_at_ms=at_ms,
        )

    # -- what happens to it --------------------------------------------------------------------

    def assign(
        self, roles: Mapping[int, Role], at_ms: int, *, drop_clock_ms: int | None = None
    ) -> Changes:
        """Host exactly these partitions in these roles from `at_ms` on; the ones given up are
        due to be dropped a grace period after `drop_clock_ms` (the drop clock's now, see the
        module docstring; `at_ms` when None)."""
        with self._lock:
            return self._assign(roles, at_ms, at_ms if drop_clock_ms is None else drop_clock_ms)

    def _assign(self, roles: Mapping[int, Role], at_ms: int, drop_clock_ms: int) -> Changes:
        before = set(self._hosted)
        hosted = tuple(sorted(roles))
        added = tuple(p for p in hosted if p not in before)
        removed = tuple(sorted(before - set(hosted)))
        roles_changed = {
            p: role for p, role in roles.items() if p in before and self._roles.get(p) != role
        }
        cancelled = tuple(p for p in hosted if self._drop_at.pop(p, None) is not None)
        for partition in added:
            self._hosted_since[partition] = at_ms  # a fresh start for the stall clock
        drops = {partition: drop_clock_ms + self.grace_ms for partition in removed}
        for partition in removed:
            del self._hosted_since[partition]  # every hosted partition has one
            self._outside_since.pop(partition, None)  # back later: watched afresh
        self._drop_at.update(drops)
        self._roles = dict(roles)
        self._hosted = hosted
        return Changes(hosted, added, removed, roles_changed, cancelled, drops)

    def due_drops(self, at_ms: int) -> list[int]:
        """The given-up partitions to drop from disk now: unhosted for the whole grace period
        (a partition assigned back has no drop waiting: `assign` cancelled it). `at_ms` is on
        the drop clock. They are forgotten here: the caller drops them."""
        with self._lock:
            return self._due_drops(at_ms)

    def _due_drops(self, at_ms: int) -> list[int]:
        due = sorted(p for p, deadline in self._drop_at.items() if deadline <= at_ms)
        for partition in due:
            del self._drop_at[partition]
        return due

    def outside_log(self, seen: Iterable[int], at_ms: int) -> list[int]:
        """Given the partitions whose store is outside the log now, the hosted ones that have
        been outside on every check for `confirm_outside_ms` (to reset)."""
        with self._lock:
            return self._outside_log(seen, at_ms)

    def _outside_log(self, seen: Iterable[int], at_ms: int) -> list[int]:
        hosted = set(self._hosted)
        self._outside_since = {
            p: self._outside_since.get(p, at_ms) for p in sorted(set(seen) & hosted)
        }
        return sorted(
            p
            for p, since in self._outside_since.items()
            if at_ms - since >= self.confirm_outside_ms
        )

    def reset(self, partitions: Iterable[int], at_ms: int) -> list[int]:
        """These partitions' stores are emptied to be read again from the log start: a fresh
        start for their stall clock, and the outside-log watch starts over (the lag snapshot
        still shows the old store). Returns the ones still hosted: the stores to empty."""
        with self._lock:
            return self._reset(partitions, at_ms)

    def _reset(self, partitions: Iterable[int], at_ms: int) -> list[int]:
        hosted = [p for p in sorted(set(partitions)) if p in self._hosted]
        for partition in hosted:
            self._hosted_since[partition] = at_ms
            self._outside_since.pop(partition, None)
        return hosted
