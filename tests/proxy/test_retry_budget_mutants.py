"""The retry budget's arithmetic, exactly: each test pins one rule that a mutant of
proxy/retry_budget.py broke while the other tests passed (scripts/mutation, docs/testing.md).

Time is the module's clock (time.monotonic) replaced by one the test moves, so a refill is
checked to the token rather than "after a while".
"""

from __future__ import annotations

import pytest

from proxy import retry_budget
from proxy.retry_budget import RetryBudget


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(retry_budget.time, "monotonic", fake)
    return fake


def drained(budget: RetryBudget) -> RetryBudget:
    while budget.withdraw():
        pass
    return budget


def test_each_request_deposits_its_percent_of_a_token(clock: Clock) -> None:
    # 25% is exact in binary: three requests are 0.75 of a token, the fourth makes one.
    budget = drained(RetryBudget(percent=25, min_per_s=0, burst=5))
    for _ in range(3):
        budget.deposit()
    assert not budget.withdraw()
    budget.deposit()
    assert budget.withdraw()
    assert not budget.withdraw()


def test_requests_the_c_path_forwarded_deposit_like_the_others(clock: Clock) -> None:
    forwarded: list[int] = []  # counts read (and so reset) by the budget before each withdrawal

    def pending() -> int:
        return forwarded.pop(0) if forwarded else 0

    budget = drained(RetryBudget(percent=25, min_per_s=0, burst=5, pending=pending))
    forwarded.append(2)
    assert not budget.withdraw()  # 2 requests: half a token
    assert not budget.withdraw()  # nothing new
    forwarded.append(2)
    assert budget.withdraw()  # 2 more: a whole token, spent
    assert not budget.withdraw()


def test_the_floor_refills_by_elapsed_time_only(clock: Clock) -> None:
    budget = drained(RetryBudget(percent=0, min_per_s=2, burst=5))
    assert not budget.withdraw()  # no time passed: no token
    clock.now += 0.25
    assert not budget.withdraw()  # half a token
    clock.now += 0.25
    assert budget.withdraw()  # a second at 2 a second, from the last withdrawal on
    clock.now += 10
    assert sum(budget.withdraw() for _ in range(10)) == 5  # capped at the burst
