"""Outlier ejection's bookkeeping (proxy.outliers), and the hedging settings: no sockets."""

from __future__ import annotations

import pytest

from common.settings import SettingsError
from proxy._hotpath import Candidate, Tally
from proxy.exchange import Target
from proxy.health import Ejections
from proxy.metrics import ProxyMetrics
from proxy.outliers import Outliers
from proxy.settings import ProxySettings


def candidate(node: str) -> Candidate:
    target = Target.build(node, f"http://127.0.0.1:1/{node}", "127.0.0.1", 1)
    return Candidate(target, None, b"", [], target.host_line, None, Tally())


def outliers(live: int = 3, percent: int = 50) -> tuple[Outliers, Ejections, ProxyMetrics]:
    ejections = Ejections(eject_ms=1000, probe_interval_ms=100, probe_timeout_s=1)
    metrics = ProxyMetrics()
    found = Outliers(
        ejections,
        metrics,
        consecutive_5xx=3,
        max_ejection_percent=percent,
        live_nodes=lambda: live,
    )
    return found, ejections, metrics


def test_consecutive_5xx_eject_and_any_answer_below_500_ends_the_streak() -> None:
    found, ejections, metrics = outliers()
    a = candidate("a")
    found.answered(a, 500)
    found.answered(a, 503)
    found.answered(a, 404)  # a 4xx is an answer: the streak ends
    found.answered(a, 500)
    found.answered(a, 500)
    a.node_tally.answered += 1  # what the C path does for each answer it serves itself
    found.failed(a, "lost a hedged race")
    found.answered(a, 502)
    assert ejections.ejected == frozenset()
    found.answered(a, 500)
    assert ejections.ejected == {"a"}
    assert metrics.outlier_ejections == 1


def test_the_cap_counts_every_ejected_node_and_allows_at_least_one() -> None:
    found, ejections, metrics = outliers(live=3, percent=50)
    ejections.eject("x", "http://x", "connection refused")  # a dead node: uncapped, counted
    b = candidate("b")
    for _ in range(4):
        found.answered(b, 500)
    assert ejections.ejected == {"x"}
    assert metrics.outlier_ejections_capped == 2
    found, ejections, metrics = outliers(live=2, percent=0)
    for _ in range(3):
        found.answered(b, 500)
    assert ejections.ejected == {"b"}


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"KROUTE_HEDGE_AFTER_MS": "2000"}, "below the per-try timeout"),
        ({"KROUTE_HEDGE_AFTER_MS": "300", "KROUTE_PER_TRY_TIMEOUT_MS": "300"}, "below"),
        ({"KROUTE_MAX_EJECTION_PERCENT": "101"}, "less than or equal to 100"),
    ],
)
def test_hedging_settings_are_checked(settings: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        ProxySettings.from_env({"KROUTE_REDIS_URL": "redis://127.0.0.1:6379/0", **settings})


def test_the_per_try_timeout_never_exceeds_the_upstream_timeout() -> None:
    env = {"KROUTE_REDIS_URL": "redis://127.0.0.1:6379/0", "KROUTE_UPSTREAM_TIMEOUT_MS": "800"}
    assert ProxySettings.from_env(env).try_timeout_ms() == 800
    assert (
        ProxySettings.from_env({**env, "KROUTE_PER_TRY_TIMEOUT_MS": "5000"}).try_timeout_ms() == 800
    )
    assert (
        ProxySettings.from_env({**env, "KROUTE_PER_TRY_TIMEOUT_MS": "300"}).try_timeout_ms() == 300
    )
