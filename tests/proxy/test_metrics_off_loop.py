"""/metrics renders the series that grow with the table or the cluster in a thread, not on the
event loop.

At 6,000 partitions the per-replica request counters alone are 12,000 series, 40-150 ms to
render: on the loop, every scrape would stop request handling for that long."""

from __future__ import annotations

import threading
from dataclasses import replace

from proxy import main
from proxy.lag_metrics import replica_gauge_lines
from proxy.metrics import CHOICES, ProxyMetrics, node_lines, replica_choice_lines
from tests.prometheus_checks import families
from tests.proxy.inprocess import InProcessProxy, run


def test_series_per_replica_are_rendered_off_the_event_loop_thread(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    threads: dict[str, str] = {}

    def recording(name: str, render):  # type: ignore[no-untyped-def]
        def render_recording(*args: object) -> list[str]:
            threads[name] = threading.current_thread().name
            return render(*args)  # type: ignore[no-any-return]

        return render_recording

    for name, render in (
        ("choices", replica_choice_lines),
        ("lags", replica_gauge_lines),
        ("nodes", node_lines),
    ):
        monkeypatch.setattr(main, render.__name__, recording(name, render))

    async def scenario(harness: InProcessProxy) -> None:
        harness.proxy.metrics.choice_tally("s", 3, "a", "active")  # a series exists
        harness.proxy.metrics.node_tally("a")
        text = b"".join(await harness.proxy._metrics_view()).decode()
        assert 'kroute_proxy_replica_choices_total{node="a",partition="3",role="active"' in text
        assert "kroute_proxy_replica_lag_offsets" in text
        assert "kroute_proxy_responses_total" in text or "kroute_proxy_responses" in text
        loop_thread = threading.current_thread().name
        assert 'kroute_proxy_node_requests_total{node="a"} 0.0' in text
        assert threads.keys() == {"choices", "lags", "nodes"}
        assert loop_thread not in threads.values(), (loop_thread, threads)

    run("python", scenario)


def test_counting_choices_while_a_thread_renders_them_never_fails() -> None:
    metrics = ProxyMetrics()
    stop = threading.Event()

    def add_series() -> None:
        for partition in range(50_000):  # the dict resizes many times meanwhile
            if stop.is_set():
                return
            metrics.choice_tally("s", partition, "a", "active")

    writer = threading.Thread(target=add_series)
    writer.start()
    try:
        while writer.is_alive():
            assert "".join(replica_choice_lines(metrics)).startswith(f"# HELP {CHOICES} ")
    finally:
        stop.set()
        writer.join()
    assert len(
        families("".join(replica_choice_lines(metrics)))["kroute_proxy_replica_choices"].samples
    ) == len(metrics.choices)


def test_a_forgotten_node_leaves_the_per_replica_and_per_node_series() -> None:
    """Node ids that change (pods) must not grow /metrics for as long as the proxy runs."""
    metrics = ProxyMetrics()
    kept = metrics.choice_tally("s", 0, "a", "active")
    metrics.choice_tally("s", 0, "gone", "standby")
    kept_node = metrics.node_tally("a")
    metrics.node_tally("gone")
    metrics.node_failures[("gone", "timeout")] = 2
    metrics.node_failures[("a", "timeout")] = 1
    metrics.misdirected.update({"gone": 3, "a": 4})
    metrics.forget_nodes(["a", "b"])
    assert metrics.choices == {("s", 0, "a", "active"): kept}
    assert metrics.node_requests == {"a": kept_node}
    assert metrics.node_failures == {("a", "timeout"): 1}
    assert metrics.misdirected == {"a": 4}


def test_a_table_without_a_node_forgets_its_series_on_the_request_path() -> None:
    async def scenario(harness: InProcessProxy) -> None:
        proxy = harness.proxy
        proxy.metrics.choice_tally("s", 1, "old-pod", "active")
        proxy.metrics.node_tally("old-pod")
        snapshot = proxy.handler.snapshot
        proxy.handler.use_snapshot(replace(snapshot, node_urls=dict(snapshot.node_urls)))
        assert all(key[2] != "old-pod" for key in proxy.metrics.choices)
        assert "old-pod" not in proxy.metrics.node_requests

    run("python", scenario)
