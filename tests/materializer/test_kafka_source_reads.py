"""The data source's worker side, reading ranges from the real broker."""

from __future__ import annotations

import pyarrow as pa
import pytest
from confluent_kafka import Producer

from kroute.topics import create_topics
from materializer import kafka_source
from materializer.kafka_source import SourceOptions, read_range

pytestmark = pytest.mark.integration


def offsets_read(options: SourceOptions, start: int, end: int) -> list[int]:
    batches = list(read_range(options, 0, start, end))
    return pa.Table.from_batches(batches)["offset"].to_pylist() if batches else []


def test_ranges_are_read_exactly_and_the_partition_is_released_between_them(broker):
    topic = "ranges"
    create_topics(broker.bootstrap_servers, {topic: 1})
    producer = Producer({"bootstrap.servers": broker.bootstrap_servers, "linger.ms": 0})
    for n in range(50):
        producer.produce(topic, key=f"k{n}".encode(), value=b"{}", partition=0)
    assert producer.flush(30) == 0
    options = SourceOptions(
        bootstrap_servers=broker.bootstrap_servers,
        topic=topic,
        partitions=(0,),
        starting_offsets={0: 0},
        max_records_per_partition=100,
        fetch_max_wait_ms=20,
        read_timeout_s=10,
    )
    key = (broker.bootstrap_servers, topic, 0)
    try:
        assert offsets_read(options, 10, 40) == list(range(10, 40))
        consumer = kafka_source._CONSUMERS[key]
        # Left assigned, an idle consumer would keep asking the broker for records.
        assert consumer.assignment() == []
        assert offsets_read(options, 40, 50) == list(range(40, 50))
        assert offsets_read(options, 0, 5) == list(range(5))  # back: another worker went on
        assert consumer.assignment() == []
    finally:
        kafka_source._CONSUMERS.pop(key).close()
