"""Run real materializer nodes (`python -m materializer`) and produce data with known truth."""

from __future__ import annotations

import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from confluent_kafka import Producer

from kroute.embedded import EmbeddedServices, ManagedProcess, free_port
from tests.kafka_helpers import read_topic


@dataclass
class NodeProcess:
    process: ManagedProcess
    url: str
    client: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=10, trust_env=False))

    def get(self, path: str) -> httpx.Response:
        return self.client.get(self.url + path)

    def metadata(self) -> dict[str, Any]:
        return self.get("/metadata").json()

    def wait_caught_up(self, ends: dict[int, int], timeout_s: float = 120) -> dict[str, Any]:
        """Until every hosted partition's current offset equals the given end offset."""
        deadline = time.monotonic() + timeout_s
        metadata: dict[str, Any] = {}
        while time.monotonic() < deadline:
            assert self.process.is_running(), f"node exited:\n{self.process.log_tail(40)}"
            try:
                metadata = self.metadata()
            except httpx.HTTPError:
                time.sleep(0.2)
                continue
            current = {p["partition"]: p.get("current_offset") for p in metadata["partitions"]}
            if current and all(current.get(p) == end for p, end in ends.items()):
                return metadata
            time.sleep(0.2)
        raise AssertionError(
            f"not caught up within {timeout_s}s: {metadata}\n{self.process.log_tail(40)}"
        )

    def close(self) -> None:
        self.client.close()


def start_node(
    services: EmbeddedServices,
    bootstrap: str,
    topic: str,
    data_dir: Path,
    *,
    name: str = "node-a",
    extra_env: dict[str, str] | None = None,
    wait_ready: bool = True,
) -> NodeProcess:
    port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("KROUTE_")},
        "KROUTE_NODE_ID": name,
        "KROUTE_BOOTSTRAP_SERVERS": bootstrap,
        "KROUTE_TOPIC": topic,
        "KROUTE_STORE": "customers",
        "KROUTE_PORT": str(port),
        "KROUTE_DATA_DIR": str(data_dir),
        "KROUTE_SPARK_MASTER": "local[2]",
        **(extra_env or {}),
    }
    url = f"http://127.0.0.1:{port}"

    def live() -> bool:
        try:
            return httpx.get(url + "/health/live", timeout=1, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    process = services.start_process(
        name, [sys.executable, "-m", "materializer"], env=env, ready=live, timeout_s=60
    )
    node = NodeProcess(process, url)
    if wait_ready:
        deadline = time.monotonic() + 120
        while node.get("/health/ready").status_code != 200:
            assert process.is_running(), process.log_tail(40)
            assert time.monotonic() < deadline, f"not ready: {node.get('/health/ready').text}"
            time.sleep(0.3)
    return node


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
    producer = Producer(
        {"bootstrap.servers": bootstrap, "partitioner": "murmur2_random", "linger.ms": 5}
    )
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


def assert_serves_truth(node: NodeProcess, truth: dict[bytes, bytes], all_keys: list[str]) -> None:
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
