"""A real materializer node (its own process, real Spark) against the real broker."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time

import pytest
from confluent_kafka import Producer

from kroute.embedded import free_port
from kroute.nodes import start_node
from kroute.topics import create_topics
from materializer.kafka_offsets import end_offsets
from materializer.store import Store
from tests.materializer.node_helpers import assert_serves_truth, ground_truth, produce_customers

pytestmark = pytest.mark.integration

PARTITIONS = 6
NODE = {"store": "customers", "spark_master": "local[2]"}


def ends_of(bootstrap: str, topic: str) -> dict[int, int]:
    return asyncio.run(end_offsets(bootstrap, topic, range(PARTITIONS)))


def customer_keys(count: int) -> list[str]:
    return [f"customer-{i}" for i in range(count)] + ["never-produced"]


def test_store_equals_ground_truth_with_updates_deletes_and_bad_records(embedded, broker, tmp_path):
    bootstrap, topic = broker.bootstrap_servers, "truth"
    create_topics(bootstrap, {topic: PARTITIONS})
    produce_customers(bootstrap, topic, 3000, keys=300, seed=1, malformed=12)
    node = start_node(embedded, bootstrap, topic, tmp_path / "data", **NODE)
    try:
        metadata = node.wait_caught_up(ends_of(bootstrap, topic))
        truth, bad = ground_truth(bootstrap, topic, PARTITIONS)
        assert bad == 12
        assert_serves_truth(node, truth, customer_keys(300))
        assert sum(p["skipped_records"] for p in metadata["partitions"]) == bad

        # Records produced while the node runs reach it too.
        produce_customers(bootstrap, topic, 1000, keys=300, seed=2, malformed=0)
        node.wait_caught_up(ends_of(bootstrap, topic))
        truth, _ = ground_truth(bootstrap, topic, PARTITIONS)
        assert_serves_truth(node, truth, customer_keys(300))
    finally:
        node.process.stop()
        node.close()


def test_kill_9_mid_consumption_then_restart_rereads_at_most_one_batch(embedded, broker, tmp_path):
    bootstrap, topic, batch = broker.bootstrap_servers, "crash", 300
    create_topics(bootstrap, {topic: PARTITIONS})
    produce_customers(bootstrap, topic, 36_000, keys=3000, seed=3, deletes=0.05)
    ends = ends_of(bootstrap, topic)
    total = sum(ends.values())
    data_dir = tmp_path / "data"
    small_batches = {**NODE, "max_records_per_partition": str(batch)}

    first = start_node(embedded, bootstrap, topic, data_dir, **small_batches, wait_ready=False)
    seen_applied: dict[int, int] = {}
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        partitions = first.metadata()["partitions"]
        seen_applied = {p["partition"]: p.get("current_offset") or 0 for p in partitions}
        if sum(seen_applied.values()) > total // 4:
            break
        time.sleep(0.1)
    first.process.signal(signal.SIGKILL)
    first.process.popen.wait(timeout=30)
    first.close()

    store = Store(data_dir / "stores" / "customers")
    checkpoints = {p: cp.next_offset if cp else 0 for p, cp in store.checkpoints().items()}
    store.close()
    assert total // 4 < sum(checkpoints.values()) < total, "killed in the middle of consumption"
    assert all(checkpoints[p] >= seen_applied.get(p, 0) for p in checkpoints), "progress was lost"

    second = start_node(embedded, bootstrap, topic, data_dir, **small_batches, wait_ready=False)
    try:
        metadata = second.wait_caught_up(ends)
        # The restarted node starts at the store's checkpoints and reads only what was not
        # applied: no restore from offset 0. The first node could have read at most one batch
        # (max_records_per_partition) past those checkpoints, so that is all that was re-read.
        log_text = second.process.log_path.read_text()
        started = json.loads(re.findall(r'"starting_offsets": (\{[^}]*\})', log_text)[-1])
        assert {int(p): o for p, o in started.items()} == checkpoints
        assert metadata["ingest"]["records"] == total - sum(checkpoints.values())
        truth, _ = ground_truth(bootstrap, topic, PARTITIONS)
        assert_serves_truth(second, truth, [f"customer-{i}" for i in range(0, 3000, 7)])
    finally:
        second.process.stop()  # a clean stop this time
        second.close()

    produce_customers(bootstrap, topic, 120, keys=3000, seed=4, deletes=0)
    third = start_node(embedded, bootstrap, topic, data_dir, wait_ready=False, **NODE)
    try:
        metadata = third.wait_caught_up(ends_of(bootstrap, topic))
        assert metadata["ingest"]["records"] == 120  # after a clean stop: only the new records
    finally:
        third.process.stop()
        third.close()


def test_broker_down_at_start_waits_retries_and_recovers(embedded, tmp_path):
    port = free_port()
    bootstrap, topic = f"127.0.0.1:{port}", "late"
    node = start_node(embedded, bootstrap, topic, tmp_path / "data", wait_ready=False, **NODE)
    try:
        time.sleep(4)
        assert node.process.is_running(), "a missing broker must not stop the node"
        assert node.get("/health/live").status_code == 200
        assert node.get("/health/ready").status_code == 503
        lookup = node.get("/stores/customers/keys/customer-1")
        assert lookup.status_code == 503
        assert "broker unreachable" in lookup.json()["detail"]
        waits = [
            json.loads(line)
            for line in node.process.log_path.read_text().splitlines()
            if "waiting for Kafka" in line
        ]
        assert len(waits) >= 2
        assert "not reachable" in waits[0]["problem"]
        assert waits[1]["retry_in_s"] > waits[0]["retry_in_s"], "retries back off"

        broker = embedded.start_broker(port=port)
        create_topics(bootstrap, {topic: PARTITIONS})
        produce_customers(bootstrap, topic, 500, keys=50, seed=5)
        node.wait_caught_up(ends_of(bootstrap, topic), timeout_s=180)
        truth, _ = ground_truth(bootstrap, topic, PARTITIONS)
        assert_serves_truth(node, truth, customer_keys(50))
    finally:
        node.process.stop()
        node.close()
    broker.process.stop()


def test_partitions_beyond_the_topic_stop_the_node_with_a_clear_error(embedded, broker, tmp_path):
    create_topics(broker.bootstrap_servers, {"two": 2})
    node = start_node(
        embedded,
        broker.bootstrap_servers,
        "two",
        tmp_path / "data",
        wait_ready=False,
        hosted_partitions="0-3",
    )
    try:
        assert node.process.popen.wait(timeout=60) == 2
        assert "names partitions [2, 3] but the topic has 2" in node.process.log_path.read_text()
    finally:
        node.close()


def test_trigger_interval_spaces_micro_batches_under_a_trickle_of_writes(
    embedded, broker, tmp_path
):
    bootstrap, topic, interval_s, trickle_s = broker.bootstrap_servers, "trickle", 1.0, 8.0
    create_topics(bootstrap, {topic: PARTITIONS})
    produce_customers(bootstrap, topic, 60, keys=60, seed=6)
    spaced = {**NODE, "trigger_interval_ms": str(int(interval_s * 1000))}
    node = start_node(embedded, bootstrap, topic, tmp_path / "data", **spaced)
    try:
        before = node.wait_caught_up(ends_of(bootstrap, topic))["ingest"]["batches"]
        producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0})
        began = time.monotonic()
        sent = 0
        while time.monotonic() - began < trickle_s:  # ~20 writes a second
            producer.produce(topic, key=f"customer-{sent % 60}".encode(), value=b'{"n": 1}')
            producer.poll(0)
            sent += 1
            time.sleep(0.05)
        assert producer.flush(30) == 0
        after = node.wait_caught_up(ends_of(bootstrap, topic))["ingest"]["batches"]
        elapsed = time.monotonic() - began
        # Back to back (interval 0), a node runs several batches a second under a trickle.
        # Spaced, one per interval boundary inside the window, plus one at each end: a CI run
        # counted 10 in 8.8 s (a batch already triggered when `before` was read).
        assert 1 <= after - before <= elapsed / interval_s + 2
    finally:
        node.process.stop()
        node.close()


def test_a_broker_restarted_empty_makes_the_node_rebuild_from_the_new_log(embedded, tmp_path):
    """The broker kept its log in memory and restarted: the topic is back, shorter, with other
    records, while the node kept its store. Positions past the new ends must not pass for
    "caught up" with the old values: the node rebuilds each partition from the new log and
    then serves exactly what the new log holds (old keys are gone)."""
    port = free_port()
    bootstrap, topic = f"127.0.0.1:{port}", "restarted"
    broker = embedded.start_broker(port=port)
    create_topics(bootstrap, {topic: PARTITIONS})
    produce_customers(bootstrap, topic, 500, keys=50, seed=5, deletes=0)
    node = start_node(embedded, bootstrap, topic, tmp_path / "data", **NODE)
    try:
        node.wait_caught_up(ends_of(bootstrap, topic), timeout_s=180)
        broker.process.stop()
        broker = embedded.start_broker(port=port)  # memory storage: an empty log
        create_topics(bootstrap, {topic: PARTITIONS})
        produce_customers(bootstrap, topic, 60, keys=20, seed=7, deletes=0)
        node.wait_caught_up(ends_of(bootstrap, topic), timeout_s=120)
        truth, _ = ground_truth(bootstrap, topic, PARTITIONS)
        assert_serves_truth(node, truth, customer_keys(50))
        assert all(p["lag"] == 0 for p in node.metadata()["partitions"])
        rebuilt = [
            json.loads(line)
            for line in node.process.log_path.read_text().splitlines()
            if "rebuilding partitions whose store is outside the log" in line
        ]
        assert rebuilt, "the node must say why it dropped what it held"
        assert set(rebuilt[0]["why"].values()) == {"past_end"}
    finally:
        node.process.stop()
        node.close()
        broker.process.stop()


def test_batches_too_big_for_the_driver_are_made_smaller_until_they_fit(embedded, broker, tmp_path):
    """60 values of 100 KB in one partition: a 64-record batch (6 MB) is more than the driver
    accepts (spark.driver.maxResultSize=1m), and retrying it would fail for ever. The node
    reads smaller batches instead, and serves every value."""
    bootstrap, topic = broker.bootstrap_servers, "big-values"
    create_topics(bootstrap, {topic: 1})
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 50})
    values = {f"big-{i}": f"{i:03d}" + "x" * 100_000 for i in range(60)}
    for key, value in values.items():
        producer.produce(topic, key=key.encode(), value=value.encode())
    assert producer.flush(30) == 0
    node = start_node(
        embedded,
        bootstrap,
        topic,
        tmp_path / "data",
        store="big",
        spark_master="local[2]",
        value_format="string",
        max_records_per_partition="64",
        spark_conf=json.dumps({"spark.driver.maxResultSize": "1m"}),
    )
    try:
        node.wait_caught_up(ends_of_one(bootstrap, topic), timeout_s=180)
        for key, value in values.items():
            response = node.get(f"/stores/big/keys/{key}")
            assert response.status_code == 200, response.text[:200]
            assert response.json()["value"] == value
        shrunk = [
            json.loads(line)
            for line in node.process.log_path.read_text().splitlines()
            if "too big for the Spark driver" in line
        ]
        assert shrunk, "the first batch must have been too big: the test would prove nothing"
        assert shrunk[0]["max_records_per_partition"] == 8
    finally:
        node.process.stop()
        node.close()


def ends_of_one(bootstrap: str, topic: str) -> dict[int, int]:
    return asyncio.run(end_offsets(bootstrap, topic, [0]))


def test_spark_refusing_to_start_stops_the_node_with_the_reason(embedded, broker, tmp_path):
    """Spark refusing its settings must not leave a node live, never ready, "starting" forever."""
    create_topics(broker.bootstrap_servers, {"refused": 2})
    node = start_node(
        embedded,
        broker.bootstrap_servers,
        "refused",
        tmp_path / "data",
        wait_ready=False,
        spark_conf='{"spark.serializer": "no.such.Serializer"}',
    )
    try:
        assert node.process.popen.wait(timeout=120) == 1
        log = node.process.log_path.read_text()
        assert "could not start materializing" in log
        assert "no.such.Serializer" in log
    finally:
        node.close()
