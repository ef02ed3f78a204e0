"""A Spark Python Data Source (`kroute-kafka`) that reads assigned Kafka partitions.

Spark runs the pieces in different processes, which shapes this module:
- `KafkaStreamReader.initialOffset/latestOffset/partitions` run in Spark's streaming-source
  runner (a Python process the JVM starts): starting offsets arrive as an option (the node reads
  them from its store's checkpoint), end offsets are what a read_committed consumer can read
  (below), and each micro-batch is capped at `maxRecordsPerPartition` records per partition;
- `read()` runs in Spark's Python workers, which Spark reuses across tasks: a module-level cache
  keeps one Kafka consumer per partition alive between micro-batches (its connections), assigned
  to the partition only while a batch is read.

The DataFrame has the schema of Spark's own Kafka source (with includeHeaders), so a node can
switch to `spark-sql-kafka-0-10` without changing anything downstream.

Isolation level: read_committed. Kafka Streams and ksqlDB write their output in transactions;
an aborted transaction's records must never reach the store (a merge such as a running count
would count them for good, and a KTable would serve values that never happened), and a record
of an open transaction may yet be aborted. A read_committed consumer stops at the partition's
last stable offset (LSO: the first offset of the oldest open transaction), not at the high
watermark, so a range ending at the high watermark would wait for the transaction and time out
(the whole query restarted, every 30 s, while it stays open). Each micro-batch therefore ends
at min(high watermark, LSO) (`readable_ends`). Records past the LSO are not readable by anyone
reading committed data; they are read once their transaction ends. A range is read to its
end, and the store's checkpoint moves to that end (sink.py), past commit markers and aborted
records that the consumer never hands over.

Offsets outside the log are never skipped silently: the consumer's reset policy is `error`, so
a range starting below the log start (records deleted by retention before this node read
them) fails its batch instead of jumping over the gap. The node sees the same thing in its lag
refresh and rebuilds the partition (lag.OutsideLog). A range starting at 0 is a store that
holds nothing, so it reads from wherever the log begins.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition

from materializer.spark_worker import skip_unchanged_archive_rereads

SOURCE_NAME = "kroute-kafka"
SCHEMA = (
    "key binary, value binary, topic string, partition int, offset long, timestamp timestamp, "
    "headers array<struct<key: string, value: binary>>"
)
ARROW_SCHEMA = pa.schema(
    [
        ("key", pa.binary()),
        ("value", pa.binary()),
        ("topic", pa.string()),
        ("partition", pa.int32()),
        ("offset", pa.int64()),
        ("timestamp", pa.timestamp("us", tz="UTC")),  # Spark takes microseconds only
        ("headers", pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))),
    ]
)
_ARROW_CHUNK = 10_000  # records per Arrow batch handed to Spark
ISOLATION_LEVEL = "read_committed"  # see the module's docstring
_READ_COMMITTED = 1  # Fetch's isolation_level field


@dataclass(frozen=True)
class SourceOptions:
    """The data source's options, parsed once from Spark's string map."""

    bootstrap_servers: str
    topic: str
    partitions: tuple[int, ...]
    starting_offsets: dict[int, int]
    max_records_per_partition: int
    fetch_max_wait_ms: int
    read_timeout_s: float
    tasks_per_batch: int = 1

    @classmethod
    def parse(cls, spark_options: Mapping[str, str]) -> SourceOptions:
        # Spark hands data sources a case-insensitive map whose keys come back lowercased.
        options = {key.lower(): value for key, value in spark_options.items()}
        partitions = tuple(sorted({int(p) for p in options["partitions"].split(",") if p.strip()}))
        starting = {
            int(p): int(o) for p, o in json.loads(options.get("startingoffsets", "{}")).items()
        }
        return cls(
            bootstrap_servers=options["bootstrap.servers"],
            topic=options["topic"],
            partitions=partitions,
            starting_offsets={p: starting.get(p, 0) for p in partitions},
            max_records_per_partition=int(options.get("maxrecordsperpartition", "20000")),
            fetch_max_wait_ms=int(options.get("fetchmaxwaitms", "20")),
            read_timeout_s=float(options.get("readtimeoutseconds", "30")),
            tasks_per_batch=int(options.get("tasksperbatch", "1")),
        )

    def as_spark_options(self) -> dict[str, str]:
        return {
            "bootstrap.servers": self.bootstrap_servers,
            "topic": self.topic,
            "partitions": ",".join(map(str, self.partitions)),
            "startingOffsets": json.dumps({str(p): o for p, o in self.starting_offsets.items()}),
            "maxRecordsPerPartition": str(self.max_records_per_partition),
            "fetchMaxWaitMs": str(self.fetch_max_wait_ms),
            "readTimeoutSeconds": str(self.read_timeout_s),
            "tasksPerBatch": str(self.tasks_per_batch),
        }


@dataclass(frozen=True)
class KafkaRange:
    """Offsets [start, end) of one Kafka partition."""

    partition: int
    start: int
    end: int


class KafkaRanges(InputPartition):
    """The ranges one Spark task reads, one after the other.

    Each Python data-source task costs ~60-70 ms of Spark overhead on this 2-core machine
    (measured: 6 tasks per micro-batch took ~500 ms, 1 task ~140 ms), so a node's partitions
    are grouped into `tasksPerBatch` tasks rather than one task per Kafka partition.
    """

    def __init__(self, ranges: tuple[KafkaRange, ...]) -> None:
        super().__init__(ranges)
        self.ranges = ranges


class KafkaDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return SOURCE_NAME

    def schema(self) -> str:
        return SCHEMA

    def streamReader(self, schema: Any) -> KafkaStreamReader:  # noqa: N802 - Spark's name
        return KafkaStreamReader(SourceOptions.parse(self.options))


class KafkaStreamReader(DataSourceStreamReader):
    def __init__(self, options: SourceOptions) -> None:
        self.options = options
        # Where the next micro-batch starts: it moves only when Spark plans a batch. Spark may
        # call latestOffset() several times per batch, so the cap must not move with each call.
        self._next_start = dict(options.starting_offsets)

    def __getstate__(self) -> dict[str, Any]:
        # Pickled to the workers for read(); only the options travel.
        return {"options": self.options, "_next_start": {}}

    def initialOffset(self) -> dict[str, int]:  # noqa: N802 - Spark's name
        return {str(p): o for p, o in self.options.starting_offsets.items()}

    def latestOffset(self) -> dict[str, int]:  # noqa: N802 - Spark's name
        probe = _probe(self.options.bootstrap_servers)
        ends = probe.readable_ends(self.options.topic, self.options.partitions, self._next_start)
        for partition, start in self._next_start.items():
            log_start = probe.log_starts.get(partition) or 0
            if start == 0 and log_start > 0:
                # An empty store reads from where the log begins: capping from 0 would plan
                # batches of deleted offsets that read nothing (the reader starts at the log
                # start and would drop every record as past the batch's end).
                self._next_start[partition] = log_start
        capped = next_batch_ends(self._next_start, ends, self.options.max_records_per_partition)
        return {str(p): end for p, end in capped.items()}

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[KafkaRanges]:
        self._next_start.update({int(p): int(o) for p, o in end.items()})

        ranges = [
            KafkaRange(int(p), int(start.get(p, end[p])), int(end[p]))
            for p in sorted(end, key=int)
            if int(end[p]) > int(start.get(p, end[p]))
        ]
        return group_ranges(ranges, self.options.tasks_per_batch)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, KafkaRanges)
        skip_unchanged_archive_rereads()  # from the next task of this (reused) worker on
        for kafka_range in partition.ranges:
            yield from read_range(
                self.options, kafka_range.partition, kafka_range.start, kafka_range.end
            )

    def commit(self, end: dict[str, int]) -> None:
        """Spark's own commit: nothing to do, the node's store holds the real checkpoint."""


def next_batch_ends(starts: Mapping[int, int], ends: Mapping[int, int], cap: int) -> dict[int, int]:
    """Where the next micro-batch ends: at most `cap` records past each start, never before
    it (an end that went backwards, after a leader change, reads nothing rather than undo)."""
    return {p: max(start, min(ends[p], start + cap)) for p, start in starts.items()}


def readable_ends(high_watermarks: Mapping[int, int], stable: Mapping[int, int]) -> dict[int, int]:
    """What a read_committed consumer can read up to: the last stable offset, or the high
    watermark where the broker gave no LSO (Fetch before v4, an error for that partition)."""
    return {
        p: min(high, stable[p]) if stable.get(p, -1) >= 0 else high
        for p, high in high_watermarks.items()
    }


def group_ranges(ranges: list[KafkaRange], tasks: int) -> list[KafkaRanges]:
    """Deal the ranges round-robin into at most `tasks` Spark tasks (none empty)."""
    groups = [tuple(ranges[i::tasks]) for i in range(max(1, tasks))]
    return [KafkaRanges(group) for group in groups if group]


# -- driver side: end offsets (runs in Spark's streaming-source runner process) --------------


class _EndOffsetProbe:
    """A long-lived aiokafka client on a private event loop, for a synchronous caller: high
    watermarks (kafka_offsets) and last stable offsets, one Fetch each per partition leader."""

    def __init__(self, bootstrap_servers: str) -> None:
        from aiokafka.client import AIOKafkaClient  # noqa: PLC0415 - only in the runner process

        self._loop = asyncio.new_event_loop()

        async def connect() -> AIOKafkaClient:
            client = AIOKafkaClient(bootstrap_servers=bootstrap_servers, request_timeout_ms=10_000)
            await client.bootstrap()
            return client

        self._client = self._loop.run_until_complete(connect())
        self._leaders: dict[int, int] = {}  # partition -> leader node, for the LSO Fetch
        self.log_starts: dict[int, int | None] = {}  # as the last Fetch answers said

    def readable_ends(
        self, topic: str, partitions: tuple[int, ...], positions: dict[int, int]
    ) -> dict[int, int]:
        return self._loop.run_until_complete(self._readable_ends(topic, partitions, positions))

    def close(self) -> None:
        """(The runner process keeps its probes until it exits; tests close theirs.)"""
        self._loop.run_until_complete(self._client.close())
        self._loop.close()

    async def _readable_ends(
        self, topic: str, partitions: tuple[int, ...], positions: dict[int, int]
    ) -> dict[int, int]:
        from materializer.kafka_offsets import fetch_log_bounds  # noqa: PLC0415

        bounds = await fetch_log_bounds(self._client, topic, partitions, positions=positions)
        self.log_starts.update({p: bound.start for p, bound in bounds.items()})
        highs = {p: bound.end for p, bound in bounds.items()}
        inside = {p: min(positions.get(p, 0), high) for p, high in highs.items()}
        return readable_ends(highs, await self._last_stable_offsets(topic, inside))

    async def _last_stable_offsets(self, topic: str, fetch_from: dict[int, int]) -> dict[int, int]:
        """partition -> LSO from one read_committed Fetch per leader (1 byte: only the header
        matters). Partitions the broker answers with an error are left out (their high
        watermark is used); their leaders are looked up again next time."""
        from aiokafka.protocol.fetch import FetchRequest  # noqa: PLC0415

        if any(p not in self._leaders for p in fetch_from):
            await self._look_up_leaders(topic)
        by_leader: dict[int, list[int]] = defaultdict(list)
        for partition in fetch_from:
            if partition in self._leaders:
                by_leader[self._leaders[partition]].append(partition)
        stable: dict[int, int] = {}
        for node_id, node_partitions in by_leader.items():
            wanted = [(p, fetch_from[p], 1) for p in node_partitions]
            request = FetchRequest(10, 0, 1, _READ_COMMITTED, [(topic, wanted)])
            response = await self._client.send(node_id, request)
            for entry in _fetched_partitions(response.to_object(), topic):
                if entry["error_code"] == 0:
                    stable[entry["partition"]] = entry.get("last_stable_offset", -1)
                else:
                    self._leaders.pop(entry["partition"], None)
        return stable

    async def _look_up_leaders(self, topic: str) -> None:
        from aiokafka.structs import TopicPartition  # noqa: PLC0415

        metadata = await self._client.fetch_all_metadata()
        self._leaders = {
            p: leader
            for p in metadata.partitions_for_topic(topic) or ()
            if (leader := metadata.leader_for_partition(TopicPartition(topic, p))) is not None
            and leader >= 0
        }


def _fetched_partitions(response: dict[str, Any], topic: str) -> list[dict[str, Any]]:
    """The per-partition entries of a Fetch response (the topic field's name varies)."""
    return [
        entry
        for topic_entry in response["topics"]
        if topic_entry.get("topic", topic_entry.get("topics")) == topic
        for entry in topic_entry["partitions"]
    ]


_PROBES: dict[str, _EndOffsetProbe] = {}


def _probe(bootstrap_servers: str) -> _EndOffsetProbe:
    if bootstrap_servers not in _PROBES:
        _PROBES[bootstrap_servers] = _EndOffsetProbe(bootstrap_servers)
    return _PROBES[bootstrap_servers]


# -- worker side: reading one range (runs in Spark's Python workers) -------------------------


_CONSUMERS: dict[tuple[str, str, int], Any] = {}  # one per partition, kept between tasks


class KafkaReadTimeout(RuntimeError):
    def __init__(
        self, topic: str, partition: int, kafka_range: KafkaRange, reached: int, waited_s: float
    ) -> None:
        super().__init__(
            f"reading {topic}[{partition}] offsets [{kafka_range.start}, {kafka_range.end}): stuck "
            f"at {reached} after {waited_s:.0f}s (broker down, or records deleted below the high "
            "watermark?)"
        )


def _consumer_key(options: SourceOptions, partition: int) -> tuple[str, str, int]:
    return (options.bootstrap_servers, options.topic, partition)


def _consumer_for(options: SourceOptions, partition: int) -> Any:
    from confluent_kafka import Consumer  # noqa: PLC0415 - worker process only

    key = _consumer_key(options, partition)
    consumer = _CONSUMERS.get(key)
    if consumer is None:
        consumer = Consumer(
            {
                "bootstrap.servers": options.bootstrap_servers,
                "group.id": "kroute-materializer",  # required by librdkafka; no group is joined
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "auto.offset.reset": "error",  # never jump over a gap (module docstring)
                # librdkafka's default, stated: the ranges end at the LSO (module docstring).
                "isolation.level": ISOLATION_LEVEL,
                "fetch.wait.max.ms": options.fetch_max_wait_ms,  # Tansu: waiting fetches don't wake
                "queued.max.messages.kbytes": 8192,  # bound what one read prefetches
                "log_level": 3,
            }
        )
        _CONSUMERS[key] = consumer
    return consumer


def read_range(
    options: SourceOptions, partition: int, start: int, end: int
) -> Iterator[pa.RecordBatch]:
    """Records [start, end) of one partition, in Arrow batches of at most _ARROW_CHUNK.

    The partition is assigned for the read only. A consumer left assigned between batches keeps
    fetching, every fetch_max_wait_ms, for nothing: with three nodes that was most of an idle
    broker's CPU. Assigning again costs under a millisecond (measured; librdkafka's pause and
    resume took ~700 ms to fetch again).
    """
    from confluent_kafka import OFFSET_BEGINNING, TopicPartition  # noqa: PLC0415 - worker only

    consumer = _consumer_for(options, partition)
    # A store at 0 read nothing yet and misses nothing: it starts where the log begins now.
    consumer.assign([TopicPartition(options.topic, partition, start or OFFSET_BEGINNING)])
    try:
        yield from _read_assigned(consumer, options, partition, start, end)
    finally:
        still_open = _CONSUMERS.get(_consumer_key(options, partition)) is consumer  # or timed out
        if still_open:
            consumer.unassign()


def _read_assigned(
    consumer: Any, options: SourceOptions, partition: int, start: int, end: int
) -> Iterator[pa.RecordBatch]:
    columns: dict[str, list[Any]] = {name: [] for name in ARROW_SCHEMA.names}
    next_offset = start
    deadline = time.monotonic() + options.read_timeout_s
    while next_offset < end:
        messages = consumer.consume(min(_ARROW_CHUNK, end - next_offset), 0.5)
        for message in messages:
            error = message.error()
            if error is not None:
                if error.retriable():
                    continue  # librdkafka retries by itself; the deadline bounds the wait
                raise _read_error(options.topic, partition, next_offset, error)
            offset = message.offset()
            if not next_offset <= offset < end:
                continue  # resent from before the start, or fetched past this batch's end
            _append(columns, message, options.topic, partition)
            next_offset = offset + 1
            deadline = time.monotonic() + options.read_timeout_s
        if len(columns["offset"]) >= _ARROW_CHUNK:
            yield _to_batch(columns)
            columns = {name: [] for name in ARROW_SCHEMA.names}
        if next_offset < end and time.monotonic() > deadline:
            _CONSUMERS.pop(_consumer_key(options, partition), None)
            consumer.close()
            raise KafkaReadTimeout(
                options.topic,
                partition,
                KafkaRange(partition, start, end),
                next_offset,
                options.read_timeout_s,
            )
        if not messages and _position(consumer, options.topic, partition) >= end:
            next_offset = end  # the rest of the range holds no records (control batches)
    if columns["offset"]:
        yield _to_batch(columns)


def _read_error(topic: str, partition: int, offset: int, error: Any) -> RuntimeError:
    from confluent_kafka import KafkaError  # noqa: PLC0415 - worker process only

    if error.code() == KafkaError._AUTO_OFFSET_RESET:
        return RuntimeError(
            f"reading {topic}[{partition}]: offset {offset} is outside the log (records deleted "
            "by retention, or the topic recreated); the node rebuilds the partition from the "
            f"log start ({error.str()})"
        )
    return RuntimeError(f"reading {topic}[{partition}]: {error}")


def _position(consumer: Any, topic: str, partition: int) -> int:
    from confluent_kafka import TopicPartition  # noqa: PLC0415

    [position] = consumer.position([TopicPartition(topic, partition)])
    return int(position.offset) if position.offset >= 0 else -1


def _append(columns: dict[str, list[Any]], message: Any, topic: str, partition: int) -> None:
    columns["key"].append(message.key())
    columns["value"].append(message.value())
    columns["topic"].append(topic)
    columns["partition"].append(partition)
    columns["offset"].append(message.offset())
    timestamp_type, timestamp = message.timestamp()
    columns["timestamp"].append(timestamp * 1000 if timestamp_type else None)  # ms -> µs
    headers = message.headers()
    columns["headers"].append([{"key": k, "value": v} for k, v in headers] if headers else [])


def _to_batch(columns: dict[str, list[Any]]) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict(columns, schema=ARROW_SCHEMA)
