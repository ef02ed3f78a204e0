"""The series that grow with the table are written directly (`proxy.exposition`), not through
prometheus_client's registry: here every byte is compared with what prometheus_client's own
`generate_latest` writes for the same families, over odd labels (quotes, backslashes, newlines,
non-ASCII) and odd values (NaN, unknowns, a million and beyond, huge counters)."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from proxy._hotpath import ReportClock
from proxy.choice import Replica
from proxy.exposition import LINES_PER_PART, encoded, header, release, sample_value
from proxy.lag_metrics import replica_gauge_lines
from proxy.metrics import ProxyMetrics, node_lines, replica_choice_lines
from proxy.routing import RoutingSnapshot, StoreRoute
from tests.proxy.exposition_reference import (
    choices_by_prometheus_client,
    gauges_by_prometheus_client,
    nodes_by_prometheus_client,
)

# Label text a user's node ids and store names might hold, escapes included.
label_text = st.text(
    st.sampled_from(["a", "Z", "0", "-", "_", ".", '"', "\\", "\n", "é", "漢", " ", "{", "}", "="]),
    min_size=1,
    max_size=8,
)
times = st.none() | st.integers(0, 2**53)
lags = st.none() | st.sampled_from([0, 1, 999_999, 1_000_000, 12_345_678]) | st.integers(0, 2**62)


@st.composite
def replicas(draw: st.DrawFn) -> Replica:
    clock = draw(st.none() | st.integers(-(2**40), 2**40).map(ReportClock))
    return Replica(
        draw(label_text),
        "http://127.0.0.1:1",
        draw(st.sampled_from(["active", "standby"])),
        draw(st.booleans()),
        draw(lags),
        draw(times),
        draw(times),
        None,
        clock,
    )


@st.composite
def snapshots(draw: st.DrawFn) -> RoutingSnapshot:
    names = draw(st.lists(label_text, max_size=3, unique=True))
    stores = {
        name: StoreRoute(
            None,  # type: ignore[arg-type]  # the gauges read the replicas only
            None,  # type: ignore[arg-type]
            tuple(draw(st.lists(st.tuples(*[replicas()] * draw(st.integers(0, 3))), max_size=4))),
        )
        for name in names
    }
    return RoutingSnapshot(generation=1, built_at_ms=0, stores=stores)


@settings(max_examples=300, deadline=None)
@given(snapshots(), st.integers(0, 2**53))
def test_the_replica_gauges_are_byte_for_byte_what_prometheus_client_writes(
    snapshot: RoutingSnapshot, now_ms: int
) -> None:
    assert "".join(replica_gauge_lines(snapshot, now_ms)) == gauges_by_prometheus_client(
        snapshot, now_ms
    )


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            label_text, st.integers(0, 20_000), label_text, label_text, st.integers(0, 2**63 - 1)
        ),
        max_size=20,
    )
)
def test_the_replica_counters_are_byte_for_byte_what_prometheus_client_writes(
    series: list[tuple[str, int, str, str, int]],
) -> None:
    metrics = ProxyMetrics()
    for store, partition, node, role, value in series:
        metrics.choice_tally(store, partition, node, role).value = value
    assert "".join(replica_choice_lines(metrics)) == choices_by_prometheus_client(metrics)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(label_text, st.integers(0, 2**63 - 1), max_size=10),
    st.dictionaries(st.tuples(label_text, label_text), st.integers(0, 2**70), max_size=10),
    st.dictionaries(label_text, st.integers(0, 2**70), max_size=10),
)
def test_the_node_counters_are_byte_for_byte_what_prometheus_client_writes(
    requests: dict[str, int], failures: dict[tuple[str, str], int], misdirected: dict[str, int]
) -> None:
    metrics = ProxyMetrics()
    for node, value in requests.items():
        metrics.node_tally(node).value = value
    metrics.node_failures.update(failures)
    metrics.misdirected.update(misdirected)
    assert "".join(node_lines(metrics)) == nodes_by_prometheus_client(metrics)


@given(st.integers(0, 3 * LINES_PER_PART + 1), st.text(max_size=3))
def test_the_parts_are_the_lines_in_order_none_too_long(count: int, text: str) -> None:
    lines = [f"{text}{i}\n" for i in range(count)]
    whole = "".join(lines).encode()
    parts = encoded(lines)
    assert b"".join(parts) == whole
    assert len(parts) == -(-count // LINES_PER_PART)  # every part but the last one full
    assert lines == [""] * count  # freed as it went (the caller's list holds nothing more)


def test_released_strings_are_dropped_from_the_list_they_were_in() -> None:
    strings = [f"label-{i}" for i in range(2 * LINES_PER_PART + 7)]
    kept = strings[-1]
    release(strings)
    assert strings == [""] * (2 * LINES_PER_PART + 7)
    assert sys.getrefcount(kept) == 2  # `kept` and the call's argument: the list let go


@given(st.floats() | st.integers(-(2**70), 2**70).map(float))
def test_a_value_is_written_as_prometheus_client_writes_it(value: float) -> None:
    assert sample_value(value) == floatToGoString(value)  # type: ignore[no-untyped-call]


def test_the_values_on_either_side_of_a_million_and_the_specials() -> None:
    for value in (999_999.0, 1e6, -1e6, 1e6 + 1, math.inf, -math.inf, math.nan, -0.0, 5e-324):
        expected = floatToGoString(value)  # type: ignore[no-untyped-call]
        assert sample_value(value) == expected, value


@given(st.text(st.sampled_from(["a", " ", "\\", "\n", '"', "é"]), max_size=12))
def test_help_text_is_escaped_as_prometheus_client_escapes_it(documentation: str) -> None:
    family = GaugeMetricFamily("kroute_x", documentation, value=1.0)
    expected = generate_latest(_Registry(family)).decode()
    assert expected.startswith(header("kroute_x", documentation, "gauge"))


class _Registry:
    """A registry of one ready-made family (what generate_latest asks of one)."""

    def __init__(self, family: Metric) -> None:
        self._family = family

    def collect(self) -> Iterator[Metric]:
        yield self._family
