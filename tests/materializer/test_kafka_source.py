"""The data source's pure parts: options as Spark hands them over, task grouping, and where a
micro-batch ends."""

from __future__ import annotations

from pyspark.sql.datasource import CaseInsensitiveDict

from materializer.kafka_source import (
    KafkaRange,
    SourceOptions,
    group_ranges,
    next_batch_ends,
    readable_ends,
)


def test_options_survive_sparks_case_insensitive_map():
    options = SourceOptions(
        bootstrap_servers="127.0.0.1:9092",
        topic="bookings",
        partitions=(0, 3, 5),
        starting_offsets={0: 10, 3: 0, 5: 42},
        max_records_per_partition=500,
        fetch_max_wait_ms=15,
        read_timeout_s=12.5,
        tasks_per_batch=2,
    )
    # Spark lowercases option keys; a missed camelCase key silently became the default once.
    as_spark_gives_them = CaseInsensitiveDict(options.as_spark_options())
    assert all(key == key.lower() for key in dict(as_spark_gives_them))
    assert SourceOptions.parse(as_spark_gives_them) == options


def test_ranges_are_dealt_into_at_most_the_given_number_of_tasks():
    ranges = [KafkaRange(p, 0, 10) for p in range(5)]
    assert [[r.partition for r in g.ranges] for g in group_ranges(ranges, 2)] == [[0, 2, 4], [1, 3]]
    assert len(group_ranges(ranges, 1)) == 1
    assert len(group_ranges(ranges[:1], 4)) == 1  # no empty tasks
    assert group_ranges([], 3) == []


def test_a_batch_ends_at_what_read_committed_can_read_the_last_stable_offset():
    # An open transaction from offset 40: the high watermark is 55, the LSO 40. A range to 55
    # would wait for the transaction (and time out, restarting the query); to 40 it is read.
    assert readable_ends({0: 55, 1: 9}, {0: 40, 1: 9}) == {0: 40, 1: 9}


def test_without_a_last_stable_offset_the_high_watermark_is_the_end():
    # Fetch before v4 reports -1; a partition the LSO Fetch failed for is missing.
    assert readable_ends({0: 55, 1: 9}, {0: -1}) == {0: 55, 1: 9}


def test_batches_are_capped_per_partition_and_never_end_before_they_start():
    starts = {0: 100, 1: 5, 2: 70}
    ends = {0: 50_000, 1: 9, 2: 60}  # 2: an end that went backwards (a new leader)
    assert next_batch_ends(starts, ends, cap=1000) == {0: 1100, 1: 9, 2: 70}


class _ProbeOfARetainedLog:
    """The broker's view of a topic whose retention deleted partition 0's first million
    offsets; partition 1 still starts at 0."""

    def __init__(self) -> None:
        self.log_starts = {0: 1_000_000, 1: 0}

    def readable_ends(self, topic, partitions, positions):
        return {0: 1_050_000, 1: 50}


def test_an_empty_store_plans_its_first_batch_from_the_log_start(monkeypatch):
    """Capping from offset 0 would plan batches of deleted offsets: the reader starts at the log
    start and drops everything as past the batch's end, and the store never fills."""
    from materializer import kafka_source  # noqa: PLC0415

    options = SourceOptions(
        bootstrap_servers="retained:9092",
        topic="bookings",
        partitions=(0, 1),
        starting_offsets={0: 0, 1: 0},
        max_records_per_partition=20_000,
        fetch_max_wait_ms=15,
        read_timeout_s=12.5,
    )
    monkeypatch.setitem(kafka_source._PROBES, "retained:9092", _ProbeOfARetainedLog())
    reader = kafka_source.KafkaStreamReader(options)
    assert reader.latestOffset() == {"0": 1_020_000, "1": 50}
