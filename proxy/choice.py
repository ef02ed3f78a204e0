"""Which replica answers a key's partition: a pure function, no I/O and no await.

Given the partition's replicas as the routing snapshot saw them, the caller's lag budget, the
nodes the proxy has ejected after failures and the current time, `choose_replicas` returns the
candidates in the order to try, and for every replica it will not try, why.

Order: the active when it qualifies, then qualifying standbys by least offset lag, least time
lag, node id; but replicas that are not known to be in sync come after all that are, and
replicas the proxy ejected after failed requests come after everything else: alive by their
heartbeat and inside the budget, one may have failed over something passing (a connection
closed at the wrong moment), and trying it beats answering 503 while it is ejected (Envoy's
panic routing, and what the unkeyed round robin already does). A replica
is in sync when its fresh report shows lag 0 or a moment it was caught up; one that is
restoring (behind and never caught up since its process started, e.g. rebuilding a lost store)
or has no fresh report could answer with a store that is hours old, so even an unlimited budget
uses it only when nothing better is left. A choice says how many of its first candidates
may share reads (`spread_width`: the in-sync replicas that are not ejected), and `rotated` is
the one rotation both the Python and the C path use to spread reads over them, so a restoring
or ejected replica is never moved ahead of them. With
`standby_reads` off only the active may answer (Kafka Streams before KIP-535): kept as a
policy for callers that must read the owner, and as the benchmarks' baseline.

A read-your-writes request (`min_offset`, see common.freshness) prefers replicas whose reported
position has reached the offset, and puts the others after them rather than refusing them:
reports are a lag refresh plus a trip through Redis old, so right after a write no report has
reached it yet, while the node itself checks its real position and waits a bounded time for
it (materializer.read_bounds). Refusing them here would turn the common read right after a
write into a 503.

Unknown lag (no report, or a report older than `stale_after_ms`) is governed by an explicit
policy: `reject` (the default) treats it as beyond any finite budget, because a read that is
silently stale is worse than a clear 503; `accept` trusts such a replica. A replica is never
refused for lag when the budget is unlimited.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypeVar

from proxy import _hotpath

UnknownLagPolicy = Literal["reject", "accept"]
# A candidate's sort key: (position reached, in sync, role, lag, time lag, node id), 0 first.
_Order = tuple[int, int, int, int, int, str]
Role = Literal["active", "standby"]
# A replica as made, less its clock: node id, url, role, alive, lag, caught up at, reported
# at, position (`Replica.as_given`).
GivenReplica = tuple[str, str, Role, bool, int | None, int | None, int | None, int | None]
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class LagBudget:
    """How far behind an answer may be: offsets and milliseconds; None is unlimited."""

    max_offsets: int | None = None
    max_ms: int | None = None

    @property
    def unlimited(self) -> bool:
        return self.max_offsets is None and self.max_ms is None

    def tightened(self, other: LagBudget) -> LagBudget:
        """The stricter of the two in each dimension (a request header can only tighten)."""
        return LagBudget(
            _stricter(self.max_offsets, other.max_offsets), _stricter(self.max_ms, other.max_ms)
        )


def _stricter(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    return a if b is None else min(a, b)


# How far a node's report times have moved since the table built its replicas' rows (a C type:
# the request path's cached choices read it too). A node that confirms an unchanged report
# later moves every time in it by the same amount ("caught up at", "reported at"). Its replicas
# read their times through this one number (`shift_ms`), so the table moves them all with one
# write (`TableBuilder.shift_node`) instead of rebuilding every row that holds one of them, and
# a cached choice's expiry moves with it (`expiry_terms`). A replica without a clock holds its
# times as given.
ReportClock = _hotpath.ReportClock


class Replica:
    """One node's replica of a partition, as the routing table holds it.

    Compared and hashed by what it says (its times as they read now), not by its clock: two
    replicas with the same values are equal whether their times come through a clock or not.
    Treated as immutable: nothing sets its attributes after it is made; only its node's
    clock moves its times (both forward, by the same amount)."""

    __slots__ = (
        "_caught_up_at_ms",
        "_reported_at_ms",
        "alive",
        "clock",
        "lag",
        "node_id",
        "position",
        "role",
        "url",
    )
    node_id: str
    url: str
    role: Role
    alive: bool
    lag: int | None  # offsets behind the high watermark; None when no report
    position: int | None  # the store's next offset, as last reported
    clock: ReportClock | None

    def __init__(  # noqa: PLR0917 (positional, as the dataclass it replaced was built)
        self,
        node_id: str,
        url: str,
        role: Role,
        alive: bool,
        lag: int | None,
        caught_up_at_ms: int | None,  # last time seen with lag 0
        reported_at_ms: int | None,
        position: int | None = None,
        clock: ReportClock | None = None,
    ) -> None:
        self.node_id = node_id
        self.url = url
        self.role = role
        self.alive = alive
        self.lag = lag
        self._caught_up_at_ms = caught_up_at_ms
        self._reported_at_ms = reported_at_ms
        self.position = position
        self.clock = clock

    @property
    def caught_up_at_ms(self) -> int | None:
        at, clock = self._caught_up_at_ms, self.clock
        return at if at is None or clock is None else at + clock.shift_ms

    @property
    def reported_at_ms(self) -> int | None:
        at, clock = self._reported_at_ms, self.clock
        return at if at is None or clock is None else at + clock.shift_ms

    @property
    def caught_up_at_as_given_ms(self) -> int | None:
        """Caught up at, as given, before its clock (what a C candidate holds with it)."""
        return self._caught_up_at_ms

    def as_given(self) -> GivenReplica:
        """What it was made with, less its clock (its times as given): the same replica is
        `Replica(*as_given(), clock=...)` on a clock that has moved as far as its own."""
        return (
            self.node_id,
            self.url,
            self.role,
            self.alive,
            self.lag,
            self._caught_up_at_ms,
            self._reported_at_ms,
            self.position,
        )

    @property
    def times(self) -> tuple[int | None, int | None]:
        """(caught up at, reported at), as they read now."""
        return self.caught_up_at_ms, self.reported_at_ms

    @property
    def has_times(self) -> bool:
        """Whether it holds a time a clock moves."""
        return self._caught_up_at_ms is not None or self._reported_at_ms is not None

    def on_clock(self, clock: ReportClock) -> Replica:
        """This replica with its times read through `clock` instead of its own clock (the
        same times as given, moved by `clock` instead)."""
        return Replica(
            self.node_id,
            self.url,
            self.role,
            self.alive,
            self.lag,
            self._caught_up_at_ms,
            self._reported_at_ms,
            self.position,
            clock,
        )

    def _values(self) -> tuple[object, ...]:
        return (
            self.node_id,
            self.url,
            self.role,
            self.alive,
            self.lag,
            self.caught_up_at_ms,
            self.reported_at_ms,
            self.position,
        )

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Replica):
            return NotImplemented
        return self._values() == other._values()

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        return (
            f"Replica(node_id={self.node_id!r}, url={self.url!r}, role={self.role!r}, "
            f"alive={self.alive!r}, lag={self.lag!r}, caught_up_at_ms={self.caught_up_at_ms!r}, "
            f"reported_at_ms={self.reported_at_ms!r}, position={self.position!r})"
        )

    def has_reached(self, min_offset: int | None) -> bool:
        """Whether its last report shows `min_offset` applied (None: no bound). Reports only
        grow, so even an old one that shows it is true (short of a store rebuilt since)."""
        return min_offset is None or (self.position is not None and self.position > min_offset)

    def time_lag_ms(self, now_ms: int) -> int | None:
        """Upper bound on staleness: the time since the replica was last known caught up.

        Even a replica that reported lag 0 is behind by up to the age of that report (records
        keep arriving), so this is never 0 by itself; 0 only for lag 0 with no time known."""
        caught_up_at_ms = self.caught_up_at_ms
        if caught_up_at_ms is None:
            return 0 if self.lag == 0 else None
        return max(now_ms - caught_up_at_ms, 0)


@dataclass(frozen=True, slots=True)
class Rejection:
    node_id: str
    role: Role
    reason: str


@dataclass(frozen=True, slots=True)
class Choice:
    candidates: tuple[Replica, ...]
    rejected: tuple[Rejection, ...]
    spread_width: int = 1  # how many leading candidates reads may rotate over


def rotated(candidates: tuple[T, ...], width: int, counter: int) -> tuple[T, ...]:
    """The candidates with their first `width` rotated by `counter`; the rest keep their
    place (spreading reads never moves a restoring or ejected replica ahead of another)."""
    if width < 2:
        return candidates
    shift = counter % width
    return candidates[shift:width] + candidates[:shift] + candidates[width:]


def choose_replicas(
    replicas: tuple[Replica, ...],
    budget: LagBudget,
    *,
    now_ms: int,
    ejected: frozenset[str] = frozenset(),
    unknown_lag: UnknownLagPolicy = "reject",
    stale_after_ms: int = 3_000,
    standby_reads: bool = True,
    min_offset: int | None = None,
) -> Choice:
    eligible: list[tuple[_Order, Replica]] = []
    last_resort: list[tuple[_Order, Replica]] = []
    rejected: list[Rejection] = []
    for replica in replicas:
        reason = _why_not(
            replica,
            budget,
            now_ms,
            unknown_lag=unknown_lag,
            stale_after_ms=stale_after_ms,
            standby_reads=standby_reads,
        )
        if reason is not None:
            rejected.append(Rejection(replica.node_id, replica.role, reason))
            continue
        fresh = _fresh(replica, now_ms, stale_after_ms)
        lag = replica.lag if fresh and replica.lag is not None else 2**62
        order = (
            0 if replica.has_reached(min_offset) else 1,
            0 if fresh and _in_sync(replica) else 1,
            0 if replica.role == "active" else 1,
            lag,
            staleness_rank(replica, fresh),
            replica.node_id,
        )
        (last_resort if replica.node_id in ejected else eligible).append((order, replica))
    eligible.sort(key=lambda entry: entry[0])
    candidates = [replica for _, replica in eligible]
    last_resort.sort(key=lambda entry: entry[0])
    candidates += [replica for _, replica in last_resort]
    return Choice(tuple(candidates), tuple(rejected), _spread_width([o for o, _ in eligible]))


def staleness_rank(replica: Replica, fresh: bool) -> int:
    """Orders replicas of equal lag by time lag, least first, with a rank that does not
    change as time passes: the caught-up time, newest first. A time lag would do the same at
    any moment but two: a lag of 0 without a caught-up time (time lag 0 forever) and a
    caught-up time ahead of this clock (time lag 0 until it passes) both keep their place
    while another replica's time lag grows, so the order of standbys would change before a
    cached choice expires (`choice_expires_at` counts only staleness and the budget)."""
    if not fresh:
        return 2**62  # unknown
    if replica.caught_up_at_ms is None:
        return -(2**62) if replica.lag == 0 else 2**62  # time lag 0, or unknown
    return -replica.caught_up_at_ms


def _spread_width(orders: list[_Order]) -> int:
    """How many leading candidates reads may rotate over: the in-sync ones of the first group
    by position (all of them without a min offset), never one behind another."""
    if not orders or orders[0][1] != 0:
        return 1
    reached = orders[0][0]
    return sum(1 for order in orders if order[:2] == (reached, 0))


def _in_sync(replica: Replica) -> bool:
    """Caught up now or at a known moment (so its time lag is bounded), per its report."""
    return replica.lag == 0 or (replica.lag is not None and replica.caught_up_at_ms is not None)


def _fresh(replica: Replica, now_ms: int, stale_after_ms: int) -> bool:
    return replica.reported_at_ms is not None and now_ms - replica.reported_at_ms <= stale_after_ms


def _why_not(
    replica: Replica,
    budget: LagBudget,
    now_ms: int,
    *,
    unknown_lag: UnknownLagPolicy,
    stale_after_ms: int,
    standby_reads: bool,
) -> str | None:
    unavailable = _why_unavailable(replica, standby_reads)
    if unavailable is not None or budget.unlimited:
        return unavailable
    fresh = _fresh(replica, now_ms, stale_after_ms)
    checks = (
        (
            budget.max_offsets,
            replica.lag if fresh else None,
            "lag {} over budget {}",
            "unknown lag",
        ),
        (
            budget.max_ms,
            replica.time_lag_ms(now_ms) if fresh else None,
            "time lag {} ms over budget {} ms",
            "unknown time lag",
        ),
    )
    for limit, value, over_budget, unknown in checks:
        if limit is None:
            continue
        if value is None and unknown_lag == "reject":
            return unknown if fresh or replica.reported_at_ms is None else "lag report too old"
        if value is not None and value > limit:
            return over_budget.format(value, limit)
    return None


def _why_unavailable(replica: Replica, standby_reads: bool) -> str | None:
    """Why the replica may not answer at all, whatever the budget."""
    if not replica.alive:
        return "dead"
    if not standby_reads and replica.role == "standby":
        return "standby reads are off"
    return None


# One moment a cached choice's expiry is the earliest of: base + the clock's shift as it
# reads at the time (`Cached` in the C path computes it again when its expiry comes).
ExpiryTerm = tuple[ReportClock, int]
# How long a computed choice may be reused at most, whatever its replicas report.
REUSE_MAX_MS = 60_000


def expiry_terms(
    replicas: tuple[Replica, ...],
    budget: LagBudget,
    *,
    now_ms: int,
    stale_after_ms: int = 3_000,
) -> tuple[int, tuple[ExpiryTerm, ...]]:
    """The first moment the same inputs could give a different choice, as time alone passes,
    as a cap and the terms that move with their replicas' clocks: the moment is the earliest
    of the cap and each term's base plus its clock's shift (`choice_expires_at`).

    Only two things change with time: a report grows older than `stale_after_ms`, and a
    replica's time lag grows past `budget.max_ms`. Until the earliest of those, a choice
    computed now stays exact and can be reused. Which replicas count is decided now; a clock
    moves only when that changes no choice (`TableBuilder.shift_node`): a fresh replica inside
    the budget stays so, and a stale or late one is never moved in place.
    """
    cap = now_ms + REUSE_MAX_MS
    terms: list[ExpiryTerm] = []

    def add(clock: ReportClock | None, at: int) -> None:
        nonlocal cap
        if clock is None:
            cap = min(cap, at)
        else:
            terms.append((clock, at - clock.shift_ms))

    for replica in replicas:
        reported_at = replica.reported_at_ms
        if reported_at is not None and _fresh(replica, now_ms, stale_after_ms):
            add(replica.clock, reported_at + stale_after_ms + 1)
        caught_up_at = replica.caught_up_at_ms
        if budget.max_ms is not None and caught_up_at is not None:
            crossing = caught_up_at + budget.max_ms + 1
            if crossing > now_ms:
                add(replica.clock, crossing)
    return cap, tuple(terms)


def expires_at(cap: int, terms: tuple[ExpiryTerm, ...]) -> int:
    """The moment `expiry_terms` gave, as the clocks read now."""
    return min([cap, *(base + clock.shift_ms for clock, base in terms)])


def choice_expires_at(
    replicas: tuple[Replica, ...],
    budget: LagBudget,
    *,
    now_ms: int,
    stale_after_ms: int = 3_000,
) -> int:
    """The first moment the same inputs could give a different choice, as time alone passes
    (`expiry_terms`, as the clocks read now)."""
    return expires_at(*expiry_terms(replicas, budget, now_ms=now_ms, stale_after_ms=stale_after_ms))
