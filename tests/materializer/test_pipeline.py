"""The pipeline's supervisor with a stand-in for Spark's query: re-plans at any moment, stops
while a query starts, the end offsets each batch hands the sink, and what counts as a stall.

The stand-in does what the supervisor relies on: `start()` takes a while (a real query takes
~1 s to start on this machine), then batches arrive every few ms through foreachBatch until
`stop()`, each after its end offsets are in the offset log, as Spark writes them.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from materializer import pipeline as pipeline_module
from materializer.lag import PartitionLag
from materializer.pipeline import Pipeline, QueryPlan, batch_end_offsets, find_stalls
from materializer.settings import NodeSettings

TOPIC = "bookings"


class FakeQuery:
    """A started query: calls foreachBatch every few ms until stopped."""

    def __init__(self, plan: QueryPlan, apply: Callable[[Any, int], None], checkpoint: Path):
        self.plan, self._apply, self._checkpoint = plan, apply, checkpoint
        self._stopped = threading.Event()
        self.lastProgress: dict[str, Any] | None = None
        self._thread = threading.Thread(target=self._batches, daemon=True)
        self._thread.start()

    @property
    def isActive(self) -> bool:  # noqa: N802 - Spark's name
        return not self._stopped.is_set()

    def _batches(self) -> None:
        batch_id = 0
        while not self._stopped.wait(0.01):
            ends = {str(p): o + batch_id + 1 for p, o in self.plan.starting_offsets.items()}
            log = self._checkpoint / "offsets"
            log.mkdir(parents=True, exist_ok=True)
            (log / str(batch_id)).write_text(f'v1\n{{"batchWatermarkMs":0}}\n{json.dumps(ends)}')
            self._apply(self.plan, batch_id)
            batch_id += 1

    def stop(self) -> None:
        """Like Spark's, returns once the query's batches have ended (the pipeline may then
        delete its checkpoint: a batch still writing its offset log there failed the test)."""
        self._stopped.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(5)

    def awaitTermination(self) -> None:  # noqa: N802 - Spark's name
        self._stopped.wait()


@dataclass
class FakeSpark:
    """read_kafka(...).writeStream...start(), with a slow start."""

    start_delay_s: float = 0.0
    queries: list[FakeQuery] = field(default_factory=list)
    starting: threading.Event = field(default_factory=threading.Event)

    def read_kafka(self, _spark: Any, _settings: Any, plan: QueryPlan) -> Any:
        return _Builder(self, plan)


class _Builder:
    def __init__(self, spark: FakeSpark, plan: QueryPlan) -> None:
        self._spark, self._plan = spark, plan
        self._apply: Callable[[Any, int], None] | None = None
        self._checkpoint = Path()

    @property
    def writeStream(self) -> _Builder:  # noqa: N802 - Spark's name
        return self

    def foreachBatch(self, apply: Callable[[Any, int], None]) -> _Builder:  # noqa: N802
        self._apply = apply
        return self

    def option(self, name: str, value: str) -> _Builder:
        if name == "checkpointLocation":
            self._checkpoint = Path(value)
        return self

    def trigger(self, **_: str) -> _Builder:
        return self

    def queryName(self, _name: str) -> _Builder:  # noqa: N802 - Spark's name
        return self

    def start(self) -> FakeQuery:
        self._spark.starting.set()
        time.sleep(self._spark.start_delay_s)
        self._spark.starting.clear()
        assert self._apply is not None
        query = FakeQuery(self._plan, self._apply, self._checkpoint)
        self._spark.queries.append(query)
        return query


@dataclass
class RecordingSink:
    """Which plan each applied batch came from, and the end offsets it was given."""

    applied: list[tuple[QueryPlan, int, dict[int, int] | None]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, batch: QueryPlan, batch_id: int, ends: dict[int, int] | None) -> None:
        with self.lock:
            self.applied.append((batch, batch_id, ends))

    def count(self, plan_partitions: set[int]) -> int:
        with self.lock:
            return sum(
                1 for plan, _, _ in self.applied if set(plan.starting_offsets) == plan_partitions
            )


@pytest.fixture
def settings(tmp_path: Path) -> NodeSettings:
    return NodeSettings.from_env(
        {
            "KROUTE_BOOTSTRAP_SERVERS": "127.0.0.1:9",
            "KROUTE_TOPIC": TOPIC,
            "KROUTE_DATA_DIR": str(tmp_path),
            "KROUTE_START_RETRY_MAX_S": "1",
        }
    )


@dataclass
class Running:
    pipeline: Pipeline
    spark: FakeSpark
    sink: RecordingSink
    hosted: dict[int, int]  # what plan_source returns next: partition -> starting offset


@pytest.fixture
def running(settings: NodeSettings, monkeypatch: pytest.MonkeyPatch) -> Iterator[Running]:
    spark = FakeSpark()
    monkeypatch.setattr(pipeline_module, "read_kafka", spark.read_kafka)
    sink = RecordingSink()
    hosted = {0: 0}
    pipeline = Pipeline(
        spark,  # type: ignore[arg-type]
        settings,
        sink,  # type: ignore[arg-type]
        lambda: QueryPlan(TOPIC, dict(hosted)),
    )
    yield Running(pipeline, spark, sink, hosted)
    pipeline.stop(timeout_s=5)


def wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def test_a_replan_while_the_next_query_starts_ends_on_the_newest_plan_applying_batches(running):
    # Issue 23, defect 1: the second re-plan used to stop the old, already stopped query and
    # leave the flag set, so every batch of the query that was starting was skipped for good
    # while the node stayed ready ("replan flag set: True, batches applied in 3 s: 0").
    running.pipeline.start()
    assert wait_for(lambda: running.sink.count({0}) > 0)
    running.spark.start_delay_s = 1.0  # a query takes a while to start

    running.hosted[1] = 0
    running.pipeline.replan()  # the query for {0, 1} starts...
    assert wait_for(running.spark.starting.is_set)
    running.hosted[2] = 0
    running.pipeline.replan()  # ...and the partitions change again before it has

    assert wait_for(lambda: running.sink.count({0, 1, 2}) > 5, timeout_s=6), (
        f"batches on the newest plan: {running.sink.count({0, 1, 2})}, "
        f"queries started: {[set(q.plan.starting_offsets) for q in running.spark.queries]}"
    )
    assert running.pipeline.running
    active = [q for q in running.spark.queries if q.isActive]
    assert [set(q.plan.starting_offsets) for q in active] == [{0, 1, 2}], "one query, the newest"
    # Nothing planned before the second re-plan reached the store once it was asked for.
    assert running.sink.count({0, 1}) == 0


def test_replans_at_any_moment_always_end_on_a_query_that_applies_batches(running):
    running.pipeline.start()
    running.spark.start_delay_s = 0.05
    for n in range(1, 30):
        running.hosted[n] = 0
        running.pipeline.replan()
        time.sleep(0.013 * (n % 7))  # before, during and after the next start
    newest = set(running.hosted)
    assert wait_for(lambda: running.sink.count(newest) > 3), "the newest plan applies batches"
    assert [set(q.plan.starting_offsets) for q in running.spark.queries if q.isActive] == [newest]


def test_a_stop_while_a_query_starts_stops_that_query_too(running):
    running.spark.start_delay_s = 0.5
    running.pipeline.start()
    assert wait_for(running.spark.starting.is_set)
    running.pipeline.stop(timeout_s=5)
    assert wait_for(lambda: bool(running.spark.queries))
    assert wait_for(lambda: not any(q.isActive for q in running.spark.queries))
    assert not running.pipeline.running


def test_each_batch_hands_the_sink_the_end_offsets_spark_logged_for_it(running):
    running.hosted.update({0: 10, 3: 7})
    running.pipeline.start()
    assert wait_for(lambda: running.sink.count({0, 3}) > 1)
    _plan, batch_id, ends = running.sink.applied[0]
    assert ends == {0: 10 + batch_id + 1, 3: 7 + batch_id + 1}
    assert running.pipeline.state().last_batch_at_ms is not None


def offset_log(tmp_path: Path, text: str) -> Path:
    (tmp_path / "offsets").mkdir(parents=True)
    (tmp_path / "offsets" / "4").write_text(text)
    return tmp_path


def test_end_offsets_are_read_from_either_sources_offset_log_format(tmp_path):
    ours = offset_log(tmp_path / "ours", 'v1\n{"batchWatermarkMs":0}\n{"0":12,"5":40}')
    assert batch_end_offsets(ours, 4, TOPIC) == {0: 12, 5: 40}
    sparks = offset_log(tmp_path / "spark", 'v1\n{"batchWatermarkMs":0}\n{"bookings":{"1":3}}')
    assert batch_end_offsets(sparks, 4, TOPIC) == {1: 3}


def test_an_unreadable_offset_log_gives_no_ends_so_the_sink_falls_back(tmp_path):
    assert batch_end_offsets(tmp_path, 4, TOPIC) is None  # no such batch
    assert batch_end_offsets(offset_log(tmp_path / "v9", "v9\n{}\n{}"), 4, TOPIC) is None
    assert batch_end_offsets(offset_log(tmp_path / "bad", "v1\n{}\nnot json"), 4, TOPIC) is None


# -- stalls ------------------------------------------------------------------------------------

NOW = 1_000_000
TIMEOUT = 30_000


def lag(current: int, end: int | None, caught_up_at: int | None) -> PartitionLag:
    return PartitionLag(0, current, end, None, caught_up_at, NOW)


def stalls(lags: dict[int, PartitionLag], progress: dict[int, int], **kw: Any) -> set[int]:
    return set(find_stalls(lags, progress, now_ms=NOW, timeout_ms=TIMEOUT, **kw))


def test_a_partition_with_unread_records_and_no_progress_for_the_timeout_is_stalled():
    frozen = lag(100, 150, NOW - 40_000)
    assert stalls({0: frozen}, {0: NOW - 40_000}) == {0}
    assert stalls({0: frozen}, {0: NOW - 1_000}) == set(), "it moved a second ago"


def test_records_after_an_idle_hour_are_not_an_hour_late():
    # Idle: caught up at every refresh; the store last moved an hour ago. A write arrives.
    assert stalls({0: lag(100, 101, NOW - 250)}, {0: NOW - 3_600_000}) == set()


def test_nothing_unread_or_an_unknown_end_is_never_a_stall():
    assert stalls({0: lag(100, 100, NOW - 90_000)}, {0: NOW - 90_000}) == set()
    assert stalls({0: lag(100, None, None)}, {0: NOW - 90_000}) == set()


def test_a_partition_never_caught_up_stalls_after_its_progress_stops():
    restoring = lag(5_000, 90_000, None)
    assert stalls({0: restoring}, {0: NOW - 2_000}) == set()
    assert stalls({0: restoring}, {0: NOW - 31_000}) == {0}


def test_the_reason_names_the_unread_records_and_an_error_from_during_the_stall():
    frozen = {0: lag(100, 150, NOW - 40_000)}
    during = find_stalls(
        frozen,
        {0: NOW - 40_000},
        now_ms=NOW,
        timeout_ms=TIMEOUT,
        last_error="PythonException: poison",
        last_error_at_ms=NOW - 5_000,
    )[0]
    assert during.unread == 50
    assert during.since_ms == NOW - 40_000
    assert "50 offsets unread" in during.reason
    assert "poison" in during.reason
    before = find_stalls(
        frozen,
        {0: NOW - 40_000},
        now_ms=NOW,
        timeout_ms=TIMEOUT,
        last_error="an old error",
        last_error_at_ms=NOW - 50_000,
    )[0]
    assert "old error" not in before.reason
