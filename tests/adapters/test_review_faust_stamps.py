"""`kroute adapt faust` publishes its last lag reading on every round, also rounds after the
clock stepped back (its first sync to Redis time, a Redis failover): the reading's times must
be mapped when they are published, not once when they were read, or a reading taken before
the step reads fresher than it is for as long as it is published (a broker that cannot be
read keeps it for good). No services: the shared clock is driven by hand."""

from __future__ import annotations

import pytest

from common.clock import SharedClock
from kroute.adapters import faust
from kroute.adapters.faust import LagBook

T0_S = 1_700_000_000  # Redis time at the first sync, in seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> tuple[SharedClock, list[float]]:
    monotonic = [1_000.0]
    # The host's own clock runs behind Redis time: the first sync steps forward (no horizon).
    shared = SharedClock(wall=lambda: T0_S - 10.0, monotonic=lambda: monotonic[0], confirmations=1)
    shared.observe((T0_S, 0), 1_000.0, 1_000.0)  # synced: now_ms() is T0_S * 1000
    monkeypatch.setattr(faust, "SHARED", shared)
    return shared, monotonic


def step_back(shared: SharedClock, monotonic: list[float], back_ms: int) -> None:
    """Redis time jumps back by `back_ms` (followed at once: one confirmation)."""
    monotonic[0] += 0.1
    now = shared.now_ms() - back_ms
    assert shared.observe((now // 1000, now % 1000 * 1000), monotonic[0], monotonic[0])


def test_a_reading_taken_before_the_clock_stepped_back_is_published_as_old_as_it_is(clock):
    shared, monotonic = clock
    book = LagBook()
    book.follow({0: "w1"}, now_ms=shared.now_ms() - 1_000)
    asked_at = shared.now_ms()
    book.observe({0: 70}, {0: 70}, asked_at_ms=asked_at, at_ms=asked_at + 5)
    assert book.reports()[0].updated_at_ms == asked_at  # no step yet: as read

    step_back(shared, monotonic, 1_500)
    report = book.reports()[0]  # the next rounds publish the same reading
    # Read 100 ms ago on the clock now in use, whose readings are 1,500 ms lower.
    assert report.updated_at_ms <= shared.now_ms() - 100
    assert report.caught_up_at_ms is not None
    assert report.caught_up_at_ms <= shared.now_ms() - 100
    assert report.caught_up_at_ms == report.updated_at_ms, "mapped alike: the body stays one"
