"""What the benchmarks report about a load's outcomes: quantiles by rank, failures by status."""

from __future__ import annotations

from benchmarks.loadgen import (
    Outcome,
    failures,
    failures_by_status,
    latency_figures,
    percentile,
)


def _outcome(status: int, latency_ms: float = 1.0) -> Outcome:
    return Outcome(
        sent_at=0.0, latency_ms=latency_ms, status=status, connection=0, path="/", label=""
    )


def test_percentile_takes_the_value_at_the_rank_below_without_interpolating():
    values = [float(v) for v in range(100, 0, -1)]  # 100 .. 1, unsorted on purpose
    assert percentile(values, 0.5) == 51.0
    assert percentile(values, 0.99) == 100.0
    assert percentile([2.25, 1.0], 0.0) == 1.0
    assert percentile([1.26], 0.5) == 1.3  # to 0.1 ms


def test_no_values_have_no_percentile_and_no_latency_figures():
    assert percentile([], 0.5) is None
    assert latency_figures([]) == {"p50_ms": None, "p99_ms": None, "max_ms": None}


def test_latency_figures_are_p50_p99_and_max():
    assert latency_figures([3.04, 1.0, 2.04]) == {"p50_ms": 2.0, "p99_ms": 3.0, "max_ms": 3.0}


def test_anything_but_a_200_is_a_failure_counted_by_its_status():
    outcomes = [_outcome(200), _outcome(503), _outcome(0), _outcome(503), _outcome(404)]
    assert [o.status for o in failures(outcomes)] == [503, 0, 503, 404]
    assert failures_by_status(outcomes) == {"503": 2, "0": 1, "404": 1}
