"""Freshness a lookup asks for, checked where the data is (ksqlDB enforces lag on the host).

A proxy chooses a replica from lag reports that are up to a report interval plus a trip
through Redis old, or older when its table is stale; only the node knows its store's position
now. So a node asked with a lag budget (`x-kroute-max-lag`, `x-kroute-max-lag-ms`) checks its
own lag, and a node asked for a minimum offset (`x-kroute-min-offset`, read-your-writes)
checks its store's real position, waiting up to `KROUTE_MIN_OFFSET_WAIT_MS` for the pipeline
to apply it. A bound it cannot meet is a 421 (RFC 9110: no authoritative answer here) with the
reason, and the proxy asks the next replica. See common.freshness for the headers.

The node's lag is what its reports say, with the store's position read now: offset lag against
the last end offset read (unknown once that is older than END_OFFSET_MAX_AGE_MS, or the store
is outside the log), time lag since it was last known caught up (unknown while stalled). Unknown
lag is beyond any budget: a read that is silently stale is worse than asking another replica.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from common.freshness import (
    MAX_LAG_HEADER,
    MAX_LAG_MS_HEADER,
    MIN_OFFSET_HEADER,
    BadFreshnessHeader,
    parse_count,
    parse_min_offsets,
    reached,
)
from materializer.lag import PartitionLag

_POLL_S = 0.005  # how often a waited-for store position is read (a few µs a read)
_NAMES = {name.encode(): name for name in (MAX_LAG_HEADER, MAX_LAG_MS_HEADER, MIN_OFFSET_HEADER)}


@dataclass(frozen=True, slots=True)
class ReadBounds:
    max_lag: int | None = None
    max_lag_ms: int | None = None
    min_offset: int | None = None  # for the lookup's partition

    @classmethod
    def from_headers(cls, headers: list[tuple[bytes, bytes]], partition: int) -> ReadBounds | None:
        """The bounds a request asks for; None when it asks for none. BadFreshnessHeader when a
        value is malformed (a header sent twice: the first counts, as the proxy reads it)."""
        values = freshness_headers(headers)
        if not values:
            return None
        max_lag, max_ms, offsets = (
            values.get(name) for name in (MAX_LAG_HEADER, MAX_LAG_MS_HEADER, MIN_OFFSET_HEADER)
        )
        return cls(
            None if max_lag is None else parse_count(max_lag, MAX_LAG_HEADER),
            None if max_ms is None else parse_count(max_ms, MAX_LAG_MS_HEADER),
            None if offsets is None else parse_min_offsets(offsets).for_partition(partition),
        )


def freshness_headers(headers: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """The request's freshness headers (the first of each), to pass on when forwarding."""
    found: dict[str, str] = {}
    for name, value in headers:
        known = _NAMES.get(name.lower())
        if known is not None and known not in found:
            found[known] = value.decode("latin-1")
    return found


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why this node will not answer: `reason` for the x-kroute-refused header, `payload` the
    JSON body of the 421."""

    reason: str
    payload: dict[str, Any]


def lag_refusal(
    bounds: ReadBounds,
    lag: PartitionLag,
    position: int,
    *,
    stalled: bool,
    at_ms: int,
    where: dict[str, Any],
) -> Refusal | None:
    """A 421 when the partition is beyond a budget; None when inside every budget asked."""
    end = lag.known_end(at_ms)
    offsets = None if end is None else max(end - position, 0)
    millis = None if stalled or lag.outside_log else lag.time_lag_ms(at_ms)
    lags = {"lag": offsets, "time_lag_ms": millis}
    checks = (
        ("max_lag", bounds.max_lag, offsets, "lag {} over budget {}", "unknown lag"),
        (
            "max_lag_ms",
            bounds.max_lag_ms,
            millis,
            "time lag {} ms over budget {} ms",
            "unknown time lag",
        ),
    )
    for budget, limit, value, over, unknown in checks:
        if limit is None or (value is not None and value <= limit):
            continue
        reason = unknown if value is None else over.format(value, limit)
        return Refusal(
            reason,
            {
                "error": "beyond_budget",
                "detail": f"{_who(where)}: {reason}; ask another replica",
                "budget": budget,
                "limit": limit,
                **lags,
                **where,
            },
        )
    return None


def position_refusal(
    min_offset: int, position: int, waited_ms: int, where: dict[str, Any]
) -> Refusal:
    applied = position - 1
    reason = f"position {applied} short of min offset {min_offset}"
    return Refusal(
        reason,
        {
            "error": "position_not_reached",
            "detail": f"{_who(where)}: the store has applied up to offset {applied}, not yet "
            f"{min_offset} (waited {waited_ms} ms); ask another replica",
            "min_offset": min_offset,
            "applied_offset": applied,
            "waited_ms": waited_ms,
            **where,
        },
    )


def _who(where: dict[str, Any]) -> str:
    return f"partition {where.get('partition')} on node {where.get('node')}"


def bad_header(exc: BadFreshnessHeader) -> dict[str, Any]:
    return {"error": "bad_header", "header": exc.header, "value": exc.value, "detail": str(exc)}


class PositionWatch:
    """Lookups waiting for a partition's store to reach an offset, woken by one poll loop.

    The store is written by the pipeline's thread; reading its checkpoint is ~1 µs, so one
    task polls every `_POLL_S` while anyone waits (never a thread, never a blocking wait on the
    event loop), however many lookups wait."""

    def __init__(self, position: Callable[[int], int], poll_s: float = _POLL_S) -> None:
        self._position = position
        self._poll_s = poll_s
        self._waiting: dict[int, list[tuple[int, asyncio.Future[None]]]] = {}
        self._task: asyncio.Task[None] | None = None

    async def wait(self, partition: int, min_offset: int, timeout_s: float) -> int:
        """The store's position once it has applied `min_offset`, or after `timeout_s`."""
        position = self._position(partition)
        if reached(position, min_offset) or timeout_s <= 0:
            return position
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (min_offset, future)
        self._waiting.setdefault(partition, []).append(entry)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._poll())
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(future, timeout_s)
        finally:
            waiters = self._waiting.get(partition, [])
            if entry in waiters:
                waiters.remove(entry)
            if not waiters:
                self._waiting.pop(partition, None)
        return self._position(partition)

    async def _poll(self) -> None:
        while self._waiting:
            await asyncio.sleep(self._poll_s)
            for partition, waiters in list(self._waiting.items()):
                position = self._position(partition)
                for min_offset, future in waiters:
                    if reached(position, min_offset) and not future.done():
                        future.set_result(None)
