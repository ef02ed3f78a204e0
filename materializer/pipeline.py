"""The node's Spark Structured Streaming query: Kafka partitions -> transform -> store.

Spark's own checkpoint is not the source of truth: every (re)start of the query begins from the
store's checkpoints, passed to the source as starting offsets, and uses a fresh Spark checkpoint
directory. A query that fails (broker gone, a bad batch) is restarted by the supervisor thread
after a capped exponential back-off, again from the store's checkpoints, so nothing is applied
twice and no crash loop hammers the broker.

Re-plans (the hosted partitions changed) are counted in a generation. Each run of the query
records the generation it was planned at, and only batches of a run on the newest generation
reach the store; a run that turns out outdated once it has started is stopped by whoever sees
it first (the re-plan, or the supervisor right after `start()` returns). So a re-plan asked at
any moment, even while a query is still starting, leads to a query on the newest plan.

Whether the pipeline keeps up is judged with `find_stalls`: a partition with unread records
whose store has not moved for longer than `KROUTE_STALL_TIMEOUT_MS` is stalled, and the node
stops calling itself ready (see server.py and node.py).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import sys
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming.query import StreamingQuery

from common.clock import now_ms
from materializer.errors import first_line
from materializer.kafka_source import SOURCE_NAME, KafkaDataSource, SourceOptions
from materializer.lag import PartitionLag
from materializer.settings import NodeSettings
from materializer.sink import BatchSink

log = structlog.get_logger("kroute.materializer.pipeline")

# Spark's default checkpoint manager renames through Hadoop's FileContext, which on a local disk
# without Hadoop's native library runs `readlink` and `chmod` as child processes of the JVM: ~4
# spawns per micro-batch, measured with strace. The FileSystem-based manager writes and renames
# the same way with only the `chmod`s (~1.5 per batch). Its rename is atomic on a local disk, and
# Spark's checkpoint is not the source of truth here anyway (see the module's docstring).
_CHECKPOINT_FILE_MANAGER = (
    "org.apache.spark.sql.execution.streaming.checkpointing.FileSystemBasedCheckpointFileManager"
)

KAFKA_COLUMNS = ("key", "value", "topic", "partition", "offset", "timestamp", "headers")


def create_spark_session(settings: NodeSettings, java_home: Path) -> SparkSession:
    """Start (or join) the Spark driver for this node. Takes seconds: the JVM starts here."""
    # Spark starts its Python workers and the streaming-source runner with PYSPARK_PYTHON, and
    # they must import pyarrow and this package, so they must run this virtualenv's python.
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ["JAVA_HOME"] = str(java_home)
    builder = (
        SparkSession.builder.master(settings.spark_master)
        .appName(f"kroute-materializer-{settings.node_id}")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.streaming.checkpointFileManagerClass", _CHECKPOINT_FILE_MANAGER)
        .config("spark.driver.extraJavaOptions", settings.spark_java_options)
    )
    if settings.spark_packages:
        builder = builder.config("spark.jars.packages", settings.spark_packages)
    for key, value in settings.spark_conf.items():
        builder = builder.config(key, value)
    if on_this_machine_only(settings.spark_master):
        # In local mode, or with a master on loopback, nothing outside this machine talks to
        # the driver: loopback only (executors on a loopback cluster reach it there).
        os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
        builder = builder.config("spark.driver.bindAddress", "127.0.0.1").config(
            "spark.driver.host", "127.0.0.1"
        )
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    spark.dataSource.register(KafkaDataSource)
    return spark


def on_this_machine_only(master: str) -> bool:
    """local[...], or a standalone master on a loopback address (spark://127.0.0.1:7077)."""
    if master.startswith("local"):
        return True
    host = urllib.parse.urlsplit(master).hostname or ""
    return host == "localhost" or host.startswith("127.") or host == "::1"


@dataclass(frozen=True)
class QueryPlan:
    """What one run of the query reads: a topic's partitions from the given offsets."""

    topic: str
    starting_offsets: dict[int, int]
    # Most records per partition in one micro-batch; None: the node's setting. The pipeline
    # lowers it when batches are too big for the driver (see Pipeline._shrink_batches).
    max_records_per_partition: int | None = None


def read_kafka(spark: SparkSession, settings: NodeSettings, plan: QueryPlan) -> DataFrame:
    records_cap = plan.max_records_per_partition or settings.max_records_per_partition
    if settings.source == "spark-kafka":
        # Spark's own source (spark-sql-kafka-0-10 must be on the classpath); same columns.
        partitions = sorted(plan.starting_offsets)
        return (
            spark.readStream.format("kafka")
            .option("kafka.bootstrap.servers", settings.bootstrap_servers)
            .option("assign", json.dumps({plan.topic: partitions}))
            .option(
                "startingOffsets",
                # -2 is "earliest" to Spark: an empty store starts where the log begins (0
                # would count offsets deleted by retention as data lost).
                json.dumps(
                    {plan.topic: {str(p): o or -2 for p, o in plan.starting_offsets.items()}}
                ),
            )
            .option("maxOffsetsPerTrigger", str(records_cap * len(partitions)))
            .option("includeHeaders", "true")
            # Lost offsets fail the query rather than be skipped silently; the node then sees
            # its position below the log start and rebuilds the partition.
            .option("failOnDataLoss", "true")
            .load()
            .select(*KAFKA_COLUMNS)
        )
    options = SourceOptions(
        bootstrap_servers=settings.bootstrap_servers,
        topic=plan.topic,
        partitions=tuple(sorted(plan.starting_offsets)),
        starting_offsets=plan.starting_offsets,
        max_records_per_partition=records_cap,
        fetch_max_wait_ms=settings.fetch_max_wait_ms,
        read_timeout_s=30.0,
        tasks_per_batch=settings.tasks_per_batch,
    )
    return spark.readStream.format(SOURCE_NAME).options(**options.as_spark_options()).load()


@dataclass(frozen=True)
class _Run:
    """One run of the query: the re-plan generation it was planned at, and its checkpoint."""

    generation: int
    topic: str
    checkpoint_dir: Path


@dataclass(frozen=True)
class PipelineProgress:
    """What the supervisor knows about progress; times are `now_ms()` readings."""

    started_at_ms: int | None  # when the supervisor started (None: not started)
    last_batch_at_ms: int | None  # when the last batch reached the store
    last_error: str | None
    last_error_at_ms: int | None
    restarts: int
    # Spark executors the application has (None: local mode, where the driver runs tasks, or
    # not known yet); 0 on a cluster means micro-batches wait for one (see ExecutorWatch).
    executors: int | None = None


class Pipeline:
    """Runs and supervises the query; `plan_source` says where each (re)start begins."""

    def __init__(
        self,
        spark: SparkSession,
        settings: NodeSettings,
        sink: BatchSink,
        plan_source: Callable[[], QueryPlan],
    ) -> None:
        self._spark = spark
        self._settings = settings
        self._sink = sink
        self._plan_source = plan_source
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # _generation and _query change together under it
        self._generation = 0  # bumped by every re-plan: runs planned before it are outdated
        self._replanned = threading.Event()  # wakes a supervisor that waits for partitions
        self._batch_lock = threading.Lock()  # held while a batch is applied to the store
        self._query: StreamingQuery | None = None
        self._checkpoint_dir: Path | None = None
        self._thread = threading.Thread(target=self._supervise, name="kroute-pipeline", daemon=True)
        self.restarts = 0
        self.last_error: str | None = None
        self._last_error_at_ms: int | None = None
        self._started_at_ms: int | None = None
        self._last_batch_at_ms: int | None = None
        self._records_cap = settings.max_records_per_partition  # lowered by _shrink_batches
        self._executors = ExecutorWatch(spark, settings.spark_master, self._note_error)

    @property
    def running(self) -> bool:
        query = self._query
        return query is not None and query.isActive

    def start(self) -> None:
        self._started_at_ms = now_ms()
        self._thread.start()
        self._executors.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stopping.set()
        self._executors.stop()
        self._replanned.set()
        self._await_batch_end(timeout_s)
        with self._lock:
            query = self._query
        if query is not None:
            try:
                query.stop()
            except Exception as exc:  # noqa: BLE001 - stopping must not raise during shutdown
                log.warning("stopping the query failed", error=str(exc))
        self._thread.join(timeout_s)
        self._remove_checkpoint_dir()

    def replan(self, between_batches: Callable[[], None] | None = None) -> bool:
        """Restart the query on the current plan (the hosted partitions changed).

        `between_batches` runs while no batch can reach the store, and every batch of the
        current query is outdated from then on: the moment to reset a partition's store.
        False when it could not run (a batch held the store for 30 s); nothing changed then."""
        if between_batches is None:
            generation, query = self._next_generation()
            self._await_batch_end(30.0)
        else:
            if not self._batch_lock.acquire(timeout=30.0):
                return False
            try:
                between_batches()
                # Bumped before the lock is released: a batch waiting for it is skipped, and
                # a plan read after the bump sees the reset store.
                generation, query = self._next_generation()
            finally:
                self._batch_lock.release()
        self._replanned.set()
        log.info("re-plan asked for", generation=generation)
        # A query that is still starting is not `self._query` yet: the supervisor stops it as
        # soon as start() returns, since it was planned at an older generation.
        if query is not None and query.isActive:
            query.stop()  # awaitTermination returns; the supervisor starts the new plan at once
        return True

    def _shrink_batches(self) -> bool:
        """Plan smaller micro-batches (an eighth) after one was too big to bring to the
        driver; False when they are one record per partition already."""
        if self._records_cap <= 1:
            return False
        self._records_cap = max(1, self._records_cap // 8)
        log.warning(
            "a micro-batch was too big for the Spark driver (spark.driver.maxResultSize); "
            "reading fewer records per batch",
            max_records_per_partition=self._records_cap,
        )
        return True

    def _next_generation(self) -> tuple[int, StreamingQuery | None]:
        with self._lock:
            self._generation += 1
            return self._generation, self._query

    def _await_batch_end(self, timeout_s: float) -> None:
        """Let the batch being applied finish before the query is stopped.

        Stopping interrupts the query thread; interrupted inside foreachBatch, Spark matches a
        regex over the whole Python traceback (SPARK-39218) and can die of a StackOverflowError
        in it before restarting. Once a stop or re-plan is asked for, later batches of the
        outdated run are no-ops (`_apply`), so after this wait the interrupt lands between
        batches.
        """
        if self._batch_lock.acquire(timeout=timeout_s):
            self._batch_lock.release()

    def _outdated(self, run: _Run) -> bool:
        return run.generation != self._generation or self._stopping.is_set()

    def _apply(self, run: _Run, batch: DataFrame, batch_id: int) -> None:
        with self._batch_lock:
            if self._outdated(run):
                # The store did not move, and the next query starts from the store's offsets.
                log.info(
                    "batch skipped: its query is outdated or stopping",
                    batch_id=batch_id,
                    run_generation=run.generation,
                    generation=self._generation,
                )
                return
            ends = batch_end_offsets(run.checkpoint_dir, batch_id, run.topic)
            self._sink(batch, batch_id, ends)
            self._last_batch_at_ms = now_ms()

    def progress(self) -> dict[str, Any] | None:
        query = self._query
        return None if query is None else query.lastProgress

    def state(self) -> PipelineProgress:
        return PipelineProgress(
            started_at_ms=self._started_at_ms,
            last_batch_at_ms=self._last_batch_at_ms,
            last_error=self.last_error,
            last_error_at_ms=self._last_error_at_ms,
            restarts=self.restarts,
            executors=self._executors.count,
        )

    def _note_error(self, error: str) -> None:
        self.last_error = error
        self._last_error_at_ms = now_ms()

    def _supervise(self) -> None:
        delay = 1.0
        while not self._stopping.is_set():
            started = time.monotonic()
            try:
                self._run_once()
            except Exception as exc:  # noqa: BLE001 - any failure: log, back off, restart
                if self._stopping.is_set():
                    return
                self.last_error = first_line(exc)
                self._last_error_at_ms = now_ms()
                self.restarts += 1
                if time.monotonic() - started > 60:
                    delay = 1.0  # it ran for a while: this is a new failure, not a crash loop
                if too_big_for_the_driver(exc) and self._shrink_batches():
                    delay = 1.0  # the cause is dealt with: the next query is not a retry
                log.error(
                    "materialization stopped; restarting from the store's checkpoints",
                    error=self.last_error,
                    restarts=self.restarts,
                    retry_in_s=delay,
                )
                self._stopping.wait(delay)
                delay = min(delay * 2, self._settings.start_retry_max_s)

    def _run_once(self) -> None:
        with self._lock:
            generation = self._generation
        self._replanned.clear()
        plan = dataclasses.replace(
            self._plan_source(),  # read after the generation: at least as new as it
            max_records_per_partition=self._records_cap,
        )
        if not plan.starting_offsets:
            log.info("no partitions to read; waiting for an assignment")
            while generation == self._generation and not self._stopping.is_set():
                self._replanned.wait(0.5)
                self._replanned.clear()
            return

        self._remove_checkpoint_dir()
        self._checkpoint_dir = self._settings.data_dir / "spark" / f"checkpoint-{uuid.uuid4().hex}"
        run = _Run(generation, plan.topic, self._checkpoint_dir)
        log.info(
            "starting the streaming query",
            topic=plan.topic,
            starting_offsets=plan.starting_offsets,
            generation=generation,
        )
        query = self._start_query(plan, run)
        with self._lock:
            self._query = query
            outdated = self._outdated(run)
        if outdated:
            # Re-planned (or stopped) while it was starting: the re-plan could not see this
            # query to stop it, so it is stopped here, and the loop plans again.
            log.info("query outdated as it started; stopping it", generation=generation)
            self._await_batch_end(30.0)
            query.stop()
            return
        query.awaitTermination()  # raises when the query fails; returns when it is stopped

    def _start_query(self, plan: QueryPlan, run: _Run) -> StreamingQuery:
        return (
            read_kafka(self._spark, self._settings, plan)
            .writeStream.foreachBatch(functools.partial(self._apply, run))
            .option("checkpointLocation", str(run.checkpoint_dir))
            .trigger(processingTime=f"{self._settings.trigger_interval_ms} milliseconds")
            .queryName(f"kroute-{self._settings.store_name}")
            .start()
        )

    def _remove_checkpoint_dir(self) -> None:
        if self._checkpoint_dir is not None:
            shutil.rmtree(self._checkpoint_dir, ignore_errors=True)
            self._checkpoint_dir = None


class ExecutorWatch:
    """On a Spark cluster, notices when the application has no executors, and says so.

    The store, the lookups and the lag reports live in the node (the driver); only the reads
    of Kafka and the transform run on executors. With none (every worker lost, or the
    cluster's cores all taken by other applications) Spark does not fail the query: the
    micro-batch waits, silently, until the master gives the application an executor again,
    and then goes on from where it was. This makes the wait visible: a warning in the log, the
    pipeline's `last_error` (in /metadata, /health/ready and stall reasons) and
    `PipelineProgress.executors`.
    """

    INTERVAL_S = 2.0
    NONE_FOR_S = 4.0  # executors come and go for a moment while the master replaces one
    # A new application's first executor takes a JVM start (20 s seen on a busy machine).
    NONE_AT_START_FOR_S = 30.0

    def __init__(self, spark: SparkSession, master: str, report: Callable[[str], None]) -> None:
        self._spark = spark
        self._master = master
        self._report = report
        self._stopping = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, name="kroute-executor-watch", daemon=True
        )
        self.count: int | None = None
        self._none_since: float | None = None
        self._said_none = False
        self._had_one = False

    def start(self) -> None:
        if not self._master.startswith("local"):  # in local mode the driver runs the tasks
            self._thread.start()

    def stop(self) -> None:
        self._stopping.set()

    def _watch(self) -> None:
        while not self._stopping.wait(self.INTERVAL_S):
            try:
                self.count = executor_count(self._spark)
            except Exception as exc:  # noqa: BLE001 - the driver stopping; a py4j hiccup
                log.debug("cannot count Spark executors", error=str(exc))
                continue
            self._judge(time.monotonic())

    def _judge(self, at: float) -> None:
        if self.count:
            if self._said_none:
                log.info("Spark executors back; micro-batches run again", executors=self.count)
            self._none_since, self._said_none, self._had_one = None, False, True
            return
        if self._none_since is None:
            self._none_since = at
        patience = self.NONE_FOR_S if self._had_one else self.NONE_AT_START_FOR_S
        if not self._said_none and at - self._none_since >= patience:
            self._said_none = True
            message = no_executors_message(self._master)
            log.warning(message)
            self._report(message)


def executor_count(spark: SparkSession) -> int:
    """Executors registered with this driver; the driver's own block manager is not one."""
    status = spark.sparkContext._jsc.sc().getExecutorMemoryStatus()
    return max(int(status.size()) - 1, 0)


def no_executors_message(master: str) -> str:
    return (
        f"no Spark executors: the cluster at {master} gives this node none (its workers are "
        "down, or other applications hold every core: give each node spark.cores.max in "
        "KROUTE_SPARK_CONF); micro-batches wait until one comes back, lookups are served "
        "from the store meanwhile"
    )


def too_big_for_the_driver(exc: BaseException) -> bool:
    """Spark refused to bring a batch's results to the driver: "Total size of serialized
    results of N tasks (X MiB) is bigger than spark.driver.maxResultSize (Y MiB)". Retrying
    the same batch would fail the same way for ever."""
    return "spark.driver.maxResultSize" in str(exc)


# -- the offsets a micro-batch read ------------------------------------------------------------

_OFFSET_LOG_VERSION = "v1"


def batch_end_offsets(checkpoint_dir: Path, batch_id: int, topic: str) -> dict[int, int] | None:
    """partition -> the offset after the range a micro-batch read, or None when unknown.

    Spark writes each micro-batch's end offsets to its offset log (`offsets/<batch id>`) before
    it runs the batch: a version line, a line of batch metadata, then one line per source with
    the offsets that source's `latestOffset()` returned. The range [start, end) of each
    partition was read in full (kafka_source.read_range), so the store's checkpoint may move to
    `end` even when the last records of the range were not data: transaction commit or abort
    markers, or records that read_committed does not deliver. Our source writes
    {"<partition>": offset}; Spark's Kafka source {"<topic>": {"<partition>": offset}}.
    """
    path = checkpoint_dir / "offsets" / str(batch_id)
    try:
        lines = path.read_text().splitlines()
        if len(lines) < 3 or lines[0] != _OFFSET_LOG_VERSION:
            raise ValueError(f"unknown offset log format: {lines[:1]}")
        offsets = json.loads(lines[2])
        if isinstance(offsets.get(topic), dict):
            offsets = offsets[topic]
        return {int(partition): int(offset) for partition, offset in offsets.items()}
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        # Without the ends the checkpoint moves to the last record + 1, as before: correct,
        # but a partition whose log ends in a transaction marker then shows lag 1.
        log.warning(
            "cannot read the micro-batch's end offsets from Spark's offset log",
            path=str(path),
            error=str(exc),
        )
        return None


# -- stalls ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stall:
    """A hosted partition with unread records whose store has not moved for too long."""

    partition: int
    unread: int  # offsets behind the end offset last read
    since_ms: int  # waiting since: the later of its last progress and when it was caught up
    reason: str

    def as_json(self, at_ms: int) -> dict[str, object]:
        return {
            "partition": self.partition,
            "unread": self.unread,
            "stalled_since_ms": self.since_ms,
            "stalled_for_ms": max(at_ms - self.since_ms, 0),
            "reason": self.reason,
        }


def find_stalls(
    lags: Mapping[int, PartitionLag],
    progress_at_ms: Mapping[int, int],
    *,
    now_ms: int,
    timeout_ms: int,
    last_error: str | None = None,
    last_error_at_ms: int | None = None,
) -> dict[int, Stall]:
    """The partitions that have waited longer than `timeout_ms` with records unread.

    `progress_at_ms[p]` is the last moment partition p is known to have moved or been given a
    fresh start: its checkpoint's last write, when the node began hosting it, when the
    pipeline started. A partition waits since the later of that and the moment it was last
    known caught up (records that arrived after an idle hour are not an hour late). Under
    steady writes a healthy pipeline moves every partition with unread records in every
    micro-batch (each batch reads up to the cap from each), so only a frozen, failing or
    crash-looping pipeline, or a partition whose checkpoint cannot pass the end offset, waits
    that long.
    """
    stalls: dict[int, Stall] = {}
    for partition, lag in lags.items():
        unread = lag.lag
        if not unread:  # 0, or unknown: nothing is known to be waiting
            continue
        since = max(progress_at_ms.get(partition, now_ms), lag.caught_up_at_ms or 0)
        waited = now_ms - since
        if waited <= timeout_ms:
            continue
        reason = f"{unread} offsets unread and the store has not moved for {waited // 1000} s"
        if last_error is not None and last_error_at_ms is not None and last_error_at_ms >= since:
            reason += f"; the pipeline failed meanwhile: {last_error}"
        stalls[partition] = Stall(partition, unread, since, reason)
    return stalls
