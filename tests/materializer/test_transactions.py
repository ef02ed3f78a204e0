"""A real node on a topic written in transactions (as Kafka Streams and ksqlDB write theirs).

Tansu writes commit markers and keeps the last stable offset, so both are tested here against
the real broker. It does not tell consumers which records were aborted (no aborted-transaction
list in Fetch responses), so that aborted records are never materialized under read_committed
rests on librdkafka and a real Kafka broker, and is not tested here.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest
from confluent_kafka import Producer

from kroute.nodes import start_node
from kroute.topics import create_topics
from materializer.kafka_offsets import end_offsets
from partitioner import partition

pytestmark = pytest.mark.integration

PARTITIONS = 2


def ends_of(bootstrap: str, topic: str) -> dict[int, int]:
    return asyncio.run(end_offsets(bootstrap, topic, range(PARTITIONS)))


def produce_in_a_transaction(producer: Producer, topic: str, keys: range, commit: bool) -> None:
    producer.begin_transaction()
    for n in keys:
        value = b'{"n": %d}' % n
        producer.produce(topic, key=f"k{n}".encode(), value=value)
    if commit:
        producer.commit_transaction(30)
    else:
        assert producer.flush(30) == 0


def test_partitions_ending_in_commit_markers_catch_up_to_lag_0_and_the_node_gets_ready(
    embedded, broker, tmp_path
):
    # Issue 23, defect 8: the checkpoint was the last record + 1, never past the commit
    # marker, so every partition sat at lag 1 for good and a starting node never got ready.
    bootstrap, topic = broker.bootstrap_servers, "transactional"
    create_topics(bootstrap, {topic: PARTITIONS})
    producer = Producer(
        {"bootstrap.servers": bootstrap, "transactional.id": "tx-node", "partitioner": "murmur2"}
    )
    producer.init_transactions(30)
    produce_in_a_transaction(producer, topic, range(20), commit=True)
    ends = ends_of(bootstrap, topic)
    records = Counter(partition(f"k{n}".encode(), PARTITIONS) for n in range(20))
    assert ends == {p: records[p] + 1 for p in range(PARTITIONS)}, "records and a commit marker"
    node = start_node(
        embedded, bootstrap, topic, tmp_path / "data", wait_ready=False, store="customers"
    )
    try:
        metadata = node.wait_caught_up(ends)
        assert {p["partition"]: p["lag"] for p in metadata["partitions"]} == {0: 0, 1: 0}
        node.wait_ready(timeout_s=30)
        assert node.get("/stores/customers/keys/k7").json()["value"] == {"n": 7}

        # An open transaction: the node applies what is committed and does not wait on it.
        produce_in_a_transaction(producer, topic, range(20, 24), commit=False)
        time.sleep(3)
        assert node.get("/stores/customers/keys/k21").status_code == 404
        # Nor is it behind: the open transaction's records are not readable yet, so its lag
        # (against the last stable offset) is 0, not the open records.
        during = node.get("/metadata").json()
        assert {p["partition"]: p["lag"] for p in during["partitions"]} == {0: 0, 1: 0}, during
        producer.commit_transaction(30)
        metadata = node.wait_caught_up(ends_of(bootstrap, topic))
        assert node.get("/stores/customers/keys/k21").json()["value"] == {"n": 21}
        assert metadata["pipeline"]["restarts"] == 0, metadata["pipeline"]
    finally:
        node.process.stop()
        node.close()
