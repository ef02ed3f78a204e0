"""Every line a real node and a real proxy write is one JSON object: their own lines, the
libraries' (uvicorn, httpx, aiokafka, py4j) and Spark's (log4j), with a typo in a KROUTE_*
variable reported as a warning naming the closest known variable."""

from __future__ import annotations

import asyncio
import json
import shutil
import uuid
from pathlib import Path

import httpx
import pytest

from kroute.embedded import BrokerHandle, EmbeddedServices, RedisHandle
from kroute.nodes import start_node
from kroute.proxies import start_proxy
from kroute.topics import create_topics
from materializer.kafka_offsets import end_offsets
from tests.materializer.node_helpers import produce_customers


def json_lines(log_path: Path) -> list[dict]:
    lines = log_path.read_text(errors="replace").splitlines()
    not_json = []
    parsed = []
    for line in lines:
        try:
            value = json.loads(line)
        except ValueError:
            not_json.append(line)
            continue
        if not isinstance(value, dict):
            not_json.append(line)
        else:
            parsed.append(value)
    assert not_json == [], f"{len(not_json)} of {len(lines)} lines are not JSON: {not_json[:10]}"
    return parsed


@pytest.mark.integration
def test_a_node_and_a_proxy_write_only_json_lines(
    embedded: EmbeddedServices, broker: BrokerHandle, redis_server: RedisHandle, tmp_path: Path
):
    topic, cluster = f"json-logs-{uuid.uuid4().hex[:8]}", f"json-logs-{uuid.uuid4().hex[:6]}"
    create_topics(broker.bootstrap_servers, {topic: 2})
    node = start_node(
        embedded,
        broker.bootstrap_servers,
        topic,
        tmp_path / "data",
        name=f"node-{uuid.uuid4().hex[:6]}",
        store="customers",
        spark_master="local[1]",
        redis_url=redis_server.url,
        cluster=cluster,
        log_level="debug",  # every library's lines too, not only warnings
        max_lag_m="1000",  # a typo of KROUTE_MAX_LAG_MS: reported, never silently dropped
    )
    proxy = start_proxy(
        embedded, redis_server.url, cluster=cluster, log_level="debug", wait_ready=False
    )
    try:
        produce_customers(broker.bootstrap_servers, topic, 20, keys=10, seed=3)
        ends = asyncio.run(end_offsets(broker.bootstrap_servers, topic, range(2)))
        node.wait_caught_up(ends, timeout_s=120)
        for key in ("customer-1", "missing"):
            httpx.get(f"{proxy.url}/stores/customers/keys/{key}", timeout=5, trust_env=False)
            httpx.get(f"{node.url}/stores/customers/keys/{key}", timeout=5, trust_env=False)
    finally:
        proxy.process.stop()
        node.process.stop()
        node.close()
    shutil.copy(node.process.log_path, tmp_path / "node.log")  # kept for a failure's report
    node_lines = json_lines(node.process.log_path)
    proxy_lines = json_lines(proxy.process.log_path)
    loggers = {line.get("logger", "") for line in node_lines + proxy_lines}
    assert any(name.startswith("uvicorn") for name in loggers), loggers
    assert any(name.startswith("py4j") for name in loggers), loggers
    assert any(name.startswith("org.apache.") for name in loggers), loggers  # Spark's log4j
    typo = [line for line in node_lines if line.get("variable") == "KROUTE_MAX_LAG_M"]
    assert typo, node_lines[:20]
    assert typo[0]["level"] == "warning"
    assert typo[0]["closest_known"] == "KROUTE_MAX_LAG_MS"
