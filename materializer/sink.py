"""The micro-batch sink (Spark's foreachBatch): transform, collect, write to the store.

Per partition, a batch's changes and the partition's new checkpoint go to the store in one
atomic write. The checkpoint is the end of the range the batch read (Spark's offset log, see
pipeline.batch_end_offsets), not one past its last record: a range may end in records that are
not data (transaction commit and abort markers, aborted records under read_committed), and a
checkpoint short of them would show lag forever. Without known ends it is one past the last
record, bad records included.

Records that cannot be materialized are counted and logged with partition and offset, never
retried forever: records the decoding checks refuse, and records a custom transform raises on.
When a transform fails on a batch, the sink asks whether the transform or the data is at
fault: a transform that fails on no rows at all is broken (the batch fails, and the pipeline
restarts and says so); otherwise the failing records are found by bisection (each half of a
failing set is tried again, on the batch Spark has cached) and skipped like malformed ones.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import structlog
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F  # noqa: N812 - Spark's own convention

from materializer.errors import first_line
from materializer.store import MergeBroken, Row, Store
from materializer.transform import (
    CHANGE_COLUMNS,
    RecordRules,
    Transform,
    as_changes,
    with_problems,
)

log = structlog.get_logger("kroute.materializer.sink")

_LOGGED_PROBLEMS_PER_BATCH = 20  # a flood of bad records is counted in full, logged in part
# Spark jobs one batch may spend looking for the records a transform fails on (~0.1-0.3 s each
# here): one bad record among 20,000 takes ~30. Past this the batch fails as a whole: so many
# failing records point at the transform, not at the data.
_MAX_ISOLATION_JOBS = 200

Offset = tuple[int, int]  # (partition, offset) of one record

# Upper bounds of the micro-batch duration histogram (seconds): a trickle's batch takes ~0.1 s
# of fixed Spark cost here, a capped batch of a restore seconds, a stuck one minutes.
BATCH_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class IngestStats:
    """Counters the node reports; updated by the sink thread, read by the HTTP thread."""

    batches: int = 0
    records: int = 0
    changes_written: int = 0
    problems_by_partition: dict[int, int] = field(default_factory=dict)
    last_batch_ms: float = 0.0
    # Batch durations as histogram counts, kept as plain integers (bucket i: at most
    # BATCH_BUCKETS_S[i]; the last: longer), turned into a Prometheus histogram when scraped.
    batch_duration_counts: list[int] = field(
        default_factory=lambda: [0] * (len(BATCH_BUCKETS_S) + 1)
    )
    batch_duration_sum_s: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def problems(self) -> int:
        return sum(self.problems_by_partition.values())

    def observe_batch(self, seconds: float) -> None:
        """Count one applied batch's duration (the caller holds `lock`)."""
        self.batch_duration_counts[bisect_left(BATCH_BUCKETS_S, seconds)] += 1
        self.batch_duration_sum_s += seconds
        self.last_batch_ms = seconds * 1000


class BatchSink:
    def __init__(
        self, store: Store, transform: Transform, rules: RecordRules, stats: IngestStats
    ) -> None:
        self._store = store
        self._transform = transform
        self._rules = rules
        self._stats = stats

    def __call__(
        self, batch: DataFrame, batch_id: int, ends: Mapping[int, int] | None = None
    ) -> None:
        """Apply one micro-batch; `ends`: partition -> the offset after the range it read."""
        started = time.perf_counter()  # the batch's records are read (lazily) from here on
        checked = with_problems(batch, self._rules)
        if self._transform.is_ktable:
            records = checked.select(*CHANGE_COLUMNS, "problem").toArrow()
            changes = records.filter(pc.is_null(records["problem"]))
        else:
            checked = checked.persist()  # read Kafka once for every collect below
            try:
                records = checked.select("partition", "offset", "timestamp_ms", "problem").toArrow()
                records, changes = self._transformed(batch_id, checked, records)
            finally:
                checked.unpersist()
        self._apply(batch_id, records, changes, ends or {}, started)

    # -- a custom transform, and the records it fails on --------------------------------------

    def _transformed(
        self, batch_id: int, checked: DataFrame, records: pa.Table
    ) -> tuple[pa.Table, pa.Table]:
        """(records with the ones the transform fails on marked as problems, the changes)."""
        valid = checked.where(F.col("problem").isNull()).drop("problem", "timestamp_ms")
        failure = self._failure(valid)
        if failure is None:
            return records, self._changes(valid)
        error, exc = failure
        if self._failure(valid.limit(0)) is not None:
            raise exc  # fails on no rows: the transform is broken, not the data; never skip all
        log.warning("the transform failed on a batch; looking for the records", error=error)
        bad = _find_bad(valid, _valid_offsets(records), self._failure, _MAX_ISOLATION_JOBS)
        if not bad:  # too many to look for, or none failed alone (a flaky transform)
            raise exc
        log.warning("records the transform fails on are skipped", count=len(bad), batch=batch_id)
        records = _mark_problems(records, bad)
        kept = valid.where(~_among(list(bad)))
        return records, self._changes(kept)

    def _changes(self, valid: DataFrame) -> pa.Table:
        assert self._transform.function is not None
        return as_changes(self._transform.function(valid)).toArrow()

    def _failure(self, valid: DataFrame) -> tuple[str, Exception] | None:
        """Why the transform fails on these records (None: it does not)."""
        try:
            self._changes(valid)
        except Exception as exc:  # noqa: BLE001 - user code: anything may be raised
            return f"transform failed: {first_line(exc)}", exc
        return None

    # -- writing ------------------------------------------------------------------------------

    def _apply(
        self,
        batch_id: int,
        records: pa.Table,
        changes: pa.Table,
        ends: Mapping[int, int],
        started: float,
    ) -> None:
        written = 0
        broken: MergeBroken | None = None
        with_records = dict(_by_partition(records))
        for partition in sorted(set(with_records) | set(ends)):
            part_records = with_records.get(partition)
            if part_records is None:
                self._pass_range(partition, ends[partition])
                continue
            next_offset = _next_offset(part_records, ends.get(partition))
            newest = pc.max(part_records["timestamp_ms"]).as_py()
            problems = _problems(part_records)
            in_partition = pc.equal(changes["partition"], partition)
            part_changes = changes.filter(in_partition).sort_by("offset")
            rows = _rows(part_changes, self._rules.value_format == "json", problems)
            try:
                result = self._store.apply(
                    partition, rows, next_offset, newest, self._transform.merge
                )
            except MergeBroken as exc:
                broken = broken or exc  # the other partitions are applied first
                continue
            problems.extend(result.merge_failures)  # poison rows for the merge hook: skipped
            self._report_problems(batch_id, partition, problems)
            written += result.written
        with self._stats.lock:
            self._stats.batches += 1
            self._stats.records += records.num_rows
            self._stats.changes_written += written
            self._stats.observe_batch(time.perf_counter() - started)
        if broken is not None:
            raise broken  # that partition stays where it was, visibly stalled

    def _pass_range(self, partition: int, end: int) -> None:
        """A range with no records for the sink (only transaction markers, or records that
        read_committed does not deliver): the checkpoint still moves to its end."""
        checkpoint = self._store.checkpoint(partition)
        position = checkpoint.next_offset if checkpoint else 0
        if end <= position or partition not in self._store.partitions():
            return  # an empty range (every idle partition, every batch), or no longer hosted
        self._store.apply(partition, [], end, None)
        log.debug("checkpoint moved past offsets with no records", partition=partition, to=end)

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


def _next_offset(records: pa.Table, end: int | None) -> int:
    """Where the partition's checkpoint moves: the end of the range read, or, when that is
    not known, one past the last record."""
    after_last = int(pc.max(records["offset"]).as_py()) + 1
    return after_last if end is None else max(end, after_last)


def _valid_offsets(records: pa.Table) -> list[Offset]:
    valid = records.filter(pc.is_null(records["problem"]))
    pairs = zip(valid["partition"].to_pylist(), valid["offset"].to_pylist(), strict=True)
    return sorted((int(p), int(o)) for p, o in pairs)


def _between(first: Offset, last: Offset) -> Column:
    """Records from `first` to `last`, (partition, offset) in lexicographic order."""
    partition, offset = F.col("partition"), F.col("offset")
    after = (partition > first[0]) | ((partition == first[0]) & (offset >= first[1]))
    before = (partition < last[0]) | ((partition == last[0]) & (offset <= last[1]))
    return after & before


def _among(offsets: list[Offset]) -> Column:
    key = F.concat_ws(":", F.col("partition").cast("string"), F.col("offset").cast("string"))
    return key.isin([f"{p}:{o}" for p, o in offsets])


def _find_bad(
    valid: DataFrame,
    offsets: list[Offset],
    failure: Callable[[DataFrame], tuple[str, Exception] | None],
    max_jobs: int,
) -> dict[Offset, str] | None:
    """The records the transform fails on, each with why. `offsets` (every valid record) are
    known to fail together: each failing set is split in two and both halves tried again,
    down to single records. None when that takes more than `max_jobs` tries."""
    bad: dict[Offset, str] = {}
    pending = _halves(offsets)
    for _ in range(max_jobs):
        if not pending:
            return bad
        chunk = pending.pop()
        why = failure(valid.where(_between(chunk[0], chunk[-1])))
        if why is None:
            continue
        if len(chunk) == 1:
            bad[chunk[0]] = why[0]
        else:
            pending += _halves(chunk)
    return None if pending else bad


def _halves(chunk: list[Offset]) -> list[list[Offset]]:
    """The two halves of a failing set, the later first (pending is a stack)."""
    if len(chunk) < 2:
        return [chunk] if chunk else []
    middle = len(chunk) // 2
    return [chunk[middle:], chunk[:middle]]


def _mark_problems(records: pa.Table, bad: Mapping[Offset, str]) -> pa.Table:
    pairs = zip(
        records["partition"].to_pylist(),
        records["offset"].to_pylist(),
        records["problem"].to_pylist(),
        strict=True,
    )
    problems = [bad.get((int(p), int(o)), problem) for p, o, problem in pairs]
    column = records.schema.get_field_index("problem")
    return records.set_column(column, "problem", pa.array(problems, pa.string()))


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
