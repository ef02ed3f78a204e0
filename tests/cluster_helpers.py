"""A cluster of real materializer nodes (real Tansu, redis-server, Spark) for tests."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import redis
from confluent_kafka import Producer

from common.contract import (
    Assignment,
    Keys,
    decode_assignment,
    decode_hosting,
    decode_report,
    lag_field,
)
from kroute.embedded import BrokerHandle, EmbeddedServices, RedisHandle
from kroute.nodes import NodeHandle, start_node
from kroute.topics import create_topics
from materializer.kafka_offsets import end_offsets
from partitioner import partition

PARTITIONS = 6
NODE_NAMES = ("a", "b", "c")


@dataclass
class Cluster:
    services: EmbeddedServices
    bootstrap: str
    topic: str
    redis: redis.Redis
    keys: Keys
    settings: dict[str, str]
    workdir: Path
    nodes: dict[str, NodeHandle]
    redis_server: RedisHandle
    dead: str = ""

    @property
    def alive(self) -> set[str]:
        return set(NODE_NAMES) - {self.dead}

    def assignment(self) -> Assignment:
        raw = self.redis.get(self.keys.assignment)
        assert raw is not None, "no assignment yet"
        return decode_assignment(raw)

    def start(self, name: str) -> NodeHandle:
        node = start_node(
            self.services,
            self.bootstrap,
            self.topic,
            self.workdir / name,
            name=name,
            wait_ready=False,
            **self.settings,
        )
        self.nodes[name] = node
        return node

    def produce(self, count: int, tag: str) -> Counter[int]:
        """`count` records with fresh keys; how many went to each partition."""
        producer = Producer(
            {"bootstrap.servers": self.bootstrap, "partitioner": "murmur2_random", "linger.ms": 5}
        )
        per_partition: Counter[int] = Counter()
        for i in range(count):
            key = f"{tag}-{i}".encode()
            producer.produce(self.topic, key=key, value=b'{"n": %d}' % i)
            per_partition[partition(key, PARTITIONS)] += 1
        assert producer.flush(30) == 0
        return per_partition

    def ends(self) -> dict[int, int]:
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
        deadline = time.monotonic() + timeout_s
        stable_since: tuple[int, float] | None = None
        while time.monotonic() < deadline:
            for name in alive:
                assert self.nodes[name].process.is_running(), self.nodes[name].process.log_tail(30)
            if not self.settled(alive):
                stable_since = None
            else:
                generation = self.assignment().generation
                if stable_since is None or stable_since[0] != generation:
                    stable_since = (generation, time.monotonic())
                elif time.monotonic() - stable_since[1] > 2.0:
                    return self.assignment()
            time.sleep(0.3)
        raise AssertionError(f"cluster did not settle: {self.redis.get(self.keys.assignment)}")


def build_cluster(
    embedded: EmbeddedServices, broker: BrokerHandle, workdir: Path, grace_s: float, **extra: str
) -> Cluster:
    """Three nodes (not yet ready) on a fresh topic with 1,200 seed records, own redis;
    `extra`: more node settings (KROUTE_* names without the prefix)."""
    redis_server = embedded.start_redis()  # its own: tests restart it
    name = f"test-{uuid.uuid4().hex[:8]}"
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
        redis.Redis.from_url(redis_server.url),
        Keys(name),
        settings,
        workdir,
        {},
        redis_server,
    )
    built.produce(1200, "seed")
    for node_name in NODE_NAMES:
        built.start(node_name)
    return built


def stop_cluster(cluster: Cluster) -> None:
    for node in cluster.nodes.values():
        node.process.stop()
        node.close()
    cluster.redis.close()
    cluster.redis_server.process.stop()


def spark_jvm_pid(node: NodeHandle) -> int:
    """The node's Spark JVM: a child of whichever of its threads started Spark."""
    children = [
        child
        for task in Path(f"/proc/{node.process.pid}/task").iterdir()
        for child in (task / "children").read_text().split()
    ]
    for child in children:
        if "java" in Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace"):
            return int(child)
    raise AssertionError(f"no JVM among the children of node {node.process.name}: {children}")


def reported_lag(cluster: Cluster, name: str, partitions: list[int]) -> dict[int, int | None]:
    reports = {}
    for p in partitions:
        raw = cluster.redis.hget(cluster.keys.lag(name), lag_field("customers", p))
        reports[p] = decode_report(raw).lag if raw else None
    return reports
