"""The data source against the real broker: reading ranges, and where a batch ends."""

from __future__ import annotations

import asyncio
import time

import pyarrow as pa
import pytest
from confluent_kafka import Producer

from kroute.topics import create_topics
from materializer import kafka_source
from materializer.kafka_offsets import end_offsets
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


def transactional_producer(bootstrap: str) -> Producer:
    producer = Producer(
        {"bootstrap.servers": bootstrap, "transactional.id": "reads-tx", "linger.ms": 0}
    )
    producer.init_transactions(30)
    return producer


def test_an_open_transaction_ends_the_batch_at_its_first_offset_and_is_read_once_committed(broker):
    # Tansu keeps the last stable offset as Kafka does (it does not filter aborted records
    # for read_committed consumers: that part is librdkafka's and Kafka's, untestable here).
    topic = "open-transaction"
    create_topics(broker.bootstrap_servers, {topic: 1})
    producer = transactional_producer(broker.bootstrap_servers)
    producer.begin_transaction()
    for n in range(3):
        producer.produce(topic, key=f"k{n}".encode(), value=b"{}", partition=0)
    producer.commit_transaction(30)  # records 0-2, the commit marker at 3
    producer.begin_transaction()
    producer.produce(topic, key=b"open", value=b"{}", partition=0)  # offset 4, not committed
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
    probe = kafka_source._EndOffsetProbe(broker.bootstrap_servers)
    key = (broker.bootstrap_servers, topic, 0)
    try:
        assert asyncio.run(end_offsets(broker.bootstrap_servers, topic, [0])) == {0: 5}
        ends = probe.readable_ends(topic, (0,), {0: 0})
        assert ends == {0: 4}, "the batch must end where read_committed stops: the LSO"
        started = time.monotonic()
        assert offsets_read(options, 0, ends[0]) == [0, 1, 2]  # the range ends on a marker
        assert time.monotonic() - started < 5, "read to its end, not waiting for a timeout"

        producer.commit_transaction(30)  # the marker at 5
        ends = probe.readable_ends(topic, (0,), {0: 4})
        assert ends == {0: 6}
        assert offsets_read(options, 4, 6) == [4]
    finally:
        probe.close()
        consumer = kafka_source._CONSUMERS.pop(key, None)
        if consumer is not None:
            consumer.close()
