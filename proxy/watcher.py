"""Keeps the routing snapshot current from Redis, reading what changed, never all at once.

Three kinds of reads, each a pipelined round trip or two:
- the *head* (the `nodes` and `stores` sets, every `store:<name>`, every node's `alive` key
  in one MGET, and Redis `TIME`): every `refresh_interval_ms`, and soon after an event says
  the assignment or the membership changed. The assignment (about 50 bytes a partition) is
  read with it only after an `assignment` event, in a full read, and every
  `ASSIGNMENT_READ_S`, and decoded (in a thread) only when its bytes changed;
- a *sweep* of every node once per `lag_read_interval_ms`, a slice of the nodes every
  `TICK_S`: lag reports change on every report and are not announced, so the sweep is what
  keeps them fresh, at an even rate instead of in bursts. It reads the slice's
  `report_at:<id>` ("<version> <at_ms>", one MGET), then, in a second MGET, the compact
  `report:<id>` body (hosting and lags, a few bytes a replica) of only the nodes whose
  version is not the one it holds: a body is rewritten only when it changes, and at steady
  state none does. It rebuilds each node's hosting and reports from the body and at_ms, around
  the end offsets of its last node read (position = end - lag: the log's end only grows, so
  this is a lower bound, still a correct preference for read-your-writes, also after a
  replica was reset and its own position fell). A node without a usable `report_at:<id>`
  or body (a writer that does not write them) gets a node read instead. A confirmation of
  the body last applied, around the same end offsets (the steady state), only moves every
  time in the node's reports by as much as its at_ms moved (`TableBuilder.shift_node`: its
  report clock moves, no row rebuilt, when that changes no choice);
- a *node read* (`node:<id>`, `hosting:<id>`, `lag:<id>`: everything, with positions): soon
  after an event names the node (`hosting`, `node`, `lag`), for every node once per
  `NODE_READ_S` (spread evenly, like the sweep), and in the sweep for nodes without
  `report:<id>`;
- a *full read* (the head and every node): at start, after `refresh()` is called, on
  (re)subscribing, after a Redis error, on an event naming no node, and when a request is
  refused by a node (`refresh_soon`); at most once per `refresh_interval_ms`.

What only the sweep brought is swapped in at most every `PUBLISH_GAP_S`; what an event named,
at once. A swap makes the request path forget only the cached choices of the partitions whose
choice it changes (`RoutingSnapshot.changed`, judged by the handler's `ChoiceStability`): a
report that moves times and lags inside the budget changes none, and the choices it leaves
standing are renewed from the new replicas after the swap (`keep_choices`), in steps.
Requests keep choosing from the old rows until the swap, so the judgement looks
`JUDGED_AHEAD_MS` past the rebuild's start too, and a swap later than that names those
partitions changed instead (`RoutingSnapshot.as_swapped_at`).
`stats` says what all this costs (logged at debug level
every `STATS_LOG_S`), including the event loop's longest stall, from a 10 ms timer.

Nothing the watcher does on the event loop grows with the table: a node's reports are decoded
one node at a time (redis-py parses the replies in C, with hiredis), the table is kept by a
`TableBuilder` that recomputes only the partitions an update touches (in steps of a few hundred
partitions), and the watcher yields to the loop once a stretch of that work has lasted
`STRETCH_S` (half a millisecond; up to `MAX_STRETCH_S` while requests keep the loop busy, so
the table keeps its share of a saturated loop: `stretch_limit`); the new snapshot is swapped
in with one assignment. `max_hold_ms` is the longest the watcher kept the loop in one go. In
the proxy (`freeze_heap`), the heap is frozen at every yield and after every swap
(`gc.freeze`): the collector's passes then walk only what was made since, not the code, the
table and the cached choices (a full pass over those takes ~40 ms at 6,000 partitions), and the
whole heap is collected once every `FULL_COLLECT_S`. Rows a rebuild replaced are freed in steps
after the swap (`TableBuilder.release_retired`), not all at once with the snapshot swapped out.

When Redis cannot be read the last snapshot stays in use, the watcher reports itself degraded,
and it keeps retrying on its own; the first good read clears the flag. Values that do not
follow the contract are skipped (and logged once each), never half-applied.

Every head read also reads Redis `TIME` (in the same round trip), which keeps this process's
shared clock (`common.clock`) in step: the times nodes report are Redis time, and so is the
"now" the proxy measures them against. A report stamped further in the future than
`CLOCK_TOLERANCE_MS` comes from a writer whose clock is not the shared one (ahead: its
"caught up at" would make answers look fresher than they are) and is treated as no report.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import gc
import ipaddress
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

import redis.asyncio as aioredis
import structlog
from redis.asyncio.client import PubSub

from common.clock import CLOCK_TOLERANCE_MS, SHARED, SharedClock
from common.contract import (
    ContractError,
    Hosting,
    Keys,
    NodeInfo,
    NodeReport,
    PartitionReport,
    StoreInfo,
    as_text,
    decode_assignment,
    decode_event,
    decode_hosting,
    decode_node,
    decode_node_report,
    decode_report,
    decode_report_at,
    decode_store,
)
from proxy.routing import (
    EMPTY,
    STEP_PARTITIONS,
    ChoiceStability,
    RoutingSnapshot,
    TableBuilder,
)

log = structlog.get_logger("kroute.proxy.watcher")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
MIN_GAP_S = 0.02  # coalesce bursts of events
TICK_S = 0.1  # the sweep reads a slice of the nodes this often
# Values per round trip of node reads: redis-py parses a pipeline's whole reply without
# yielding (~3 µs a value without hiredis), so this bounds that stretch to about a millisecond.
VALUES_PER_PIPELINE = 300
# A `report:<id>` body longer than this is decoded in a thread (about 1 ms of decoding on the
# loop; a node hosting a few dozen replicas writes well under 1 KiB).
THREAD_DECODE_BYTES = 16 * 1024
# `report:<id>` values per MGET of the sweep (each a few bytes a replica; hiredis parses them).
REPORTS_PER_MGET = 100
PIPELINES_IN_FLIGHT = 4
PUBLISH_GAP_S = 0.2
# Every node's reports at least this often. A report reaches the table within this plus a
# step (up to TICK_S + MIN_GAP_S + the step's own time), then waits for a publish (up to
# PUBLISH_GAP_S plus a step): at 700 ms, reports at 1,000 nodes took up to 0.96 s to be routed
# by, against a goal of 1 s; at 500 ms they take about 0.8 s, for about 40% more sweep reads
# (each ~30 bytes a node).
DEFAULT_LAG_READ_INTERVAL_MS = 500
STATS_LOG_S = 2.0  # at debug level: what benchmarks read
LOOP_PROBE_S = 0.01
# The watcher's work on the loop comes in stretches of about this long between yields.
STRETCH_S = 0.0005
# After each stretch the watcher waits this many times the stretch's length before the next,
# so requests get the loop for several turns in a row. A request takes about four turns
# (its head from the client, to the node, the answer from the node, to the client); with a
# bare yield between stretches each turn could wait behind one, and at 300 nodes / 6,000
# partitions that made the paced p99 three times the 20-node one on a core shared with the
# table work. Bounded per step (STEP_PAUSE_BUDGET_S, charged the time pauses took): past it
# the rest of the step runs with bare yields, so a large step (a full read) is not stretched
# without end, and a report reaches the table at most about two budgets later (its read and
# its publish): with 150 ms, a proxy saturated by wrk on one core routed by a report 1.3 s
# after it was written.
PAUSE_PER_STRETCH = 2.0
STEP_PAUSE_BUDGET_S = 0.05
# On a loop driven flat out, each yield waits for a whole round of request callbacks, several
# milliseconds, and stretches of STRETCH_S left the table a few percent of the loop: at 1,000
# nodes on a slower host its reports aged past their stale time while Redis held fresh ones,
# and requests were refused for unknown lag. So a stretch may last TABLE_SHARE times the time
# requests ran during the last yield (the loop thread's CPU time), between STRETCH_S and
# MAX_STRETCH_S: the table keeps about a third of a saturated loop, and a loop with time to
# spare still sees stretches of STRETCH_S.
TABLE_SHARE = 0.5
MAX_STRETCH_S = 0.002
# With freeze_heap, how often the collector walks the whole heap (a pause of tens of ms at
# thousands of partitions) to free cyclic garbage frozen meanwhile.
FULL_COLLECT_S = 600.0
# The assignment grows with the table (a megabyte of JSON at 20,000 partitions) and changes
# only in a rebalance, which its writer announces (`assignment` event): read on those events,
# in every full read, and this often in case an event was lost (pub/sub delivers at most once:
# an event published while the subscription is being made is gone). 5 s bounds how long a
# lost rebalance goes unseen, for ~200 KB/s per proxy at 20,000 partitions.
ASSIGNMENT_READ_S = 5.0
# Every node gets a node read (node:<id>, hosting:<id> and lag:<id> with its positions) at
# least this often, even when the sweep reads its compact `report:<id>`. Positions are all it
# brings that the sweep does not, and they only order read-your-writes candidates: counted
# back from an end offset up to this old, a position is a lower bound (a replica it names is
# past the offset asked; at worst one that has since passed it is not preferred). A URL
# change comes with a `node` event, and a request a node refuses triggers a full read; this
# bounds only what a lost event hides. The node reads were the biggest share of a proxy's
# Redis traffic at 5 s.
NODE_READ_S = 30.0
# The request path's renewal of its cached choices of some partitions of a store (see
# `TableWatcher.keep_choices`).
Renew = Callable[[RoutingSnapshot, str, list[int]], None]
# The request path's renewal of the kept choices it left for later whose turn has come, up to
# a number of them; True when more are due (see `TableWatcher.keep_choices`).
RenewDue = Callable[[RoutingSnapshot, int], bool]


def redis_client(url: str, timeout_ms: int, ca_file: str | None) -> aioredis.Redis:
    """The table's Redis client, as the proxy and its table process both make it."""
    return aioredis.from_url(
        url,
        socket_timeout=timeout_ms / 1000,
        socket_connect_timeout=timeout_ms / 1000,
        **({"ssl_ca_certs": ca_file} if ca_file else {}),
    )


@dataclass
class WatcherStats:
    """What the control plane costs this proxy (read by benchmarks and logged at debug)."""

    head_reads: int = 0
    node_reads: int = 0  # nodes read, either way
    report_reads: int = 0  # of them, from `report_at:<id>` and `report:<id>` alone
    report_confirms: int = 0  # of those, from `report_at:<id>` alone (the body known)
    unpaired_bodies: int = 0  # bodies read with a stamp naming another version: not applied
    full_reads: int = 0
    commands: int = 0  # Redis commands sent (a pipeline counts each)
    reply_bytes: int = 0  # the values read, an estimate of the reply bytes
    hold_s: float = 0.0  # time spent on the loop decoding, rebuilding and swapping
    max_hold_ms: float = 0.0  # the longest the watcher kept the event loop in one go
    snapshots: int = 0
    # Partitions whose cached choices the swaps made the request path forget (a full reset
    # counts every partition), and those they left standing, to be renewed.
    changed_partitions: int = 0
    renewed_partitions: int = 0
    # Swaps that came too late after their rebuild for its renewals to hold (requests kept
    # choosing from the old rows meanwhile): they named those partitions changed instead.
    late_swaps: int = 0
    max_swap_ms: float = 0.0  # the longest `on_snapshot` took (the handler's own swap)
    # The event loop's longest stall, whatever caused it (a request burst, the garbage
    # collector, the table, the machine running something else): how late a timer asking for
    # LOOP_PROBE_S ran.
    max_loop_lag_ms: float = 0.0
    # Of each stall, at most the CPU time this process used meanwhile (all its threads) can be
    # its own work; the rest it spent waiting for a core. The largest such share: on a busy
    # machine, a long wall-clock stall with a small share here is the scheduler's, not the
    # proxy's.
    max_loop_lag_busy_ms: float = 0.0
    # The garbage collector's longest pause and its total time (every generation): a pause
    # holds the loop like any other stretch.
    max_gc_ms: float = 0.0
    gc_s: float = 0.0


class _CollectorTimer:
    """Times the collector's passes into a WatcherStats (a `gc.callbacks` entry)."""

    def __init__(self, stats: WatcherStats) -> None:
        self.stats = stats
        self._started_s = 0.0

    def __call__(self, phase: str, _info: dict[str, int]) -> None:
        if phase == "start":
            self._started_s = time.perf_counter()
            return
        took = time.perf_counter() - self._started_s
        self.stats.gc_s += took
        self.stats.max_gc_ms = max(self.stats.max_gc_ms, took * 1000)


class TableWatcher:
    # A subscription `start` made before its first read, for `_listen` to take over.
    _subscribed: PubSub | None = None
    STATS_EVENT = "control plane"  # the debug line benchmarks read (see _log_stats)
    # A table with `_placed` replicas is served already (by the process this one builds for),
    # and a smaller one is held back even before this watcher's first (`_holding_last_table`).
    _served_before = False

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        *,
        refresh_interval_ms: int,
        networks: tuple[Network, ...] | None,
        on_snapshot: Callable[[RoutingSnapshot], None] = lambda _snapshot: None,
        hold_smaller_table_ms: int = 10_000,
        clock: SharedClock = SHARED,
        lag_read_interval_ms: int = DEFAULT_LAG_READ_INTERVAL_MS,
    ) -> None:
        self.redis = redis
        self.clock = clock  # this process's (the handler's now_ms reads the same one)
        self.keys = keys
        self.refresh_interval_s = refresh_interval_ms / 1000
        self.lag_read_interval_s = lag_read_interval_ms / 1000
        self.networks = networks
        self.on_snapshot = on_snapshot
        self.snapshot: RoutingSnapshot = EMPTY
        self.loaded = False
        self.degraded = False
        self.last_error: str | None = None
        self.last_refresh_ms: int | None = None
        self.refreshes = 0
        self.refresh_failures = 0
        self.hold_smaller_table_ms = hold_smaller_table_ms
        self.stats = WatcherStats()
        self._smaller_since_ms: int | None = None
        self._changes_dropped = False  # a built snapshot was held back (see _publish)
        self._wake = asyncio.Event()
        self._warned: set[str] = set()
        self._table = TableBuilder()
        self._node_ids: list[str] = []  # the `nodes` set at the last head read
        self._named: set[str] = set()  # nodes an event named since their last read
        self._sweep = _Round(self.lag_read_interval_s)
        self._node_round = _Round(NODE_READ_S)  # node reads of nodes that write report:
        # What the last node read said, for the sweep's reads of `report:<id>`: the node's
        # info (None: not routable) and each replica's end offset (positions are counted back
        # from it: a replica's own position falls when it is reset, the log's end does not).
        self._infos: dict[str, NodeInfo | None] = {}
        self._ends: dict[str, dict[tuple[str, int], int]] = {}
        # Each node's last `report:<id>` body read (by its version): re-applied with the time
        # of every `report_at:<id>` that names that version.
        self._bodies: dict[str, NodeReport] = {}
        # What the table holds of each node from its last body applied (see _apply_report).
        self._applied: dict[str, _Applied] = {}
        # The version each node's `report_at:<id>` named when its body was refused: that body
        # is not read (nor decoded) again, the node gets node reads until a new version.
        self._refused: dict[str, int] = {}
        self._head_due = True
        self._assignment_due = True
        self._last_assignment_s = 0.0
        self._full_due = False
        self._last_head_s = 0.0
        self._last_full_s = 0.0
        self._placed = 0  # replicas in the last snapshot swapped in
        self._last_swap_s = 0.0
        self._raw_assignment: bytes | None = None
        self._held_since_s: float | None = None  # thread time the open stretch began at
        self._own_cpu_s = 0.0  # the loop thread's CPU time in this watcher's stretches
        self._stretch_started_s = 0.0
        self._step_started_s = 0.0  # when the stretch's current step began (see _pace)
        self._stretch_limit_s = STRETCH_S  # (see stretch_limit)
        self._pause_left_s = 0.0  # of this step's pause budget (STEP_PAUSE_BUDGET_S)
        self._renew: Renew | None = None
        self._renew_due: RenewDue | None = None
        # Freeze the heap after every swap (see _freeze_heap): for a process whose heap is
        # mostly its table (the proxy), not for tests that run a watcher among other things.
        self.freeze_heap = False
        # KROUTE_STALL_REPORT_MS (see _probe_loop); None: off.
        self.stall_report_ms: int | None = None
        self._full_collect_s = time.monotonic()

    def keep_choices(
        self, stability: ChoiceStability, renew: Renew, renew_due: RenewDue | None = None
    ) -> None:
        """How to tell, under the request path's policy, a partition whose replicas changed
        but whose choice did not (`ChoiceStability.same`): snapshots name such partitions in
        `renewed` instead of `changed`, so the choices cached for them stay in use, and after
        each swap `renew(snapshot, store, partitions)` is called for them a step of
        partitions at a time (yielding to the loop in between) to renew those choices from
        the new replicas. `renew_due(snapshot, most)`, called on every step of the loop
        until it says no more are due (yielding in between), renews those `renew` left for
        later whose turn has come."""
        self.judge_with(stability)
        self._renew = renew
        self._renew_due = renew_due

    def judge_with(self, stability: ChoiceStability) -> None:
        """Name partitions whose choice stays `renewed`, not `changed` (see `keep_choices`),
        with nothing renewed here: a process that builds the table for another."""
        self._table.stability = stability

    def refresh_soon(self) -> None:
        """Something suggests the table is out of date (a node refused a request): read
        everything soon (at most once per refresh interval; the head at once)."""
        self._full_due = True
        self._head_due = True
        self._wake.set()

    async def run(self) -> None:
        # A task group: a loop that dies takes the others with it and the failure surfaces in
        # the caller, instead of a proxy routing on a table nobody refreshes any more.
        async with asyncio.TaskGroup() as group:
            for loop in (self._poll(), self._listen(), self._probe_loop(), self._log_stats()):
                group.create_task(loop)

    async def start(self) -> None:
        """Subscribe to the events, then read everything (see `refresh`): the first table
        with nothing lost between its read and `run`, which listens on this subscription.
        Subscribed after the read, as `run` alone does, an event in between would go unseen
        and `run` must read everything again: at 1,000 nodes a second read of ~2 s with no
        sweep, in which the first read's reports grew old enough to be refused."""
        if self._subscribed is not None:  # started before, never run: that one goes
            await _closed(self._subscribed)
        self._subscribed = await self._confirmed_subscription()
        await self.refresh()

    async def _confirmed_subscription(self) -> PubSub | None:
        """A subscription to the events that Redis has confirmed, or None (Redis not there,
        or no confirmation within the refresh interval: `run` subscribes when it can and
        reads everything then). SUBSCRIBE alone only sends the command: the first read, on
        another connection, could reach Redis before it and an event in between go unseen."""
        pubsub = self.redis.pubsub()  # the confirmation is a message: not ignored
        try:
            async with asyncio.timeout(self.refresh_interval_s):
                await pubsub.subscribe(self.keys.events)
                while True:
                    message = await pubsub.get_message(timeout=self.refresh_interval_s)
                    if message is not None and message.get("type") == "subscribe":
                        return pubsub
        except (aioredis.RedisError, OSError, TimeoutError):
            await _closed(pubsub)
            return None

    async def refresh(self) -> None:
        """Read everything now and swap the result in (or record why not)."""
        await self._guarded(self._read_everything)

    # -- the loop ----------------------------------------------------------------------------

    async def _poll(self) -> None:
        while True:
            _raise_if_cancelled()
            self._wake.clear()
            await self._guarded(self._step)
            with contextlib.suppress(TimeoutError):
                # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation
                # that lands as the event fires (CPython gh-86296), and shutdown would hang.
                async with asyncio.timeout(TICK_S):
                    await self._wake.wait()
            await asyncio.sleep(MIN_GAP_S)

    async def _step(self) -> None:
        self._pause_left_s = STEP_PAUSE_BUDGET_S
        # Measured afresh each step: the last one's load is at least MIN_GAP_S old.
        self._stretch_limit_s = STRETCH_S
        now = time.monotonic()
        if self._full_due and now - self._last_full_s >= self.refresh_interval_s:
            await self._read_everything()
            return
        if self._head_due or now - self._last_head_s >= self.refresh_interval_s:
            await self._read_head()
        # Something an event named (or the head) is swapped in at once; what only the sweep
        # brought (lag reports) at most every PUBLISH_GAP_S: each swap makes the request path
        # recompute the choices of the partitions it changed.
        urgent = bool(self._named) or self._last_head_s >= now
        swept = self._sweep.due(self._node_ids)
        whole = self._named | set(self._node_round.due(self._node_ids))
        whole |= {n for n in swept if n not in self._infos}  # never read whole: info unknown
        self._named = set()
        await self._read_nodes(sorted(whole))
        await self._read_reports([n for n in swept if n not in whole])
        if urgent or time.monotonic() - self._last_swap_s >= PUBLISH_GAP_S:
            await self._publish()
        await self._renew_due_choices()

    async def _read_everything(self) -> None:
        self._full_due = False
        self._last_full_s = time.monotonic()
        self._assignment_due = True
        await self._read_head()
        self._named = set()
        await self._read_nodes(self._node_ids)
        self._sweep.restart(self._node_ids)  # every node was just read: start new rounds
        self._node_round.restart(self._node_ids)
        self.stats.full_reads += 1
        await self._publish()

    async def _guarded(self, read: Callable[[], Any]) -> None:
        try:
            await read()
        except Exception as exc:  # the loop must outlive any value or error
            self.refresh_failures += 1
            self.last_error = str(exc) or type(exc).__name__
            if not isinstance(exc, aioredis.RedisError | OSError):
                # Not Redis: a value or a bug. Said each time (with the traceback), never
                # allowed to stop the refreshes; the table stays the last good one meanwhile.
                log.exception("routing table read failed: routing on the last table")
            elif not self.degraded:
                log.warning(
                    "redis unreachable: routing on the last table",
                    error=self.last_error,
                    table_generation=self.snapshot.generation,
                )
            self.degraded = True
            self._full_due = True  # what changed meanwhile is unknown: read it all
        finally:
            self._end_stretch()  # the step's last stretch: not open while the watcher waits

    # -- reading -----------------------------------------------------------------------------

    async def _read_head(self) -> None:
        with_assignment = self._assignment_due or (
            time.monotonic() - self._last_assignment_s >= ASSIGNMENT_READ_S
        )
        # Cleared before the reads, not after: an event that lands while they are in flight
        # may postdate what they return, and must make the next step read the head again.
        self._head_due = False
        if with_assignment:
            self._assignment_due = False
        try:
            await self._read_head_from_redis(with_assignment)
        except BaseException:
            self._head_due = True  # not read: still due (with the assignment, if it was)
            self._assignment_due = self._assignment_due or with_assignment
            raise

    async def _read_head_from_redis(self, with_assignment: bool) -> None:
        keys = self.keys
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.smembers(keys.nodes)
            pipe.smembers(keys.stores)
            pipe.time()
            if with_assignment:
                pipe.get(keys.assignment)
            sent = self.clock.stopwatch()
            node_set, store_set, redis_time, *assignment_reply = await pipe.execute()
            self.clock.observe(redis_time, sent, self.clock.stopwatch())
        node_ids = sorted(as_text(n) for n in node_set)
        store_names = sorted(as_text(s) for s in store_set)
        async with self.redis.pipeline(transaction=False) as pipe:
            if node_ids:
                pipe.mget([keys.alive(n) for n in node_ids])
            for name in store_names:
                pipe.get(keys.store(name))
            results = await pipe.execute()
        self._last_head_s = time.monotonic()
        self._count(4 + len(store_names), node_set, store_set, assignment_reply, results)
        alive_flags = results[0] if node_ids else []
        self._hold()
        stores: dict[str, StoreInfo] = {}
        for name, raw_store in zip(store_names, results[bool(node_ids) :], strict=True):
            info = self._decoded(decode_store, raw_store, f"store:{name}")
            if info is not None:
                stores[name] = info
        table = self._table
        table.set_stores(stores)
        if with_assignment:
            self._last_assignment_s = time.monotonic()
            if assignment_reply[0] != self._raw_assignment:
                table.set_assignment(await self._assignment(assignment_reply[0]))
                self._raw_assignment = assignment_reply[0]
        table.set_alive({n for n, f in zip(node_ids, alive_flags, strict=True) if f is not None})
        for gone in set(self._node_ids) - set(node_ids):
            table.forget_node(gone)
            self._infos.pop(gone, None)
            self._ends.pop(gone, None)
            self._bodies.pop(gone, None)
            self._applied.pop(gone, None)
            self._refused.pop(gone, None)
        self._named |= set(node_ids) - set(self._node_ids) - set(table.nodes)
        self._node_ids = node_ids
        self.stats.head_reads += 1
        await self._yield()

    async def _assignment(self, raw: bytes | None) -> Any:
        """The assignment decoded in a thread: it grows with the table (a megabyte of JSON at
        20,000 partitions), and is read again only when its bytes change (a rebalance)."""
        self._end_stretch()  # not open while the thread decodes: requests have the loop
        decoded = await asyncio.to_thread(self._decoded, decode_assignment, raw, "assignment")
        self._hold()
        return decoded

    async def _read_nodes(self, node_ids: Iterable[str]) -> None:
        """Node reads in small pipelines, a few in flight at once: the round trips overlap
        (the sweep keeps its pace when Redis or this host is slow to answer), while each reply
        is still parsed and applied in short stretches (`_pace`)."""
        known = set(self._node_ids)
        await self._in_flight(
            self._read_chunk, deque(self._chunks([n for n in node_ids if n in known]))
        )

    async def _read_reports(self, node_ids: list[str]) -> None:
        """The sweep's read of nodes whose info is known: their `report:<id>` in one MGET
        (a few, in flight at once, for many nodes); a node read for those without one."""
        known = set(self._node_ids)
        wanted = [n for n in node_ids if n in known]
        chunks = deque(
            wanted[i : i + REPORTS_PER_MGET] for i in range(0, len(wanted), REPORTS_PER_MGET)
        )
        without: list[str] = []

        async def read(chunk: list[str]) -> None:
            without.extend(await self._read_report_chunk(chunk))

        await self._in_flight(read, chunks)
        await self._read_nodes(sorted(without))

    async def _in_flight(
        self, read: Callable[[list[str]], Awaitable[None]], chunks: deque[list[str]]
    ) -> None:
        """Read the chunks with up to PIPELINES_IN_FLIGHT readers, each a task of its own.

        A reader's last stretch ends with it, and this one's before it waits: the readers run
        as tasks, and this task resumes only after the loop ran whatever else was ready (under
        load, rounds of requests). A stretch left open across that wait counted the requests'
        CPU as the table's: holds of 17 ms under wrk at 100 nodes, from stretches of at most
        2 ms.

        One reader failing stops the others before the error goes on: left running, they
        would go on taking chunks and applying them while the next step (a full read, after an
        error) ran beside them."""

        async def reader() -> None:
            try:
                while chunks:
                    _raise_if_cancelled()  # a cancellation redis-py swallowed (see there)
                    await read(chunks.popleft())
            finally:
                self._end_stretch()

        self._end_stretch()
        readers = [
            asyncio.ensure_future(reader()) for _ in range(min(PIPELINES_IN_FLIGHT, len(chunks)))
        ]
        try:
            await asyncio.gather(*readers)
        except BaseException:
            chunks.clear()  # nothing left to take, for a reader that outlives its cancel
            for running in readers:
                running.cancel()
            await asyncio.gather(*readers, return_exceptions=True)
            raise
        self._hold()

    async def _read_report_chunk(self, chunk: list[str]) -> list[str]:
        """Apply the chunk's reports: `report_at:<id>` for every node, then the `report:<id>`
        bodies whose version it names and this watcher does not hold. The nodes without a
        usable pair, which need a node read."""
        keys = self.keys
        self._end_stretch()
        raw_stamps = await self.redis.mget([keys.report_at(node_id) for node_id in chunk])
        self._count(1, raw_stamps)
        self._hold()
        stamps: dict[str, tuple[int, int]] = {}
        without = []
        for node_id, raw in zip(chunk, raw_stamps, strict=True):
            stamp = self._decoded(decode_report_at, raw, f"report_at:{node_id}")
            if (
                stamp is None
                or node_id not in self._infos
                or self._refused.get(node_id) == stamp[0]
            ):
                without.append(node_id)
            else:
                stamps[node_id] = stamp
        unknown = [n for n, (version, _) in stamps.items() if self._body_version(n) != version]
        if unknown:
            await self._yield()
            # Each body with its stamp again, in one command: a node whose body changes on
            # every report (a lagging replica's lag moves) may write between this read and
            # the first, and a body newer than its stamp holds as of an unknown time. Read
            # alone, such a body waited for the next sweep round: a report routed by up to a
            # whole round late (1.4 s instead of 0.7).
            self._end_stretch()
            raw_pairs = await self.redis.mget(
                [key for n in unknown for key in (keys.report_at(n), keys.report(n))]
            )
            self._count(1, raw_pairs)
            self._hold()
            for index, node_id in enumerate(unknown):
                raw_stamp, raw = raw_pairs[2 * index], raw_pairs[2 * index + 1]
                stamp = self._decoded(decode_report_at, raw_stamp, f"report_at:{node_id}")
                if stamp is not None:
                    stamps[node_id] = stamp  # the one written with this body
                if not self._keep_body(node_id, raw, await self._decoded_body(node_id, raw)):
                    self._refused[node_id] = stamps[node_id][0]
                await self._pace()  # every body at start, or after a rebalance
        at = self.clock.now_ms()  # after the reports arrived: none can be newer but by skew
        read = set(unknown)
        for node_id, (version, at_ms) in stamps.items():
            body = self._bodies.get(node_id)
            if body is None or node_id not in self._infos:  # (a full read may have run)
                without.append(node_id)
                continue
            if body.version != version:
                # A writer that broke the pair (a lost write, a stamp without its body): the
                # time it holds as of is unknown. The table keeps what it had; the next sweep
                # reads again.
                self.stats.unpaired_bodies += 1
                continue
            self._apply_report(node_id, body, at_ms, at)
            self.stats.node_reads += 1
            self.stats.report_reads += 1
            self.stats.report_confirms += int(node_id not in read)
            await self._pace()
        return without

    def _body_version(self, node_id: str) -> int | None:
        body = self._bodies.get(node_id)
        return None if body is None else body.version

    async def _decoded_body(self, node_id: str, raw: Any) -> NodeReport | None:
        """A `report:<id>` body decoded: on the loop when small (a node's few dozen replicas),
        in a thread when big enough to hold the loop (100,000 entries: ~150 ms)."""
        what = f"report:{node_id}"
        if raw is None or len(raw) <= THREAD_DECODE_BYTES:
            decoded: NodeReport | None = self._decoded(decode_node_report, raw, what)
            return decoded
        self._end_stretch()  # not open while the thread decodes: requests have the loop
        decoded = await asyncio.to_thread(self._decoded, decode_node_report, raw, what)
        self._hold()
        return decoded

    def _keep_body(self, node_id: str, raw: Any, body: NodeReport | None) -> bool:
        """Hold a node's `report:<id>` body, or forget the one held when there is no usable
        one (absent, or breaking the contract: skipped, logged once). False when there was
        one and it was refused."""
        if body is not None and body.node_id != node_id:
            self._warn_once(
                f"report-of:{node_id}:{body.node_id}",
                "ignoring a report naming another node",
                key=f"report:{node_id}",
                names=body.node_id,
            )
            body = None
        if body is not None and not self._within_stores(node_id, body):
            body = None
        if body is None:
            self._bodies.pop(node_id, None)
            return raw is None
        self._bodies[node_id] = body
        self._refused.pop(node_id, None)
        return True

    def _within_stores(self, node_id: str, body: NodeReport) -> bool:
        """Whether every partition the body names for a store this proxy knows is one of
        the store's: a body is re-applied on every sweep, so one a writer padded with
        partitions that do not exist would hold the loop that long each time (100,000:
        ~0.5 s). Skipped whole (logged once): the node is read from the legacy keys."""
        stores = self._table.stores
        for store, roles in body.stores.items():
            info = stores.get(store)
            if info is None:
                continue  # a store this proxy has not read yet: its rows ignore the body
            if any(p >= info.partitions for ps in roles.values() for p in ps):
                self._warn_once(
                    f"report-outside:{node_id}:{store}",
                    "ignoring a report naming partitions the store does not have",
                    key=f"report:{node_id}",
                    store=store,
                    partitions=info.partitions,
                )
                return False
        return True

    def _apply_report(self, node_id: str, body: NodeReport, at_ms: int, at: int) -> None:
        """A node's hosting and reports from its body as of `at_ms` (its `report_at:<id>`),
        positions from its last node read; a time further in the future than the clocks can
        disagree by makes every entry no report, as a lag report's would."""
        info = self._infos[node_id]
        if info is None:
            return  # not routable (its node read said so): nothing to apply
        ends = self._ends.get(node_id)
        last = self._applied.get(node_id)
        table = self._table
        same_body = last is not None and last.body is body
        ahead = last.ahead_ms if last is not None and same_body else _ahead_ms(body)
        in_time = at_ms + ahead <= at + CLOCK_TOLERANCE_MS  # no entry from the future
        if (
            in_time
            and last is not None
            and same_body
            and last.ends is ends
            and table.reports.get(node_id) is last.fields
        ):
            judged_at = judging_moment(at, self.clock)
            moved = table.shift_node(node_id, at_ms - last.at_ms, body.hosting(at_ms), judged_at)
            self._applied[node_id] = _Applied(body, ends, at_ms, moved, ahead)
            return
        reports = {
            where: partition_report
            for where, partition_report in body.partition_reports(ends or {}, at_ms).items()
            if not self._from_the_future(node_id, partition_report, at)
        }
        table.set_node(node_id, info, body.hosting(at_ms), reports)
        if in_time:
            self._applied[node_id] = _Applied(body, ends, at_ms, table.reports[node_id], ahead)
        else:
            self._applied.pop(node_id, None)

    def _chunks(self, node_ids: list[str]) -> Iterable[list[str]]:
        """Node ids in groups of about VALUES_PER_PIPELINE values (by their last report)."""
        chunk: list[str] = []
        values = 0
        for node_id in node_ids:
            chunk.append(node_id)
            values += 3 + 2 * len(self._table.reports.get(node_id, ()))
            if values >= VALUES_PER_PIPELINE:
                yield chunk
                chunk, values = [], 0
        if chunk:
            yield chunk

    async def _read_chunk(self, chunk: list[str]) -> None:
        keys = self.keys
        async with self.redis.pipeline(transaction=False) as pipe:
            for node_id in chunk:
                pipe.get(keys.node(node_id))
                pipe.get(keys.hosting(node_id))
                pipe.hgetall(keys.lag(node_id))
            self._end_stretch()
            results = await pipe.execute()
        at = self.clock.now_ms()  # after the reports arrived: none can be newer but by skew
        self._hold()
        for index, node_id in enumerate(chunk):
            raw_node, raw_hosting, raw_lag = results[index * 3 : index * 3 + 3]
            self._count(3, raw_node, raw_hosting, raw_lag)
            self._apply_node(node_id, raw_node, raw_hosting, raw_lag, at)
            self.stats.node_reads += 1
            await self._pace()

    def _apply_node(
        self, node_id: str, raw_node: Any, raw_hosting: Any, raw_lag: dict[Any, Any], at: int
    ) -> None:
        info = self._decoded(decode_node, raw_node, f"node:{node_id}")
        if info is None or not self._allowed(info):
            self._table.set_node(node_id, None, None, {})
            if info is None:  # not registered (yet): read whole again by the next sweep
                self._infos.pop(node_id, None)
            else:
                self._infos[node_id] = None
            self._ends.pop(node_id, None)
            return
        hosting: Hosting | None = self._decoded(decode_hosting, raw_hosting, f"hosting:{node_id}")
        reports: dict[tuple[str, int], PartitionReport] = {}
        for raw_field, raw_report in raw_lag.items():
            store, _, partition = as_text(raw_field).rpartition("/")
            report = self._decoded(decode_report, raw_report, f"lag:{node_id}")
            if report is None or self._from_the_future(node_id, report, at):
                continue
            if partition.isascii() and partition.isdigit():  # "²" is a digit int() refuses
                reports[(store, int(partition))] = report
        self._table.set_node(node_id, info, hosting, reports)
        self._infos[node_id] = info
        self._ends[node_id] = {
            where: r.end_offset for where, r in reports.items() if r.end_offset is not None
        }

    async def _publish(self) -> None:
        """Recompute what changed (yielding between steps) and swap the new snapshot in."""
        table = self._table
        holding = self._smaller_since_ms is not None
        # While a smaller table is held back, every publish looks at it again (nothing may be
        # pending: an empty Redis sends no reports), to keep the flag or accept it in time.
        if not table.pending and self.loaded and not holding:
            self._settle(self.snapshot.built_at_ms)
            if self.clock.now_ms() - self.snapshot.built_at_ms >= self.refresh_interval_s * 1000:
                confirmed = replace(
                    self.snapshot, built_at_ms=self.clock.now_ms(), changed={}, renewed={}
                )
                self._swap(confirmed)
            return
        self._hold()
        for _ in table.rebuild(self.clock.now_ms()):
            await self._pace()
        snapshot = table.snapshot(self.clock.now_ms())
        placed = table.placed  # (kept by the builder: a sum over the snapshot took ms here)
        if self._holding_last_table(placed):
            # This snapshot's changes are dropped with it: the next one swapped in must say
            # that any partition may have changed, or a cache of choices would miss them.
            self._changes_dropped = True
            table.withhold()
            await self._yield()
            # (rows retired meanwhile were never served, or the served snapshot holds them)
            await self._release_retired()
            return
        self._placed = placed
        self._settle(snapshot.built_at_ms)
        self._swap(snapshot)
        await self._yield()
        await self._release_retired()
        await self._renew_choices(self.snapshot)

    async def _release_retired(self) -> None:
        """Free the rows this snapshot replaced, in steps: the one swapped out held them, and
        freed together they held the loop for up to 29 ms at 20,000 partitions."""
        while self._table.release_retired(STEP_PARTITIONS):
            await self._pace()

    def _freeze_heap(self) -> None:
        """Take what is alive now out of the collector's passes (`gc.freeze`), at every yield
        (the one after a swap included), and collect the whole heap when it is due.

        A full pass walks every tracked object: at 6,000 partitions the table and the request
        path's cached choices make that ~40 ms on the loop, and the sweep's new replicas
        trigger one every few seconds. Frozen, a pass walks only what was made since the last
        yield: frozen only after swaps, the sweep's reports and rows made between two swaps
        (100,000 objects at 1,000 nodes) were walked by the young passes they survived, 5-55
        ms each under wrk there. Frozen objects are still freed when nothing refers to them
        (the table's rows and choices are); only cyclic garbage among them waits, which this
        process makes little of (about a hundred objects a second under load), for the one
        full pass every FULL_COLLECT_S that unfreezes and collects everything."""
        now = time.monotonic()
        if now - self._full_collect_s >= FULL_COLLECT_S:
            self._full_collect_s = now
            gc.unfreeze()
            gc.collect()
        gc.freeze()

    async def _renew_choices(self, snapshot: RoutingSnapshot) -> None:
        """Let the request path renew its cached choices of the partitions `renewed` names,
        in steps (yielding between them), while the snapshot is still the one in use."""
        if self._renew is None:
            return
        for name, partitions in snapshot.renewed.items():
            ordered = list(partitions)
            for start in range(0, len(ordered), STEP_PARTITIONS):
                if self.snapshot is not snapshot:
                    return  # a newer table came in: what it renews, it says itself
                self._renew(snapshot, name, ordered[start : start + STEP_PARTITIONS])
                await self._pace()

    async def _renew_due_choices(self) -> None:
        """The request path's renewals left for later whose turn has come, in steps."""
        if self._renew_due is None:
            return
        self._hold()
        while self._renew_due(self.snapshot, STEP_PARTITIONS):
            await self._pace()
        await self._yield()

    def _swap(self, snapshot: RoutingSnapshot) -> None:
        if self._changes_dropped:
            snapshot = replace(snapshot, changed=None, renewed={})
            self._changes_dropped = False
        swapped = snapshot.as_swapped_at(judging_moment(self.clock.now_ms(), self.clock))
        if swapped is not snapshot:
            self.stats.late_swaps += 1
            snapshot = swapped
        self._last_swap_s = time.monotonic()
        previous, self.snapshot = self.snapshot, snapshot
        if previous.generation != snapshot.generation:
            log.info("routing table changed", generation=snapshot.generation)
        self.stats.snapshots += 1
        self._count_changes(snapshot)
        started = time.perf_counter()
        self.on_snapshot(snapshot)
        took_ms = (time.perf_counter() - started) * 1000
        self.stats.max_swap_ms = max(self.stats.max_swap_ms, took_ms)

    def _count_changes(self, snapshot: RoutingSnapshot) -> None:
        stats = self.stats
        if snapshot.changed is None:
            stats.changed_partitions += sum(len(r.replicas) for r in snapshot.stores.values())
        else:
            stats.changed_partitions += sum(map(len, snapshot.changed.values()))
        stats.renewed_partitions += sum(map(len, snapshot.renewed.values()))

    def _settle(self, built_at_ms: int) -> None:
        """A good read: clear the degraded flag and count it."""
        if self.degraded:
            log.info("redis reachable again: table refreshed", generation=self.snapshot.generation)
        self.degraded = False
        self.last_error = None
        self.loaded = True
        self.refreshes += 1
        self.last_refresh_ms = built_at_ms

    def _holding_last_table(self, placed: int) -> bool:
        """Whether to keep the last table because Redis now holds less than it described.

        A Redis restarted empty fills up again as nodes heartbeat and the leader rewrites the
        assignment; swapping in a half-filled table would turn good reads into 404s and 503s.
        So a table with fewer placed replicas than the last one is held back for
        `hold_smaller_table_ms` (a real shrink, such as a cluster down to one node that can
        no longer place standbys, is accepted after that).
        """
        if not (self.loaded or self._served_before) or placed >= self._placed:
            self._smaller_since_ms = None
            return False
        at = self.clock.now_ms()
        if self._smaller_since_ms is None:
            self._smaller_since_ms = at
            log.warning(
                "redis describes less than the last table (restarted empty?): keeping it",
                placed_now=placed,
                placed_before=self._placed,
                hold_ms=self.hold_smaller_table_ms,
            )
        if at - self._smaller_since_ms < self.hold_smaller_table_ms:
            self.degraded = True
            self.last_error = "redis holds less than the last table; waiting for nodes"
            return True
        log.warning("accepting a smaller table", placed=placed)
        self._smaller_since_ms = None
        return False

    # -- measuring the loop time it takes ----------------------------------------------------

    def _hold(self) -> None:
        """Mark the start of a stretch on the event loop (after an await returned). One still
        open goes on: the loop was the watcher's all along (and its limit still counts)."""
        if self._held_since_s is not None:
            return
        self._held_since_s = time.thread_time()
        self._stretch_started_s = self._step_started_s = time.perf_counter()

    def _end_stretch(self) -> None:
        """Count the open stretch (before any await: a yield, or a Redis read). Each one is
        counted, wherever it ends: the readers in flight take turns on the loop, and what
        one of them holds while another yields is the watcher's time, not requests'."""
        if self._held_since_s is None:
            return
        held = time.thread_time() - self._held_since_s
        self._held_since_s = None
        self._own_cpu_s += held
        self.stats.hold_s += held
        self.stats.max_hold_ms = max(self.stats.max_hold_ms, held * 1000)

    async def _pace(self) -> None:
        """Yield before a step like the one that just ended would take the current stretch
        past its limit (STRETCH_S on a loop with time to spare). Not after every small step:
        under load each yield waits for a round of request callbacks (milliseconds), and a
        watcher that yielded after every node could not read 400 nodes a second; reports would
        then go stale in its table while Redis has fresh ones. Not only once the limit has
        passed either: a stretch then overran it by up to a step (a rebuild or renewal step is
        0.2-1 ms on a slow core), and at the 2 ms limit of a saturated loop held it for up to
        2.9 ms at 300 nodes / 6,000 partitions."""
        now = time.perf_counter()
        step, self._step_started_s = now - self._step_started_s, now
        if now - self._stretch_started_s + step >= self._stretch_limit_s:
            await self._yield()

    async def _yield(self) -> None:
        """End a stretch on the loop: count it, then let requests run."""
        if self.freeze_heap:
            # What the stretch made (rows, reports, choices) out of the collector's passes
            # before they walk it; and the full collection when due, from here (counted in
            # the stretch): a quiet table may go without a swap while the cluster is steady.
            self._freeze_heap()
        self._end_stretch()
        paused_at, cpu_at, own_at = time.perf_counter(), time.thread_time(), self._own_cpu_s
        await asyncio.sleep(self._pause_after(paused_at - self._stretch_started_s))
        # The budget pays for the time the pause took, not the time asked: on a busy loop a
        # timer fires late, and the step's delay is what the budget bounds.
        self._pause_left_s -= time.perf_counter() - paused_at
        # What requests took meanwhile is the loop thread's CPU time, not the wall time: a
        # core lent to another process, or an idle pause, says nothing of the loop's load.
        # Less the stretches of this watcher's other readers that ran meanwhile: counted as
        # requests, readers in flight would lengthen each other's stretches to the cap on an
        # idle loop.
        others = (time.thread_time() - cpu_at) - (self._own_cpu_s - own_at)
        self._stretch_limit_s = stretch_limit(others)
        self._hold()

    def _pause_after(self, stretch_s: float) -> float:
        """How long to leave the loop to requests after a stretch of `stretch_s`, out of what
        is left of this step's pause budget (0: a bare yield)."""
        return max(0.0, min(stretch_s * PAUSE_PER_STRETCH, self._pause_left_s))

    def _count(self, commands: int, *replies: Any) -> None:
        self.stats.commands += commands
        self.stats.reply_bytes += sum(map(_size, replies))

    async def _probe_loop(self) -> None:
        stats = self.stats
        watchdog = _StallWatchdog(self.stall_report_ms)
        try:
            while True:
                watchdog.arm()
                asked, cpu_before = time.perf_counter(), time.process_time()
                await asyncio.sleep(LOOP_PROBE_S)
                late_ms = (time.perf_counter() - asked - LOOP_PROBE_S) * 1000
                cpu_ms = (time.process_time() - cpu_before) * 1000
                stats.max_loop_lag_ms = max(stats.max_loop_lag_ms, late_ms)
                stats.max_loop_lag_busy_ms = max(stats.max_loop_lag_busy_ms, min(late_ms, cpu_ms))
                watchdog.saw(late_ms, cpu_ms)
        finally:
            watchdog.disarm()

    def stats_fields(self) -> dict[str, Any]:
        """What the stats line says (counters since start, maxima since the last line)."""
        return {
            "nodes": len(self._node_ids),
            "clocks_moved_in_place": self._table.clocks_moved_in_place,
            **vars(self.stats),
        }

    async def _log_stats(self) -> None:
        """Counters since start and maxima since the last line (then started again)."""
        timer = _CollectorTimer(self.stats)
        gc.callbacks.append(timer)
        try:
            while True:
                await asyncio.sleep(STATS_LOG_S)
                log.debug(self.STATS_EVENT, **self.stats_fields())
                stats = self.stats
                stats.max_hold_ms = stats.max_swap_ms = stats.max_loop_lag_ms = 0.0
                stats.max_loop_lag_busy_ms = stats.max_gc_ms = 0.0
        finally:
            gc.callbacks.remove(timer)

    # -- checks ------------------------------------------------------------------------------

    def _from_the_future(self, node_id: str, report: PartitionReport, at: int) -> bool:
        """Whether a report carries a time beyond what two synced clocks can disagree by.

        Its writer's clock runs ahead of Redis time (a writer that does not sync, or not
        yet): its "caught up at" would understate how stale an answer is by that much, so
        the report counts as missing (unknown lag: refused under a budget), not as fresh."""
        newest = max(report.updated_at_ms, report.caught_up_at_ms or 0)
        if newest <= at + CLOCK_TOLERANCE_MS:
            return False
        self._warn_once(
            f"future:{node_id}",
            "ignoring lag reports stamped in the future: the node's clock is ahead of redis time",
            node=node_id,
            ahead_by_ms=newest - at,
            tolerance_ms=CLOCK_TOLERANCE_MS,
        )
        return True

    def _decoded(self, decode: Callable[[Any], Any], raw: Any, what: str) -> Any:
        if raw is None:
            return None
        try:
            return decode(raw)
        except (ContractError, ValueError, RecursionError) as exc:  # deep nesting: Recursion
            self._warn_once(f"{what}:{exc}", "ignoring a value that breaks the contract", key=what)
            return None

    def _allowed(self, info: NodeInfo) -> bool:
        parts = urlsplit(info.url)
        if parts.scheme != "http" or not parts.hostname or parts.port is None:
            self._warn_once(
                f"url:{info.node_id}:{info.url}",
                "ignoring a node whose URL is not http://host:port",
                node=info.node_id,
                url=info.url,
            )
            return False
        if self.networks is None:
            return True
        try:
            address = ipaddress.ip_address(parts.hostname)
        except ValueError:
            address = None
        if address is None or not any(address in network for network in self.networks):
            self._warn_once(
                f"allow:{info.node_id}:{info.url}",
                "ignoring a node outside KROUTE_ALLOWED_NETWORKS",
                node=info.node_id,
                url=info.url,
            )
            return False
        return True

    def _warn_once(self, token: str, message: str, **fields: Any) -> None:
        if token not in self._warned:
            self._warned.add(token)
            log.warning(message, **fields)

    # -- events ------------------------------------------------------------------------------

    async def _listen(self) -> None:
        while True:
            handed_over = self._subscribed is not None  # by `start`, which read after it
            pubsub = self._subscribed or self.redis.pubsub(ignore_subscribe_messages=True)
            self._subscribed = None
            try:
                if not handed_over:
                    await pubsub.subscribe(self.keys.events)
                    self.refresh_soon()  # whatever happened while we were not subscribed
                while True:
                    _raise_if_cancelled()
                    message = await pubsub.get_message(timeout=self.refresh_interval_s)
                    if message is not None and message.get("type") == "message":
                        self._note(message.get("data"))
            except (aioredis.RedisError, OSError):
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise  # a read timeout racing the cancellation must not outlive it
                await asyncio.sleep(self.refresh_interval_s)
            finally:
                await _closed(pubsub)

    def _note(self, raw: Any) -> None:
        """An event: read the node it names, or the head (assignment, membership) soon."""
        try:
            event = decode_event(raw)
        except (ContractError, ValueError, TypeError, RecursionError):
            self._head_due = self._assignment_due = True  # a writer we cannot read: the head
            self._wake.set()
            return
        if event.type == "assignment":
            self._head_due = self._assignment_due = True
        elif event.node_id is not None:
            self._named.add(event.node_id)
            if event.type == "node" or event.node_id not in self._table.nodes:
                self._head_due = True  # the `nodes` set may have changed
        else:
            # A writer of many nodes at once (a single-writer adapter) names none of them:
            # read everything (at most once per refresh interval; the head at once).
            self._full_due = self._head_due = True
        self._wake.set()


@dataclass(frozen=True, eq=False, slots=True)
class _Applied:
    """What a node's last body applied left in the table: from that body (the object held in
    `_bodies`), around those end offsets (the object the last node read left), as of `at_ms`,
    every entry kept (none from the future), giving the table the reports `fields` (the
    builder's own object, which any other update of the node that changes them replaces:
    a node read, a new URL, a forgotten node). While all of these are still the same objects,
    a confirmation of the body at another at_ms gives the same reports with every time moved
    by the difference. Compared by identity, never by value: cheap, and a new body or node
    read in between (new objects, however equal) takes the whole path."""

    body: NodeReport
    ends: dict[tuple[str, int], int] | None
    at_ms: int
    fields: Any  # the TableBuilder's mapping of the node's reports
    ahead_ms: int  # _ahead_ms(body)


def _ahead_ms(body: NodeReport) -> int:
    """How far past its at_ms the newest time of a body's entries lies (a "caught up at" after
    the report's time, a negative age; 0 when none is): an entry is from the future when at_ms
    plus this is."""
    ahead = 0
    for entries in body.lags.values():
        for entry in entries:
            if entry is not None and entry[1] is not None and -entry[1] > ahead:
                ahead = -entry[1]
    return ahead


async def _closed(pubsub: PubSub) -> None:
    with contextlib.suppress(aioredis.RedisError, OSError):
        await pubsub.aclose()  # type: ignore[no-untyped-call]


def _raise_if_cancelled() -> None:
    """Honour a cancellation a library swallowed. redis-py sends every command through
    `asyncio.wait_for` when a socket timeout is set (its default is 5 s), and on Python 3.11
    wait_for can return a result that landed with the cancellation and drop the cancellation
    (CPython gh-86296). The task still counts it (`cancelling()`): checked each round, a loop
    does not outlive it (a CI run once waited on such a loop until pytest's timeout)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def stretch_limit(requests_s: float) -> float:
    """How long the watcher's next stretch on the loop may last, given how long requests
    ran on the loop during its last yield: the longer they kept it, the longer the table's
    turn, so a saturated loop still leaves the table its share."""
    return min(MAX_STRETCH_S, max(STRETCH_S, requests_s * TABLE_SHARE))


def judging_moment(at: int, clock: SharedClock) -> int:
    """The moment a confirmation is judged as of (`TableBuilder.shift_node`): a moved clock
    moves the served rows' times at once, so it must be no earlier than any request's clock
    so far. Not `at`, which the loop's yields since leave behind; not the clock's now alone
    either: at a sync the shared clock steps back silently by up to `max_step_ms`, so a
    request may have read a later time than now. Judged two such steps ahead (about two
    syncs), a replica that close to a limit takes the rebuild path instead."""
    return max(at, clock.now_ms()) + 2 * int(clock.max_step_ms)


class _Round:
    """Every node once per `interval_s`, a slice at a time: as many nodes as the time since
    the last slice asks for, however long the ticks really took."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.queue: deque[str] = deque()
        self.credit = 0.0  # nodes owed (fractions carry over)
        self.last_s = time.monotonic()

    def restart(self, node_ids: list[str]) -> None:
        self.queue = deque(node_ids)

    def due(self, node_ids: list[str]) -> list[str]:
        now = time.monotonic()
        elapsed, self.last_s = now - self.last_s, now
        self.credit += len(node_ids) * min(elapsed, 1.0) / self.interval_s
        count = int(self.credit)
        self.credit -= count
        due = []
        for _ in range(count):
            if not self.queue:
                self.queue = deque(node_ids)
                if not self.queue:
                    break
            due.append(self.queue.popleft())
        return due


def _size(reply: Any) -> int:
    """About how many bytes a reply took on the wire (its values and their framing)."""
    if isinstance(reply, bytes | str):
        return len(reply) + 5
    if isinstance(reply, dict):
        return sum(_size(k) + _size(v) for k, v in reply.items()) + 5
    if isinstance(reply, list | tuple | set | frozenset):
        return sum(map(_size, reply)) + 5
    return 5 if reply is None else len(str(reply)) + 3


class _StallWatchdog:
    """KROUTE_STALL_REPORT_MS: every thread's stack printed to stderr while the loop is held
    longer than `report_ms` (faulthandler's watchdog, a C thread that needs no GIL, so it
    prints while the code holding the loop is still on the stack; a Python thread could only
    look afterwards), and a warning logged for each such stall.

    Re-arming stops faulthandler's thread and starts another (a fraction of a millisecond,
    more on a busy machine), so it is re-armed every REARM_S, not on every 10 ms probe: the
    stacks come for stalls longer than `report_ms` plus up to REARM_S. A diagnostic never
    stops the watcher: a stderr without a file descriptor turns the stacks off (logged)."""

    REARM_S = 0.1

    def __init__(self, report_ms: int | None) -> None:
        self.report_ms = report_ms
        self._stacks = report_ms is not None
        self._armed_at = -1.0

    def arm(self) -> None:
        if not self._stacks or self.report_ms is None:
            return
        now = time.monotonic()
        if now - self._armed_at < self.REARM_S:
            return
        try:
            faulthandler.dump_traceback_later(self.REARM_S + self.report_ms / 1000, file=sys.stderr)
        except (AttributeError, OSError, RuntimeError, ValueError) as exc:
            # sys.stderr None, replaced by an object without a file descriptor, or closed.
            self._stacks = False
            log.warning("stall report: no stacks, stderr cannot take them", error=repr(exc))
            return
        self._armed_at = now

    def saw(self, late_ms: float, cpu_ms: float) -> None:
        if self.report_ms is not None and late_ms > self.report_ms:
            log.warning(
                "event loop stalled",
                stall_ms=round(late_ms, 1),
                proxy_cpu_ms=round(cpu_ms, 1),
                stacks="printed to stderr during the stall" if self._stacks else "off",
            )

    def disarm(self) -> None:
        if self._armed_at >= 0:
            faulthandler.cancel_dump_traceback_later()
