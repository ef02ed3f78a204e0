"""A cluster of real materializer nodes (real Tansu, redis-server, Spark) for tests."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from aiokafka.errors import KafkaError

from common.contract import (
    Assignment,
    Keys,
    decode_assignment,
    decode_hosting,
    decode_report,
    lag_field,
)
from kroute.cluster_harness import NodeCluster, keyed_producer, wait_steady
from kroute.embedded import BrokerHandle, EmbeddedServices, RedisHandle
from kroute.proxies import ProxyHandle, start_proxy
from kroute.topics import create_topics
from materializer.kafka_offsets import end_offsets
from partitioner import partition

PARTITIONS = 6
NODE_NAMES = ("a", "b", "c")


@dataclass(kw_only=True)
class Cluster(NodeCluster):
    """The nodes (data directories `workdir / name`), their cluster's Redis and contract keys,
    and which node a test has killed (`dead`)."""

    redis: redis.Redis
    keys: Keys
    redis_server: RedisHandle
    dead: str = ""

    @property
    def alive(self) -> set[str]:
        return set(NODE_NAMES) - {self.dead}

    def assignment(self) -> Assignment:
        raw = self.redis.get(self.keys.assignment)
        assert raw is not None, "no assignment yet"
        return decode_assignment(raw)

    def produce(self, count: int, tag: str) -> Counter[int]:
        """`count` records with fresh keys; how many went to each partition."""
        producer = keyed_producer(self.bootstrap, linger_ms=5)
        per_partition: Counter[int] = Counter()
        for i in range(count):
            key = f"{tag}-{i}".encode()
            producer.produce(self.topic, key=key, value=b'{"n": %d}' % i)
            per_partition[partition(key, PARTITIONS)] += 1
        assert producer.flush(30) == 0
        return per_partition

    def ends(self, attempts: int = 3) -> dict[int, int]:
        """The topic's end offsets. A read the broker does not answer in time is tried again:
        on a loaded machine Tansu (S3-backed in the fault suite) can miss a 5 s timeout once,
        and the callers poll, so one slow answer is not a failure."""
        for _ in range(attempts - 1):
            with contextlib.suppress(KafkaError):
                return asyncio.run(end_offsets(self.bootstrap, self.topic, range(PARTITIONS)))
        return asyncio.run(end_offsets(self.bootstrap, self.topic, range(PARTITIONS)))

    def settled(self, alive: set[str]) -> bool:
        """Every live node reports the current generation and has caught up on it."""
        return self.unsettled(alive) is None

    def unsettled(self, alive: set[str]) -> str | None:
        """What keeps the cluster from being settled (None: nothing)."""
        try:
            assignment = self.assignment()
        except AssertionError:
            return "no assignment"
        ends = self.ends()
        for name in sorted(alive):
            behind = self.node_behind(name, assignment, ends)
            if behind is not None:
                return behind
        covered = {
            n for placed in assignment.stores["customers"].values() for n in placed.replicas()
        }
        if covered != alive or len(assignment.stores["customers"]) != PARTITIONS:
            return f"assignment covers {sorted(covered)}, alive {sorted(alive)}"
        return None

    def node_behind(self, name: str, assignment: Assignment, ends: dict[int, int]) -> str | None:
        raw = self.redis.get(self.keys.hosting(name))
        if raw is None:
            return f"{name} reports no hosting"
        hosted = decode_hosting(raw).generation
        if hosted != assignment.generation:
            return f"{name} hosts generation {hosted}, not {assignment.generation}"
        mine = assignment.for_node(name).get("customers", {})
        for p in mine.get("active", []) + mine.get("standby", []):
            report = self.redis.hget(self.keys.lag(name), lag_field("customers", p))
            if report is None:
                return f"{name} reports no lag for partition {p}"
            offset = decode_report(report).current_offset
            if offset != ends[p]:
                return f"{name} partition {p} at {offset}, end {ends[p]}"
        return None

    def wait_settled(self, alive: set[str], timeout_s: float = 180) -> Assignment:
        """Until settled() has held, on one generation, for several leader rounds."""
        wait_steady(
            lambda: self.assignment().generation if self.settled(alive) else None,
            hold_s=2.0,
            poll_s=0.3,
            timeout_s=timeout_s,
            check=lambda: self.check_running(sorted(alive)),
            timeout_error=lambda: AssertionError(
                f"cluster did not settle: {self.redis.get(self.keys.assignment)}"
            ),
        )
        return self.assignment()


def build_cluster(
    embedded: EmbeddedServices,
    broker: BrokerHandle,
    workdir: Path,
    grace_s: float,
    *,
    names: tuple[str, ...] = NODE_NAMES,
    seed: int = 1200,
    prefix: str = "test",
    **extra: str,
) -> Cluster:
    """`names` nodes (not yet ready) on a fresh topic with `seed` records (keys seed-0, ...),
    own redis; `extra`: more node settings (KROUTE_* names without the prefix)."""
    redis_server = embedded.start_redis()  # its own: tests restart it
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    topic = f"cluster-{name}"
    create_topics(broker.bootstrap_servers, {topic: PARTITIONS})
    settings = {
        "store": "customers",
        "spark_master": "local[1]",
        "redis_url": redis_server.url,
        "cluster": name,
        "grace_period_s": str(grace_s),
        "standbys": "1",
        "alive_ttl_ms": "2000",
        "heartbeat_ms": "300",
        **extra,
    }
    built = Cluster(
        embedded,
        broker.bootstrap_servers,
        topic,
        workdir,
        settings,
        dir_prefix="",
        redis=redis.Redis.from_url(redis_server.url),
        keys=Keys(name),
        redis_server=redis_server,
    )
    built.produce(seed, "seed")
    built.start_all(names)
    return built


def stop_cluster(cluster: Cluster) -> None:
    cluster.stop()
    cluster.redis.close()
    cluster.redis_server.process.stop()


@contextlib.contextmanager
def running_cluster(
    embedded: EmbeddedServices, broker: BrokerHandle, workdir: Path, grace_s: float, **options: Any
) -> Iterator[Cluster]:
    """build_cluster's cluster (same arguments), stopped on exit: a module fixture's body."""
    built = build_cluster(embedded, broker, workdir, grace_s, **options)
    try:
        yield built
    finally:
        stop_cluster(built)


@contextlib.contextmanager
def cluster_proxy(
    embedded: EmbeddedServices,
    cluster: Cluster,
    *,
    name: str | None = None,
    wait_ready: bool = True,
    **settings: str,
) -> Iterator[ProxyHandle]:
    """A proxy in front of `cluster` (named after it unless `name`), stopped on exit;
    `settings`: KROUTE_* names without the prefix."""
    handle = start_proxy(
        embedded,
        cluster.redis_server.url,
        name=name or f"proxy-{cluster.keys.cluster}",
        cluster=cluster.keys.cluster,
        wait_ready=wait_ready,
        **settings,
    )
    try:
        yield handle
    finally:
        handle.process.stop()
        handle.close()


def reported_lag(cluster: Cluster, name: str, partitions: list[int]) -> dict[int, int | None]:
    reports = {}
    for p in partitions:
        raw = cluster.redis.hget(cluster.keys.lag(name), lag_field("customers", p))
        reports[p] = decode_report(raw).lag if raw else None
    return reports
