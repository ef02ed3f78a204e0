"""The retry budget's arithmetic: the per-second floor, the deposit ratio, the burst cap and the
C path's bulk deposits, on a clock the test moves (pure: no I/O)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from proxy import retry_budget
from proxy.retry_budget import RetryBudget


class Clock:
    """Monotonic seconds that move only when the test says so."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    stopped = Clock()
    # Only the budget's module sees the stopped clock; everything else keeps real time.
    monkeypatch.setattr(retry_budget, "time", SimpleNamespace(monotonic=stopped.monotonic))
    return stopped


def drained(budget: RetryBudget) -> RetryBudget:
    """The budget with its starting burst spent, so what follows is only what it earns."""
    while budget.withdraw():
        pass
    return budget


def retries_allowed(budget: RetryBudget, tries: int = 1_000) -> int:
    return sum(budget.withdraw() for _ in range(tries))


def test_a_quiet_proxy_earns_the_floor_each_second_and_no_more(clock: Clock) -> None:
    budget = drained(RetryBudget(percent=0, min_per_s=4, burst=10))
    clock.advance(1.0)
    assert retries_allowed(budget) == 4
    clock.advance(0.25)
    assert retries_allowed(budget) == 1
    clock.advance(0.1)  # 0.4 of a token: not a retry yet
    assert retries_allowed(budget) == 0


def test_the_floor_is_capped_at_the_burst(clock: Clock) -> None:
    budget = drained(RetryBudget(percent=0, min_per_s=4, burst=10))
    clock.advance(3_600.0)  # an idle hour saves no more than the burst
    assert retries_allowed(budget) == 10


# Percents whose ratio is exact in binary floating point, so sums of deposits are too.
@pytest.mark.parametrize(("percent", "requests", "expected"), [(25, 40, 10), (12.5, 80, 10)])
def test_each_request_earns_its_percent_of_a_retry(
    clock: Clock, percent: float, requests: int, expected: int
) -> None:
    budget = drained(RetryBudget(percent=percent, min_per_s=0, burst=1_000))
    for _ in range(requests):
        budget.deposit()
    assert retries_allowed(budget) == expected


def test_deposits_are_capped_at_the_burst(clock: Clock) -> None:
    budget = drained(RetryBudget(percent=100, min_per_s=0, burst=7))
    for _ in range(1_000):
        budget.deposit()
    assert retries_allowed(budget) == 7


def test_requests_the_c_path_forwarded_count_like_python_deposits(clock: Clock) -> None:
    """The C path counts its forwards and the budget takes them before each withdrawal: a
    proxy serving mostly in C must earn retries like one serving in Python."""
    forwarded_in_c = [40]

    def take_deposits() -> int:  # what Hub.take_deposits does: read and reset
        taken, forwarded_in_c[0] = forwarded_in_c[0], 0
        return taken

    budget = RetryBudget(percent=25, min_per_s=0, burst=1_000, pending=take_deposits)
    budget.tokens = 0.0  # spent (drained() would take the pending deposits first)
    assert retries_allowed(budget) == 10  # 25% of 40 forwards
    assert forwarded_in_c == [0]
    forwarded_in_c[0] = 8
    for _ in range(6):
        budget.deposit()
    assert retries_allowed(budget) == 3  # 25% of 8 in C and of 6 in Python: 3.5
