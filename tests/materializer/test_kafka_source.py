"""The data source's pure parts: options as Spark hands them over, and task grouping."""

from __future__ import annotations

from pyspark.sql.datasource import CaseInsensitiveDict

from materializer.kafka_source import KafkaRange, SourceOptions, group_ranges


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
