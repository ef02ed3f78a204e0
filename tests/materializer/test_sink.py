"""The sink on real Spark and a real store: checkpoints at the end of the range a batch read,
and records a custom transform fails on, isolated instead of failing the batch forever."""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from materializer.errors import first_line
from materializer.kafka_source import SCHEMA
from materializer.sink import BatchSink, IngestStats
from materializer.store import Store
from materializer.transform import KTABLE, RecordRules, Transform
from tests.materializer.poison_transform import (
    BROKEN_FLAG,
    POISON,
    broken_while_flagged,
    fails_on_poison,
)

pytestmark = pytest.mark.integration

T0 = dt.datetime(2026, 11, 22, 10, 0, tzinfo=dt.UTC)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def workers_import_the_tests() -> None:
    # Spark's Python workers unpickle the test transform's UDF by reference: they must be
    # able to import tests.materializer.poison_transform. They start with this environment.
    path = os.environ.get("PYTHONPATH", "")
    if str(ROOT) not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), path) if p)


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


def next_offsets(store: Store) -> dict[int, int | None]:
    return {p: cp.next_offset if cp else None for p, cp in store.checkpoints().items()}


def test_the_checkpoint_moves_to_the_end_of_the_range_read_not_past_the_last_record(spark, store):
    # A transactional producer's range ends in a commit marker (offset 3): no record for the
    # sink, but the partition's end. One past the last record (3) would be lag 1 for good.
    sink = BatchSink(store, KTABLE, RecordRules("json"), IngestStats())
    batch = [(0, 0, b"a", b"1"), (0, 1, b"b", b"2"), (0, 2, b"a", b"3")]
    sink(records(spark, batch), 0, {0: 4, 1: 0})
    assert next_offsets(store) == {0: 4, 1: None}, "an empty range writes nothing"
    assert store.get(0, b"a").value == b"3"


def test_a_range_with_no_records_at_all_still_moves_the_checkpoint(spark, store):
    # Only markers (or, under read_committed, an aborted transaction's records) in the range.
    sink = BatchSink(store, KTABLE, RecordRules("json"), IngestStats())
    sink(records(spark, [(0, 0, b"a", b"1")]), 0, {0: 1})
    sink(records(spark, []), 1, {0: 7, 1: 2})
    assert next_offsets(store) == {0: 7, 1: 2}
    sink(records(spark, []), 2, {0: 5})  # an end below the checkpoint never moves it back
    assert next_offsets(store) == {0: 7, 1: 2}


def test_records_a_transform_fails_on_are_skipped_counted_and_the_rest_applied(spark, store):
    stats = IngestStats()
    transform = Transform("fails_on_poison", fails_on_poison, KTABLE.merge)
    sink = BatchSink(store, transform, RecordRules("json"), stats)
    batch = [(0, o, f"k{o}".encode(), b'{"n": %d}' % o) for o in range(40)]
    batch[17] = (0, 17, b"k17", POISON)
    batch += [(1, 0, b"x", POISON), (1, 1, b"y", b'{"n": 1}')]
    with capture_logs() as logs:
        sink(records(spark, batch), 0, {0: 40, 1: 2})
    assert store.get(0, b"k17") is None
    assert store.get(1, b"x") is None
    assert store.get(0, b"k18").value == b'{"n": 18}'
    assert store.get(1, b"y") is not None
    assert sum(1 for _ in store.items(0)) == 39
    assert stats.problems_by_partition == {0: 1, 1: 1}
    assert next_offsets(store) == {0: 40, 1: 2}
    skipped = [e for e in logs if e["event"] == "record skipped"]
    assert {(e["partition"], e["offset"]) for e in skipped} == {(0, 17), (1, 0)}
    assert all("ValueError: poison record" in e["problem"] for e in skipped), skipped


def test_a_transform_that_fails_on_no_records_at_all_fails_the_batch_and_skips_nothing(
    spark, store, tmp_path, monkeypatch
):
    # Broken code, not bad data: skipping every record would lose the topic silently.
    flag = tmp_path / "broken"
    flag.touch()
    monkeypatch.setenv(BROKEN_FLAG, str(flag))
    stats = IngestStats()
    transform = Transform("broken", broken_while_flagged, KTABLE.merge)
    sink = BatchSink(store, transform, RecordRules("json"), stats)
    with pytest.raises(RuntimeError, match="broken by a bad deploy"):
        sink(records(spark, [(0, 0, b"a", b"1")]), 0, {0: 1})
    assert next_offsets(store) == {0: None, 1: None}
    assert stats.problems() == 0


def test_an_error_from_a_python_worker_is_told_by_its_last_line():
    worker_error = RuntimeError(
        "\n  An exception was thrown from the Python worker. Please see the stack trace below."
        '\nTraceback (most recent call last):\n  File "x.py", line 20, in _checked\n'
        '    raise ValueError("poison record")\nValueError: poison record\n'
    )
    assert first_line(worker_error) == "RuntimeError: ValueError: poison record"
    failed_query = RuntimeError(
        "[STREAM_FAILED] Query terminated with exception: [FOREACH_BATCH_USER_FUNCTION_ERROR] "
        'Return Message: Traceback (most recent call last):\n  File "sink.py", line 9, in f\n'
        "    raise RuntimeError('broken')\nRuntimeError: broken\n SQLSTATE: 39000\n"
        "=== Streaming Query ===\nCurrent State: ACTIVE\n"
    )
    assert first_line(failed_query) == "RuntimeError: RuntimeError: broken"
    assert first_line(ValueError("one\ntwo")) == "ValueError: one"
