"""Milliseconds since the Unix epoch on one clock for the whole cluster: Redis `TIME`.

Every time the Redis contract carries (`caught_up_at_ms`, `updated_at_ms`, dead-since) is
written by one process and compared with "now" by another. With each host's own wall clock, a
node 5 s ahead makes a 5.4 s old answer look 400 ms old to a proxy, and a node 3 s behind makes
every report look too old. So every process keeps an offset to Redis's clock, refreshed
periodically (nodes on each heartbeat, proxies on each table refresh), and `now_ms()` returns
Redis time once the process has synced: local monotonic time plus that offset (so a local
wall-clock step cannot move it either). Before the first sync it is the local wall clock.

A sample is the Redis reply taken at the midpoint of its round trip: wrong by at most half the
round trip. Samples are bounded so that one bad reply cannot throw the clock around:
- after the first sync, a sample whose round trip exceeds `max_rtt_ms` is dropped;
- a sample more than `max_step_ms` away from the current estimate is a jump (Redis failed over
  to a host with another clock, or that host's clock was stepped): it is followed only when
  `confirmations` samples in a row agree on it, and logged either way.

A step backwards makes times stamped before it look fresher than they were (the first sync of a
host whose clock runs ahead is such a step). `conservative_ms` maps such a stamp to a time that
is never later than the truth; writers of "caught up at" times pass them through it.

`KROUTE_CLOCK_SKEW_MS` (fault injection, for tests) pretends this process's wall clock is off
by that many milliseconds.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import structlog

log = structlog.get_logger("kroute.common.clock")

# Two synced processes agree within this (each sample is off by at most half a round trip of
# at most 250 ms, and normal corrections are smaller than a step). Readers refuse a time that
# is further than this in their future: its writer's clock is not the shared one.
CLOCK_TOLERANCE_MS = 500
SKEW_ENV = "KROUTE_CLOCK_SKEW_MS"


class TimeSource(Protocol):
    """Anything with Redis's TIME command (redis.asyncio.Redis)."""

    def time(self) -> Awaitable[tuple[int, int]]: ...


# A TIME reply (seconds, microseconds), when it was asked for and when it arrived (`stopwatch`
# readings: the host's monotonic clock, the same in every process on it).
ClockSample = tuple[tuple[int, int], float, float]


class SharedClock:
    """This process's estimate of Redis time; see the module docstring."""

    def __init__(
        self,
        *,
        skew_ms: int = 0,
        wall: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        max_rtt_ms: float = 250.0,
        max_step_ms: float = 250.0,
        confirmations: int = 3,
    ) -> None:
        self.skew_ms = skew_ms
        self._wall = wall
        self._monotonic = monotonic
        self.max_rtt_ms = max_rtt_ms
        self.max_step_ms = max_step_ms
        self.confirmations = confirmations
        self._base_ms: float | None = None  # Redis time = monotonic ms + base, once synced
        self._jump: list[float] = []  # candidate bases of a jump not yet confirmed
        self._stepped_back_ms = 0  # how far backward steps have gone, all together
        self._horizon_ms: int | None = None  # stamps at or before this may predate one
        self.samples = 0
        self.dropped = 0
        # Called with every sample taken (`observe`): the proxy's table process sends them to
        # the proxy, whose own clock observes them.
        self.taps: list[Callable[[tuple[int, int], float, float], None]] = []
        self.last_rtt_ms: float | None = None

    # -- reading --------------------------------------------------------------------------

    @property
    def synced(self) -> bool:
        return self._base_ms is not None

    def local_ms(self) -> int:
        """This host's own wall clock (with the injected skew)."""
        return int(self._wall() * 1000) + self.skew_ms

    def now_ms(self) -> int:
        base = self._base_ms
        if base is None:
            return self.local_ms()
        return int(self._monotonic() * 1000 + base)

    def stopwatch(self) -> float:
        """Monotonic seconds, to time a round trip for `observe`."""
        return self._monotonic()

    def wall_offset_ms(self) -> int:
        """What to add to this host's wall clock (CLOCK_REALTIME) to get `now_ms()`: for code
        that reads the clock itself (the proxy's C path)."""
        return self.now_ms() - self.local_ms() + self.skew_ms

    def conservative_ms(self, stamp_ms: int) -> int:
        """A time stamped earlier on this clock, mapped so it is never later than the truth.

        After a backward step of J ms, a stamp taken before it reads J ms too late, and one
        taken just after it cannot be told apart by value. Every stamp up to the latest
        reading before a step is moved back by all the steps: exact for the old ones,
        older than true (refused sooner, never served staler) for the new ones, until the
        clock passes that reading."""
        if self._horizon_ms is not None and stamp_ms <= self._horizon_ms:
            return stamp_ms - self._stepped_back_ms
        return stamp_ms

    # -- syncing --------------------------------------------------------------------------

    async def sync(self, redis: TimeSource) -> bool:
        """Take one sample of Redis time; whether it was used."""
        sent = self.stopwatch()
        reply = await redis.time()
        return self.observe(reply, sent, self.stopwatch())

    def observe(self, reply: tuple[int, int], sent_s: float, received_s: float) -> bool:
        """Take a TIME reply (seconds, microseconds) that was asked for at `sent_s` and
        arrived at `received_s` (both `stopwatch()` readings); whether it was used."""
        seconds, micros = int(reply[0]), int(reply[1])
        for tap in self.taps:
            tap((seconds, micros), sent_s, received_s)
        rtt_ms = max((received_s - sent_s) * 1000, 0.0)
        # Redis read its clock somewhere in the round trip: the midpoint is off by <= rtt/2.
        base = seconds * 1000 + micros / 1000 - (sent_s + received_s) / 2 * 1000
        self.samples += 1
        self.last_rtt_ms = rtt_ms
        if self._base_ms is None:
            self._first(base, rtt_ms)
            return True
        if rtt_ms > self.max_rtt_ms:
            self.dropped += 1
            log.debug("clock sample dropped: slow round trip", rtt_ms=round(rtt_ms, 1))
            return False
        step = base - self._base_ms
        if abs(step) <= self.max_step_ms:
            self._jump.clear()
            self._set(base)
            return True
        return self._jumped(base, step)

    def _first(self, base: float, rtt_ms: float) -> None:
        # Any first sample beats an unknown local clock; a bad one is corrected later (a
        # jump that later samples confirm).
        before = self.now_ms()
        self._set(base)
        offset = self.now_ms() - before
        level = log.warning if abs(offset) > CLOCK_TOLERANCE_MS else log.info
        level(
            "clock synced to redis time",
            local_clock_off_by_ms=-offset,
            rtt_ms=round(rtt_ms, 1),
        )

    def _jumped(self, base: float, step: float) -> bool:
        if self._jump and abs(base - self._jump[-1]) > self.max_step_ms:
            self._jump.clear()  # not the same jump: start counting again
        self._jump.append(base)
        if len(self._jump) < self.confirmations:
            self.dropped += 1
            log.warning(
                "redis time jumped; not followed until confirmed",
                step_ms=round(step),
                seen=len(self._jump),
                needed=self.confirmations,
            )
            return False
        self._jump.clear()
        log.warning("redis time jump confirmed; following it", step_ms=round(step))
        self._set(base)
        return True

    def _set(self, base: float) -> None:
        before = self.now_ms()
        self._base_ms = base
        back = before - self.now_ms()
        if back > self.max_step_ms:  # smaller steps are within the tolerance readers allow
            self._horizon_ms = max(self._horizon_ms or before, before)
            self._stepped_back_ms += back
            log.warning(
                "clock stepped back; earlier stamps are moved back with it",
                back_ms=back,
                until_ms=self._horizon_ms,
            )


def _skew_from_environment() -> int:
    raw = os.environ.get(SKEW_ENV, "").strip()
    try:
        return int(raw) if raw else 0
    except ValueError:
        log.warning("ignoring a malformed clock skew", variable=SKEW_ENV, value=raw)
        return 0


SHARED = SharedClock(skew_ms=_skew_from_environment())  # this process's clock


def now_ms() -> int:
    """Redis time in milliseconds once this process has synced (`SHARED`); the local wall
    clock before that. Every time written to or compared with the Redis contract uses it."""
    return SHARED.now_ms()
