"""The retry budget: a cap on the extra load that failover may add (Finagle's RetryBudget).

Every request deposits `percent/100` of a token; every retry withdraws a whole one; a floor of
`min_per_s` tokens a second keeps a quiet proxy able to fail over. Tokens are capped at
`burst`, so a long healthy period cannot save up an unbounded storm. Sustained retries are thus
at most `percent`% of requests (plus the floor), while the burst of a node dying with many
requests in flight is absorbed: each of them goes at once to the next candidate.

Requests the C path forwards are deposited in bulk (`pending`, read before each withdrawal):
n deposits capped at `burst` equal one deposit of n.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class RetryBudget:
    def __init__(
        self,
        *,
        percent: float,
        min_per_s: float,
        burst: int,
        pending: Callable[[], int] | None = None,
    ) -> None:
        self.ratio = percent / 100
        self.min_per_s = min_per_s
        self.burst = float(burst)
        self.tokens = float(burst)
        self._refilled_at = time.monotonic()
        self._pending = pending

    def deposit(self) -> None:
        tokens = self.tokens + self.ratio
        self.tokens = tokens if tokens < self.burst else self.burst

    def withdraw(self) -> bool:
        now = time.monotonic()
        elapsed, self._refilled_at = now - self._refilled_at, now
        deposited = self._pending() * self.ratio if self._pending is not None else 0.0
        self.tokens = min(self.burst, self.tokens + elapsed * self.min_per_s + deposited)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False
