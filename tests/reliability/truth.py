"""What the nodes must serve, computed from the topic itself, and the check that they do.

The ground truth is the topic read from offset 0 to the high watermarks with an independent
consumer (`tests/kafka_helpers.read_topic`): the latest value per key, and a tombstone
deletes. That read must return every offset below the watermarks, and every record the writer
had acknowledged must be among them at the offset the broker gave it, so a broker that lost or
rewrote records after a restart cannot hand us a smaller truth. The check asks every live
replica of every key's partition, so a replica that lost, kept or resurrected a key is caught
even when the other replica is right.

While the writer keeps writing there is no fixed truth to compare with, so a read is judged by
its staleness instead, the way the system benchmark judges it: how long before the answer
arrived the broker had acknowledged the oldest write to that key the answer does not show
(`true_staleness_s`). A replica whose time lag (caught up at T: everything the broker held at
T is applied) is within a budget cannot miss a write acknowledged before T, so a fresh-enough
answer has a true staleness within the budget plus its own time on the way back, whatever
the nodes or the proxy believe about their lag.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from common.contract import decode_report, lag_field
from partitioner import partition
from tests.cluster_helpers import PARTITIONS, Cluster
from tests.kafka_helpers import Acknowledged, assert_topic_holds, read_topic
from tests.reliability.traffic import Outcome, Write, Writer

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


def wait_nodes_caught_up(cluster: Cluster, names: set[str], timeout_s: float) -> None:
    """Until each of `names` has applied its replicas up to the current ends (the others may
    be anywhere: unlike `Cluster.settled`, a stopped node does not hold this up)."""
    deadline = time.monotonic() + timeout_s
    while (behind := _behind(cluster, names)) is not None:
        assert time.monotonic() < deadline, f"replicas did not catch up: {behind}"
        time.sleep(0.3)


def _behind(cluster: Cluster, names: set[str]) -> str | None:
    assignment, ends = cluster.assignment(), cluster.ends()
    for name in sorted(names):
        mine = assignment.for_node(name).get("customers", {})
        for p in mine.get("active", []) + mine.get("standby", []):
            raw = cluster.redis.hget(cluster.keys.lag(name), lag_field("customers", p))
            offset = decode_report(raw).current_offset if raw is not None else None
            if offset != ends[p]:
                return f"{name} partition {p} at {offset}, end {ends[p]}"
    return None


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


def shown_write(writes: list[Write], outcome: Outcome) -> int | None:
    """The index in `writes` of the write the answer shows; -1 for none of them (the seed
    value); None if it can show none (a deletion never written, a value never written)."""
    if outcome.status == 200:
        shown = (outcome.answer.get("value") or {}).get("write")
        if shown is None:
            return -1
        # A value this writer never wrote to this key shows nothing it wrote: wrong, not old.
        return next((i for i, write in enumerate(writes) if write.n == shown), None)
    received = outcome.at + outcome.latency_s
    # "Deleted" is what every tombstone shows: credit the newest sent before the answer came.
    deletions = [i for i, w in enumerate(writes) if w.deleted and w.sent_at <= received]
    return deletions[-1] if deletions else None


def true_staleness_s(writer: Writer, outcome: Outcome) -> float:
    """How long the oldest acknowledged write to the key that a 200 or 404 does not show had
    been in the topic when the answer arrived (0 if it shows everything acknowledged by
    then; infinite for an answer that shows no write of that key at all)."""
    writes = writer.writes_to(outcome.key)
    shown = shown_write(writes, outcome)
    if shown is None:
        return float("inf")
    received = outcome.at + outcome.latency_s
    unseen = [w.acked_at for w in writes[shown + 1 :] if w.acked_at is not None]
    oldest = min(unseen, default=received)
    return max(received - oldest, 0.0)
