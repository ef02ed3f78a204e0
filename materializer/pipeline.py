"""The node's Spark Structured Streaming query: Kafka partitions -> transform -> store.

Spark's own checkpoint is not the source of truth: every (re)start of the query begins from the
store's checkpoints, passed to the source as starting offsets, and uses a fresh Spark checkpoint
directory. A query that fails (broker gone, a bad batch) is restarted by the supervisor thread
after a capped exponential back-off, again from the store's checkpoints, so nothing is applied
twice and no crash loop hammers the broker.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming.query import StreamingQuery

from materializer.kafka_source import SOURCE_NAME, KafkaDataSource, SourceOptions
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
    if settings.spark_master.startswith("local"):
        # In local mode nothing outside this machine talks to the driver: loopback only.
        os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
        builder = builder.config("spark.driver.bindAddress", "127.0.0.1").config(
            "spark.driver.host", "127.0.0.1"
        )
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    spark.dataSource.register(KafkaDataSource)
    return spark


@dataclass(frozen=True)
class QueryPlan:
    """What one run of the query reads: a topic's partitions from the given offsets."""

    topic: str
    starting_offsets: dict[int, int]


def read_kafka(spark: SparkSession, settings: NodeSettings, plan: QueryPlan) -> DataFrame:
    if settings.source == "spark-kafka":
        # Spark's own source (spark-sql-kafka-0-10 must be on the classpath); same columns.
        partitions = sorted(plan.starting_offsets)
        return (
            spark.readStream.format("kafka")
            .option("kafka.bootstrap.servers", settings.bootstrap_servers)
            .option("assign", json.dumps({plan.topic: partitions}))
            .option(
                "startingOffsets",
                json.dumps({plan.topic: {str(p): o for p, o in plan.starting_offsets.items()}}),
            )
            .option(
                "maxOffsetsPerTrigger", str(settings.max_records_per_partition * len(partitions))
            )
            .option("includeHeaders", "true")
            .option("failOnDataLoss", "false")
            .load()
            .select(*KAFKA_COLUMNS)
        )
    options = SourceOptions(
        bootstrap_servers=settings.bootstrap_servers,
        topic=plan.topic,
        partitions=tuple(sorted(plan.starting_offsets)),
        starting_offsets=plan.starting_offsets,
        max_records_per_partition=settings.max_records_per_partition,
        fetch_max_wait_ms=settings.fetch_max_wait_ms,
        read_timeout_s=30.0,
        tasks_per_batch=settings.tasks_per_batch,
    )
    return spark.readStream.format(SOURCE_NAME).options(**options.as_spark_options()).load()


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
        self._replan = threading.Event()
        self._batch_lock = threading.Lock()  # held while a batch is applied to the store
        self._query: StreamingQuery | None = None
        self._checkpoint_dir: Path | None = None
        self._thread = threading.Thread(target=self._supervise, name="kroute-pipeline", daemon=True)
        self.restarts = 0
        self.last_error: str | None = None

    @property
    def running(self) -> bool:
        return self._query is not None and self._query.isActive

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stopping.set()
        self._await_batch_end(timeout_s)
        query = self._query
        if query is not None:
            try:
                query.stop()
            except Exception as exc:  # noqa: BLE001 - stopping must not raise during shutdown
                log.warning("stopping the query failed", error=str(exc))
        self._thread.join(timeout_s)
        self._remove_checkpoint_dir()

    def replan(self) -> None:
        """Restart the query on the current plan (the hosted partitions changed)."""
        self._replan.set()
        self._await_batch_end(30.0)
        query = self._query
        if query is not None and query.isActive:
            query.stop()  # awaitTermination returns; the supervisor starts the new plan at once

    def _await_batch_end(self, timeout_s: float) -> None:
        """Let the batch being applied finish before the query is stopped.

        Stopping interrupts the query thread; interrupted inside foreachBatch, Spark matches a
        regex over the whole Python traceback (SPARK-39218) and can die of a StackOverflowError
        in it before restarting. Once a stop or re-plan is asked for, later batches are no-ops
        (`_apply`), so after this wait the interrupt lands between batches.
        """
        if self._batch_lock.acquire(timeout=timeout_s):
            self._batch_lock.release()

    def _apply(self, batch: DataFrame, batch_id: int) -> None:
        with self._batch_lock:
            if self._replan.is_set() or self._stopping.is_set():
                # The store did not move, and the next query starts from the store's offsets.
                log.debug("batch skipped: the query is being stopped", batch_id=batch_id)
                return
            self._sink(batch, batch_id)

    def progress(self) -> dict[str, Any] | None:
        query = self._query
        return None if query is None else query.lastProgress

    def _supervise(self) -> None:
        delay = 1.0
        while not self._stopping.is_set():
            started = time.monotonic()
            try:
                self._run_once()
            except Exception as exc:  # noqa: BLE001 - any failure: log, back off, restart
                if self._stopping.is_set():
                    return
                self.last_error = _first_line(exc)
                self.restarts += 1
                if time.monotonic() - started > 60:
                    delay = 1.0  # it ran for a while: this is a new failure, not a crash loop
                log.error(
                    "materialization stopped; restarting from the store's checkpoints",
                    error=self.last_error,
                    retry_in_s=delay,
                )
                self._stopping.wait(delay)
                delay = min(delay * 2, self._settings.start_retry_max_s)

    def _run_once(self) -> None:
        self._replan.clear()
        plan = self._plan_source()
        if not plan.starting_offsets:
            log.info("no partitions to read; waiting for an assignment")
            while not (self._replan.wait(0.5) or self._stopping.is_set()):
                pass
            return

        self._remove_checkpoint_dir()
        self._checkpoint_dir = self._settings.data_dir / "spark" / f"checkpoint-{uuid.uuid4().hex}"
        log.info(
            "starting the streaming query", topic=plan.topic, starting_offsets=plan.starting_offsets
        )
        query = (
            read_kafka(self._spark, self._settings, plan)
            .writeStream.foreachBatch(self._apply)
            .option("checkpointLocation", str(self._checkpoint_dir))
            .trigger(processingTime=f"{self._settings.trigger_interval_ms} milliseconds")
            .queryName(f"kroute-{self._settings.store_name}")
            .start()
        )
        self._query = query
        query.awaitTermination()  # raises when the query fails; returns when it is stopped

    def _remove_checkpoint_dir(self) -> None:
        if self._checkpoint_dir is not None:
            shutil.rmtree(self._checkpoint_dir, ignore_errors=True)
            self._checkpoint_dir = None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:500]
