"""The micro-batch sink (Spark's foreachBatch): transform, collect, write to the store.

Per partition, a batch's changes and the partition's new checkpoint (one past the batch's last
offset, bad records included) go to the store in one atomic write. Records that cannot be
materialized are counted and logged with partition and offset, never retried forever.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import structlog
from pyspark.sql import DataFrame
from pyspark.sql import functions as F  # noqa: N812 - Spark's own convention

from materializer.store import Row, Store
from materializer.transform import (
    CHANGE_COLUMNS,
    RecordRules,
    Transform,
    as_changes,
    with_problems,
)

log = structlog.get_logger("kroute.materializer.sink")

_LOGGED_PROBLEMS_PER_BATCH = 20  # a flood of bad records is counted in full, logged in part


@dataclass
class IngestStats:
    """Counters the node reports; updated by the sink thread, read by the HTTP thread."""

    batches: int = 0
    records: int = 0
    changes_written: int = 0
    problems_by_partition: dict[int, int] = field(default_factory=dict)
    last_batch_ms: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def problems(self) -> int:
        return sum(self.problems_by_partition.values())


class BatchSink:
    def __init__(
        self, store: Store, transform: Transform, rules: RecordRules, stats: IngestStats
    ) -> None:
        self._store = store
        self._transform = transform
        self._rules = rules
        self._stats = stats

    def __call__(self, batch: DataFrame, batch_id: int) -> None:
        checked = with_problems(batch, self._rules)
        if self._transform.is_ktable:
            records = checked.select(*CHANGE_COLUMNS, "problem").toArrow()
            changes = records.filter(pc.is_null(records["problem"]))
        else:
            checked = checked.persist()  # read Kafka once for both collects below
            try:
                records = checked.select("partition", "offset", "timestamp_ms", "problem").toArrow()
                valid = checked.where(F.col("problem").isNull()).drop("problem", "timestamp_ms")
                assert self._transform.function is not None
                changes = as_changes(self._transform.function(valid)).toArrow()
            finally:
                checked.unpersist()
        self._apply(batch_id, records, changes)

    def _apply(self, batch_id: int, records: pa.Table, changes: pa.Table) -> None:
        written = 0
        for partition, part_records in _by_partition(records):
            next_offset = int(pc.max(part_records["offset"]).as_py()) + 1
            newest = pc.max(part_records["timestamp_ms"]).as_py()
            problems = _problems(part_records)
            in_partition = pc.equal(changes["partition"], partition)
            part_changes = changes.filter(in_partition).sort_by("offset")
            rows = _rows(part_changes, self._rules.value_format == "json", problems)
            result = self._store.apply(partition, rows, next_offset, newest, self._transform.merge)
            self._report_problems(batch_id, partition, problems)
            written += result.written
        with self._stats.lock:
            self._stats.batches += 1
            self._stats.records += records.num_rows
            self._stats.changes_written += written

    def _report_problems(
        self, batch_id: int, partition: int, problems: list[tuple[int, str]]
    ) -> None:
        if not problems:
            return
        with self._stats.lock:
            counts = self._stats.problems_by_partition
            counts[partition] = counts.get(partition, 0) + len(problems)
        for offset, problem in problems[:_LOGGED_PROBLEMS_PER_BATCH]:
            log.warning(
                "record skipped",
                partition=partition,
                offset=offset,
                problem=problem,
                batch=batch_id,
            )
        if len(problems) > _LOGGED_PROBLEMS_PER_BATCH:
            more = len(problems) - _LOGGED_PROBLEMS_PER_BATCH
            log.warning("more records skipped", partition=partition, count=more, batch=batch_id)


def _by_partition(records: pa.Table) -> Iterator[tuple[int, pa.Table]]:
    for partition in pc.unique(records["partition"]).to_pylist():
        yield int(partition), records.filter(pc.equal(records["partition"], partition))


def _problems(records: pa.Table) -> list[tuple[int, str]]:
    """(offset, reason) of the records Spark found unusable."""
    bad = records.filter(pc.invert(pc.is_null(records["problem"]))).select(["offset", "problem"])
    return list(zip(bad["offset"].to_pylist(), bad["problem"].to_pylist(), strict=True))


def _rows(changes: pa.Table, strict_json: bool, problems: list[tuple[int, str]]) -> Iterator[Row]:
    """Store rows; with strict_json, values that are not RFC 8259 JSON become problems.

    Spark's try_parse_json accepts a valid prefix ('{"a": 1} trailing'); the server embeds stored
    JSON in responses as it is, so it must be valid to the letter (orjson: ~0.15 µs a value).
    """
    columns: dict[str, list[Any]] = changes.select(
        ["key", "value", "offset", "timestamp_ms"]
    ).to_pydict()
    for key, value, offset, timestamp in zip(
        columns["key"], columns["value"], columns["offset"], columns["timestamp_ms"], strict=True
    ):
        if strict_json and value is not None:
            try:
                orjson.loads(value)
            except orjson.JSONDecodeError:
                problems.append((offset, "value is not valid JSON"))
                continue
        yield Row(key, value, offset, timestamp)
