"""A proxy reading its routing table from a Redis read replica (the README's scaling advice).

Proxies only read Redis (GET, HGETALL, SUBSCRIBE), and a primary propagates PUBLISH to its
replicas, so a proxy pointed at a replica follows changes written to the primary.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from common.contract import Keys, PartitionAssignment
from kroute.embedded import EmbeddedServices, RedisHandle
from kroute.proxies import start_proxy
from partitioner import partition, serialize_key
from tests.proxy.conftest import PARTITIONS, PROXY_SETTINGS, publish_stand_ins
from tests.proxy.echo_backend import EchoBackend

pytestmark = pytest.mark.integration

KEY = "customer-42"


@pytest.fixture
def primary_and_replica(embedded: EmbeddedServices) -> Iterator[tuple[RedisHandle, RedisHandle]]:
    primary, replica = embedded.start_redis(), embedded.start_redis()
    client = redis.Redis.from_url(replica.url)
    client.replicaof("127.0.0.1", primary.port)
    deadline = time.monotonic() + 10
    while client.info("replication").get("master_link_status") != "up":
        assert time.monotonic() < deadline, "the replica never linked to its primary"
        time.sleep(0.05)
    client.close()
    try:
        yield primary, replica
    finally:
        replica.process.stop()
        primary.process.stop()


def test_a_proxy_on_a_read_replica_follows_the_primary(embedded, primary_and_replica):
    primary, replica = primary_and_replica
    writer = redis.Redis.from_url(primary.url)
    backends = {f"n{i}": EchoBackend(f"n{i}").start() for i in range(3)}
    keys = Keys(f"replica-{uuid.uuid4().hex[:8]}")
    cluster = publish_stand_ins(writer, keys, backends)
    settings = PROXY_SETTINGS | {"refresh_interval_ms": "60000"}  # only events can move it
    proxy = start_proxy(embedded, replica.url, cluster=keys.cluster, **settings)
    try:
        chosen = partition(serialize_key(KEY, "string"), PARTITIONS)
        placed = cluster.placements["customers"][chosen]
        first = proxy.get(f"/stores/customers/keys/{KEY}")
        assert first.status_code == 200
        assert first.headers["x-kroute-node"] == placed.active

        # Move the partition's active on the primary: the event reaches the proxy via the replica.
        moved_to = next(n for n in sorted(backends) if n not in placed.replicas())
        cluster.placements["customers"][chosen] = PartitionAssignment(moved_to, (placed.active,))
        cluster.generation += 1
        cluster.publish(writer)
        deadline = time.monotonic() + 5
        while proxy.get(f"/stores/customers/keys/{KEY}").headers["x-kroute-node"] != moved_to:
            assert time.monotonic() < deadline, "the proxy never saw the primary's new assignment"
            time.sleep(0.05)
    finally:
        proxy.process.stop()
        proxy.close()
        for backend in backends.values():
            backend.shutdown()
        writer.close()
