"""A materializer node's settings, read once from KROUTE_* environment variables."""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, Json, ValidationInfo, field_validator

from common.settings import (
    EnvSettings,
    Host,
    HostPortList,
    HttpUrl,
    ImportPath,
    Name,
    RedisUrl,
    SettingsError,
    SparkMaster,
    known_partitioning_choice,
)
from partitioner import ALGORITHMS, KEY_FORMATS

_PARTITION_LIST = re.compile(r"^(all|\d+(-\d+)?(,\d+(-\d+)?)*)$")


class NodeSettings(EnvSettings):
    # KROUTE_PARTITIONS also named the demo topic's partition count (`kroute run`) and the
    # topic's (compose): each now has a name of its own.
    env_names: ClassVar[dict[str, str]] = {"partitions": "KROUTE_HOSTED_PARTITIONS"}
    deprecated_env: ClassVar[dict[str, str]] = {"KROUTE_PARTITIONS": "partitions"}

    node_id: Name = Field(
        default_factory=socket.gethostname,
        description="This node's id in the cluster (default: the host name).",
    )
    host: Host = Field(default="127.0.0.1", description="Address the node's HTTP server binds to.")
    port: int = Field(
        default=8081,
        ge=0,
        le=65535,
        description="Port of the node's HTTP server (0: any free port).",
    )
    bootstrap_servers: HostPortList = Field(
        description="Kafka bootstrap servers, host:port[,host:port]."
    )
    topic: Name = Field(description="The Kafka topic this node materializes.")
    store: Name | None = Field(
        default=None, description="Store name in lookup URLs (default: the topic name)."
    )
    partitions: str = Field(
        default="all",
        description="Partitions this node hosts: all, or a list such as 0-5,7 "
        "(formerly KROUTE_PARTITIONS).",
    )
    key_format: str = Field(
        default="string", description=f"How lookup keys are serialized: {', '.join(KEY_FORMATS)}."
    )
    partitioner: str = Field(
        default="murmur2", description=f"The producers' partitioner: {', '.join(ALGORITHMS)}."
    )
    value_format: Literal["json", "string", "bytes"] = Field(
        default="json", description="How record values are decoded: json, string or bytes."
    )
    data_dir: Path = Field(
        default=Path("data"),
        description="Where the node keeps its store (RocksDB) and Spark scratch files.",
    )
    spark_master: SparkMaster = Field(
        default="local[*]",
        description="Spark master URL: local[*], or a cluster such as spark://host:7077.",
    )
    spark_java_options: str = Field(
        default="-XX:TieredStopAtLevel=1",
        # Spark generates classes for every micro-batch and C2 recompiling them took half the
        # JVM's CPU (measured with per-thread CPU times); C1 code plans batches and moves Arrow
        # buffers about as well.
        description="JVM options of the node's Spark driver (default: compile with C1 only, "
        "half the JVM's CPU per micro-batch).",
    )
    spark_packages: str | None = Field(
        default=None,
        description="Maven coordinates Spark loads (spark.jars.packages), e.g. "
        "org.apache.spark:spark-sql-kafka-0-10_2.13:4.1.1 for KROUTE_SOURCE=spark-kafka.",
    )
    spark_conf: Json[dict[str, str]] = Field(
        default={},
        description="More Spark settings, a JSON object applied last, e.g. "
        '{"spark.cores.max": "2", "spark.driver.maxResultSize": "2g"}. Nodes sharing a Spark '
        "standalone cluster each need spark.cores.max (docs/spark-cluster.md).",
    )
    max_value_bytes: int = Field(
        default=8 * 1024 * 1024,
        ge=1,
        le=1 << 31,
        description="Records with larger values are skipped, counted and logged with their "
        "partition and offset (one outsized record must not stall the store).",
    )
    source: Literal["python", "spark-kafka"] = Field(
        default="python",
        description="Kafka source: kroute's Python data source, or Spark's own "
        "(needs spark-sql-kafka-0-10).",
    )
    max_records_per_partition: int = Field(
        default=20_000,
        ge=1,
        le=10_000_000,
        description="Most records read per partition in one micro-batch "
        "(bounds batch time and write pauses).",
    )
    tasks_per_batch: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="Spark tasks per micro-batch (each Python task costs ~65 ms of overhead here).",
    )
    fetch_max_wait_ms: int = Field(
        default=20,
        ge=1,
        le=5_000,
        description="Kafka fetch max wait; keep small (Tansu does not wake waiting fetches).",
    )
    trigger_interval_ms: int = Field(
        default=500,
        ge=0,
        le=600_000,
        # Each batch has a fixed Spark cost (~60-150 ms of CPU here): under a trickle of writes,
        # back-to-back batches (0) kept half a core busy per node and slowed lookups.
        description="Least time between the starts of two micro-batches; a longer batch starts "
        "the next at once (0: always back to back, most CPU).",
    )
    stall_timeout_ms: int = Field(
        default=30_000,
        ge=1_000,
        le=3_600_000,
        # A healthy pipeline moves every partition with unread records once per micro-batch:
        # a trigger interval plus one batch (seconds at most, even for a capped batch of a
        # restore on a busy machine). 30 s is many of those, and well below what a user waits.
        description="A hosted partition with unread records whose store has not moved for "
        "this long is stalled: the node is not ready and reports it as not caught up "
        "(must exceed KROUTE_TRIGGER_INTERVAL_MS).",
    )
    transform: ImportPath | None = Field(
        default=None,
        description="Custom Spark transform, module:function (default: latest value per key).",
    )
    merge: ImportPath | None = Field(
        default=None,
        description="Merge of a transform's rows with stored values, module:function "
        "(default: replace).",
    )
    role: Literal["active", "standby"] = Field(
        default="active",
        description="Role reported for this node's partitions until cluster assignment takes over.",
    )
    lag_interval_ms: int = Field(
        default=250, ge=10, le=60_000, description="How often end offsets and lag are refreshed."
    )
    min_offset_wait_ms: int = Field(
        default=500,
        ge=0,
        le=10_000,
        # A write is applied within a trigger interval plus one micro-batch; past this the
        # node answers 421 and the proxy asks another replica. Keep it well below the proxy's
        # KROUTE_UPSTREAM_TIMEOUT_MS, or the proxy gives up on (and ejects) a waiting node.
        description="How long a lookup with x-kroute-min-offset waits for the store to apply "
        "that offset before answering 421 (0: never waits).",
    )
    start_retry_max_s: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description="Longest wait between attempts to reach the broker or restart Spark.",
    )
    redis_url: RedisUrl | None = Field(
        default=None,
        description="Redis for the cluster, e.g. redis://:password@host:6379/0 (unset: standalone "
        "node serving KROUTE_HOSTED_PARTITIONS). Printed as ***.",
    )
    cluster: Name = Field(
        default="default",
        description="Cluster name: the prefix of every Redis key.",
    )
    advertised_url: HttpUrl | None = Field(
        default=None,
        description="URL other nodes and proxies use to reach this node (default: http://host:port).",
    )
    standbys: int = Field(
        default=1,
        ge=0,
        le=10,
        description="Standby replicas per partition (the leader places them).",
    )
    grace_period_s: float = Field(
        default=600.0,
        ge=0,
        le=86_400,
        description="How long a dead node keeps its partitions before they move.",
    )
    acceptable_recovery_lag: int = Field(
        default=10_000,
        ge=0,
        le=10**12,
        description="A standby at most this many offsets behind may take over as active when "
        "actives are rebalanced (Kafka Streams' acceptable.recovery.lag). 0 waits for a lag "
        "report of exactly 0, which steady writes may never give.",
    )
    heartbeat_ms: int = Field(default=300, ge=50, le=10_000, description="Heartbeat interval.")
    alive_ttl_ms: int = Field(
        default=2000, ge=200, le=60_000, description="A node missing heartbeats this long is dead."
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="Log level of the node's JSON logs."
    )

    @classmethod
    def check_deprecated(cls, variable: str, value: str) -> str:
        # A bare number under the old name may be a partition count (its meaning elsewhere)
        # as well as the one partition to host: refuse to guess.
        if value.strip().isdigit():
            raise SettingsError(
                f"invalid configuration: {variable}={value!r} is ambiguous (a partition count, "
                f"or the one partition to host?): set KROUTE_HOSTED_PARTITIONS={value} to host "
                "that partition"
            )
        return value

    @field_validator("partitions")
    @classmethod
    def _partition_list(cls, value: str) -> str:
        value = value.replace(" ", "")
        if not _PARTITION_LIST.match(value):
            raise ValueError("expected 'all' or a list such as 0-5,7")
        return value

    @field_validator("stall_timeout_ms")
    @classmethod
    def _longer_than_a_trigger(cls, value: int, info: ValidationInfo) -> int:
        trigger_ms = info.data.get("trigger_interval_ms")
        if trigger_ms is not None and value <= trigger_ms:
            raise ValueError(
                f"must exceed KROUTE_TRIGGER_INTERVAL_MS ({trigger_ms}): a pipeline that waits "
                "for its next trigger is not stalled"
            )
        return value

    @field_validator("key_format", "partitioner")
    @classmethod
    def _known_choice(cls, value: str, info: ValidationInfo) -> str:
        return known_partitioning_choice(str(info.field_name), value)

    @property
    def store_name(self) -> str:
        return self.store or self.topic

    def hosted_partitions(self, num_partitions: int) -> tuple[int, ...]:
        """The partitions this node hosts, checked against the topic's partition count."""
        if self.partitions == "all":
            return tuple(range(num_partitions))
        chosen: set[int] = set()
        for item in self.partitions.split(","):
            low, _, high = item.partition("-")
            chosen.update(range(int(low), int(high or low) + 1))
        beyond = sorted(p for p in chosen if p >= num_partitions)
        if beyond:
            raise ValueError(
                f"KROUTE_HOSTED_PARTITIONS={self.partitions!r} names partitions {beyond} but "
                f"the topic has {num_partitions} (0-{num_partitions - 1})"
            )
        return tuple(sorted(chosen))
