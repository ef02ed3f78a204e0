"""A real node whose custom transform fails: on one record (skipped and counted, the rest
applied), and on every batch (not ready, saying why, until the transform works again)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from kroute.cluster_harness import keyed_producer
from kroute.nodes import NodeHandle, start_node
from kroute.topics import create_topics
from materializer.kafka_offsets import end_offsets
from tests.materializer.poison_transform import BROKEN_FLAG, POISON

pytestmark = pytest.mark.integration

PARTITIONS = 2
ROOT = Path(__file__).resolve().parents[2]
STALL_TIMEOUT_MS = 3000


def ends_of(bootstrap: str, topic: str) -> dict[int, int]:
    return asyncio.run(end_offsets(bootstrap, topic, range(PARTITIONS)))


def produce(bootstrap: str, topic: str, keys: range, poison_at: int | None = None) -> None:
    producer = keyed_producer(bootstrap, linger_ms=5)
    for n in keys:
        value = POISON if n == poison_at else json.dumps({"n": n}).encode()
        producer.produce(topic, key=f"k{n}".encode(), value=value)
    assert producer.flush(30) == 0


def readiness_over(node: NodeHandle, seconds: float) -> list[tuple[int, dict[str, object]]]:
    answers = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        response = node.get("/health/ready")
        answers.append((response.status_code, response.json()))
        time.sleep(0.2)
    return answers


def test_a_failing_transform_skips_its_bad_records_and_a_broken_one_makes_the_node_not_ready(
    embedded, broker, tmp_path, monkeypatch
):
    bootstrap, topic = broker.bootstrap_servers, "failing-transform"
    create_topics(bootstrap, {topic: PARTITIONS})
    flag = tmp_path / "transform-broken"
    # The node and its Spark workers import the test transform from the repository.
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv(BROKEN_FLAG, str(flag))
    produce(bootstrap, topic, range(200), poison_at=57)
    node = start_node(
        embedded,
        bootstrap,
        topic,
        tmp_path / "data",
        wait_ready=False,
        store="customers",
        spark_master="local[2]",
        transform="tests.materializer.poison_transform:broken_while_flagged",
        stall_timeout_ms=str(STALL_TIMEOUT_MS),
        start_retry_max_s="1",  # restarts as fast as they come: the node must still say no
    )
    try:
        # One record the transform raises on: before, the batch failed and was retried from
        # the same checkpoint forever; now the record is skipped, counted and logged.
        metadata = node.wait_caught_up(ends_of(bootstrap, topic), timeout_s=180)
        assert sum(p["skipped_records"] for p in metadata["partitions"]) == 1
        assert node.get("/stores/customers/keys/k57").status_code == 404
        assert node.get("/stores/customers/keys/k58").json()["value"] == {"n": 58}
        node.wait_ready(timeout_s=30)
        assert "ValueError: poison record" in node.process.log_path.read_text()

        # A broken deploy: every batch fails. The query restarts forever, and the node says
        # it is not ready, and why, for as long as that lasts (it used to flap to ready).
        flag.touch()
        produce(bootstrap, topic, range(200, 240))
        time.sleep(STALL_TIMEOUT_MS / 1000 + 2)
        answers = readiness_over(node, 4)
        assert {status for status, _ in answers} == {503}, answers
        reason = str(answers[-1][1]["reason"])
        assert reason.startswith("pipeline stalled"), reason
        assert "transform broken by a bad deploy" in reason, reason
        pipeline = node.metadata()["pipeline"]
        assert pipeline["stalled"] is True
        # It keeps restarting (each restart starts a query and fails its batch: seconds on a
        # busy machine), and is not ready all the while.
        deadline = time.monotonic() + 90
        while pipeline["restarts"] < 2:
            assert time.monotonic() < deadline, pipeline
            assert node.get("/health/ready").status_code == 503
            time.sleep(1)
            pipeline = node.metadata()["pipeline"]
        assert "transform broken by a bad deploy" in pipeline["last_error"]

        flag.unlink()  # fixed: it catches up and is ready again
        node.wait_caught_up(ends_of(bootstrap, topic), timeout_s=120)
        node.wait_ready(timeout_s=30)
        assert node.metadata()["pipeline"]["stalled"] is False
        assert node.get("/stores/customers/keys/k230").json()["value"] == {"n": 230}
    finally:
        node.process.stop()
        node.close()
