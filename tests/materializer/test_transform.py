"""Decoding checks, the KTable sink and the transform hook, on real Spark and a real store."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from structlog.testing import capture_logs

from materializer.examples.bookings import booking_summary, merge_summary
from materializer.kafka_source import SCHEMA
from materializer.sink import BatchSink, IngestStats
from materializer.store import Store
from materializer.transform import KTABLE, RecordRules, load_transform

pytestmark = pytest.mark.integration

T0 = dt.datetime(2026, 11, 22, 10, 0, tzinfo=dt.UTC)


def records(spark, rows):
    """rows: (partition, offset, key, value) -> a DataFrame with the Kafka source's schema."""
    data = [
        (key, value, "bookings", partition, offset, T0 + dt.timedelta(seconds=offset), [])
        for partition, offset, key, value in rows
    ]
    return spark.createDataFrame(data, SCHEMA)


@pytest.fixture
def store(tmp_path):
    opened = Store(tmp_path / "store")
    for p in (0, 1):
        opened.add_partition(p)
    yield opened
    opened.close()


def test_ktable_keeps_the_latest_value_and_applies_deletes(spark, store):
    stats = IngestStats()
    sink = BatchSink(store, KTABLE, RecordRules("json"), stats)
    sink(
        records(
            spark,
            [
                (0, 0, b"a", b'{"v":1}'),
                (0, 1, b"b", b'{"v":2}'),
                (0, 2, b"a", b'{"v":3}'),
                (1, 0, b"c", b'{"v":4}'),
            ],
        ),
        0,
    )
    sink(records(spark, [(0, 3, b"b", None), (1, 1, b"c", b'{"v":5}')]), 1)
    assert store.get(0, b"a").value == b'{"v":3}'
    assert store.get(0, b"b") is None
    assert store.get(1, b"c").value == b'{"v":5}'
    assert (store.checkpoint(0).next_offset, store.checkpoint(1).next_offset) == (4, 2)
    assert store.checkpoint(0).newest_record_ms == int(
        (T0 + dt.timedelta(seconds=3)).timestamp() * 1000
    )
    assert (stats.batches, stats.records) == (2, 6)


@pytest.mark.parametrize(
    ("value_format", "value", "problem"),
    [
        ("json", b"{not json", "value is not valid JSON"),
        ("json", b'{"a": 1} trailing', "value is not valid JSON"),
        ("json", b"\xff\xfe", "value is not valid UTF-8"),
        ("string", b"\xc3\x28", "value is not valid UTF-8"),
    ],
)
def test_bad_records_are_skipped_counted_and_still_advance_the_checkpoint(
    spark, store, value_format, value, problem
):
    stats = IngestStats()
    sink = BatchSink(store, KTABLE, RecordRules(value_format), stats)
    batch = [(0, 0, b"good", b'"fine"'), (0, 1, b"bad", value), (0, 2, None, b'"no key"')]
    with capture_logs() as logs:
        sink(records(spark, batch), 0)
    assert store.get(0, b"good").value == b'"fine"'
    assert store.get(0, b"bad") is None
    assert store.checkpoint(0).next_offset == 3  # the pipeline moves past them
    assert stats.problems_by_partition == {0: 2}
    skipped = {
        (e["partition"], e["offset"], e["problem"]) for e in logs if e["event"] == "record skipped"
    }
    assert skipped == {(0, 1, problem), (0, 2, "null key")}


UUID = b"123e4567-e89b-12d3-a456-426614174000"


@pytest.mark.parametrize(
    ("key_format", "good_and_bad", "problem"),
    [
        ("string", (b"alice", b"\xff\xfe"), "key is not valid UTF-8"),
        ("int64", ((7).to_bytes(8, "big"), (7).to_bytes(4, "big")), "key is not 8 bytes (int64)"),
        ("int32", ((7).to_bytes(4, "big"), b"7"), "key is not 4 bytes (int32)"),
        ("uuid", (UUID, UUID.upper()), "key is not a lower-case UUID"),
    ],
)
def test_keys_a_lookup_could_never_reach_are_skipped_and_logged(
    spark, store, key_format, good_and_bad, problem
):
    good_key, bad_key = good_and_bad
    stats = IngestStats()
    sink = BatchSink(store, KTABLE, RecordRules("json", key_format), stats)
    with capture_logs() as logs:
        sink(records(spark, [(1, 0, good_key, b"1"), (1, 1, bad_key, b"2")]), 0)
    assert store.get(1, good_key).value == b"1"
    assert store.get(1, bad_key) is None
    assert stats.problems_by_partition == {1: 1}
    assert [(e["partition"], e["offset"], e["problem"]) for e in logs if "problem" in e] == [
        (1, 1, problem)
    ]


def test_oversized_values_are_skipped_and_the_batch_goes_on(spark, store):
    stats = IngestStats()
    sink = BatchSink(store, KTABLE, RecordRules("json", max_value_bytes=1000), stats)
    huge = json.dumps({"blob": "x" * 5000}).encode()
    with capture_logs() as logs:
        sink(records(spark, [(0, 0, b"big", huge), (0, 1, b"small", b'"ok"')]), 0)
    assert store.get(0, b"big") is None
    assert store.get(0, b"small").value == b'"ok"'
    assert store.checkpoint(0).next_offset == 2
    (skipped,) = [e for e in logs if e["event"] == "record skipped"]
    assert skipped["problem"] == f"value is {len(huge)} bytes, over KROUTE_MAX_VALUE_BYTES=1000"
    assert (skipped["partition"], skipped["offset"]) == (0, 0)


def test_bytes_values_are_never_malformed(spark, store):
    stats = IngestStats()
    BatchSink(store, KTABLE, RecordRules("bytes"), stats)(
        records(spark, [(0, 0, b"k", b"\xff\xfe\x00")]), 0
    )
    assert store.get(0, b"k").value == b"\xff\xfe\x00"
    assert stats.problems() == 0


def booking(n, route="London-Paris"):
    return json.dumps({"booking_id": n, "route": route}).encode()


def test_booking_summary_counts_across_batches_and_restarts_after_a_delete(spark, store):
    transform = load_transform(
        "materializer.examples.bookings:booking_summary",
        "materializer.examples.bookings:merge_summary",
    )
    assert transform.function is booking_summary
    assert transform.merge is merge_summary
    stats = IngestStats()
    sink = BatchSink(store, transform, RecordRules("json"), stats)
    sink(
        records(
            spark,
            [(0, 0, b"ann", booking(1)), (0, 1, b"ann", booking(2)), (0, 2, b"bob", booking(3))],
        ),
        0,
    )
    assert json.loads(store.get(0, b"ann").value) == {
        "bookings": 2,
        "latest": {"booking_id": 2, "route": "London-Paris"},
    }
    sink(records(spark, [(0, 3, b"ann", booking(4, "Paris-Rome")), (0, 4, b"bob", None)]), 1)
    assert json.loads(store.get(0, b"ann").value) == {
        "bookings": 3,
        "latest": {"booking_id": 4, "route": "Paris-Rome"},
    }
    assert store.get(0, b"bob") is None  # a tombstone deletes the summary
    sink(
        records(
            spark, [(0, 5, b"ann", None), (0, 6, b"ann", booking(5)), (0, 7, b"bob", booking(6))]
        ),
        2,
    )
    assert (
        json.loads(store.get(0, b"ann").value)["bookings"] == 1
    )  # counting starts again after a delete
    assert json.loads(store.get(0, b"bob").value)["bookings"] == 1
    assert store.checkpoint(0).next_offset == 8


def test_hook_specs_that_do_not_resolve_say_why():
    with pytest.raises(ValueError, match="not of the form"):
        load_transform("no_colon", None)
    with pytest.raises(ValueError, match=r"cannot import 'no\.such\.module'"):
        load_transform("no.such.module:f", None)
    with pytest.raises(ValueError, match="has no 'nothing'"):
        load_transform("materializer.examples.bookings:nothing", None)
    with pytest.raises(ValueError, match="needs a transform function"):
        load_transform(None, "materializer.examples.bookings:merge_summary")


def test_sparks_own_kafka_source_without_its_package_fails_clearly(spark):
    from pyspark.errors import AnalysisException  # noqa: PLC0415

    from materializer.pipeline import QueryPlan, read_kafka  # noqa: PLC0415
    from materializer.settings import NodeSettings  # noqa: PLC0415

    settings = NodeSettings.from_env(
        {
            "KROUTE_BOOTSTRAP_SERVERS": "127.0.0.1:9",
            "KROUTE_TOPIC": "t",
            "KROUTE_SOURCE": "spark-kafka",
        }
    )
    with pytest.raises(AnalysisException, match="Failed to find data source: kafka"):
        read_kafka(spark, settings, QueryPlan("t", {0: 0}))
