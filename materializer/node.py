"""A materializer node: the composition root that wires store, Spark, lag and HTTP together.

Start-up never crash-loops: the HTTP server answers at once (liveness yes, readiness no), the
broker is retried with a capped back-off until it answers, then Spark starts (seconds: the JVM)
and reads every hosted partition from the store's checkpoint. SIGTERM/SIGINT stop HTTP, then
the query, then close the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import time
from collections.abc import Coroutine, Iterator
from typing import Any

import redis.asyncio as aioredis
import structlog
import uvicorn
from aiokafka.client import AIOKafkaClient

from common.clock import SHARED, now_ms
from common.contract import Assignment, Hosting, Keys, NodeInfo, PartitionReport, Role, StoreInfo
from common.java import JavaRuntime
from materializer.cluster import ClusterMember, ClusterTiming
from materializer.forwarding import Forwarder, answer_limit
from materializer.hosting import HostedPartitions
from materializer.lag import LagTracker, PartitionLag
from materializer.pipeline import Pipeline, QueryPlan, Stall, create_spark_session, find_stalls
from materializer.server import NodeApp, NodeState
from materializer.settings import NodeSettings
from materializer.sink import BatchSink, IngestStats
from materializer.store import open_or_rebuild
from materializer.transform import RecordRules, load_transform
from partitioner import KeyPartitioner

log = structlog.get_logger("kroute.materializer.node")


def _drop_clock_ms() -> int:
    """The clock of the hosting's drop deadlines: monotonic, so a step of the shared clock
    cannot drop a given-up partition before its grace period is over."""
    return int(time.monotonic() * 1000)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # The node handles SIGINT/SIGTERM itself: after HTTP it must stop Spark and the store.
        yield


def bind_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(
            f"kroute materializer: cannot listen on {host}:{port}: {exc.strerror} "
            "(is the port taken? set KROUTE_PORT)"
        ) from exc
    sock.listen(1024)
    sock.setblocking(False)
    return sock


async def connect_to_broker(settings: NodeSettings) -> tuple[AIOKafkaClient, int]:
    """(client, partition count of the topic), retrying with a capped back-off."""
    delay = 0.5
    while True:
        client = AIOKafkaClient(
            bootstrap_servers=settings.bootstrap_servers, request_timeout_ms=5_000
        )
        try:
            await client.bootstrap()
            metadata = await client.fetch_all_metadata()
            partitions = metadata.partitions_for_topic(settings.topic)
            if partitions:
                return client, len(partitions)
            problem = f"topic {settings.topic!r} does not exist"
        except Exception as exc:  # noqa: BLE001 - any failure: say what, wait, try again
            problem = f"broker {settings.bootstrap_servers} not reachable: {exc}"
        await client.close()
        log.warning("waiting for Kafka", problem=problem, retry_in_s=delay)
        await asyncio.sleep(delay)
        delay = min(delay * 2, settings.start_retry_max_s)


class Node:
    def __init__(self, settings: NodeSettings, java: JavaRuntime) -> None:
        self.settings = settings
        self.java = java
        self.store = open_or_rebuild(settings.data_dir / "stores" / settings.store_name)
        self.stats = IngestStats()
        self.pipeline: Pipeline | None = None
        # Which partitions this node hosts: decided there, carried out here (store, timers).
        self.hosting = HostedPartitions(
            grace_ms=int(settings.grace_period_s * 1000), default_role=settings.role
        )
        self.partitioner: KeyPartitioner | None = None  # once the partition count is known
        self.forwarder: Forwarder | None = None  # in a cluster
        # What the HTTP app reads; only this node changes what is behind it.
        self.state = NodeState(
            node_id=settings.node_id,
            store_name=settings.store_name,
            topic=settings.topic,
            value_format=settings.value_format,
            store=self.store,
            lag=LagTracker(self.store, settings.topic, lambda: self.hosting.hosted),
            stats=self.stats,
            hosting=self.hosting,
            node=self,
            min_offset_wait_ms=settings.min_offset_wait_ms,
        )
        self.transform = load_transform(settings.transform, settings.merge)
        self.exit_code = 0
        self._stop = asyncio.Event()
        self._client: AIOKafkaClient | None = None
        self._lag_task: asyncio.Task[None] | None = None
        self._stall_task: asyncio.Task[None] | None = None
        self.advertised_url = settings.advertised_url or ""
        self.cluster: ClusterMember | None = None
        self._cluster_task: asyncio.Task[None] | None = None
        self._generation = 0
        self._drop_timer: asyncio.TimerHandle | None = None  # for hosting.next_drop_at()
        self._tasks: set[asyncio.Future[object]] = set()
        self._started_at_ms = now_ms()
        self._stalled: frozenset[int] = frozenset()  # as last logged

    def pipeline_status(self) -> dict[str, Any]:
        pipeline = self.pipeline
        if pipeline is None:
            return {"running": False, "state": "starting"}
        progress = pipeline.progress() or {}
        state = pipeline.state()
        return {
            "running": pipeline.running,
            "started_at_ms": state.started_at_ms,
            "last_batch_applied_at_ms": state.last_batch_at_ms,
            "restarts": state.restarts,
            "last_error": state.last_error,
            "last_error_at_ms": state.last_error_at_ms,
            "executors": state.executors,  # None in local mode; 0: waiting for Spark executors
            "last_batch": {k: progress.get(k) for k in ("batchId", "numInputRows", "durationMs")}
            if progress
            else None,
        }

    # -- is the pipeline keeping up? ------------------------------------------------------------

    def stalls(self) -> dict[int, Stall]:
        """Hosted partitions with unread records whose store has not moved for too long."""
        pipeline = self.pipeline
        state = pipeline.state() if pipeline is not None else None
        # Before the pipeline exists (Spark starting) the node's own start is the fresh start.
        floor = (state.started_at_ms if state else None) or self._started_at_ms
        checkpoints = self.store.checkpoints()
        progress = {}
        hosted = self.hosting.hosted
        for partition in hosted:
            checkpoint = checkpoints.get(partition)
            moved = checkpoint.updated_at_ms if checkpoint else 0
            latest = max(floor, moved, self.hosting.stall_clock_start(partition) or 0)
            # Stamped before the clock stepped back to Redis time, it reads too late and
            # would hide a stall for as long as the step: mapped the way reports are.
            progress[partition] = SHARED.conservative_ms(latest)
        snapshot = self.state.lag.snapshot
        return find_stalls(
            {p: snapshot[p] for p in hosted if p in snapshot},
            progress,
            now_ms=now_ms(),
            timeout_ms=self.settings.stall_timeout_ms,
            last_error=state.last_error if state else None,
            last_error_at_ms=state.last_error_at_ms if state else None,
        )

    async def _watch_stalls(self, interval_s: float) -> None:
        """Log when partitions stall and when they move again (readiness and reports ask
        `stalls` themselves, at the moment they answer)."""
        while True:
            try:
                self._log_stall_changes()
                await self._rebuild_outside_log()
            except Exception as exc:
                log.exception("watching the pipeline failed; trying again", error=str(exc))
            await asyncio.sleep(interval_s)

    def _log_stall_changes(self) -> None:
        stalls = self.stalls()
        stalled = frozenset(stalls)
        if stalled - self._stalled:
            log.warning(
                "pipeline stalled: not ready, partitions reported as not caught up",
                partitions=sorted(stalled),
                reasons={p: stall.reason for p, stall in sorted(stalls.items())},
            )
        if recovered := self._stalled - stalled:
            log.info("stalled partitions moving again", partitions=sorted(recovered))
        self._stalled = stalled

    async def _rebuild_outside_log(self) -> None:
        """Read again from the log's beginning every hosted partition whose store position is
        outside the log (see `OutsideLog`): what the store holds cannot be trusted, and
        reading on from its position would read nothing or skip records silently. Until the
        store catches up again the partition reports itself not caught up (lag from 0)."""
        snapshot = self.state.lag.snapshot
        seen = [p for p, lag in snapshot.items() if lag.outside_log]
        # A high watermark can dip for a moment after a leader change while the log still
        # holds the records: rebuild only what stays outside (reported unknown meanwhile).
        outside = self.hosting.outside_log(seen, now_ms())
        if not outside:
            return
        log.warning(
            "rebuilding partitions whose store is outside the log",
            partitions=outside,
            why={p: snapshot[p].outside_log for p in outside},
        )
        if self.pipeline is None:  # Spark is starting: nothing writes the store yet
            self._reset(outside)
            return
        reset = await asyncio.to_thread(self.pipeline.replan, lambda: self._reset(outside))
        if not reset:
            log.error("could not pause the pipeline to rebuild; trying again", partitions=outside)

    def _reset(self, partitions: list[int]) -> None:
        """Empty these partitions' stores (values and checkpoints): the next plan reads them
        from the log start. Runs while no batch can write the store."""
        for partition in self.hosting.reset(partitions, now_ms()):
            self.store.drop_partition(partition)
            self.store.add_partition(partition)

    def plan(self) -> QueryPlan:
        checkpoints = self.store.checkpoints()
        return QueryPlan(
            topic=self.settings.topic,
            starting_offsets={
                p: (cp.next_offset if (cp := checkpoints.get(p)) else 0)
                for p in self.hosting.hosted
            },
        )

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self._stop.set)
        sock = bind_socket(self.settings.host, self.settings.port)
        host, port = sock.getsockname()[:2]
        self.advertised_url = self.settings.advertised_url or f"http://{host}:{port}"
        server = _Server(
            uvicorn.Config(
                NodeApp(self.state),
                http="httptools",
                lifespan="off",
                access_log=False,
                log_config=None,
                # The node reads neither the client's address nor the scheme, so uvicorn's
                # x-forwarded-* middleware would only cost every lookup an extra layer.
                proxy_headers=False,
                timeout_graceful_shutdown=5,
            )
        )
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        log.info(
            "node listening",
            node=self.settings.node_id,
            url=f"http://{host}:{port}",
            store=self.settings.store_name,
            topic=self.settings.topic,
        )
        self.state.lag.refresh_offsets_only()
        starting = asyncio.create_task(self._start_materializing())
        starting.add_done_callback(self._materializing_started)
        try:
            await self._stop.wait()
        finally:
            log.info("node stopping")
            server.should_exit = True
            background = [
                task
                for task in (starting, self._lag_task, self._stall_task, self._cluster_task)
                if task is not None
            ]
            for task in background:
                task.cancel()
            await asyncio.gather(serving, *background, return_exceptions=True)
            if self.pipeline is not None:
                await asyncio.to_thread(self.pipeline.stop)
            if self._client is not None:
                await self._client.close()
            await self._leave_cluster()
            self.store.close()
            log.info("node stopped")

    def _materializing_started(self, task: asyncio.Task[None]) -> None:
        """A start that failed (Spark refusing its settings, say) stops the node with the
        reason, instead of leaving it live, never ready and "starting" forever."""
        if task.cancelled() or task.exception() is None:
            return
        error = task.exception()
        log.error("could not start materializing", error=f"{type(error).__name__}: {error}")
        self.exit_code = 1
        self._stop.set()

    async def _start_materializing(self) -> None:
        self._client, num_partitions = await connect_to_broker(self.settings)
        self.partitioner = KeyPartitioner(
            self.settings.key_format, self.settings.partitioner, num_partitions
        )
        if self.settings.redis_url is None:
            try:
                hosted = self.settings.hosted_partitions(num_partitions)
            except ValueError as exc:
                log.error("bad configuration", error=str(exc))
                self.exit_code = 2
                self._stop.set()
                return
            self._host({p: self.settings.role for p in hosted})
        else:
            hosted = ()
            self._join_cluster(num_partitions)
            await self._sync_clock()

        self._lag_task = asyncio.create_task(
            self.state.lag.run(self._client, self.settings.lag_interval_ms / 1000)
        )
        self._stall_task = asyncio.create_task(
            self._watch_stalls(self.settings.lag_interval_ms / 1000)
        )
        log.info(
            "starting Spark",
            master=self.settings.spark_master,
            java=str(self.java.java),
            partitions=list(hosted),
        )
        spark = await asyncio.to_thread(create_spark_session, self.settings, self.java.java_home)
        rules = RecordRules(
            value_format=self.settings.value_format,
            key_format=self.settings.key_format,
            max_value_bytes=self.settings.max_value_bytes,
        )
        sink = BatchSink(self.store, self.transform, rules, self.stats)
        self.pipeline = Pipeline(spark, self.settings, sink, self.plan)
        self.pipeline.start()

    # -- hosting and the cluster ---------------------------------------------------------------

    def _host(self, roles: dict[int, Role]) -> bool:
        """Serve and read exactly these partitions; True when the set changed."""
        changes = self.hosting.assign(roles, now_ms(), drop_clock_ms=_drop_clock_ms())
        for partition in changes.hosted:
            self.store.add_partition(partition)
        # A partition given up is kept on disk for the grace period, in case it comes back;
        # assigned back within it (changes.drops_cancelled), there is nothing to restore.
        self._arm_drop_timer()
        return changes.changed

    def _arm_drop_timer(self) -> None:
        """One timer, for the earliest partition waiting to be dropped. A drop the hosting
        cancelled needs no timer cancelled (the check finds nothing due). The deadlines are on
        the monotonic drop clock (not the shared clock, which steps when it syncs)."""
        if self._drop_timer is not None:
            self._drop_timer.cancel()
            self._drop_timer = None
        deadline = self.hosting.next_drop_at()
        if deadline is not None:
            delay_s = max(deadline - _drop_clock_ms(), 0) / 1000
            self._drop_timer = asyncio.get_running_loop().call_later(delay_s, self._drop_due)

    def _drop_due(self) -> None:
        self._drop_timer = None
        for partition in self.hosting.due_drops(_drop_clock_ms()):
            log.info("dropping a partition no longer hosted", partition=partition)
            self.store.drop_partition(partition)
        self._arm_drop_timer()

    def _apply_assignment(self, assignment: Assignment) -> None:
        mine = assignment.for_node(self.settings.node_id).get(self.settings.store_name, {})
        roles: dict[int, Role] = {p: "active" for p in mine.get("active", [])}
        roles.update({p: "standby" for p in mine.get("standby", [])})
        self._generation = assignment.generation
        if self._host(roles):
            log.info(
                "assignment applied",
                generation=assignment.generation,
                active=mine.get("active", []),
                standby=mine.get("standby", []),
            )
            if self.pipeline is not None:
                self._background(asyncio.to_thread(self.pipeline.replan))

    def _background(self, work: Coroutine[Any, Any, object]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _sync_clock(self) -> None:
        """Take Redis time before the first lag stamps, so they are on the cluster's clock
        (reports would correct them anyway, by making them look older)."""
        assert self.cluster is not None
        try:
            await self.cluster.sync_clock()
        except (aioredis.RedisError, OSError) as exc:
            log.warning("cannot read Redis time yet; the heartbeat will sync", error=str(exc))

    def _join_cluster(self, num_partitions: int) -> None:
        settings = self.settings
        assert settings.redis_url is not None
        redis = aioredis.from_url(
            settings.redis_url.get_secret_value(),
            socket_timeout=1.0,
            socket_connect_timeout=1.0,
            health_check_interval=5,
        )
        self.forwarder = Forwarder(
            settings.node_id, max_body_bytes=answer_limit(settings.max_value_bytes)
        )
        self.cluster = ClusterMember(
            redis=redis,
            keys=Keys(settings.cluster),
            node=NodeInfo(settings.node_id, self.advertised_url, now_ms()),
            store=StoreInfo(
                settings.store_name,
                settings.topic,
                num_partitions,
                settings.key_format,
                settings.partitioner,
                settings.value_format,
            ),
            timing=ClusterTiming(
                heartbeat_ms=settings.heartbeat_ms,
                alive_ttl_ms=settings.alive_ttl_ms,
                leader_lease_ms=max(settings.alive_ttl_ms, 1000),
                report_interval_ms=settings.lag_interval_ms,
                grace_ms=int(settings.grace_period_s * 1000),
                standbys=settings.standbys,
                acceptable_recovery_lag=settings.acceptable_recovery_lag,
            ),
            hosting=self._hosting,
            reports=self._reports,
            on_assignment=self._apply_assignment,
        )
        self._cluster_task = asyncio.create_task(self.cluster.run())
        log.info("joining the cluster", cluster=settings.cluster, url=self.advertised_url)

    async def _leave_cluster(self) -> None:
        cluster = self.cluster
        if cluster is None:
            return
        with contextlib.suppress(aioredis.RedisError, OSError):
            # Stopping on purpose: say so at once instead of letting the heartbeat expire.
            await cluster.redis.delete(cluster.keys.alive(self.settings.node_id))
        await cluster.redis.aclose()
        if self.forwarder is not None:
            await self.forwarder.close()

    def owner_of(self, partition: int) -> str | None:
        """The URL of the live node that is active for a partition (else a live standby)."""
        cluster = self.cluster
        assignment = cluster.assignment if cluster else None
        if cluster is None or assignment is None:
            return None
        placed = assignment.stores.get(self.settings.store_name, {}).get(partition)
        if placed is None:
            return None
        for node_id in placed.replicas():
            if node_id != self.settings.node_id and node_id in cluster.alive_nodes:
                return cluster.node_urls.get(node_id)
        return None

    def _hosting(self) -> Hosting:
        return self.hosting.as_contract(
            self.settings.node_id, self.settings.store_name, self._generation, now_ms()
        )

    def _reports(self) -> dict[int, PartitionReport]:
        """Each hosted partition's offsets. A stalled partition is reported as not known to be
        caught up (no `caught_up_at_ms`): with lag > 0 that makes it "not in sync" to proxies,
        which then prefer any in-sync replica even for reads without a budget, and refuse it
        for a time budget (unknown time lag). Its offsets stay true."""
        at = now_ms()
        stalled = self.stalls()
        return {
            partition: _report_of(lag, at, stalled=partition in stalled)
            for partition, lag in self.state.lag.snapshot.items()
        }


def _read_stamp(read_at_ms: int, at_ms: int) -> int:
    """The stamp of a report made at `at_ms` from an end-offset read at `read_at_ms`: that
    read's time, unless the shared clock stepped back since (`SharedClock.conservative_ms`
    moves it). A read from before the step reads too late, and the clock cannot tell it from
    one after: mapped, every such stamp would read older by the whole step until the clock
    passes the old time, so a step of a few seconds would make every report look too old
    to proxies (3 s by default) for as long, a read outage. The report's own time is true
    instead, as it was before reports were stamped as of their reads; its caught-up age
    (mapped, older) is then above 0, and the body changes, only in that window."""
    return read_at_ms if SHARED.conservative_ms(read_at_ms) == read_at_ms else at_ms


def _report_of(lag: PartitionLag, at_ms: int, *, stalled: bool) -> PartitionReport:
    """One partition's report at `at_ms`, stamped as of the end offset read its lag is
    measured against (the report's own time when no end is known): that is when its figures
    were true, never later than now, so it can only read older than it is. One read stamps
    every partition alike, and a caught-up partition's `caught_up_at_ms` is that same read's
    time: on an idle node every age in `report:<id>` stays the same from one report to the
    next, and so does the body (docs/redis-contract.md, "The compact report")."""
    end = lag.known_end(at_ms)  # unknown once the broker is not being read
    read_at = lag.end_offset_at_ms
    as_of = at_ms if end is None or read_at is None else _read_stamp(read_at, at_ms)
    return PartitionReport(
        current_offset=lag.current_offset,
        end_offset=end,
        newest_record_ms=lag.newest_record_ms,
        caught_up_at_ms=None if stalled or lag.outside_log else lag.caught_up_at_ms,
        updated_at_ms=as_of,
    )
