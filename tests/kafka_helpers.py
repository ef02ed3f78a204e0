"""Read every record of a topic back, as the broker stored it (tests only)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from confluent_kafka import Consumer, TopicPartition

from materializer.kafka_offsets import end_offsets


@dataclass(frozen=True)
class StoredRecord:
    key: bytes | None
    value: bytes | None
    partition: int
    offset: int


def read_topic(bootstrap_servers: str, topic: str, num_partitions: int) -> list[StoredRecord]:
    """Every record the broker stored, up to the high watermarks read at the start."""
    ends = asyncio.run(end_offsets(bootstrap_servers, topic, range(num_partitions)))
    expected = sum(ends.values())
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap_servers,
            "group.id": f"read-{topic}",
            "enable.auto.commit": False,
            "fetch.wait.max.ms": 20,  # Tansu does not wake waiting fetches (DESIGN.md)
        }
    )
    consumer.assign([TopicPartition(topic, p, 0) for p in range(num_partitions) if ends[p]])
    records: list[StoredRecord] = []
    deadline = time.monotonic() + 30
    try:
        while len(records) < expected and time.monotonic() < deadline:
            for message in consumer.consume(num_messages=1000, timeout=0.2):
                if message.error():
                    raise RuntimeError(f"consume error on {topic}: {message.error()}")
                records.append(
                    StoredRecord(
                        message.key(), message.value(), message.partition(), message.offset()
                    )
                )
    finally:
        consumer.close()
    assert len(records) == expected, f"read {len(records)} of {expected} records from {topic}"
    return records
