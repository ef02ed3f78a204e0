"""Realistic load on a running kroute (or any keyed HTTP service): checkout-style lookups.

Users look keys up (by default Zipf-skewed customer ids, as the demo producer books for them),
some keys that do not exist (misses: 404s are expected answers, not failures), and some lookups
with a tight lag budget (`x-kroute-max-lag-ms`), as a fraud check that must not read stale data
would send; a 503 saying no replica is fresh enough is an expected answer to those. A 404 for a
key is never a failure: the demo may not have written that customer yet.

Headless, against `./scripts/run` (see the README, "Load tests"):

    .venv/bin/locust -f benchmarks/locustfile.py --headless -u 50 -r 10 -t 60s \\
        --host http://127.0.0.1:8080

Settings (environment, validated when locust starts like every kroute setting; see
benchmarks/load_settings.py): KROUTE_LOAD_PATH (/stores/{store}/keys/{key}), KROUTE_LOAD_STORE
(bookings), KROUTE_LOAD_KEY_TEMPLATE (customer-{n:06d}), KROUTE_LOAD_KEY_DISTRIBUTION (zipf or
uniform), KROUTE_LOAD_CUSTOMERS (5000), KROUTE_LOAD_HEADERS (a JSON object sent with every
request), KROUTE_LOAD_TIGHT_BUDGET_MS (1000).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

from locust import FastHttpUser, between, task

# locust puts only this file's folder on sys.path; the project's packages are one up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.load_settings import LoadSettings
from common.settings import SettingsError

try:
    SETTINGS = LoadSettings.from_env()
except SettingsError as exc:
    sys.exit(f"kroute locustfile: {exc}")
_KEYS = SETTINGS.keys(random.Random())


class CheckoutUser(FastHttpUser):
    """One checkout front end: mostly plain lookups, some misses, some tight budgets."""

    wait_time = between(0.01, 0.05)

    def _get(self, key: str, name: str, headers: dict[str, str] | None = None) -> None:
        with self.client.get(
            SETTINGS.path(key),
            headers={**SETTINGS.load_headers, **(headers or {})},
            name=name,
            catch_response=True,
        ) as response:
            if response.status_code == 404:
                response.success()  # absent (not written yet, or never): an answer
            elif (
                response.status_code == 503
                and headers
                and b"no_replica" in (response.content or b"")
            ):
                response.success()  # refusing stale data is the requested behaviour

    @task(8)
    def lookup(self) -> None:
        self._get(next(_KEYS), "lookup")

    @task(1)
    def miss(self) -> None:
        self._get(SETTINGS.missing_key(random.Random()), "miss")

    @task(1)
    def fresh_lookup(self) -> None:
        budget = {"x-kroute-max-lag-ms": str(SETTINGS.load_tight_budget_ms)}
        self._get(next(_KEYS), "lookup (tight lag budget)", budget)
