"""Read every record of a topic back, as the broker stored it (tests only)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from confluent_kafka import Consumer, TopicPartition

from materializer.kafka_offsets import end_offsets

# A read fails when it stops moving, not when it is slow: Tansu reading a log of single-record
# batches back from S3 while three nodes fetch too took more than a fixed 30 s (issue 17).
STALL_S = 60.0  # no new record for this long: the read is stuck
# No read, however steady, takes longer: below pytest's 300 s per-test timeout, so a read that
# never ends fails with how far it got rather than a thread dump.
CAP_S = 240.0
# Tansu with S3 storage answers a Fetch once its max wait has passed, with only the batches it
# has read from S3 by then. Measured on a cold broker: 20 ms returned nothing at all, 100 ms
# ~5 KB, 500 ms ~17 KB. A memory:// broker answers as fast either way when records are waiting;
# and as the records are there, "waiting fetches are not woken" costs this read nothing.
FETCH_MAX_WAIT_MS = 500

Acknowledged = Mapping[tuple[int, int], tuple[bytes | None, bytes | None]]
"""(partition, offset) -> (key, value) of every record a producer's delivery report confirmed."""


@dataclass(frozen=True)
class StoredRecord:
    key: bytes | None
    value: bytes | None
    partition: int
    offset: int


@dataclass
class Patience:
    """When a read gives up: no new record for `stall_s`, or `cap_s` after it started."""

    stall_s: float = STALL_S
    cap_s: float = CAP_S
    clock: Callable[[], float] = time.monotonic
    started: float = field(init=False)
    last_progress: float = field(init=False)

    def __post_init__(self) -> None:
        self.started = self.last_progress = self.clock()

    def progressed(self) -> None:
        self.last_progress = self.clock()

    def exhausted(self) -> str | None:
        """Why to give up now, or None to go on."""
        now = self.clock()
        if now - self.last_progress >= self.stall_s:
            return f"no new record for {now - self.last_progress:.0f} s"
        if now - self.started >= self.cap_s:
            return f"still reading after {now - self.started:.0f} s"
        return None


def read_topic(
    bootstrap_servers: str, topic: str, num_partitions: int, patience: Patience | None = None
) -> list[StoredRecord]:
    """Every record the broker stored, up to the high watermarks read at the start, in
    (partition, offset) order. Fails unless every offset below them was read."""
    ends = asyncio.run(end_offsets(bootstrap_servers, topic, range(num_partitions)))
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap_servers,
            "group.id": f"read-{topic}",
            "enable.auto.commit": False,
            "fetch.wait.max.ms": FETCH_MAX_WAIT_MS,
        }
    )
    consumer.assign([TopicPartition(topic, p, 0) for p in range(num_partitions) if ends[p]])
    try:
        return read_until_ends(lambda: _poll(consumer, topic), ends, patience or Patience(), topic)
    finally:
        consumer.close()


def _poll(consumer: Consumer, topic: str) -> list[StoredRecord]:
    records = []
    for message in consumer.consume(num_messages=1000, timeout=0.2):
        if message.error():
            raise RuntimeError(f"consume error on {topic}: {message.error()}")
        records.append(
            StoredRecord(message.key(), message.value(), message.partition(), message.offset())
        )
    return records


def read_until_ends(
    poll: Callable[[], Sequence[StoredRecord]],
    ends: Mapping[int, int],
    patience: Patience,
    topic: str,
) -> list[StoredRecord]:
    """The records below `ends` that `poll` returns, until each partition's last one arrived.

    Records at or past a partition's end were written after the ends were read: not part of
    this read. A partition is done when its last offset arrives (a consumer reads a partition
    in order), so a missing offset fails at once instead of waiting out the patience."""
    read: dict[int, dict[int, StoredRecord]] = {p: {} for p in ends}
    unfinished = {p for p, end in ends.items() if end > 0}
    while unfinished:
        reason = patience.exhausted()
        assert reason is None, f"{_progress(read, ends)} from {topic}: {reason}"
        for record in poll():
            if record.offset >= ends[record.partition]:
                continue
            if _keep(read[record.partition], record, topic):
                patience.progressed()
            if record.offset == ends[record.partition] - 1:
                unfinished.discard(record.partition)
    _assert_every_offset(read, ends, topic)
    return [read[p][offset] for p in sorted(read) for offset in sorted(read[p])]


def _keep(by_offset: dict[int, StoredRecord], record: StoredRecord, topic: str) -> bool:
    """Store a record; False for one already read (a consumer may fetch a range again)."""
    before = by_offset.setdefault(record.offset, record)
    assert before == record, f"{topic} answered two records at one offset: {before}, {record}"
    return before is record


def _progress(read: Mapping[int, Mapping[int, StoredRecord]], ends: Mapping[int, int]) -> str:
    return f"read {sum(map(len, read.values()))} of {sum(ends.values())} records"


def _assert_every_offset(
    read: Mapping[int, Mapping[int, StoredRecord]], ends: Mapping[int, int], topic: str
) -> None:
    """Exactly offsets 0 .. end-1 of every partition: the count alone would let a gap in one
    partition hide behind an extra record in another."""
    missing = {
        p: [offset for offset in range(end) if offset not in read[p]][:5]
        for p, end in ends.items()
        if len(read[p]) != end
    }
    assert not missing, f"{_progress(read, ends)} from {topic}; first missing offsets {missing}"


def assert_topic_holds(records: Iterable[StoredRecord], acknowledged: Acknowledged) -> None:
    """Every acknowledged record is in the topic at the offset its delivery report gave."""
    stored = {(r.partition, r.offset): (r.key, r.value) for r in records}
    lost = [
        (where, sent, stored.get(where))
        for where, sent in acknowledged.items()
        if stored.get(where) != sent
    ]
    assert not lost, (
        f"{len(lost)} of {len(acknowledged)} acknowledged records are not in the topic as "
        f"acknowledged ((partition, offset), sent, stored), e.g. {lost[:3]}"
    )
