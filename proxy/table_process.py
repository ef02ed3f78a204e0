"""The routing table built in a process of its own (`KROUTE_TABLE_PROCESS=true`).

In one process, the watcher's reads, decoding, rebuilds and judgements run on the event loop
that serves requests, in stretches of half a millisecond to two; at 300 nodes / 6,000
partitions they took about 4% of a core and made the paced p99 about 1.27 times a 20-node
proxy's on this project's two-core test machine. With the table's work stopped (frozen after
the first read) the same proxy measured 1.0 times: it is the work, not the table's size,
that requests wait behind. Here a child process runs the same `TableWatcher` (everything it
does, as documented there) and sends each snapshot it swaps in as the rows that changed,
and between snapshots the report clocks it moved in place (proxy.table_feed); the proxy's
loop applies them (`TableProcess`), in time that follows what changed.

The child gets a socket pair of its own and its settings over it (the Redis URL's password
is not put on a command line), dies with the proxy (PR_SET_PDEATHSIG, and the socket's end),
and sends its Redis TIME samples with every message (the proxy's clock observes them before
the rows they judge), and a status every `STATUS_S`, with each snapshot and when its flags
change: loaded, degraded, the last error, the refresh counts and its read counters.
`refresh_soon` is a byte to it. When it exits, the proxy routes on its last table, reports
itself degraded and starts another after `RESTART_S`, which sends everything again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import pickle
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
import structlog
import uvloop

from common.clock import SHARED, ClockSample
from common.contract import Keys
from common.logging import configure_logging
from proxy.lifetime import die_with_parent
from proxy.routing import ChoiceStability, RoutingSnapshot
from proxy.table_feed import ClockMessage, FeedEncoder, FeedMirror, SnapshotMessage, dumps, loads
from proxy.watcher import (
    MIN_GAP_S,
    STEP_PAUSE_BUDGET_S,
    STRETCH_S,
    TICK_S,
    Network,
    Renew,
    RenewDue,
    TableWatcher,
    WatcherStats,
    redis_client,
)

log = structlog.get_logger("kroute.proxy.table_process")

STATUS_S = 1.0  # a status at least this often, with or without a change
RESTART_S = 1.0  # after the child exits, before the next one starts
# A child that ends within YOUNG_S of its start doubles the wait for the next one, up to
# MAX_RESTART_S (a setting it cannot use, a Redis it cannot parse: not a restart a second).
YOUNG_S = 30.0
MAX_RESTART_S = 30.0
SILENT_S = 10.0  # a child that sent nothing for this long (after its first status) is replaced
# The first status (the child's first full read done, or failed) within this, or the proxy
# starts without a table (as when Redis is not there) and takes it when it comes.
FIRST_STATUS_S = 30.0
# A message this long (a whole table: a new child, a rebalance) is applied in a thread: at
# 20,000 partitions it makes 40,000 replicas, tens of milliseconds of Python (about 4 ms at
# 256 KiB on the loop; the GIL is handed back every millisecond, see proxy.main).
THREAD_APPLY_BYTES = 32 * 1024
_LENGTH = struct.Struct(">I")
REFRESH_FAILURES_HELP = "Routing table refreshes from Redis that failed"
# The read counters the child keeps (the proxy's own stats keep its loop's figures).
READ_COUNTERS = (
    "head_reads",
    "node_reads",
    "report_reads",
    "report_confirms",
    "unpaired_bodies",
    "full_reads",
    "commands",
    "reply_bytes",
)


@dataclass(frozen=True)
class TableConfig:
    """What the child needs of the proxy's settings (sent over the socket)."""

    redis_url: str
    redis_timeout_ms: int
    redis_ca_file: str | None
    cluster: str
    refresh_interval_ms: int
    networks: tuple[Network, ...] | None
    log_level: str
    stall_report_ms: int | None
    cpus: frozenset[int] | None = None  # None: the proxy's
    stability: ChoiceStability | None = None
    placed: int = 0  # replicas in the table the proxy serves (see _holding_last_table)


@dataclass(frozen=True)
class TableStatus:
    loaded: bool
    degraded: bool
    last_error: str | None
    last_refresh_ms: int | None
    refreshes: int
    refresh_failures: int
    counters: dict[str, Any]
    pid: int = 0  # the table process's: its counts start from 0 (see TableProcess._follow)
    placed: int = 0  # replicas in the table it serves (a new process's floor, see TableKeeper)


@dataclass(frozen=True)
class Feed:
    """One message from the table process: its Redis TIME samples since the last one (always:
    the proxy's clock observes them before the rows they judge), a status when due, and the
    table's change, if any."""

    clock_samples: list[ClockSample]
    status: TableStatus | None
    change: ClockMessage | SnapshotMessage | None


def frame(payload: bytes) -> bytes:
    return _LENGTH.pack(len(payload)) + payload


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    return await reader.readexactly(length)


# -- the proxy's side ----------------------------------------------------------------------------


class TableProcess(TableWatcher):
    """A `TableWatcher` whose table a child process builds: the same snapshots, swaps,
    renewals, stats and flags, with only the applying of changes on this loop."""

    ENDED = "table process ended"
    SILENT = "table process silent"
    CANNOT = "cannot start the table process"
    START_WAIT_S = FIRST_STATUS_S  # how long `start` waits for the first status
    FIRST_WAIT_S = RESTART_S  # before the next child, doubling up to MAX_WAIT_S
    MAX_WAIT_S = MAX_RESTART_S

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        *,
        config: TableConfig,
        **options: Any,
    ) -> None:
        super().__init__(
            redis,
            keys,
            refresh_interval_ms=config.refresh_interval_ms,
            networks=config.networks,
            **options,
        )
        self.config = config
        self.restarts = 0
        self.process: asyncio.subprocess.Process | None = None
        self._mirror = FeedMirror()
        self._writer: asyncio.StreamWriter | None = None
        self._reader: asyncio.StreamReader | None = None
        self._child_fields: dict[str, Any] = {}
        self._heard = False  # the current child has sent a status
        self._started_s = 0.0  # when the current child was started
        self._restart_s = self.FIRST_WAIT_S  # the wait before the next one (see _feed)
        self._starting: asyncio.Task[None] | None = None  # the first status awaited (start)
        # Counts from the children before the current one: a new child counts from 0, the
        # proxy's figures (and the benchmarks' differences) never go back.
        self._before: dict[str, int] = {}
        self._last_counts: dict[str, int] = {}
        self._child_pid: int | None = None  # the process the last status came from
        self._placed_served = 0  # replicas in the table the proxy serves (a new child's floor)
        self._renewing: asyncio.Task[None] | None = None
        self._refresh_asked_s = 0.0

    def keep_choices(
        self, stability: ChoiceStability, renew: Renew, renew_due: RenewDue | None = None
    ) -> None:
        # The child judges with `stability`; the renewals are the request path's, here.
        self.config = replace(self.config, stability=stability)
        self._renew, self._renew_due = renew, renew_due

    def refresh_soon(self) -> None:
        """Ask the child for a full read soon (a node refused a request): a byte, at most every
        MIN_GAP_S (the child coalesces them anyway)."""
        writer, now = self._writer, time.monotonic()
        if writer is None or writer.is_closing() or now - self._refresh_asked_s < MIN_GAP_S:
            return
        self._refresh_asked_s = now
        writer.write(b"R")

    async def refresh(self) -> None:
        self.refresh_soon()

    async def start(self) -> None:
        """Start the child and take what it sends until its first status (its first full
        read, done or failed; FIRST_STATUS_S at most), or START_WAIT_S: then `run` goes on
        waiting for it on the same line (the proxy serves without a table meanwhile, not
        ready). A child that fails before is replaced by `run`."""
        if not await self._spawned():
            return
        self._starting = asyncio.create_task(self._until_heard())
        await asyncio.wait({self._starting}, timeout=self.START_WAIT_S)
        # (Not when the wait is the first status's own limit: the child is being replaced.)
        if not self._starting.done() and self.START_WAIT_S < FIRST_STATUS_S:
            log.warning(
                "no table from the table process yet: serving without one until it comes",
                waited_s=self.START_WAIT_S,
            )

    async def _until_heard(self) -> None:
        while not self._heard:
            if not await self._taken():
                await self._replace()
                return

    async def run(self) -> None:
        async with asyncio.TaskGroup() as group:
            for loop in (self._feed(), self._renew_loop(), self._probe_loop(), self._log_stats()):
                group.create_task(loop)

    def stats_fields(self) -> dict[str, Any]:
        return {
            **super().stats_fields(),
            **self._child_fields,
            "table_process_restarts": self.restarts,
        }

    async def _feed(self) -> None:
        try:
            if self._starting is not None:  # the first status, still awaited (see start)
                await self._starting
            while True:
                if self._reader is None:
                    await asyncio.sleep(self._restart_s)
                    self._restart_s = min(self._restart_s * 2, self.MAX_WAIT_S)
                    self.restarts += 1
                    if not await self._spawned():
                        continue
                while await self._taken():
                    pass
                await self._replace()
        finally:
            for task in (self._renewing, self._starting):
                if task is not None:
                    task.cancel()
            self._kill()

    async def _replace(self) -> None:
        """The child is gone or of no use: route on the last table, degraded, until the next
        one (after FIRST_WAIT_S, doubling up to MAX_WAIT_S while children die young)."""
        code = await self._ended()
        self.degraded = True
        self.last_error = self._lost(code)
        if time.monotonic() - self._started_s >= YOUNG_S:
            self._restart_s = self.FIRST_WAIT_S
        log.error(
            f"{self.ENDED}: routing on the last table",
            code=code,
            next_in_s=self._restart_s,
        )

    def _lost(self, code: int | None) -> str:
        return f"table process ended ({code}); starting another"

    async def _spawned(self) -> bool:
        try:
            await self._spawn()
        except OSError as exc:
            self.degraded = True
            self.last_error = f"{self.CANNOT}: {exc}"
            log.error(f"{self.CANNOT}: routing on the last table", error=str(exc))
            return False
        return True

    async def _spawn(self) -> None:
        ours, theirs = socket.socketpair()
        try:
            self.process = await _start_table_process(theirs)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._reader, self._writer = await asyncio.open_connection(sock=ours)
        # A new child: what the proxy serves is its floor for `_holding_last_table`.
        config = replace(self.config, placed=self._placed_served)
        self._writer.write(frame(pickle.dumps(config)))
        self._connected()
        log.info("table process started", pid=self.process.pid)

    def _connected(self) -> None:
        """A new line to a table process: it sends the whole table first."""
        self._mirror.restart()
        self._heard = False
        self._started_s = time.monotonic()

    async def _taken(self) -> bool:
        """Take one message; False when the child is gone, silent, or sent what cannot be
        applied (a bug on one side: a new child sends everything again)."""
        try:
            return await self._take()
        except Exception:
            log.exception("a message from the table process could not be applied")
            return False

    async def _take(self) -> bool:
        assert self._reader is not None
        # The child says something every STATUS_S once it has read the table: silent for
        # SILENT_S (stopped, or stuck) it is replaced; its first read may take longer.
        limit = SILENT_S if self._heard else FIRST_STATUS_S
        try:
            async with asyncio.timeout(limit):
                payload = await read_frame(self._reader)
        except TimeoutError:  # (before OSError: it is one)
            log.error(f"{self.SILENT}: replacing it", silent_s=limit)
            return False
        except (asyncio.IncompleteReadError, OSError):
            return False
        big = len(payload) > THREAD_APPLY_BYTES
        feed: Feed = await asyncio.to_thread(loads, payload) if big else loads(payload)
        # The clock first: in step before the rows are judged by it.
        for sample in feed.clock_samples:
            self.clock.observe(*sample)
        if feed.status is not None:
            self._follow(feed.status)
        message = feed.change
        if isinstance(message, SnapshotMessage):
            await self._apply(message, big=big)
        elif isinstance(message, ClockMessage):
            self._mirror.move_clocks(message.clocks)
        return True

    async def _apply(self, message: SnapshotMessage, *, big: bool) -> None:
        self._pause_left_s, self._stretch_limit_s = STEP_PAUSE_BUDGET_S, STRETCH_S
        if big:
            snapshot = await asyncio.to_thread(self._mirror.apply, message)
            self._hold()
        else:
            self._hold()
            snapshot = self._mirror.apply(message)
        self._swap(snapshot)
        self._placed_served = message.placed
        self._end_stretch()
        # Renewed in a task of its own: the messages behind this one (clocks moved in place)
        # are applied meanwhile, not after the renewals' paced steps.
        if self._renewing is not None:
            self._renewing.cancel()  # (it stops at its next step anyway: a newer snapshot)
        self._renewing = asyncio.create_task(self._renew_swapped(self.snapshot))

    async def _renew_swapped(self, snapshot: RoutingSnapshot) -> None:
        try:
            await self._yield()
            await self._renew_choices(snapshot)
        except Exception:  # the request path's renewal: logged, never the feed's end
            log.exception("renewing cached choices failed")
        finally:
            self._end_stretch()

    def _follow(self, status: TableStatus) -> None:
        # A new child has read nothing yet: the table served stays loaded.
        self.loaded = self.loaded or status.loaded
        self.degraded = status.degraded or not status.loaded
        self.last_error, self.last_refresh_ms = status.last_error, status.last_refresh_ms
        counts = {
            "refreshes": status.refreshes,
            "refresh_failures": status.refresh_failures,
            **{name: status.counters.get(name, 0) for name in READ_COUNTERS},
        }
        if status.pid != self._child_pid:  # another process, counting from 0: add the last's
            for name, count in self._last_counts.items():
                self._before[name] = self._before.get(name, 0) + count
            self._child_pid = status.pid
        self._last_counts = counts
        totals = {name: self._before.get(name, 0) + n for name, n in counts.items()}
        self.refreshes, self.refresh_failures = totals["refreshes"], totals["refresh_failures"]
        for name in READ_COUNTERS:
            setattr(self.stats, name, totals[name])
        self._child_fields = {
            "nodes": status.counters.get("nodes", 0),
            "clocks_moved_in_place": status.counters.get("clocks_moved_in_place", 0),
        }
        self._heard = True

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            self._pause_left_s, self._stretch_limit_s = STEP_PAUSE_BUDGET_S, STRETCH_S
            try:
                await self._renew_due_choices()
            except Exception:  # the request path's renewal: logged, the loop goes on
                log.exception("renewing cached choices failed")
            self._end_stretch()

    async def _ended(self) -> int | None:
        """The child's exit code, once it has exited (killed if it has not within a second:
        its socket is closed, so it is of no use)."""
        self._close_socket()
        return await _exit_code(self.process)

    def _close_socket(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None

    def _kill(self) -> None:
        self._close_socket()
        _kill(self.process)


class SharedTableProcess(TableProcess):
    """A worker's table (KROUTE_WORKERS > 1): the supervisor runs one table process for every
    worker (`TableKeeper`); this worker connects to it, and connects again when its line ends
    or goes silent (the supervisor replaces a process that exits or goes silent)."""

    def __init__(
        self, redis: aioredis.Redis, keys: Keys, *, config: TableConfig, path: Path, **options: Any
    ) -> None:
        super().__init__(redis, keys, config=config, **options)
        self.path = path

    async def _spawn(self) -> None:
        self._reader, self._writer = await asyncio.open_unix_connection(self.path)
        self._connected()
        log.info("connected to the table process", path=str(self.path))

    async def _ended(self) -> int | None:
        self._close_socket()
        return None

    ENDED = "the line to the table process ended"
    CANNOT = "cannot connect to the table process"
    SILENT = "the table process is silent on this worker's line"
    # Under the supervisor's watchdog's grace for a starting worker (WATCHDOG_START_GRACE_S):
    # a worker waiting longer for a table process that is not there would be killed as hung.
    START_WAIT_S = 5.0
    # Connecting again costs nothing (the supervisor's socket holds the connection until a
    # table process takes it): soon, so a worker is back on a new process's table at once.
    FIRST_WAIT_S = 0.25
    MAX_WAIT_S = 2.0

    def _lost(self, code: int | None) -> str:
        return f"{self.ENDED}; connecting again"


class TableKeeper:
    """The supervisor's side with KROUTE_WORKERS > 1: one table process for all the workers,
    so the table's reads from Redis and its upkeep are done once per host, not per worker.

    It binds the socket the workers connect to before any of them starts (a connection made
    while the process restarts waits in its backlog for the next one), starts the process with
    it, hears its statuses on a line of its own (statuses only: no table to apply here), and
    starts another when it exits or goes silent, after a wait that doubles while they die
    young. A new process is told how many replicas the last one's table placed, so a smaller
    table read now is held back as a worker's own would be."""

    def __init__(self, config: TableConfig, path: Path) -> None:
        self.config, self.path = config, path
        self.listening: socket.socket | None = None
        self.process: asyncio.subprocess.Process | None = None
        self.restarts = 0
        self.status: TableStatus | None = None
        self._failures_before = 0  # refresh failures of the processes before this one

    def listen(self) -> None:
        listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listening.bind(str(self.path))
            listening.listen(128)
        except OSError:
            listening.close()
            raise
        self.listening = listening

    def describe(self) -> dict[str, Any]:
        """For the supervisor's /cluster/status: the process and what it last said."""
        process, status = self.process, self.status
        return {
            "pid": process.pid if process is not None and process.returncode is None else None,
            "restarts": self.restarts,
            "loaded": status is not None and status.loaded,
            "degraded": status is None or status.degraded,
            "last_error": None if status is None else status.last_error,
            "refresh_failures": self.refresh_failures,
        }

    @property
    def refresh_failures(self) -> int:
        current = 0 if self.status is None else self.status.refresh_failures
        return self._failures_before + current

    async def run(self) -> None:
        wait_s = RESTART_S
        try:
            while True:
                started_s = time.monotonic()
                code = await self._run_guarded()
                if time.monotonic() - started_s >= YOUNG_S:
                    wait_s = RESTART_S
                log.error(
                    "the workers' table process ended: starting another",
                    code=code,
                    next_in_s=wait_s,
                )
                await asyncio.sleep(wait_s)
                wait_s = min(wait_s * 2, MAX_RESTART_S)
                self.restarts += 1
        finally:
            self._kill()
            if self.listening is not None:
                self.listening.close()

    async def _run_guarded(self) -> int | None:
        """`_run_one`, whatever fails in it (the keeper must outlive any process)."""
        try:
            return await self._run_one()
        except Exception:
            log.exception("keeping the workers' table process failed: starting another")
            self._kill()
            return None

    async def _run_one(self) -> int | None:
        """One process, from its start until it exits, or goes silent (then killed)."""
        assert self.listening is not None
        status = self.status
        if status is not None:  # a new process counts from 0: the last one's, kept once
            self._failures_before += status.refresh_failures
            self.status = replace(status, refresh_failures=0)
        placed = 0 if status is None else status.placed
        ours, theirs = socket.socketpair()
        try:
            self.process = await _start_table_process(theirs, self.listening)
        except OSError as exc:
            ours.close()
            log.error("cannot start the workers' table process", error=str(exc))
            return None
        finally:
            theirs.close()
        log.info("the workers' table process started", pid=self.process.pid)
        try:
            reader, writer = await asyncio.open_connection(sock=ours)
        except BaseException:
            ours.close()
            raise
        try:
            writer.write(frame(pickle.dumps(replace(self.config, placed=placed))))
            await self._hear(reader)
        finally:
            writer.close()
        code = await self._ended()
        if self.status is not None:  # what /cluster/status says until the next one speaks
            self.status = replace(
                self.status, degraded=True, last_error=f"table process ended ({code})"
            )
        return code

    async def _hear(self, reader: asyncio.StreamReader) -> None:
        """Its statuses, until its line ends or it is silent for too long."""
        heard = False
        while True:
            limit = SILENT_S if heard else FIRST_STATUS_S
            try:
                async with asyncio.timeout(limit):
                    payload = await read_frame(reader)
            except TimeoutError:  # (before OSError: it is one)
                log.error("the workers' table process is silent: replacing it", silent_s=limit)
                return
            except (asyncio.IncompleteReadError, OSError):
                return
            feed: Feed = loads(payload)
            if feed.status is not None:
                self.status, heard = feed.status, True

    async def _ended(self) -> int | None:
        return await _exit_code(self.process)

    def _kill(self) -> None:
        _kill(self.process)


async def _start_table_process(
    line: socket.socket, listening: socket.socket | None = None
) -> asyncio.subprocess.Process:
    """`python -m proxy.table_process` with its end of `line` (and the workers' listening
    socket, for one process for every worker): `main` below."""
    fds = [line.fileno()] if listening is None else [line.fileno(), listening.fileno()]
    first, *rest = (str(fd) for fd in fds)
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy.table_process", first, str(os.getpid()), *rest,
        pass_fds=tuple(fds),
    )  # fmt: skip


async def _exit_code(process: asyncio.subprocess.Process | None) -> int | None:
    """The process's exit code once it has exited (killed if it has not within a second)."""
    if process is None:
        return None
    try:
        async with asyncio.timeout(1.0):
            return await process.wait()
    except TimeoutError:
        _kill(process)
        return await process.wait()


def _kill(process: asyncio.subprocess.Process | None) -> None:
    if process is not None and process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.kill()


# -- the child's side ----------------------------------------------------------------------------


@dataclass(eq=False)
class Subscriber:
    """One line the table process sends on: a proxy's feed (a worker's, with one process for
    every worker), or, with no encoder, the supervisor's, which takes the statuses only."""

    write: Callable[[bytes], None]
    encoder: FeedEncoder | None = field(default_factory=FeedEncoder)
    writer: asyncio.StreamWriter | None = None  # (None: a test's list)

    def backlog(self) -> int:
        """Bytes written and not yet taken by the other side."""
        writer = self.writer
        return 0 if writer is None else writer.transport.get_write_buffer_size()


# A line whose reader has left this much unread (a worker stopped: SIGSTOP, a stuck loop) is
# dropped, not buffered without end; a worker that connects again gets the whole table.
MAX_BACKLOG_BYTES = 64 << 20
Change = ClockMessage | SnapshotMessage


class FeedingWatcher(TableWatcher):
    """The table process's watcher: what it swaps in, and the clocks it moves, go to each line
    (`subscribers`) as changes, encoded per line; its clock's TIME samples go with each
    message, for the proxy's clock to observe (the host's monotonic clock is the same in
    both processes)."""

    STATS_EVENT = "table process"

    def __init__(
        self,
        *args: Any,
        send: Callable[[bytes], None] | None = None,
        placed: int = 0,
        **options: Any,
    ) -> None:
        super().__init__(*args, **options)
        self.subscribers: list[Subscriber] = [] if send is None else [Subscriber(send)]
        self._table.recording_moves = True
        self.on_snapshot = self._feed_snapshot
        self._status_sent_s = 0.0
        self._flags_sent: tuple[bool, bool, str | None] | None = None
        self._samples: list[ClockSample] = []
        self._last_sample: ClockSample | None = None
        self.clock.taps.append(self._tapped)
        # The table the proxy serves (from an earlier table process): a smaller one read now
        # is held back as the proxy's own would be (`_holding_last_table`).
        self._placed = placed
        self._served_before = placed > 0

    def _tapped(self, reply: tuple[int, int], sent_s: float, received_s: float) -> None:
        sample = (reply, sent_s, received_s)
        self._samples.append(sample)
        self._last_sample = sample

    def subscribe(self, subscriber: Subscriber) -> None:
        """A new line. Once this process has said it serves (its first status), it gets the
        whole table now, with the last clock sample; before, with everyone's first."""
        self.subscribers.append(subscriber)
        if self._flags_sent is None:
            return
        change = None
        if subscriber.encoder is not None and self.loaded:
            change = self._snapshot_message(subscriber.encoder, self.snapshot)
        samples = [] if self._last_sample is None else [self._last_sample]
        self._write(subscriber, Feed(samples, self.status(), change))

    def unsubscribe(self, subscriber: Subscriber) -> None:
        if subscriber in self.subscribers:
            self.subscribers.remove(subscriber)

    def status(self) -> TableStatus:
        stats: WatcherStats = self.stats
        counters = {name: getattr(stats, name) for name in READ_COUNTERS}
        counters["nodes"] = len(self._node_ids)
        counters["clocks_moved_in_place"] = self._table.clocks_moved_in_place
        return TableStatus(
            loaded=self.loaded,
            degraded=self.degraded,
            last_error=self.last_error,
            last_refresh_ms=self.last_refresh_ms,
            refreshes=self.refreshes,
            refresh_failures=self.refresh_failures,
            counters=counters,
            pid=os.getpid(),
            placed=self._placed,
        )

    def send(
        self, encode: Callable[[FeedEncoder], Change | None] | None = None, *, status: bool = False
    ) -> None:
        """To every line: its change (`encode` with its encoder), the clock samples taken
        since the last message, and a status when asked for or wanted (`_status_wanted`).
        The supervisor's line gets the statuses only."""
        current = self.status() if status or self._status_wanted() else None
        if current is not None:
            self._status_sent_s, self._flags_sent = time.monotonic(), self._flags()
        samples, self._samples = self._samples, []
        for subscriber in list(self.subscribers):
            encoder = subscriber.encoder
            if encoder is not None:
                change = None if encode is None else encode(encoder)
                self._write(subscriber, Feed(samples, current, change))
            elif current is not None:
                self._write(subscriber, Feed([], current, None))

    def _write(self, subscriber: Subscriber, feed: Feed) -> None:
        writer = subscriber.writer
        if writer is not None and writer.is_closing():
            self.unsubscribe(subscriber)
        elif subscriber.backlog() > MAX_BACKLOG_BYTES:
            log.error(
                "a line to the table process stopped reading: dropped",
                unread_bytes=subscriber.backlog(),
            )
            self.unsubscribe(subscriber)
            if writer is not None:
                writer.transport.abort()  # (close would wait for the backlog to drain)
        else:
            subscriber.write(frame(dumps(feed)))

    def _status_wanted(self) -> bool:
        """Due (every STATUS_S), or its flags changed since the last one (a failed read makes
        the proxy degraded now, not within a second). Not before the first, which goes with
        the first table, or says the first read failed (`serve`): the proxy starts serving
        once it has heard a status."""
        if self._flags_sent is None:
            return False
        return (
            time.monotonic() - self._status_sent_s >= STATUS_S or self._flags() != self._flags_sent
        )

    def _flags(self) -> tuple[bool, bool, str | None]:
        """What the proxy says of its health from a status (loaded, degraded, last error)."""
        return self.loaded, self.degraded, self.last_error

    def _feed_snapshot(self, snapshot: RoutingSnapshot) -> None:
        self._table.take_clocks_moved()  # the snapshot's message looks at every clock
        self.send(lambda encoder: self._snapshot_message(encoder, snapshot), status=True)

    def _snapshot_message(self, encoder: FeedEncoder, snapshot: RoutingSnapshot) -> Change:
        message = encoder.snapshot(snapshot, self._table.clocks.values())
        message.placed = self._placed
        return message

    async def _yield(self) -> None:
        # Clocks moved in place reach the proxy before the watcher lets anything else run:
        # they were judged for now (a little ahead), not for whenever the step ends.
        self.flush()
        await super()._yield()

    async def _guarded(self, read: Callable[[], Any]) -> None:
        # After each step, also one that failed (its flags changed after it raised).
        try:
            await super()._guarded(read)
        finally:
            self.flush()

    def flush(self) -> None:
        """The clocks moved in place since the last message; a message without them only
        when a status is wanted."""
        moved = self._table.take_clocks_moved()
        if moved or self._status_wanted():
            self.send(lambda encoder: _clock_message(encoder.moved_clocks(moved)))

    async def run(self) -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(super().run())
            group.create_task(self._status_loop())

    async def _status_loop(self) -> None:
        while True:
            await asyncio.sleep(STATUS_S)
            self.flush()


def _clock_message(moved: dict[int, int]) -> ClockMessage | None:
    return ClockMessage(moved) if moved else None


async def serve(
    sock: socket.socket, config: TableConfig, listening: socket.socket | None = None
) -> int:
    """Build the table and send it on the line `sock` (the proxy's); with `listening` (the
    supervisor's socket, KROUTE_WORKERS > 1), to every worker that connects to it, and on
    `sock` the statuses only."""
    reader, writer = await asyncio.open_connection(sock=sock)
    redis = redis_client(config.redis_url, config.redis_timeout_ms, config.redis_ca_file)
    watcher = FeedingWatcher(
        redis,
        Keys(config.cluster),
        refresh_interval_ms=config.refresh_interval_ms,
        networks=config.networks,
        clock=SHARED,
        placed=config.placed,
    )
    watcher.subscribe(Subscriber(writer.write, None if listening else FeedEncoder(), writer))
    if config.stability is not None:
        watcher.judge_with(config.stability)  # the renewals are the proxy's
    watcher.freeze_heap = True
    watcher.stall_report_ms = config.stall_report_ms
    workers = None
    if listening is not None:  # before the first read: a worker waits for its first table
        # The socket is the supervisor's, for the next process too: closing this server must
        # not unlink its path (uvloop, and asyncio from Python 3.13, would by default).
        workers = await asyncio.start_unix_server(
            functools.partial(_feed_worker, watcher), sock=listening, cleanup_socket=False
        )
    await watcher.start()
    watcher.send(status=True)
    running = asyncio.create_task(watcher.run())
    commands = asyncio.create_task(_take_commands(reader, watcher))
    try:
        # Until the proxy closes its end (it stopped, or it is gone), or the watcher fails:
        # an exit the proxy sees as the socket's end, and starts another process for.
        await asyncio.wait({running, commands}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if workers is not None:
            workers.close()
        for task in (running, commands):
            task.cancel()
        await asyncio.gather(running, commands, return_exceptions=True)
        await redis.aclose()
    failed = running.done() and not running.cancelled() and running.exception() is not None
    if failed:
        log.error("table process failed", error=repr(running.exception()))
    return 1 if failed else 0


async def _feed_worker(
    watcher: FeedingWatcher, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """One worker's line, until it closes it: the table, then its changes."""
    subscriber = Subscriber(writer.write, FeedEncoder(), writer)
    watcher.subscribe(subscriber)
    log.info("a worker connected", lines=len(watcher.subscribers))
    try:
        await _take_commands(reader, watcher)
    except OSError:
        pass
    finally:
        watcher.unsubscribe(subscriber)
        writer.transport.abort()
        log.info("a worker's line ended", lines=len(watcher.subscribers))


async def _take_commands(reader: asyncio.StreamReader, watcher: TableWatcher) -> None:
    """The proxy's commands: b"R" asks for a refresh soon (a node refused a request)."""
    while command := await reader.read(64):
        if b"R" in command:
            watcher.refresh_soon()


def _first_frame(sock: socket.socket) -> bytes:
    data = b""
    while len(data) < _LENGTH.size or len(data) < _LENGTH.size + _LENGTH.unpack(data[:4])[0]:
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise EOFError("the proxy closed the table process's socket before its settings")
        data += chunk
    return data[_LENGTH.size :]


def main(argv: list[str]) -> int:
    fd, parent_pid = int(argv[0]), int(argv[1])
    listening_fd = int(argv[2]) if len(argv) > 2 else None  # the supervisor's (shared)
    # The proxy starts and stops this process: a SIGTERM or SIGINT sent to the whole process
    # group (a terminal's Ctrl-C, a service manager) is the proxy's to act on, and the proxy
    # would take this process's exit for a failure while it drains. Gone with the proxy
    # (SIGKILL, which cannot be ignored), or when its socket closes.
    for ignored in (signal.SIGTERM, signal.SIGINT):
        signal.signal(ignored, signal.SIG_IGN)
    if not die_with_parent(parent_pid, signal.SIGKILL):
        return 1
    sock = socket.socket(fileno=fd)
    config: TableConfig = loads(_first_frame(sock))
    configure_logging(config.log_level, component="proxy")
    structlog.contextvars.bind_contextvars(table_process=True)
    if config.cpus is not None:
        try:
            os.sched_setaffinity(0, config.cpus)
        except (OSError, ValueError, OverflowError) as exc:  # a CPU it may not use (a cpuset)
            log.error(
                "cannot run the table process on the CPUs asked for: running on the proxy's",
                cpus=sorted(config.cpus),
                error=str(exc),
            )
    sys.setswitchinterval(0.001)
    listening = None if listening_fd is None else socket.socket(fileno=listening_fd)
    return uvloop.run(serve(sock, config, listening))


if __name__ == "__main__":
    # Run as the module's importable self: the messages it pickles name their classes by
    # module, and `__main__` is not one the proxy can load them from.
    from proxy.table_process import main as table_main

    sys.exit(table_main(sys.argv[1:]))
