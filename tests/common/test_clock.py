"""The shared clock: Redis time with a per-process offset, bounded against bad samples."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from common import clock as clock_module
from common.clock import CLOCK_TOLERANCE_MS, SKEW_ENV, SharedClock

REDIS_S = 1_700_000_000  # what the fake Redis's clock says, in seconds


class Host:
    """A host's clocks, moved by hand: wall time and monotonic time advance together."""

    def __init__(self, wall_s: float) -> None:
        self.wall_s = wall_s
        self.mono_s = 100.0

    def advance(self, seconds: float) -> None:
        self.wall_s += seconds
        self.mono_s += seconds

    def clock(self, **options: float) -> SharedClock:
        return SharedClock(wall=lambda: self.wall_s, monotonic=lambda: self.mono_s, **options)  # type: ignore[arg-type]


def redis_reply(at_s: float) -> tuple[int, int]:
    return int(at_s), round((at_s - int(at_s)) * 1_000_000)


def sample(host: Host, shared: SharedClock, redis_at_s: float, rtt_s: float = 0.002) -> bool:
    """One TIME round trip: Redis read its clock (`redis_at_s`) halfway through it."""
    sent = host.mono_s
    host.advance(rtt_s)
    return shared.observe(redis_reply(redis_at_s), sent, host.mono_s)


def test_before_the_first_sync_it_is_the_local_clock_with_its_skew():
    host = Host(REDIS_S + 5.0)
    shared = host.clock()
    assert not shared.synced
    assert shared.now_ms() == (REDIS_S + 5) * 1000
    assert SharedClock(skew_ms=5000, wall=lambda: 10.0).now_ms() == 15_000


def test_a_host_five_seconds_ahead_reads_redis_time_after_one_sample():
    host = Host(REDIS_S + 5.0)  # this host's wall clock runs 5 s ahead of Redis
    shared = host.clock()
    assert sample(host, shared, REDIS_S + 0.001, rtt_s=0.002)
    assert shared.synced
    assert abs(shared.now_ms() - (REDIS_S * 1000 + 2)) <= 1  # Redis time, plus the half trip
    host.advance(1.5)
    assert abs(shared.now_ms() - (REDIS_S * 1000 + 1502)) <= 1  # and it runs on monotonic time
    # The proxy's C path reads CLOCK_REALTIME itself: this is what it must add.
    assert abs(shared.wall_offset_ms() + 5000) <= 2


def test_the_midpoint_of_a_slow_first_trip_is_off_by_at_most_half_of_it():
    host = Host(REDIS_S)
    shared = host.clock()
    sent = host.mono_s
    host.advance(0.4)  # Redis answered at once, the reply took 400 ms to come back
    shared.observe(redis_reply(REDIS_S), sent, host.mono_s)
    assert abs(shared.now_ms() - (REDIS_S + 0.4) * 1000) <= 200


def test_after_the_first_sync_slow_samples_are_dropped():
    host = Host(REDIS_S)
    shared = host.clock(max_rtt_ms=100)
    sample(host, shared, REDIS_S)
    before = shared.now_ms()
    assert not sample(host, shared, REDIS_S + 10, rtt_s=0.3)
    assert shared.now_ms() - before == 300  # only the time the trip took
    assert shared.dropped == 1


def test_one_wild_sample_does_not_move_the_clock_but_a_confirmed_jump_does():
    host = Host(REDIS_S)
    shared = host.clock(max_step_ms=250, confirmations=3)
    sample(host, shared, REDIS_S + 0.001)
    offset = shared.now_ms() - host.wall_s * 1000

    assert not sample(host, shared, host.wall_s + 60)  # one reply a minute off: ignored
    assert abs(shared.now_ms() - host.wall_s * 1000 - offset) <= 1
    assert sample(host, shared, host.wall_s + 0.1)  # a small correction is taken at once

    # Redis failed over to a host whose clock is 10 s behind: followed once three agree.
    assert not sample(host, shared, host.wall_s - 10)
    assert not sample(host, shared, host.wall_s - 10)
    assert sample(host, shared, host.wall_s - 10)
    assert abs(shared.now_ms() - (host.wall_s - 10) * 1000) <= 2


def test_a_jump_interrupted_by_a_normal_sample_starts_counting_again():
    host = Host(REDIS_S)
    shared = host.clock(confirmations=2)
    sample(host, shared, REDIS_S)
    assert not sample(host, shared, host.wall_s + 30)
    assert sample(host, shared, host.wall_s)
    assert not sample(host, shared, host.wall_s + 30)
    assert sample(host, shared, host.wall_s + 30)


def test_stamps_taken_before_a_backward_step_are_moved_back_with_it():
    host = Host(REDIS_S + 5.0)  # 5 s ahead and not synced yet
    shared = host.clock()
    early = shared.now_ms() - 400  # "caught up 400 ms ago", on the local clock
    sample(host, shared, REDIS_S)
    true_early = REDIS_S * 1000 - 400
    assert abs(shared.conservative_ms(early) - true_early) <= 5
    # A stamp taken after the step, but not yet past the old reading, is moved back too:
    # older than true (refused sooner), never fresher.
    after = shared.now_ms()
    assert shared.conservative_ms(after) <= after
    host.advance(6)
    later = shared.now_ms()
    assert shared.conservative_ms(later) == later  # past the old reading: left alone


def test_a_forward_step_moves_no_stamp():
    host = Host(REDIS_S - 5.0)  # 5 s behind: old stamps read older than true, which is safe
    shared = host.clock()
    early = shared.now_ms()
    sample(host, shared, REDIS_S)
    assert shared.conservative_ms(early) == early


def test_now_ms_is_the_processes_shared_clock(monkeypatch):
    host = Host(REDIS_S + 5.0)
    shared = host.clock()
    monkeypatch.setattr(clock_module, "SHARED", shared)
    assert clock_module.now_ms() == (REDIS_S + 5) * 1000  # local, before the first sync
    sample(host, shared, REDIS_S)
    assert abs(clock_module.now_ms() - REDIS_S * 1000) <= 5


@pytest.mark.integration
def test_a_real_redis_gives_a_skewed_clock_its_time(redis_server):
    async def synced() -> tuple[int, int, int]:
        client = aioredis.Redis.from_url(redis_server.url)
        try:
            shared = SharedClock(skew_ms=5_000)
            before = shared.now_ms()
            await shared.sync(client)
            seconds, micros = await client.time()
            return before, shared.now_ms(), seconds * 1000 + micros // 1000
        finally:
            await client.aclose()

    before, after, redis_ms = asyncio.run(synced())
    assert before - redis_ms > 4_900
    assert abs(after - redis_ms) < 50


@pytest.mark.integration
def test_a_process_whose_clock_is_injected_five_seconds_ahead_syncs_to_redis(redis_server):
    program = (
        "import asyncio, json, sys, redis.asyncio as r\n"
        "from common.clock import SHARED, now_ms\n"
        "async def main():\n"
        "    client = r.Redis.from_url(sys.argv[1])\n"
        "    before = now_ms()\n"
        "    await SHARED.sync(client)\n"
        "    print(json.dumps([before, now_ms()]))\n"
        "    await client.aclose()\n"
        "asyncio.run(main())\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", program, redis_server.url],
        env={**os.environ, SKEW_ENV: "5000", "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    before, after = json.loads(done.stdout.strip().splitlines()[-1])
    now = time.time() * 1000  # this host's clock is Redis's clock: same machine
    assert before > after + 4_500, "the injected skew applies until the first sync"
    assert abs(after - now) < CLOCK_TOLERANCE_MS
