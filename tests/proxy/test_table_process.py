"""A real proxy whose table a process of its own builds (KROUTE_TABLE_PROCESS=true), before
stand-in nodes published in real Redis: it routes by what Redis says, follows changes, keeps
serving its last table while that process is gone and starts another, and never outlives the
proxy (stopped, or killed)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from common.contract import Keys, PartitionAssignment
from kroute.embedded import EmbeddedServices
from partitioner import partition, serialize_key
from proxy import table_process
from proxy.choice import Replica
from proxy.routing import RoutingSnapshot
from proxy.table_feed import ClockMessage, FeedMirror, SnapshotMessage, loads
from proxy.table_process import SILENT_S, Feed, FeedingWatcher, Subscriber
from proxy.watcher import redis_client
from tests.proxy.conftest import (
    PARTITIONS,
    PROXY_SETTINGS,
    StandIns,
    running_stand_ins,
    table_processes,
    wait_for,
)
from tests.proxy.echo_backend import EchoBackend

pytestmark = pytest.mark.integration

SETTINGS = PROXY_SETTINGS | {"table_process": "true", "refresh_interval_ms": "60000"}


@pytest.fixture
def stand_ins(embedded: EmbeddedServices) -> Iterator[StandIns]:
    backends = {f"n{i}": EchoBackend(f"n{i}").start() for i in range(3)}
    with running_stand_ins(embedded, embedded.start_redis(), backends, **SETTINGS) as running:
        yield running


def owner(stand_ins: StandIns, key: str) -> str:
    chosen = partition(serialize_key(key, "string"), PARTITIONS)
    return stand_ins.cluster.placements["customers"][chosen].active


def read(stand_ins: StandIns, key: str) -> str:
    """The node that answered a keyed read, after checking the answer is this request's."""
    request_id = uuid.uuid4().hex
    answer = stand_ins.proxy.get(f"/stores/customers/keys/{key}?id={request_id}")
    assert answer.status_code == 200, answer.text
    echoed = json.loads(answer.text)
    assert echoed["target"] == f"/stores/customers/keys/{key}?id={request_id}"
    assert answer.headers["x-kroute-node"] == echoed["node"]
    return str(echoed["node"])


def move_active(stand_ins: StandIns, key: str) -> str:
    """Give the key's partition another active (in Redis, announced); the new active."""
    chosen = partition(serialize_key(key, "string"), PARTITIONS)
    placed = stand_ins.cluster.placements["customers"][chosen]
    moved_to = next(n for n in sorted(stand_ins.backends) if n not in placed.replicas())
    stand_ins.cluster.placements["customers"][chosen] = PartitionAssignment(
        moved_to, (placed.active,)
    )
    stand_ins.cluster.generation += 1
    stand_ins.publish()
    return moved_to


def test_keyed_reads_go_where_redis_places_them(stand_ins):
    assert table_processes(stand_ins.proxy.process.pid), "the table is built in a child"
    for index in range(60):
        key = f"customer-{index}"
        assert read(stand_ins, key) == owner(stand_ins, key)


def test_a_new_assignment_reaches_the_request_path(stand_ins):
    key = "customer-7"
    moved_to = move_active(stand_ins, key)
    wait_for(lambda: read(stand_ins, key) == moved_to, "the proxy routes by the new active")


def test_a_killed_table_process_is_replaced_and_the_last_table_serves_meanwhile(stand_ins):
    proxy_pid = stand_ins.proxy.process.pid
    (first,) = table_processes(proxy_pid)
    os.kill(first, signal.SIGKILL)
    # Served from the last table while no process builds one.
    for index in range(20):
        key = f"customer-{index}"
        assert read(stand_ins, key) == owner(stand_ins, key)
    (second,) = wait_for(
        lambda: [p for p in table_processes(proxy_pid) if p != first], "another table process"
    )
    assert second != first
    log = stand_ins.proxy.process.log_path.read_text()
    assert "table process ended: routing on the last table" in log
    # The new one reads Redis and its changes reach the request path.
    key = "customer-11"
    moved_to = move_active(stand_ins, key)
    wait_for(lambda: read(stand_ins, key) == moved_to, "the new table process's table")
    status = stand_ins.proxy.status()
    assert status["proxy"]["table_loaded"] is True
    wait_for(lambda: stand_ins.proxy.status()["proxy"]["degraded"] is False, "degraded cleared")


def test_a_silent_table_process_is_replaced(stand_ins):
    proxy_pid = stand_ins.proxy.process.pid
    (first,) = table_processes(proxy_pid)
    os.kill(first, signal.SIGSTOP)
    try:
        wait_for(
            lambda: [p for p in table_processes(proxy_pid) if p != first],
            "a replacement for the stopped process",
            limit_s=SILENT_S + 10,
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(first, signal.SIGCONT)
    assert "table process silent: replacing it" in stand_ins.proxy.process.log_path.read_text()
    key = "customer-5"
    moved_to = move_active(stand_ins, key)
    wait_for(lambda: read(stand_ins, key) == moved_to, "the replacement's table")


def test_the_table_process_stops_with_the_proxy(stand_ins):
    proxy = stand_ins.proxy.process
    children = table_processes(proxy.pid)
    assert children
    proxy.stop()
    wait_for(lambda: not any(_alive(p) for p in children), "the table process gone")


def test_the_table_process_dies_with_a_killed_proxy(stand_ins):
    proxy = stand_ins.proxy.process
    children = table_processes(proxy.pid)
    assert children
    os.kill(proxy.pid, signal.SIGKILL)
    wait_for(lambda: not any(_alive(p) for p in children), "the orphaned table process gone")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_stopped_table_process_is_replaced(stand_ins):
    """A child that says nothing (SIGSTOP: alive, its socket open) is killed and replaced,
    and the proxy says it is degraded meanwhile."""
    proxy_pid = stand_ins.proxy.process.pid
    (first,) = table_processes(proxy_pid)
    os.kill(first, signal.SIGSTOP)
    try:
        wait_for(
            lambda: stand_ins.proxy.status()["proxy"]["degraded"] is True,
            "degraded while no table process answers",
            limit_s=20,
        )
        wait_for(
            lambda: [p for p in table_processes(proxy_pid) if p != first],
            "another table process",
            limit_s=10,
        )
        wait_for(lambda: not _alive(first), "the stopped one killed")
        key = "customer-3"
        assert read(stand_ins, key) == owner(stand_ins, key)
    finally:
        if _alive(first):
            os.kill(first, signal.SIGKILL)


def test_answers_are_never_fresher_than_the_truth_with_a_clock_behind_redis(embedded):
    """The proxy's clock observes the table process's Redis TIME samples before it swaps in
    the rows they judge: on a host 5 s behind Redis, the time lag answers carry (the C path
    included) is the reports' real age, not 5 s less."""
    backends = {f"n{i}": EchoBackend(f"n{i}").start() for i in range(3)}
    settings = SETTINGS | {"clock_skew_ms": "-5000"}
    with running_stand_ins(embedded, embedded.start_redis(), backends, **settings) as running:
        for _ in range(4):
            answer = running.proxy.get("/stores/customers/keys/customer-1")
            age_ms = int(time.time() * 1000) - running.published_at_ms
            assert answer.status_code == 200, answer.text
            lag_ms = int(answer.headers["x-kroute-time-lag-ms"])
            assert lag_ms >= age_ms - 1_000, f"answered {lag_ms} ms behind, truly {age_ms}"
            time.sleep(0.7)


def test_a_table_process_replaced_while_redis_is_down_keeps_the_table_served(stand_ins):
    """Redis goes away, then the table process: the proxy keeps serving its last table, stays
    ready and loaded (a new table process that cannot read Redis has not unloaded it), says
    it is degraded, and its counters do not go back."""
    proxy_pid = stand_ins.proxy.process.pid
    (first,) = table_processes(proxy_pid)
    stand_ins.redis_server.process.stop()
    wait_for(lambda: stand_ins.proxy.status()["proxy"]["degraded"] is True, "degraded")
    failures_before = _metric(stand_ins, "kroute_proxy_table_refresh_failures_total")
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: [p for p in table_processes(proxy_pid) if p != first], "another table process")
    time.sleep(3)  # the new one has tried Redis and failed
    assert stand_ins.proxy.is_ready()
    proxy_status = stand_ins.proxy.status()["proxy"]
    assert proxy_status["table_loaded"] is True
    assert proxy_status["degraded"] is True
    assert _metric(stand_ins, "kroute_proxy_table_refresh_failures_total") >= failures_before
    for index in range(10):
        key = f"customer-{index}"
        assert read(stand_ins, key) == owner(stand_ins, key)


def _metric(stand_ins: StandIns, name: str) -> float:
    for line in stand_ins.proxy.admin("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


def test_a_new_table_process_holds_a_smaller_table_back_as_the_proxy_would(stand_ins):
    """Redis restarted empty (flushed), then a new table process: it reads less than the
    proxy serves, and holds that back (for 10 s) as a watcher that had
    served the table itself would; reads go on from the table served."""
    proxy_pid = stand_ins.proxy.process.pid
    (first,) = table_processes(proxy_pid)
    stand_ins.redis.flushall()
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: [p for p in table_processes(proxy_pid) if p != first], "another table process")
    log_path = stand_ins.proxy.process.log_path
    wait_for(
        lambda: "redis describes less than the last table" in log_path.read_text(),
        "the new table process holding the smaller table back",
    )
    for index in range(10):
        key = f"customer-{index}"
        assert read(stand_ins, key) == owner(stand_ins, key)
    assert stand_ins.proxy.status()["proxy"]["degraded"] is True


def _frames_of_a_first_read(redis_url: str, keys: Keys) -> list[Feed]:
    """What a table process sends during its first full read (`FeedingWatcher.start`)."""
    frames: list[bytes] = []

    async def first_read() -> None:
        redis = redis_client(redis_url, 1_000, None)
        watcher = FeedingWatcher(
            redis, keys, refresh_interval_ms=60_000, networks=None, send=frames.append
        )
        try:
            await watcher.start()
        finally:
            await redis.aclose()

    asyncio.run(first_read())
    return [loads(frame[4:]) for frame in frames]


def test_a_table_process_says_nothing_of_itself_before_its_first_table(stand_ins):
    """The proxy starts serving once it has heard a status: the first one comes with the
    first table, not from a yield in the middle of the first read (the proxy would serve an
    empty table meanwhile)."""
    feeds = _frames_of_a_first_read(stand_ins.redis_server.url, stand_ins.cluster.keys)
    first = next(feed for feed in feeds if feed.status is not None)
    assert first.status is not None
    assert first.status.loaded
    assert isinstance(first.change, SnapshotMessage)


def test_a_failed_read_reaches_the_proxy_at_once():
    """A read that fails changes the flags after its step raised: the status goes at once,
    not with the next status due a second later."""
    frames: list[bytes] = []
    redis = redis_client("redis://127.0.0.1:1", 100, None)
    watcher = FeedingWatcher(
        redis, Keys("t"), refresh_interval_ms=60_000, networks=None, send=frames.append
    )
    watcher.send(status=True)  # the first status (serve's, after the first read)

    async def failing() -> None:
        raise aioredis.ConnectionError("gone")

    asyncio.run(watcher._guarded(failing))
    last: Feed = loads(frames[-1][4:])
    assert len(frames) == 2
    assert last.status is not None
    assert last.status.degraded
    assert last.status.last_error == "gone"


def _feeds(frames: list[bytes]) -> list[Feed]:
    return [loads(frame[4:]) for frame in frames]


def _mirrored(feeds: list[Feed]) -> RoutingSnapshot:
    """What a proxy applying these messages serves."""
    mirror, snapshot = FeedMirror(), None
    for feed in feeds:
        if isinstance(feed.change, SnapshotMessage):
            snapshot = mirror.apply(feed.change)
        elif isinstance(feed.change, ClockMessage):
            mirror.move_clocks(feed.change.clocks)
    assert snapshot is not None, "no table"
    return snapshot


def _replicas(snapshot: RoutingSnapshot) -> dict[str, tuple[tuple[Replica, ...], ...]]:
    return {name: route.replicas for name, route in snapshot.stores.items()}


def test_a_line_opened_later_gets_the_whole_table_at_once_and_the_statuses_line_only_statuses(
    stand_ins,
):
    """With one table process for every worker, a worker connects (or reconnects) at any
    time: it gets the table as the first line has it, with a status and the last clock
    sample, and every change after that; the supervisor's line gets the statuses only."""
    first: list[bytes] = []
    later: list[bytes] = []
    statuses: list[bytes] = []

    async def lines() -> None:
        redis = redis_client(stand_ins.redis_server.url, 1_000, None)
        watcher = FeedingWatcher(
            redis, stand_ins.cluster.keys, refresh_interval_ms=60_000, networks=None
        )
        watcher.subscribe(Subscriber(first.append))
        watcher.subscribe(Subscriber(statuses.append, encoder=None))
        try:
            await watcher.start()
            watcher.send(status=True)
            watcher.subscribe(Subscriber(later.append))
            move_active(stand_ins, "customer-3")
            await watcher.refresh()
        finally:
            await redis.aclose()

    asyncio.run(lines())
    joined = _feeds(later)
    assert isinstance(joined[0].change, SnapshotMessage), "the whole table at once"
    assert joined[0].status is not None
    assert joined[0].status.loaded
    assert joined[0].clock_samples, "with the last clock sample"
    assert _replicas(_mirrored(joined)) == _replicas(_mirrored(_feeds(first)))
    chosen = partition(serialize_key("customer-3", "string"), PARTITIONS)
    moved_to = stand_ins.cluster.placements["customers"][chosen].active
    assert _mirrored(joined).stores["customers"].replicas[chosen][0].node_id == moved_to
    assert all(feed.change is None and feed.status is not None for feed in _feeds(statuses))
    assert len(statuses) >= 2


def test_a_line_that_stops_reading_is_dropped_not_buffered_without_end(monkeypatch):
    """A worker that reads nothing (stopped) would make the table process buffer every
    change for it: past MAX_BACKLOG_BYTES its line is cut (it reconnects for a new table)."""
    monkeypatch.setattr(table_process, "MAX_BACKLOG_BYTES", 64 * 1024)

    async def stalled() -> tuple[int, bool]:
        ours, theirs = socket.socketpair()
        try:
            _, writer = await asyncio.open_connection(sock=ours)
            redis = redis_client("redis://127.0.0.1:1", 100, None)
            watcher = FeedingWatcher(redis, Keys("t"), refresh_interval_ms=60_000, networks=None)
            watcher.subscribe(Subscriber(writer.write, writer=writer))
            watcher.send(status=True)
            sent = 0
            while watcher.subscribers and sent < 10_000:
                watcher.send(status=True)  # nobody reads `theirs`
                sent += 1
                await asyncio.sleep(0)
            await asyncio.sleep(0.05)
            return sent, writer.transport.is_closing()
        finally:
            theirs.close()

    sent, closed = asyncio.run(stalled())
    assert sent < 10_000, "never dropped"
    assert closed
