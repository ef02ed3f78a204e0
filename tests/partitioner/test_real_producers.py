"""Real producers write keyed records to a real broker; we must name the partition they used.

For every record the broker stored, the partition it stored it in must equal
`partition(key, N, algorithm)`. Producers: aiokafka and kafka-python (Java's algorithm in
Python), and librdkafka through confluent-kafka with its murmur2_random, consistent and
fnv1a_random partitioners.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import pytest
from aiokafka import AIOKafkaProducer
from confluent_kafka import Producer
from kafka import KafkaProducer

from kroute.topics import create_topics
from partitioner import partition
from tests.kafka_helpers import read_topic
from tests.partitioner.independent import four_byte_key_with_murmur2

pytestmark = pytest.mark.integration

PARTITION_COUNTS = (1, 7, 12, 100)

EDGE_KEYS = [
    b"",
    b"\x00",
    b"\xff",
    b"\x00\xff\x00\xff",
    b"\xff\x00" * 9,
    "ünïcødé".encode(),
    "日本語のキー".encode(),
    "🚂🎫 booking".encode(),
    four_byte_key_with_murmur2(-(2**31)),  # murmur2 == INT32_MIN
    four_byte_key_with_murmur2(2**31 - 1),
    four_byte_key_with_murmur2(-1),
]


def _keys() -> list[bytes]:
    rng = random.Random(20261122)
    generated = [rng.randbytes(rng.randint(1, 64)) for _ in range(300)]
    customer_ids = [f"customer-{i}".encode() for i in range(200)]
    return EDGE_KEYS + generated + customer_ids


KEYS = _keys()


def produce_with_aiokafka(bootstrap: str, topic: str, keys: list[bytes]) -> None:
    async def run() -> None:
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=5)
        await producer.start()
        try:
            batch = [
                await producer.send(topic, key=key, value=b"%d" % i) for i, key in enumerate(keys)
            ]
            await asyncio.gather(*batch)
        finally:
            await producer.stop()

    asyncio.run(run())


def produce_with_kafka_python(bootstrap: str, topic: str, keys: list[bytes]) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=5, enable_idempotence=False)
    try:
        for i, key in enumerate(keys):
            producer.send(topic, key=key, value=b"%d" % i)
        producer.flush(timeout=30)
    finally:
        producer.close(timeout=10)


def librdkafka_producer(partitioner: str) -> Callable[[str, str, list[bytes]], None]:
    def produce(bootstrap: str, topic: str, keys: list[bytes]) -> None:
        producer = Producer(
            {"bootstrap.servers": bootstrap, "partitioner": partitioner, "linger.ms": 5}
        )
        failures: list[str] = []

        def on_delivery(error: object, _message: object) -> None:
            if error is not None:
                failures.append(str(error))

        for i, key in enumerate(keys):
            producer.produce(topic, key=key, value=b"%d" % i, on_delivery=on_delivery)
        assert producer.flush(30) == 0, "records still in flight after 30 s"
        assert not failures, failures

    return produce


PRODUCERS: dict[str, tuple[Callable[[str, str, list[bytes]], None], str]] = {
    "aiokafka": (produce_with_aiokafka, "murmur2"),
    "kafka-python": (produce_with_kafka_python, "murmur2"),
    "librdkafka-murmur2_random": (librdkafka_producer("murmur2_random"), "murmur2"),
    "librdkafka-consistent": (librdkafka_producer("consistent"), "crc32"),
    "librdkafka-fnv1a_random": (librdkafka_producer("fnv1a_random"), "fnv1a"),
}


@pytest.mark.parametrize("num_partitions", PARTITION_COUNTS)
@pytest.mark.parametrize("producer_name", sorted(PRODUCERS))
def test_partition_equals_where_the_broker_stored_it(broker, producer_name, num_partitions):
    produce, algorithm = PRODUCERS[producer_name]
    topic = f"keys-{producer_name}-{num_partitions}"
    create_topics(broker.bootstrap_servers, {topic: num_partitions})

    produce(broker.bootstrap_servers, topic, KEYS)
    stored = read_topic(broker.bootstrap_servers, topic, num_partitions)

    assert len(stored) == len(KEYS)
    mismatches = [
        (record.key, record.partition, partition(record.key or b"", num_partitions, algorithm))
        for record in stored
        if record.partition != partition(record.key or b"", num_partitions, algorithm)
    ]
    assert not mismatches, f"{len(mismatches)} keys stored elsewhere, e.g. {mismatches[:3]}"
    assert {record.key for record in stored} == set(KEYS)
    if num_partitions > 1:  # the keys really spread, so the comparison is not vacuous
        assert len({record.partition for record in stored}) > 1
