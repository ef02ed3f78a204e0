"""What the nodes must serve, computed from the topic itself, and the check that they do.

The ground truth is the topic read from offset 0 to the high watermarks with an independent
consumer (`tests/kafka_helpers.read_topic`): the latest value per key, and a tombstone
deletes. That read must return every offset below the watermarks, and every record the writer
had acknowledged must be among them at the offset the broker gave it, so a broker that lost or
rewrote records after a restart cannot hand us a smaller truth. The check asks every live
replica of every key's partition, so a replica that lost, kept or resurrected a key is caught
even when the other replica is right.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from partitioner import partition
from tests.cluster_helpers import PARTITIONS, Cluster
from tests.kafka_helpers import Acknowledged, assert_topic_holds, read_topic

Truth = dict[str, Any]  # key -> value (None: deleted)


def read_truth(cluster: Cluster, acknowledged: Acknowledged) -> Truth:
    """The latest value of every key in the topic, up to its current high watermarks; the
    topic must hold every `acknowledged` record (writers paused and flushed)."""
    latest: Truth = {}
    records = read_topic(cluster.bootstrap, cluster.topic, PARTITIONS)
    assert_topic_holds(records, dict(acknowledged))  # a copy: delivery reports add to it
    for record in sorted(records, key=lambda r: r.offset):  # a key lives in one partition
        assert record.key is not None
        latest[record.key.decode()] = None if record.value is None else json.loads(record.value)
    return latest


def wait_caught_up(cluster: Cluster, alive: set[str], timeout_s: float = 180) -> None:
    """Until every live node's replicas have applied everything up to the current ends."""
    deadline = time.monotonic() + timeout_s
    while not cluster.settled(alive):
        for name in alive:
            process = cluster.nodes[name].process
            assert process.is_running(), process.log_tail(40)
        assert time.monotonic() < deadline, f"replicas did not catch up: {cluster.unsettled(alive)}"
        time.sleep(0.3)


def assert_replicas_serve_the_topic(
    cluster: Cluster, alive: set[str], acknowledged: Acknowledged
) -> int:
    """Every live replica of every key answers exactly the topic's latest value (404 when
    deleted). Writers must be paused. Returns the number of keys checked."""
    wait_caught_up(cluster, alive)
    truth = read_truth(cluster, acknowledged)
    placements = cluster.assignment().stores["customers"]
    wrong: list[str] = []
    clients = {n: httpx.Client(base_url=cluster.nodes[n].url, timeout=10) for n in alive}
    try:
        for key, value in truth.items():
            for name in placements[partition(key.encode(), PARTITIONS)].replicas():
                if name not in alive:
                    continue
                response = clients[name].get(f"/stores/customers/keys/{key}")
                served = response.json().get("value") if response.status_code == 200 else None
                if value is None and response.status_code != 404:
                    wrong.append(f"{name} resurrected {key}: {response.status_code} {served}")
                elif value is not None and served != value:
                    wrong.append(f"{name} {key}: {response.status_code} {served} != {value}")
    finally:
        for client in clients.values():
            client.close()
    assert not wrong, f"{len(wrong)} wrong answers, e.g. {wrong[:5]}"
    return len(truth)
