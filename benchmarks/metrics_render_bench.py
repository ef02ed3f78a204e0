"""What a /metrics scrape costs the proxy as the table grows: the per-replica series, written
by prometheus_client's registry (before) and directly (`proxy.exposition`, now), side by side
in one run, interleaved.

The series are the replicas' four lag gauges (from the routing snapshot), the request counter
per replica (here one per replica: traffic that reached every one) and the one per node. For each
size and renderer: the CPU one rendering takes, its size, and how late a 1 ms timer on an
event loop fires while the rendering runs in a thread, as the proxy runs it (the GIL handed
over every millisecond, as the proxy sets it): what a scrape does to requests.

Usage: .venv/bin/python -m benchmarks.metrics_render_bench [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import uvloop

from benchmarks.results_file import git_revision, machine_notes, write_json, write_section
from proxy._hotpath import ReportClock
from proxy.choice import Replica, Role
from proxy.exposition import encoded
from proxy.lag_metrics import replica_gauge_lines
from proxy.main import GIL_SWITCH_S
from proxy.metrics import ProxyMetrics, node_lines, replica_choice_lines
from proxy.routing import RoutingSnapshot, StoreRoute
from tests.proxy.exposition_reference import (
    choices_by_prometheus_client,
    gauges_by_prometheus_client,
    nodes_by_prometheus_client,
)

SIZES = ((20, 240), (100, 2_000), (300, 6_000), (1_000, 20_000))  # nodes, partitions
STORE = "customers"
NOW_MS = 1_800_000_000_000
TICK_S = 0.001
ROLES: tuple[tuple[int, Role], ...] = ((0, "active"), (1, "standby"))  # node offset, role
IDLE_S = 0.5

Renderer = Callable[[RoutingSnapshot, ProxyMetrics], list[bytes]]


def by_prometheus_client(snapshot: RoutingSnapshot, metrics: ProxyMetrics) -> list[bytes]:
    text = gauges_by_prometheus_client(snapshot, NOW_MS) + choices_by_prometheus_client(metrics)
    return [(text + nodes_by_prometheus_client(metrics)).encode()]


def direct(snapshot: RoutingSnapshot, metrics: ProxyMetrics) -> list[bytes]:
    """As the proxy's /metrics renders them (`Proxy._table_series`)."""
    lines = replica_gauge_lines(snapshot, NOW_MS)
    lines += replica_choice_lines(metrics)
    lines += node_lines(metrics)
    return encoded(lines)


RENDERERS: dict[str, Renderer] = {"prometheus_client": by_prometheus_client, "direct": direct}


def cluster(nodes: int, partitions: int) -> tuple[RoutingSnapshot, ProxyMetrics]:
    """An active and a standby per partition, every replica reporting (its node's clock
    moved since), and a request counter per replica."""
    clocks = [ReportClock(250) for _ in range(nodes)]
    metrics = ProxyMetrics()
    rows = []
    for partition in range(partitions):
        row = []
        for offset, role in ROLES:
            node = (partition + offset) % nodes
            node_id = f"node-{node:04d}"
            lag = (partition * 7 + offset) % 50
            replica = Replica(
                node_id, f"http://10.0.{node // 250}.{node % 250}:8081", role, True, lag,
                NOW_MS - 1_500 - lag, NOW_MS - 300, 10_000 - lag, clocks[node],
            )  # fmt: skip
            row.append(replica)
            metrics.choice_tally(STORE, partition, node_id, role).value = partition + 1
            metrics.node_tally(node_id).value += 1
        rows.append(tuple(row))
    stores = {STORE: StoreRoute(None, None, tuple(rows))}  # type: ignore[arg-type]  # replicas only
    return RoutingSnapshot(generation=1, built_at_ms=NOW_MS, stores=stores), metrics


def render_cpu_ms(render: Renderer, snapshot: RoutingSnapshot, metrics: ProxyMetrics) -> float:
    started = time.thread_time()
    render(snapshot, metrics)
    return (time.thread_time() - started) * 1000


async def scrape_beside_a_loop(
    render: Renderer | None, snapshot: RoutingSnapshot, metrics: ProxyMetrics
) -> dict[str, float]:
    """The rendering in a thread (as /metrics runs it) while a 1 ms timer runs on the loop:
    the longest its callback came late, and the scrape's wall time. No rendering: the timer
    alone for IDLE_S (how late it comes with nothing else to do, on this machine)."""
    late_ms = [0.0]
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            asked = time.perf_counter()
            await asyncio.sleep(TICK_S)
            late_ms[0] = max(late_ms[0], (time.perf_counter() - asked - TICK_S) * 1000)

    ticking = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)  # the ticker running before the scrape
    started = time.perf_counter()
    if render is None:
        await asyncio.sleep(IDLE_S)
    else:
        await asyncio.to_thread(render, snapshot, metrics)
    wall_ms = (time.perf_counter() - started) * 1000
    done.set()
    await ticking
    return {"loop_late_max_ms": round(late_ms[0], 2), "wall_ms": round(wall_ms, 1)}


def measure_size(nodes: int, partitions: int, rounds: int) -> dict[str, Any]:
    snapshot, metrics = cluster(nodes, partitions)
    texts = {name: b"".join(render(snapshot, metrics)) for name, render in RENDERERS.items()}
    if texts["direct"] != texts["prometheus_client"]:  # the comparison would mean nothing
        raise SystemExit(f"{nodes}/{partitions}: the two renderings differ")
    cpu: dict[str, list[float]] = {name: [] for name in RENDERERS}
    late: dict[str, list[float]] = {name: [] for name in (*RENDERERS, "no_scrape")}
    for _ in range(rounds):
        idle = uvloop.run(scrape_beside_a_loop(None, snapshot, metrics))
        late["no_scrape"].append(idle["loop_late_max_ms"])
        for name, render in RENDERERS.items():  # interleaved: drift hits both alike
            cpu[name].append(render_cpu_ms(render, snapshot, metrics))
            late[name].append(
                uvloop.run(scrape_beside_a_loop(render, snapshot, metrics))["loop_late_max_ms"]
            )
    figures: dict[str, Any] = {
        "nodes": nodes,
        "partitions": partitions,
        # Lines less each family's HELP and TYPE.
        "series": texts["direct"].count(b"\n") - 2 * texts["direct"].count(b"# TYPE "),
        "bytes": len(texts["direct"]),
    }
    for name in RENDERERS:
        figures[name] = {
            "render_cpu_ms_median": round(statistics.median(cpu[name]), 1),
            "loop_late_max_ms_median": round(statistics.median(late[name]), 2),
            "loop_late_max_ms_worst": max(late[name]),
            "render_cpu_ms": [round(v, 1) for v in cpu[name]],
            "loop_late_max_ms": late[name],
        }
    figures["no_scrape"] = {
        "loop_late_max_ms_median": round(statistics.median(late["no_scrape"]), 2),
        "loop_late_max_ms_worst": max(late["no_scrape"]),
        "loop_late_max_ms": late["no_scrape"],
    }
    before, now = figures["prometheus_client"], figures["direct"]
    figures["cpu_ratio"] = round(before["render_cpu_ms_median"] / now["render_cpu_ms_median"], 1)
    return figures


def _late(figures: dict[str, Any]) -> str:
    return f"{figures['loop_late_max_ms_median']} ({figures['loop_late_max_ms_worst']})"


def markdown(data: dict[str, Any]) -> str:
    lines = [
        "## /metrics: the per-replica series as the table grows (issue 22)",
        "",
        f"`python -m benchmarks.metrics_render_bench --rounds {data['rounds']}` at "
        f"{data['revision']}; {data['machine']}. An active and a standby per partition, a "
        "request counter per replica and per node; medians of the rounds (the worst round in "
        "brackets), the two renderers interleaved. "
        '"Loop late" is how late a 1 ms timer on an event loop fired while the rendering ran '
        "in a thread, as /metrics runs it, with the GIL handed over every "
        f'{data["gil_switch_ms"]} ms as the proxy sets it; "no scrape": the same timer for '
        f"{data['idle_s']} s with nothing else running. Both renderers write the same bytes "
        "(checked before timing).",
        "",
        "| nodes/partitions | series | bytes | prometheus_client CPU ms | direct CPU ms | CPU "
        "ratio | loop late max ms: prometheus_client | direct | no scrape |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for size in data["sizes"]:
        before, now = size["prometheus_client"], size["direct"]
        lines.append(
            f"| {size['nodes']}/{size['partitions']} | {size['series']:,} | {size['bytes']:,} "
            f"| {before['render_cpu_ms_median']:,} | {now['render_cpu_ms_median']:,} "
            f"| {size['cpu_ratio']}x | {_late(before)} | {_late(now)} "
            f"| {_late(size['no_scrape'])} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    sys.setswitchinterval(GIL_SWITCH_S)
    revision = git_revision()
    sizes = []
    for nodes, partitions in SIZES:
        figures = measure_size(nodes, partitions, args.rounds)
        print(f"[metrics-render] {nodes}/{partitions}: {figures}", flush=True)
        sizes.append(figures)
    data = {
        "revision": revision,
        "machine": machine_notes(),
        "rounds": args.rounds,
        "gil_switch_ms": GIL_SWITCH_S * 1000,
        "idle_s": IDLE_S,
        "sizes": sizes,
    }
    write_json("metrics_render", data)
    write_section("metrics_render", markdown(data))
    print(markdown(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
