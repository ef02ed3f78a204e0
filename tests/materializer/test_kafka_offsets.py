"""End offsets must come from Fetch high watermarks: Tansu's ListOffsets(latest) is wrong.

The first test documents the broker's behaviour; if a Tansu upgrade fixes ListOffsets it will
fail, and docs/broker-quirks.md should be updated.
"""

from __future__ import annotations

import asyncio

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from kroute.topics import create_topics
from materializer.errors import EndOffsetsError
from materializer.kafka_offsets import end_offsets
from tests.kafka_helpers import read_topic

pytestmark = pytest.mark.integration


def produce_in_batches(bootstrap: str, topic: str, partitions: int, per_partition: int) -> None:
    # A generous linger makes librdkafka send each partition's records as one batch.
    producer = Producer(
        {"bootstrap.servers": bootstrap, "linger.ms": 200, "batch.num.messages": 10_000}
    )
    for i in range(per_partition * partitions):
        producer.produce(topic, key=b"k%d" % i, value=b"v", partition=i % partitions)
    assert producer.flush(30) == 0


def list_offsets_latest(bootstrap: str, topic: str, partitions: int) -> dict[int, int]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "list-offsets"})
    try:
        return {
            p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
            for p in range(partitions)
        }
    finally:
        consumer.close()


def test_list_offsets_is_wrong_and_fetch_high_watermark_is_right(broker):
    topic, partitions, per_partition = "batched", 3, 25
    create_topics(broker.bootstrap_servers, {topic: partitions})
    produce_in_batches(broker.bootstrap_servers, topic, partitions, per_partition)

    truth = {p: per_partition for p in range(partitions)}
    stored = read_topic(broker.bootstrap_servers, topic, partitions)
    assert {p: sum(r.partition == p for r in stored) for p in range(partitions)} == truth

    assert asyncio.run(end_offsets(broker.bootstrap_servers, topic, range(partitions))) == truth
    listed = list_offsets_latest(broker.bootstrap_servers, topic, partitions)
    assert all(listed[p] < truth[p] for p in range(partitions)), listed


def test_high_watermarks_follow_new_records(broker):
    topic = "growing"
    create_topics(broker.bootstrap_servers, {topic: 2})
    assert asyncio.run(end_offsets(broker.bootstrap_servers, topic, [0, 1])) == {0: 0, 1: 0}
    produce_in_batches(broker.bootstrap_servers, topic, 2, 7)
    produce_in_batches(broker.bootstrap_servers, topic, 2, 5)
    assert asyncio.run(end_offsets(broker.bootstrap_servers, topic, [0, 1])) == {0: 12, 1: 12}


def test_unknown_topic_is_a_clear_error(broker):
    with pytest.raises(EndOffsetsError, match="topic does not exist"):
        asyncio.run(end_offsets(broker.bootstrap_servers, "no-such-topic", [0], timeout_s=2))


def test_unknown_partition_is_a_clear_error(broker):
    create_topics(broker.bootstrap_servers, {"two-partitions": 2})
    with pytest.raises(EndOffsetsError, match=r"partitions \[5\].*no leader"):
        asyncio.run(end_offsets(broker.bootstrap_servers, "two-partitions", [5], timeout_s=2))
