"""The load test's settings (benchmarks/locustfile.py), apart so they can be checked without
importing locust (which monkey-patches the standard library on import)."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from typing import Literal
from urllib.parse import quote

from pydantic import Field, Json, field_validator

from common.settings import EnvSettings, Name
from kroute.demo import ZIPF_EXPONENT


class LoadSettings(EnvSettings):
    load_path: str = Field(
        default="/stores/{store}/keys/{key}",
        pattern=r"^/",
        description="Path template of a lookup: {key} is the key, {store} KROUTE_LOAD_STORE.",
    )
    load_store: Name = Field(default="bookings", description="Store name put in {store}.")
    load_key_template: str = Field(
        default="customer-{n:06d}",
        description="Keys looked up: {n} is a number from 1 to KROUTE_LOAD_CUSTOMERS "
        "(default: the demo's customer ids).",
    )
    load_key_distribution: Literal["zipf", "uniform"] = Field(
        default="zipf",
        description="How numbers are drawn: zipf (1 most often, as the demo books) or uniform.",
    )
    load_customers: int = Field(
        default=5000, ge=1, le=10_000_000, description="How many distinct keys exist."
    )
    load_headers: Json[dict[str, str]] = Field(
        default={}, description="Headers sent with every request, a JSON object."
    )
    load_tight_budget_ms: int = Field(
        default=1000, ge=0, le=3_600_000, description="x-kroute-max-lag-ms of the tight lookups."
    )

    @field_validator("load_path")
    @classmethod
    def _has_key(cls, value: str) -> str:
        if "{key}" not in value:
            raise ValueError("expected a path with {key}, e.g. /stores/{store}/keys/{key}")
        try:
            value.format(key="k", store="s")
        except (KeyError, IndexError, ValueError):
            raise ValueError("only {key} and {store} may be filled in") from None
        return value

    @field_validator("load_key_template")
    @classmethod
    def _has_number(cls, value: str) -> str:
        try:
            made = value.format(n=1)
        except (KeyError, IndexError, ValueError):
            raise ValueError("expected a template with {n} only, e.g. card-{n}") from None
        if made == value:
            raise ValueError("expected a template with {n}, e.g. card-{n}")
        return value

    def path(self, key: str) -> str:
        return self.load_path.format(key=quote(key, safe=""), store=self.load_store)

    def missing_key(self, rng: random.Random) -> str:
        """A key of the same shape that does not exist: a number past KROUTE_LOAD_CUSTOMERS, so
        a typed service (int, uuid keys) answers 404, not 400."""
        return self.load_key_template.format(n=self.load_customers + 1 + rng.randrange(10**9))

    def keys(self, rng: random.Random) -> Iterator[str]:
        """Keys without end, drawn as configured."""
        ranks = range(1, self.load_customers + 1)
        weights = None
        if self.load_key_distribution == "zipf":  # the demo producer's skew
            weights = list(itertools.accumulate(1 / rank**ZIPF_EXPONENT for rank in ranks))
        while True:
            for n in rng.choices(ranks, cum_weights=weights, k=256):
                yield self.load_key_template.format(n=n)
