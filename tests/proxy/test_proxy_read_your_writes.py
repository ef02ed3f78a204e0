"""Issue 19 item 4 on a real cluster: three materializer nodes (real Tansu, redis-server and
Spark) behind a real proxy. A client writes a record, takes its offset from the producer's
acknowledgement and reads the key through the proxy with `x-kroute-min-offset`: every answer
it gets holds its write, or is a 503 that says the write is not applied anywhere yet; never an
older value. Also while the key's active is SIGSTOPped (so a standby, behind at the moment of
each read, must wait for its pipeline) and while that standby's Spark is frozen too.

Every write carries a unique id in its value and every read a unique x-request-id, both
checked on the answer.
"""

from __future__ import annotations

import os
import signal
import statistics
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest
from confluent_kafka import Producer

from common.contract import decode_report, lag_field
from kroute.cluster_harness import keyed_producer, spark_jvm_pid
from kroute.proxies import ProxyHandle
from partitioner import partition
from tests.cluster_helpers import (
    NODE_NAMES,
    PARTITIONS,
    Cluster,
    cluster_proxy,
    running_cluster,
)

pytestmark = pytest.mark.integration

KEY = "ryw-customer"
UPSTREAM_TIMEOUT_MS = 3000
# Two cores shared by three Spark nodes: a write can take over a second to be applied, so the
# nodes wait longer than the default (still well inside the proxy's upstream timeout).
WAIT_MS = 1500


@pytest.fixture(scope="module")
def cluster(embedded, broker, tmp_path_factory) -> Iterator[Cluster]:
    with running_cluster(
        embedded, broker, tmp_path_factory.mktemp("ryw"), 120, min_offset_wait_ms=str(WAIT_MS)
    ) as built:
        yield built


@pytest.fixture(scope="module")
def proxy(embedded, cluster) -> Iterator[ProxyHandle]:
    with cluster_proxy(
        embedded,
        cluster,
        refresh_interval_ms="200",
        eject_ms="500",
        probe_interval_ms="100",
        upstream_timeout_ms=str(UPSTREAM_TIMEOUT_MS),
        wait_ready=False,
    ) as handle:
        yield handle


@dataclass
class Writer:
    """Writes unique values to KEY and reads them back through the proxy."""

    cluster: Cluster
    proxy: ProxyHandle
    producer: Producer = field(init=False)
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=15))
    latencies: list[float] = field(default_factory=list)  # ack -> answer holding the write, s

    def __post_init__(self) -> None:
        self.producer = keyed_producer(self.cluster.bootstrap)

    def write(self) -> tuple[str, int, float]:
        """(unique id, the record's offset, when it was acknowledged)."""
        written = uuid.uuid4().hex
        acked: list[int] = []

        def delivered(error: object, message: object) -> None:
            assert error is None, error
            acked.append(message.offset())  # type: ignore[attr-defined]

        self.producer.produce(
            self.cluster.topic,
            key=KEY.encode(),
            value=b'{"id": "%s"}' % written.encode(),
            on_delivery=delivered,
        )
        assert self.producer.flush(10) == 0
        return written, acked[0], time.monotonic()

    def read(self, **headers: str) -> httpx.Response:
        request_id = uuid.uuid4().hex
        response = self.http.get(
            f"{self.proxy.url}/stores/customers/keys/{KEY}",
            headers={"x-request-id": request_id, **headers},
        )
        assert response.headers["x-request-id"] == request_id
        return response

    def write_then_read(self) -> tuple[httpx.Response, str, int]:
        """Write, read at the write's offset; a 200 must hold the write (checked here)."""
        written, offset, acked_at = self.write()
        response = self.read(**{"x-kroute-min-offset": str(offset)})
        if response.status_code == 200:
            assert response.json()["value"] == {"id": written}, (offset, response.text)
            applied = int(response.headers["x-kroute-position"].split(":")[1])
            assert applied >= offset
            self.latencies.append(time.monotonic() - acked_at)
        else:
            assert response.status_code == 503, response.text
            body = response.json()
            assert body["min_offset"] == offset
            assert body["partition"] == partition(KEY.encode(), PARTITIONS)
        return response, written, offset


def test_write_then_read_always_sees_the_write(cluster, proxy):
    cluster.wait_settled(set(NODE_NAMES))
    writer = Writer(cluster, proxy)
    p = partition(KEY.encode(), PARTITIONS)
    placed = cluster.assignment().stores["customers"][p]
    active, standby = placed.active, placed.standbys[0]
    _wait_until_answered(writer)

    # Healthy: the control read right after the acknowledgement, without the header, is
    # usually stale (the write waits for the next micro-batch); the bounded read never is.
    stale_controls = reported_at_ack = 0
    for _ in range(8):
        written, offset, acked_at = writer.write()
        reported_at_ack += any(
            _reported_position(cluster, n, p) > offset for n in (active, standby)
        )
        control = writer.read()
        stale_controls += control.json().get("value") != {"id": written}
        bounded = writer.read(**{"x-kroute-min-offset": str(offset)})
        assert bounded.status_code == 200, bounded.text
        assert bounded.json()["value"] == {"id": written}
        writer.latencies.append(time.monotonic() - acked_at)  # a control read (~ms) included
    assert stale_controls >= 1, "every control read was fresh: the test shows nothing"
    healthy = list(writer.latencies)
    writer.latencies.clear()

    # The active stopped: its standby answers, behind at the moment of each read.
    stopped = [cluster.nodes[active].process.pid, spark_jvm_pid(cluster.nodes[active])]
    standby_jvm = spark_jvm_pid(cluster.nodes[standby])
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    try:
        answered = [writer.write_then_read()[0] for _ in range(10)]
        assert all(r.status_code == 200 for r in answered), [r.text for r in answered]
        assert all(r.headers["x-kroute-node"] == standby for r in answered[1:])
        while_stopped = list(writer.latencies)

        # The standby's Spark frozen too: nobody can apply a write; answers say so.
        os.kill(standby_jvm, signal.SIGSTOP)
        try:
            frozen = [writer.write_then_read()[0] for _ in range(3)]
        finally:
            os.kill(standby_jvm, signal.SIGCONT)
        assert all(r.status_code == 503 for r in frozen), [r.text for r in frozen]
        for response in frozen:
            body = response.json()
            assert body["error"] == "position_not_reached", body
            assert body["best_applied_offset"] < body["min_offset"]

        # Thawed: the standby catches up and reads see their writes again (the first may
        # still find its Spark resuming).
        thawed = [writer.write_then_read()[0] for _ in range(5)]
        assert all(r.status_code == 200 for r in thawed[1:]), [r.text for r in thawed]
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    healthy_ms = [t * 1000 for t in healthy]
    stopped_ms = [t * 1000 for t in while_stopped]
    print(
        f"reports past the offset at the ack: {reported_at_ack}/8 writes; "
        f"stale control reads: {stale_controls}/8; "
        f"ack -> read holding the write, ms: healthy p50 {statistics.median(healthy_ms):.0f} "
        f"max {max(healthy_ms):.0f}; active stopped p50 {statistics.median(stopped_ms):.0f} "
        f"max {max(stopped_ms):.0f} (its first read waits for the upstream timeout)"
    )


def _reported_position(cluster: Cluster, node: str, p: int) -> int:
    """The position `node` last reported for partition `p` in Redis (-1: none)."""
    raw = cluster.redis.hget(cluster.keys.lag(node), lag_field("customers", p))
    return -1 if raw is None else decode_report(raw).current_offset


def _wait_until_answered(writer: Writer, timeout_s: float = 60) -> None:
    """Until the proxy has a table and answers KEY's partition (with anything but a 5xx)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if writer.read().status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError("the proxy never answered")
