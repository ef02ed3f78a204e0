"""True end offsets (high watermarks) of Kafka partitions, read from Fetch responses.

A consumer's `end_offsets()` / `seek_to_end()` asks ListOffsets(latest). Tansu answers that
with the base offset of the partition's last record batch + 1, not the high watermark: a
partition written as one batch of 10 records reports 1. The high watermark that every Fetch
response carries is right on Tansu and on Apache Kafka alike, so lag and "caught up" are
computed from it. tests/materializer/test_kafka_offsets.py shows both answers side by side.

Broker quirks this module works around (measured on Tansu 0.6, see docs/broker-quirks.md):
- a Fetch with max wait 0 comes back with no partitions at all, so we wait a few ms;
- a Fetch past the end is answered without error on Tansu but with OFFSET_OUT_OF_RANGE (and no
  high watermark) on Kafka, so we fetch from an offset inside the log.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from aiokafka.client import AIOKafkaClient
from aiokafka.protocol.fetch import FetchRequest
from aiokafka.protocol.offset import OffsetRequest
from aiokafka.structs import TopicPartition

from materializer.errors import EndOffsetsError

_NO_ERROR = 0
_OFFSET_OUT_OF_RANGE = 1
_EARLIEST_TIMESTAMP = -2
_READ_UNCOMMITTED = 0
_READ_COMMITTED = 1
# One byte per partition: the broker still returns at most one record batch (KIP-74), which
# we discard; we only want the response header's high watermark.
_PARTITION_MAX_BYTES = 1
_FETCH_MAX_WAIT_MS = 10
# Fetch errors after which a partition's leader must be looked up again: UNKNOWN_TOPIC_OR_PARTITION,
# NOT_LEADER_OR_FOLLOWER, FENCED_LEADER_EPOCH, UNKNOWN_LEADER_EPOCH.
_STALE_LEADER_ERRORS = frozenset({3, 6, 74, 75})

# Partition leaders per client and topic. Spark asks for end offsets every ~10 ms while idle;
# asking the broker for metadata each time as well would double the round trips.
_LEADERS: weakref.WeakKeyDictionary[AIOKafkaClient, dict[str, dict[int, int]]] = (
    weakref.WeakKeyDictionary()
)


@dataclass(frozen=True, slots=True)
class LogBounds:
    """Where a partition's log starts and ends, as one Fetch response said."""

    start: int | None  # the log start offset; None when the broker does not report it
    end: int  # the high watermark, or the last stable offset when asked for `stable`


async def fetch_high_watermarks(
    client: AIOKafkaClient,
    topic: str,
    partitions: Iterable[int],
    *,
    positions: Mapping[int, int] | None = None,
    timeout_s: float = 5.0,
    stable: bool = False,
) -> dict[int, int]:
    """partition -> high watermark (see `fetch_log_bounds`)."""
    bounds = await fetch_log_bounds(
        client, topic, partitions, positions=positions, timeout_s=timeout_s, stable=stable
    )
    return {partition: bound.end for partition, bound in bounds.items()}


async def fetch_log_bounds(
    client: AIOKafkaClient,
    topic: str,
    partitions: Iterable[int],
    *,
    positions: Mapping[int, int] | None = None,
    timeout_s: float = 5.0,
    stable: bool = False,
) -> dict[int, LogBounds]:
    """partition -> log start and high watermark, from one Fetch per partition leader.

    `positions` are offsets expected inside each partition's log (a consumer's positions);
    without them we fetch from 0. A position outside the log is answered with
    OFFSET_OUT_OF_RANGE by Kafka: we fetch again from the log start, and the answer still
    shows where the log begins, so the caller can see that its position fell out of it.
    With `stable`, the end a read_committed reader can reach: the last stable offset when the
    broker reports one below the high watermark (an open transaction), else the high watermark.
    """
    wanted = sorted(set(partitions))
    fetch_from = {p: (positions or {}).get(p, 0) for p in wanted}
    found: dict[int, LogBounds] = {}
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [p for p in wanted if p not in found]
        if not missing:
            return found
        if time.monotonic() >= deadline:
            raise EndOffsetsError(topic, missing, f"no high watermark within {timeout_s:.1f}s")
        out_of_range = await _fetch_once(client, topic, missing, fetch_from, found, stable=stable)
        if out_of_range:
            fetch_from.update(await _earliest_offsets(client, topic, out_of_range))
        elif len(found) < len(wanted):
            await asyncio.sleep(0.01)


async def _fetch_once(
    client: AIOKafkaClient,
    topic: str,
    partitions: list[int],
    fetch_from: Mapping[int, int],
    found: dict[int, LogBounds],
    *,
    stable: bool = False,
) -> list[int]:
    """Record the bounds one round of Fetches reports; return partitions out of range."""
    out_of_range: list[int] = []
    for node_id, node_partitions in (await _by_leader(client, topic, partitions)).items():
        request = FetchRequest(
            _FETCH_MAX_WAIT_MS,
            0,  # min_bytes: answer at once, we want the header not the data
            _PARTITION_MAX_BYTES,
            _READ_COMMITTED if stable else _READ_UNCOMMITTED,
            [(topic, [(p, fetch_from[p], _PARTITION_MAX_BYTES) for p in node_partitions])],
        )
        response = await client.send(node_id, request)
        for entry in _partition_entries(response, topic):
            partition, error_code = entry["partition"], entry["error_code"]
            if error_code == _NO_ERROR and entry["highwater_offset"] >= 0:
                found[partition] = _bounds_of(entry, stable=stable)
            elif error_code == _OFFSET_OUT_OF_RANGE:
                out_of_range.append(partition)
            elif error_code in _STALE_LEADER_ERRORS:
                _LEADERS.get(client, {}).pop(topic, None)  # look up again on the next round
            elif error_code != _NO_ERROR:
                raise EndOffsetsError(topic, [partition], f"Fetch error code {error_code}")
    return out_of_range


def _bounds_of(entry: Mapping[str, Any], *, stable: bool) -> LogBounds:
    high, lso = entry["highwater_offset"], entry.get("last_stable_offset", -1)
    start = entry.get("log_start_offset", -1)  # Fetch v5+; -1 when the broker does not know
    return LogBounds(
        start=start if start >= 0 else None,
        end=min(high, lso) if stable and lso >= 0 else high,
    )


async def _earliest_offsets(
    client: AIOKafkaClient, topic: str, partitions: list[int]
) -> dict[int, int]:
    earliest: dict[int, int] = {}
    for node_id, node_partitions in (await _by_leader(client, topic, partitions)).items():
        request = OffsetRequest(
            -1, _READ_UNCOMMITTED, [(topic, [(p, _EARLIEST_TIMESTAMP) for p in node_partitions])]
        )
        response = await client.send(node_id, request)
        for entry in _partition_entries(response, topic):
            if entry["error_code"] != _NO_ERROR:
                raise EndOffsetsError(
                    topic, [entry["partition"]], f"ListOffsets error code {entry['error_code']}"
                )
            offset = entry["offset"] if "offset" in entry else entry["offsets"][0]
            earliest[entry["partition"]] = offset
    return earliest


async def _by_leader(
    client: AIOKafkaClient, topic: str, partitions: list[int]
) -> dict[int, list[int]]:
    leaders = _LEADERS.get(client, {}).get(topic, {})
    if any(p not in leaders for p in partitions):
        leaders = await _current_leaders(client, topic, partitions)
        _LEADERS.setdefault(client, {})[topic] = leaders
    by_leader: dict[int, list[int]] = defaultdict(list)
    for partition in partitions:
        by_leader[leaders[partition]].append(partition)
    return by_leader


async def _current_leaders(
    client: AIOKafkaClient, topic: str, partitions: list[int]
) -> dict[int, int]:
    """partition -> leader node for every partition of the topic, from fresh metadata."""
    metadata = await client.fetch_all_metadata()
    known = metadata.partitions_for_topic(topic)
    if known is None:
        raise EndOffsetsError(topic, partitions, "topic does not exist")
    leaders: dict[int, int] = {}
    for partition in known:
        leader = metadata.leader_for_partition(TopicPartition(topic, partition))
        if leader is not None and leader >= 0:
            leaders[partition] = leader
    for partition in partitions:
        if partition not in leaders:
            raise EndOffsetsError(topic, [partition], "partition has no leader")
    return leaders


def _partition_entries(response: Any, topic: str) -> list[dict[str, Any]]:
    """The per-partition entries of a Fetch or ListOffsets response, as named fields."""
    topics = response.to_object()["topics"]
    return [
        entry
        for topic_entry in topics
        if topic_entry.get("topic", topic_entry.get("topics")) == topic
        for entry in topic_entry["partitions"]
    ]


async def end_offsets(
    bootstrap_servers: str, topic: str, partitions: Iterable[int], timeout_s: float = 5.0
) -> dict[int, int]:
    """One-shot: connect, read the high watermarks, close. For tests, scripts and start-up."""
    client = AIOKafkaClient(
        bootstrap_servers=bootstrap_servers, request_timeout_ms=int(timeout_s * 1000)
    )
    await client.bootstrap()
    try:
        return await fetch_high_watermarks(client, topic, partitions, timeout_s=timeout_s)
    finally:
        await client.close()
