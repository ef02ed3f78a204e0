"""The lag tracker pinned where mutants of materializer/lag.py survived the other tests
(scripts/mutation, docs/testing.md): what a refresh asks the broker, what it does and logs when
the broker cannot be read, the retry loop, and the log lines of a store outside the log. Also
`PartitionLag`, which mutmut does not mutate (a slots dataclass): its report, pinned exactly.

Plain checkpoints stand in for the RocksDB store (the tracker reads nothing else from it), so
these tests open no store.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from structlog.testing import capture_logs

from materializer import lag as lag_module
from materializer.kafka_offsets import LogBounds
from materializer.lag import LagTracker, PartitionLag
from materializer.store import Checkpoint, Store


class Checkpoints:
    """The one method of Store the tracker calls, over plain values."""

    def __init__(self, positions: dict[int, int | None]) -> None:
        self.positions = positions

    def checkpoints(self) -> dict[int, Checkpoint | None]:
        return {
            p: None if offset is None else Checkpoint(offset, 900, 0)
            for p, offset in self.positions.items()
        }


def tracker_over(positions: dict[int, int | None], partitions: tuple[int, ...]) -> LagTracker:
    return tracker_of(Checkpoints(positions), partitions)


def tracker_of(checkpoints: Checkpoints, partitions: tuple[int, ...]) -> LagTracker:
    store: Any = checkpoints
    tracked: Store = store
    return LagTracker(tracked, "bookings", lambda: partitions)


class Broker:
    """Stands in for fetch_log_bounds: records every call, answers or fails as told."""

    def __init__(self, *answers: dict[int, LogBounds] | Exception) -> None:
        self.answers = list(answers)
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    async def __call__(self, *args: Any, **kwargs: Any) -> dict[int, LogBounds]:
        self.calls.append((args, kwargs))
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_a_refresh_asks_for_the_hosted_partitions_stable_ends_within_two_seconds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Positions are sent for the hosted partitions that have a checkpoint (the broker needs
    them to say whether the store is inside the log); the ends asked are the last stable
    offsets (the nodes read committed records), and the broker has two seconds to answer."""
    broker = Broker({0: LogBounds(0, 12), 1: LogBounds(0, 3)})
    monkeypatch.setattr(lag_module, "fetch_log_bounds", broker)
    # Partition 1 is hosted but has read nothing yet; partition 2 is no longer hosted.
    tracker = tracker_over({0: 10, 1: None, 2: 5}, (0, 1))
    client = object()
    asyncio.run(tracker.refresh(client))
    assert broker.calls == [
        ((client, "bookings", (0, 1)), {"positions": {0: 10}, "timeout_s": 2.0, "stable": True})
    ]
    assert (tracker.snapshot[0].lag, tracker.snapshot[1].lag) == (2, 3)
    assert tracker.broker_error is None


def test_a_broker_that_cannot_be_read_keeps_the_ends_says_why_and_logs_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    broker = Broker({0: LogBounds(0, 12)}, OSError("broker down"), OSError("still down"), {})
    monkeypatch.setattr(lag_module, "fetch_log_bounds", broker)
    tracker = tracker_over({0: 10}, (0,))
    asyncio.run(tracker.refresh(None))
    read = tracker.snapshot[0]
    with capture_logs() as first:
        asyncio.run(tracker.refresh(None))
    assert first == [
        {
            "event": "cannot read end offsets; lag reports keep the last known ends",
            "error": "broker down",
            "log_level": "warning",
        }
    ]
    assert tracker.broker_error == "broker down"
    kept = tracker.snapshot[0]
    assert (kept.end_offset, kept.end_offset_at_ms, kept.lag) == (12, read.end_offset_at_ms, 2)
    with capture_logs() as second:
        asyncio.run(tracker.refresh(None))
    assert second == []  # one warning per outage, not one per refresh
    assert tracker.broker_error == "still down"
    asyncio.run(tracker.refresh(None))
    assert tracker.broker_error is None  # read again: no error to report


def test_a_node_that_never_reached_the_broker_reports_no_error_until_it_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The lag report shows `broker_error`: nothing before the first refresh, and the first
    refresh that fails is warned about like any later outage."""
    monkeypatch.setattr(lag_module, "fetch_log_bounds", Broker(OSError("no route")))
    tracker = tracker_over({0: 10}, (0,))
    assert tracker.broker_error is None
    with capture_logs() as logs:
        asyncio.run(tracker.refresh(None))
    assert [line["error"] for line in logs] == ["no route"]
    assert tracker.broker_error == "no route"


def test_the_loop_retries_after_a_failed_refresh_and_logs_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tracker = tracker_over({0: 10}, (0,))
    client = object()
    clients: list[object] = []
    third = asyncio.Event()

    async def refresh(given: object) -> None:
        clients.append(given)
        if len(clients) == 1:
            raise ValueError("boom")
        if len(clients) == 3:
            third.set()

    monkeypatch.setattr(tracker, "refresh", refresh)

    async def run_until_the_third_refresh() -> None:
        task = asyncio.create_task(tracker.run(client, 0.01))
        try:
            await asyncio.wait_for(third.wait(), 5)
        finally:
            task.cancel()

    with capture_logs() as logs:
        asyncio.run(run_until_the_third_refresh())
    assert clients[:3] == [client, client, client]
    assert logs == [
        {
            "event": "refreshing lag failed; trying again",
            "error": "boom",
            "exc_info": True,
            "log_level": "error",
        }
    ]


def test_the_loop_waits_the_interval_between_refreshes(monkeypatch: pytest.MonkeyPatch) -> None:
    tracker = tracker_over({0: 10}, (0,))
    slept: list[float] = []

    async def refresh(_client: object) -> None:
        pass

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) == 2:
            raise asyncio.CancelledError

    monkeypatch.setattr(tracker, "refresh", refresh)
    monkeypatch.setattr("materializer.lag.asyncio.sleep", sleep)
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(tracker.run(None, 0.25))
    assert slept == [0.25, 0.25]


def test_offsets_only_takes_the_checkpoints_without_ends() -> None:
    tracker = tracker_over({0: 10, 1: None}, (0, 1))
    tracker.refresh_offsets_only()
    assert tracker.snapshot[0].current_offset == 10
    assert tracker.snapshot[0].end_offset is None
    assert tracker.snapshot[1].current_offset == 0


@pytest.mark.parametrize(
    ("bounds", "outside", "what"),
    [
        (
            LogBounds(0, 5),
            "past_end",
            "the store is past the end of the partition's log: the topic was recreated or "
            "truncated",
        ),
        (
            LogBounds(50, 80),
            "below_start",
            "records the store never read were deleted from the log (retention)",
        ),
    ],
)
def test_a_store_outside_the_log_is_logged_once_with_where_it_is(
    bounds: LogBounds, outside: str, what: str
) -> None:
    tracker = tracker_over({0: 10}, (0,))
    with capture_logs() as logs:
        tracker.apply_bounds({0: bounds}, 1_000)
    with capture_logs() as later:
        tracker.apply_bounds({0: bounds}, 2_000)
    assert later == []  # still outside: said already
    assert tracker.snapshot[0].outside_log == outside
    assert logs == [
        {
            "event": f"{what}; its lag is unknown until the partition is rebuilt from the log",
            "partition": 0,
            "store_position": 10,
            "log_start": bounds.start,
            "end_offset": bounds.end,
            "log_level": "error",
        }
    ]


def test_each_partition_keeps_its_own_end_offset_history() -> None:
    """A store at 50 of a partition whose log ends at 100 is behind, even though another
    partition's end (10) lies below 50."""
    tracker = tracker_over({0: 10, 1: 50}, (0, 1))
    tracker.apply_ends({0: 10, 1: 100}, 1_000)
    assert tracker.snapshot[0].caught_up_at_ms == 1_000
    assert tracker.snapshot[1].caught_up_at_ms is None


def test_the_history_holds_the_last_64_end_offsets() -> None:
    """A micro-batch that ends at an end offset read 64 refreshes ago still proves that
    moment; one read 65 refreshes ago is forgotten (the history is bounded)."""
    for refreshes, caught_up_at in ((64, 1_000), (65, None)):
        store = Checkpoints({0: 0})
        tracker = tracker_of(store, (0,))
        for i in range(refreshes):
            tracker.apply_ends({0: 10 + i}, 1_000 + i)
        store.positions[0] = 10  # reached the first end read, and no later one
        tracker.keep_ends(5_000)
        assert tracker.snapshot[0].caught_up_at_ms == caught_up_at, refreshes


def a_lag(**fields: Any) -> PartitionLag:
    values: dict[str, Any] = {
        "partition": 3,
        "current_offset": 10,
        "end_offset": 12,
        "newest_record_ms": 900,
        "caught_up_at_ms": 1_000,
        "end_offset_at_ms": 1_200,
    }
    return PartitionLag(**(values | fields))


def test_an_end_offset_is_reported_up_to_two_seconds_old_and_not_after() -> None:
    lag = a_lag(end_offset_at_ms=1_000)
    assert lag.known_end(3_000) == 12
    assert lag.known_end(3_001) is None
    assert lag.known_end(1_500, max_age_ms=500) == 12
    assert lag.known_end(1_501, max_age_ms=500) is None
    assert a_lag(end_offset_at_ms=None).known_end(1_000) is None


def test_time_lag_is_the_age_of_the_caught_up_moment_never_negative() -> None:
    assert a_lag(caught_up_at_ms=1_000).time_lag_ms(1_750) == 750
    assert a_lag(caught_up_at_ms=1_000).time_lag_ms(900) == 0  # a clock read before the stamp
    # Never seen caught up: lag 0 now is a bound of 0; anything else is no bound at all.
    assert a_lag(caught_up_at_ms=None, current_offset=12).time_lag_ms(5_000) == 0
    assert a_lag(caught_up_at_ms=None).time_lag_ms(5_000) is None
    assert a_lag(caught_up_at_ms=None, end_offset=None).time_lag_ms(5_000) is None


def test_the_lag_report_of_a_partition() -> None:
    assert a_lag().as_json(2_000) == {
        "partition": 3,
        "current_offset": 10,
        "end_offset": 12,
        "lag": 2,
        "time_lag_ms": 1_000,
        "newest_record_ms": 900,
        "caught_up": False,
        "outside_log": None,
        "end_offset_age_ms": 800,
    }
    caught_up = a_lag(current_offset=12, end_offset_at_ms=None).as_json(2_000)
    assert (caught_up["lag"], caught_up["caught_up"], caught_up["end_offset_age_ms"]) == (
        0,
        True,
        None,
    )
    outside = a_lag(current_offset=20, outside_log="past_end").as_json(2_000)
    assert (outside["lag"], outside["caught_up"], outside["outside_log"]) == (
        None,
        False,
        "past_end",
    )


def test_a_store_below_the_log_start_stays_outside_while_the_broker_cannot_be_read() -> None:
    """The log start is remembered like the end: a refresh without an answer must not make
    a store that misses deleted records look inside the log."""
    tracker = tracker_over({0: 10}, (0,))
    tracker.apply_bounds({0: LogBounds(50, 80)}, 1_000)
    tracker.keep_ends(1_250)
    kept = tracker.snapshot[0]
    assert (kept.outside_log, kept.log_start, kept.lag) == ("below_start", 50, None)
    tracker.keep_ends(1_500)
    assert tracker.snapshot[0].outside_log == "below_start"


def test_a_store_one_record_in_is_below_a_later_log_start() -> None:
    tracker = tracker_over({0: 1}, (0,))
    tracker.apply_bounds({0: LogBounds(2, 80)}, 1_000)
    assert tracker.snapshot[0].outside_log == "below_start"


def test_the_snapshot_carries_the_partition_and_its_newest_record_time() -> None:
    tracker = tracker_over({3: 10}, (3,))
    tracker.apply_ends({3: 12}, 1_000)
    lag = tracker.snapshot[3]
    assert (lag.partition, lag.newest_record_ms, lag.end_offset_at_ms) == (3, 900, 1_000)
