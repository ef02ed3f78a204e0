"""How far behind each hosted partition is: offsets from the store, end offsets from Kafka.

A timer task reads the high watermarks (Fetch responses, see kafka_offsets) and the store's
checkpoints, and publishes an immutable snapshot that the HTTP handlers read without waiting.

Time lag is an upper bound on staleness: every record produced before the last moment this
partition was known caught up has been applied, so a value served now is at most
`now - caught_up_at` old. A partition never seen caught up since start reports no time lag.

Known caught up at T means: the store's position has reached an end offset read at T. That is
the moment of a refresh that finds lag 0, or, under steady writes (where a refresh rarely
finds lag 0 because records keep arriving during each micro-batch, and a micro-batch may take
longer than a refresh interval), the latest recent refresh whose end offset the store has
since passed. The tracker keeps the last `_END_HISTORY` end offsets read per partition.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import structlog
from aiokafka.client import AIOKafkaClient

from common.clock import SHARED, now_ms
from materializer.kafka_offsets import LogBounds, fetch_log_bounds
from materializer.store import Store

log = structlog.get_logger("kroute.materializer.lag")
_END_HISTORY = 64  # end offsets remembered per partition: a minute at the default interval
# End offsets older than this are not reported (lag unknown): several refreshes (250 ms each by
# default) failed in a row, so the broker is not being read.
END_OFFSET_MAX_AGE_MS = 2_000

# Where the store's position is when it is not inside the partition's log:
# - past_end: beyond the high watermark: the topic was recreated or truncated (an unclean
#   election, a broker restarted on memory storage). Nothing the store holds is known.
# - below_start: before the log start: records the node never read were deleted (retention).
#   The store misses them, and reading on would skip them silently.
# Either way the partition is rebuilt from the log (see Node._rebuild_outside_log).
OutsideLog = Literal["past_end", "below_start"]


@dataclass(frozen=True, slots=True)
class PartitionLag:
    partition: int
    current_offset: int
    end_offset: int | None  # None until the broker has answered once
    newest_record_ms: int | None
    caught_up_at_ms: int | None
    end_offset_at_ms: int | None  # when end_offset was read
    outside_log: OutsideLog | None = None  # the store's position is not inside the log
    log_start: int | None = None  # the log start offset, when the broker reports it

    @property
    def lag(self) -> int | None:
        if self.end_offset is None or self.outside_log is not None:
            return None
        return max(self.end_offset - self.current_offset, 0)

    def known_end(self, at_ms: int, max_age_ms: int = END_OFFSET_MAX_AGE_MS) -> int | None:
        """The end offset to report: None (lag unknown) once it is older than `max_age_ms`, as
        when the broker cannot be read; a report must not say lag 0 against an end offset
        from minutes ago while the store falls behind."""
        if self.outside_log is not None or self.end_offset_at_ms is None:
            return None
        return self.end_offset if at_ms - self.end_offset_at_ms <= max_age_ms else None

    def time_lag_ms(self, at_ms: int) -> int | None:
        """Upper bound on staleness at `at_ms`: everything written before caught_up_at_ms is
        applied. Lag 0 at the last refresh is no bound by itself: records may have arrived
        since, so even a caught-up partition's time lag is the age of that refresh."""
        if self.caught_up_at_ms is None:
            return 0 if self.lag == 0 else None
        # A stamp taken before the clock stepped back to Redis time reads too fresh: mapped.
        return max(at_ms - SHARED.conservative_ms(self.caught_up_at_ms), 0)

    def as_json(self, at_ms: int) -> dict[str, object]:
        return {
            "partition": self.partition,
            "current_offset": self.current_offset,
            "end_offset": self.end_offset,
            "lag": self.lag,
            "time_lag_ms": self.time_lag_ms(at_ms),
            "newest_record_ms": self.newest_record_ms,
            "caught_up": self.lag == 0,
            "outside_log": self.outside_log,
            "end_offset_age_ms": None
            if self.end_offset_at_ms is None
            else at_ms - self.end_offset_at_ms,
        }


class LagTracker:
    def __init__(self, store: Store, topic: str, partitions: Callable[[], tuple[int, ...]]) -> None:
        self._store = store
        self._topic = topic
        self._partitions = partitions
        self.snapshot: dict[int, PartitionLag] = {}
        self.broker_error: str | None = None
        self._recent_ends: dict[int, deque[tuple[int, int]]] = {}  # (end offset, read at ms)

    def refresh_offsets_only(self) -> None:
        """Take the store's checkpoints without asking the broker (before it is reachable)."""
        self.snapshot = self._build(None, now_ms())

    async def refresh(self, client: AIOKafkaClient) -> None:
        partitions = self._partitions()
        positions = {
            p: cp.next_offset
            for p, cp in self._store.checkpoints().items()
            if cp and p in partitions
        }
        # The ends describe the partition as it was when asked, not when the answer arrived:
        # stamping them later would count records appended meanwhile as applied.
        asked_at = now_ms()
        try:
            # The nodes read committed records (see kafka_source): an open transaction's
            # records are not behind, they are not readable yet.
            bounds = await fetch_log_bounds(
                client, self._topic, partitions, positions=positions, timeout_s=2.0, stable=True
            )
        except Exception as exc:  # noqa: BLE001 - keep serving; the report says the ends are old
            if self.broker_error is None:
                log.warning(
                    "cannot read end offsets; lag reports keep the last known ends", error=str(exc)
                )
            self.broker_error = str(exc)
            self.keep_ends(now_ms())
            return
        self.broker_error = None
        self.apply_bounds(bounds, asked_at)

    def apply_bounds(self, bounds: Mapping[int, LogBounds], asked_at_ms: int) -> None:
        """Take the partitions' logs as they were at `asked_at_ms`."""
        self.snapshot = self._build(bounds, asked_at_ms)

    def apply_ends(self, ends: Mapping[int, int], asked_at_ms: int) -> None:
        """Take end offsets from a broker that does not report where its logs start."""
        self.apply_bounds({p: LogBounds(None, end) for p, end in ends.items()}, asked_at_ms)

    def keep_ends(self, at_ms: int) -> None:
        """Take the store's positions; the broker could not be read, the ends stay as known."""
        self.snapshot = self._build(None, at_ms)

    async def run(self, client: AIOKafkaClient, interval_s: float) -> None:
        while True:
            try:
                await self.refresh(client)
            except Exception as exc:
                log.exception("refreshing lag failed; trying again", error=str(exc))
            await asyncio.sleep(interval_s)

    def _build(self, bounds: Mapping[int, LogBounds] | None, at_ms: int) -> dict[int, PartitionLag]:
        previous = self.snapshot
        checkpoints = self._store.checkpoints()
        snapshot: dict[int, PartitionLag] = {}
        for partition in self._partitions():
            checkpoint = checkpoints.get(partition)
            current = checkpoint.next_offset if checkpoint else 0
            before = previous.get(partition)
            recent = self._recent_ends.setdefault(partition, deque(maxlen=_END_HISTORY))
            went_back = before is not None and current < before.current_offset
            if went_back:
                # The store went back (the partition was dropped, rebuilt or re-added): what
                # it reached before says nothing about what it holds now.
                recent.clear()
            bound = bounds.get(partition) if bounds is not None else None
            end: int | None
            end_at: int | None
            log_start: int | None
            if bound is not None:
                end, end_at, log_start = bound.end, at_ms, bound.start
                recent.append((bound.end, at_ms))
            else:
                end = before.end_offset if before else None
                end_at = before.end_offset_at_ms if before else None
                log_start = before.log_start if before else None
            caught_up_at = before.caught_up_at_ms if before and not went_back else None
            outside = _outside_log(current, log_start, end)
            if outside is not None:
                if not (before and before.outside_log == outside and not went_back):
                    _log_outside(partition, outside, current, log_start, end)
                # Nothing it holds is known: not caught up (so not ready), and ends read now
                # must not count as reached if the log grows past the position again.
                caught_up_at = None
                recent.clear()
            else:
                for end_read, read_at in reversed(recent):
                    if current >= end_read:
                        caught_up_at = max(caught_up_at or 0, read_at)
                        break
            snapshot[partition] = PartitionLag(
                partition=partition,
                current_offset=current,
                end_offset=end,
                newest_record_ms=checkpoint.newest_record_ms if checkpoint else None,
                caught_up_at_ms=caught_up_at,
                end_offset_at_ms=end_at,
                outside_log=outside,
                log_start=log_start,
            )
        return snapshot


def _outside_log(current: int, log_start: int | None, end: int | None) -> OutsideLog | None:
    """Whether the store's position (the next offset to read) lies outside [log start, end].

    Position 0 is never below the start: a store that read nothing misses nothing, and its
    reader starts at the log's beginning."""
    if end is not None and current > end:
        return "past_end"
    if log_start is not None and 0 < current < log_start:
        return "below_start"
    return None


def _log_outside(
    partition: int, outside: OutsideLog, current: int, log_start: int | None, end: int | None
) -> None:
    what = (
        "the store is past the end of the partition's log: the topic was recreated or truncated"
        if outside == "past_end"
        else "records the store never read were deleted from the log (retention)"
    )
    log.error(
        f"{what}; its lag is unknown until the partition is rebuilt from the log",
        partition=partition,
        store_position=current,
        log_start=log_start,
        end_offset=end,
    )
