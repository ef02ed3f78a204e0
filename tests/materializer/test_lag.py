"""When a partition counts as caught up: the time-lag bound under steady writes (pure + RocksDB)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from aiokafka.client import AIOKafkaClient
from confluent_kafka import Producer

from kroute.topics import create_topics
from materializer import lag as lag_module
from materializer.kafka_offsets import LogBounds
from materializer.lag import LagTracker
from materializer.store import Row, Store


def test_steady_writes_still_give_a_time_lag_bound(tmp_path):
    """Records keep arriving, so no refresh finds lag 0; once the store has passed the end
    offset read at T, the partition is known caught up at T (everything written before T is
    in), and its time lag is bounded."""
    store = Store(tmp_path / "store")
    store.add_partition(0)
    tracker = LagTracker(store, "bookings", lambda: (0,))
    try:
        tracker.apply_ends({0: 10}, 1_000)  # end 10 read at t=1000; store at 0
        assert tracker.snapshot[0].caught_up_at_ms is None
        store.apply(0, [Row(b"k", b"v", 9, 900)], 10, 900)  # the store passes offset 10 ...
        tracker.apply_ends({0: 14}, 2_000)  # ... while 4 more were written
        lag = tracker.snapshot[0]
        assert lag.lag == 4
        assert lag.caught_up_at_ms == 1_000
        assert lag.time_lag_ms(2_500) == 1_500
    finally:
        store.close()


def test_a_store_behind_the_last_end_offset_is_not_caught_up(tmp_path):
    store = Store(tmp_path / "store")
    store.add_partition(0)
    tracker = LagTracker(store, "bookings", lambda: (0,))
    try:
        tracker.apply_ends({0: 10}, 1_000)
        store.apply(0, [Row(b"k", b"v", 8, 900)], 9, 900)  # one short of the end read
        tracker.apply_ends({0: 14}, 2_000)
        assert tracker.snapshot[0].caught_up_at_ms is None
        assert tracker.snapshot[0].time_lag_ms(2_500) is None
    finally:
        store.close()


def test_micro_batches_longer_than_the_refresh_interval_still_catch_up(tmp_path):
    """Each batch ends at the end offset of its start, two refreshes back: the bound is that
    older refresh, not none."""
    store = Store(tmp_path / "store")
    store.add_partition(0)
    tracker = LagTracker(store, "bookings", lambda: (0,))
    try:
        for second, end in enumerate((10, 20, 30), start=1):
            tracker.apply_ends({0: end}, second * 1_000)
        store.apply(0, [Row(b"k", b"v", 19, 900)], 20, 900)  # reached the end read at t=2000
        tracker.apply_ends({0: 40}, 4_000)
        assert tracker.snapshot[0].caught_up_at_ms == 2_000
        assert tracker.snapshot[0].time_lag_ms(4_000) == 2_000
    finally:
        store.close()


def test_a_store_past_the_end_of_the_log_is_never_caught_up(tmp_path):
    """The topic was recreated (or the broker restarted empty) while the node kept its store:
    the position is past the high watermark. That is no lag 0, and time must not make the
    old values look fresh."""
    store = Store(tmp_path / "store")
    store.add_partition(0)
    tracker = LagTracker(store, "bookings", lambda: (0,))
    try:
        store.apply(0, [Row(b"k", b"v", 99, 900)], 100, 900)
        tracker.apply_ends({0: 100}, 1_000)  # caught up at t=1000
        assert tracker.snapshot[0].caught_up_at_ms == 1_000
        for second in (2, 3, 4):  # the log now ends at 5
            tracker.apply_ends({0: 5}, second * 1_000)
        lag = tracker.snapshot[0]
        assert lag.outside_log
        assert lag.lag is None
        assert lag.known_end(4_000) is None
        assert lag.caught_up_at_ms is None  # nothing it holds is known: no time bound
        assert lag.time_lag_ms(4_000) is None
        # The log grows past the position again (a busy topic recreated): the ends read while
        # the store was outside the log must not count as reached.
        tracker.apply_ends({0: 130}, 5_000)
        assert tracker.snapshot[0].outside_log is None
        assert tracker.snapshot[0].caught_up_at_ms is None
    finally:
        store.close()


def test_an_end_offset_that_is_no_longer_read_is_not_reported(tmp_path):
    """The broker cannot be read: the last end offset is kept for serving, but a lag report
    against it would say lag 0 while the store falls behind."""
    store = Store(tmp_path / "store")
    store.add_partition(0)
    tracker = LagTracker(store, "bookings", lambda: (0,))
    try:
        store.apply(0, [Row(b"k", b"v", 9, 900)], 10, 900)
        tracker.apply_ends({0: 10}, 1_000)
        for second in (2, 3, 4):  # refreshes that could not read the broker
            tracker.keep_ends(second * 1_000)
        lag = tracker.snapshot[0]
        assert lag.end_offset == 10  # still known for serving
        assert lag.known_end(1_500) == 10
        assert lag.known_end(4_000) is None  # too old to report
    finally:
        store.close()


def test_a_store_whose_next_records_were_deleted_is_outside_the_log(tmp_path):
    """Retention deleted records 10..49 before the node read them: reading on from the log
    start would skip them silently. The partition is not caught up and its lag is unknown."""
    store = Store(tmp_path / "store")
    store.add_partition(0)
    store.add_partition(1)
    tracker = LagTracker(store, "bookings", lambda: (0, 1))
    try:
        store.apply(0, [Row(b"k", b"v", 9, 900)], 10, 900)
        tracker.apply_bounds({0: LogBounds(50, 80), 1: LogBounds(50, 80)}, 1_000)
        behind, fresh = tracker.snapshot[0], tracker.snapshot[1]
        assert behind.outside_log == "below_start"
        assert behind.lag is None
        assert behind.known_end(1_000) is None
        assert behind.caught_up_at_ms is None
        # A store that read nothing misses nothing: its reader starts at the log start.
        assert fresh.outside_log is None
        assert fresh.lag == 80
    finally:
        store.close()


def test_a_store_at_the_log_start_is_inside_the_log(tmp_path):
    store = Store(tmp_path / "store")
    store.add_partition(0)
    tracker = LagTracker(store, "bookings", lambda: (0,))
    try:
        store.apply(0, [Row(b"k", b"v", 49, 900)], 50, 900)
        tracker.apply_bounds({0: LogBounds(50, 50)}, 1_000)
        assert tracker.snapshot[0].outside_log is None
        assert tracker.snapshot[0].caught_up_at_ms == 1_000
    finally:
        store.close()


def test_a_partition_dropped_and_added_again_does_not_keep_its_old_caught_up_time(tmp_path):
    """Within one refresh interval the partition was dropped and re-added (or rebuilt): the
    position went back to 0, and the old `caught_up_at` would make an empty store look fresh."""
    store = Store(tmp_path / "store")
    store.add_partition(0)
    tracker = LagTracker(store, "bookings", lambda: (0,))
    try:
        store.apply(0, [Row(b"k", b"v", 9, 900)], 10, 900)
        tracker.apply_ends({0: 10}, 1_000)
        assert tracker.snapshot[0].caught_up_at_ms == 1_000
        store.drop_partition(0)
        store.add_partition(0)
        tracker.keep_ends(1_100)  # no broker answer in between
        assert tracker.snapshot[0].current_offset == 0
        assert tracker.snapshot[0].caught_up_at_ms is None
        assert tracker.snapshot[0].time_lag_ms(1_100) is None
        tracker.apply_ends({0: 10}, 1_200)  # the end read at 1_000 is history: not reached
        assert tracker.snapshot[0].caught_up_at_ms is None
    finally:
        store.close()


def test_caught_up_at_is_the_latest_moment_known_and_never_moves_back(tmp_path):
    """`caught_up_at` is the latest T at which everything the partition held is applied. A
    refresh whose end offset was read at an earlier moment (the clock stepped back to Redis
    time) proves T for that moment too, but the later T it already knew still holds."""
    store = Store(tmp_path / "store")
    store.add_partition(0)
    tracker = LagTracker(store, "bookings", lambda: (0,))
    try:
        store.apply(0, [Row(b"k", b"v", 9, 900)], 10, 900)
        tracker.apply_ends({0: 10}, 2_000)
        assert tracker.snapshot[0].caught_up_at_ms == 2_000
        tracker.apply_ends({0: 10}, 1_500)
        assert tracker.snapshot[0].caught_up_at_ms == 2_000
        tracker.apply_ends({0: 10}, 2_500)
        assert tracker.snapshot[0].caught_up_at_ms == 2_500
    finally:
        store.close()


def test_a_refresh_stamps_the_ends_with_the_moment_it_asked(tmp_path, monkeypatch):
    """The fast-tier twin of the broker test below: an answer that takes 50 ms to arrive is
    stamped with the moment the refresh asked, before the answer came."""
    store = Store(tmp_path / "store")
    store.add_partition(0)
    store.apply(0, [Row(b"k", b"v", 9, 900)], 10, 900)
    tracker = LagTracker(store, "bookings", lambda: (0,))
    arrived: list[int] = []

    async def slow_answer(*_args: Any, **_kwargs: Any) -> dict[int, LogBounds]:
        await asyncio.sleep(0.05)
        arrived.append(lag_module.now_ms())
        return {0: LogBounds(0, 10)}

    monkeypatch.setattr(lag_module, "fetch_log_bounds", slow_answer)
    try:
        asked = lag_module.now_ms()
        asyncio.run(tracker.refresh(client=None))  # type: ignore[arg-type]
        lag = tracker.snapshot[0]
        assert lag.lag == 0
        assert lag.end_offset_at_ms is not None
        assert asked <= lag.end_offset_at_ms < arrived[0]
        assert lag.caught_up_at_ms == lag.end_offset_at_ms
    finally:
        store.close()


def produce(producer: Producer, topic: str, count: int) -> list[int]:
    """Write `count` records to partition 0; their timestamps as the delivery reports give them."""
    stamps: list[int] = []

    def delivered(error: Any, message: Any) -> None:
        assert error is None, error
        stamps.append(message.timestamp()[1])

    for i in range(count):
        producer.produce(topic, key=b"k%d" % i, value=b"v", partition=0, on_delivery=delivered)
    assert producer.flush(30) == 0
    assert len(stamps) == count
    return stamps


@pytest.mark.integration
def test_end_offsets_are_stamped_when_asked_not_when_the_answer_arrives(
    tmp_path, broker, monkeypatch
):
    """Records written while the broker's answer is on its way are not in the end offset it
    carries. The store has reached that end, so the partition is caught up as of the ask, not
    the arrival: a later stamp would cover records the store does not hold, and a time-lag
    bound that counts them as applied."""
    topic = f"lag-stamp-{uuid.uuid4().hex[:8]}"
    create_topics(broker.bootstrap_servers, {topic: 1})
    producer = Producer({"bootstrap.servers": broker.bootstrap_servers, "linger.ms": 0})
    produce(producer, topic, 10)
    store = Store(tmp_path / "store")
    store.add_partition(0)
    store.apply(0, [Row(b"k9", b"v", 9, None)], 10, None)  # the store holds offsets 0..9
    tracker = LagTracker(store, topic, lambda: (0,))
    missed: list[int] = []  # the times of records the store does not hold
    read_log_bounds = lag_module.fetch_log_bounds

    async def answer_arriving_late(*args: Any, **kwargs: Any) -> dict[int, LogBounds]:
        bounds = await read_log_bounds(*args, **kwargs)
        missed.extend(produce(producer, topic, 5))  # written while the answer travels back
        await asyncio.sleep(0.05)
        return bounds

    monkeypatch.setattr(lag_module, "fetch_log_bounds", answer_arriving_late)

    async def refresh() -> None:
        client = AIOKafkaClient(bootstrap_servers=broker.bootstrap_servers)
        await client.bootstrap()
        try:
            await tracker.refresh(client)
        finally:
            await client.close()

    try:
        asyncio.run(refresh())
        lag = tracker.snapshot[0]
        assert tracker.broker_error is None
        assert (lag.end_offset, lag.lag) == (10, 0)
        assert lag.caught_up_at_ms is not None
        assert lag.caught_up_at_ms <= min(missed), "records the store lacks counted as applied"
    finally:
        store.close()
