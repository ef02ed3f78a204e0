"""Produce data with a known truth, and check what a node serves against it."""

from __future__ import annotations

import json
import random

from kroute.cluster_harness import keyed_producer
from kroute.nodes import NodeHandle
from tests.kafka_helpers import read_topic


def produce_customers(
    bootstrap: str,
    topic: str,
    count: int,
    *,
    keys: int,
    seed: int,
    deletes: float = 0.1,
    malformed: int = 0,
) -> None:
    """Keyed JSON records with updates, tombstones and some malformed values (murmur2 keys)."""
    rng = random.Random(seed)
    producer = keyed_producer(bootstrap, linger_ms=5)
    bad_at = set(rng.sample(range(count), malformed)) if malformed else set()
    for i in range(count):
        key = f"customer-{rng.randrange(keys)}".encode()
        if i in bad_at:
            value: bytes | None = rng.choice([b"{not json", b'{"a": 1} trailing', b"\xff\xfe"])
        elif rng.random() < deletes:
            value = None
        else:
            value = json.dumps(
                {"customer": key.decode(), "seq": i, "amount": rng.randrange(1000)}
            ).encode()
        producer.produce(topic, key=key, value=value)
        if i % 10_000 == 0:
            producer.poll(0)
    assert producer.flush(60) == 0


def ground_truth(bootstrap: str, topic: str, num_partitions: int) -> tuple[dict[bytes, bytes], int]:
    """(latest valid value per live key, number of undecodable records), from the topic itself."""
    truth: dict[bytes, bytes] = {}
    bad = 0
    records = sorted(
        read_topic(bootstrap, topic, num_partitions), key=lambda r: (r.partition, r.offset)
    )
    for record in records:
        assert record.key is not None
        if record.value is None:
            truth.pop(record.key, None)
            continue
        try:
            json.loads(record.value)
        except ValueError:
            bad += 1
            continue
        truth[record.key] = record.value
    return truth, bad


def assert_serves_truth(node: NodeHandle, truth: dict[bytes, bytes], all_keys: list[str]) -> None:
    wrong = []
    for key in all_keys:
        response = node.get(f"/stores/customers/keys/{key}")
        expected = truth.get(key.encode())
        if expected is None:
            if response.status_code != 404:
                wrong.append((key, "expected 404", response.status_code, response.text[:200]))
        elif response.status_code != 200 or response.json()["value"] != json.loads(expected):
            wrong.append(
                (key, "expected", json.loads(expected), response.status_code, response.text[:200])
            )
    assert not wrong, f"{len(wrong)} keys wrong, e.g. {wrong[:3]}"
