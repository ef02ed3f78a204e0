"""Realistic load on a running kroute: checkout-style customer lookups through the proxy.

Users look customers up with Zipf-skewed ids (a few customers are looked up far more often,
as the demo producer also books for them more), some ids that do not exist (misses: 404s are
expected answers, not failures), and some lookups with a tight lag budget (`x-kroute-max-lag-ms`),
as a fraud check that must not read stale data would send; a 503 saying no replica is fresh
enough is an expected answer to those.

Headless, against `./scripts/run` (see the README, "Load tests"):

    .venv/bin/locust -f benchmarks/locustfile.py --headless -u 50 -r 10 -t 60s \\
        --host http://127.0.0.1:8080

Settings (environment): KROUTE_LOAD_STORE (bookings), KROUTE_LOAD_CUSTOMERS (5000),
KROUTE_LOAD_TIGHT_BUDGET_MS (1000).
"""

from __future__ import annotations

import os
import random

from locust import FastHttpUser, between, task

from kroute.demo import popular_customers

STORE = os.environ.get("KROUTE_LOAD_STORE", "bookings")
CUSTOMERS = int(os.environ.get("KROUTE_LOAD_CUSTOMERS", "5000"))
TIGHT_BUDGET_MS = os.environ.get("KROUTE_LOAD_TIGHT_BUDGET_MS", "1000")
# The demo producer's own skew (ids drawn in blocks from precomputed cumulative weights).
_CUSTOMERS = popular_customers(random.Random(), CUSTOMERS)


def popular_customer() -> str:
    return next(_CUSTOMERS)


class CheckoutUser(FastHttpUser):
    """One checkout front end: mostly plain lookups, some misses, some tight budgets."""

    wait_time = between(0.01, 0.05)

    @task(8)
    def lookup(self) -> None:
        self.client.get(f"/stores/{STORE}/keys/{popular_customer()}", name="lookup")

    @task(1)
    def miss(self) -> None:
        unknown = f"nobody-{random.randrange(10**9)}"
        with self.client.get(
            f"/stores/{STORE}/keys/{unknown}", name="miss", catch_response=True
        ) as response:
            if response.status_code == 404:
                response.success()  # a miss is an answer

    @task(1)
    def fresh_lookup(self) -> None:
        with self.client.get(
            f"/stores/{STORE}/keys/{popular_customer()}",
            headers={"x-kroute-max-lag-ms": TIGHT_BUDGET_MS},
            name="lookup (tight lag budget)",
            catch_response=True,
        ) as response:
            if response.status_code == 503 and b"no_replica" in (response.content or b""):
                response.success()  # refusing stale data is the requested behaviour
