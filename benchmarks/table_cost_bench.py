"""What a large routing table costs the request path, told apart from the machine's noise.

The control-plane sweep (control_plane_bench.py) measures a size's proxy and then, minutes
later, a small table's proxy: on a shared two-core machine the same proxy measured twice a
minute apart differs by more than the 10% the table is allowed, so that comparison cannot say
whether the table costs 10%. Here, per size N nodes / P partitions, with the writers of the
size's simulated cluster and of a SMALL_TABLE one running throughout, the same paced load
(`--rate` requests/s, latency timed from when each request was due) goes, in rounds whose
order rotates (so that each is measured under every phase of the machine's background), to:
- `large`: a proxy of the size's cluster;
- `large-process`: the same with its table built in a process of its own
  (`KROUTE_TABLE_PROCESS`), which inherits the proxy's CPUs (it shares the request path's);
- `large-aside`: the same with the table process on the other CPUs
  (`KROUTE_TABLE_PROCESS_CPUS`: those of Redis and the writers, off the request path's);
- `small` and `small-again`: a proxy of the small cluster, twice;
- `direct`: straight to a backend (no proxy): the host's own floor.
Each proxy is started for its turn (and stopped after it), on the request path's CPUs, and
serves a warm-up round (`--warmup-seconds`, not counted: its cached choices fill) before the
measured one, so that one proxy at a time runs, as in the sweep. Proxies kept running between
their turns do not work on two cores: three on the request path's core queue every request
behind three tables' work; paused (SIGSTOP), a proxy comes back to a backlog of events as long
as the pause; moved to the other core, beside Redis and the writers, a 1,000-node proxy falls
behind there (its reports go stale and every cached choice is dropped) and catches up during
its turn. `large` against `small` is what the table costs a request; `small-again` against
`small` is the noise floor of this very comparison (an A/A pair: the same table twice). Per
target: the p50, p95 and p99 of its rounds' latencies pooled, each round's p99, and from the
proxy's watcher's stats lines over its rounds the loop's longest stall (and of it, at most
the proxy's own CPU time: the rest it waited for a core), the table's longest hold, the
longest swap and the collector's longest pause.

Results: benchmarks/results/table_cost.json and the `table_cost` section of RESULTS.md.

Run: .venv/bin/python -m benchmarks.table_cost_bench --request-path-cpus 1
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks.control_plane_bench import (
    SMALL_TABLE,
    STATS_LINE_S,
    Writers,
    add_request_path_cpus,
    cluster_services,
    debug_proxy,
    max_of,
    parse_sizes,
    say,
    start_writers,
    steady_load,
    watcher_lines,
)
from benchmarks.loadgen import latency_figures, percentile
from benchmarks.results_file import git_revision, machine_notes, write_json, write_section
from kroute.embedded import EmbeddedServices
from kroute.proxies import ProxyHandle

DEFAULT_SIZES = "300/6000,1000/20000"
PROXIES = ("large", "large-process", "large-aside", "small", "small-again")
# Proxies whose table is built in a process of their own (KROUTE_TABLE_PROCESS), and of them
# those whose table process runs off the request path's CPUs.
TABLE_PROCESS = frozenset({"large-process", "large-aside"})
ASIDE = frozenset({"large-aside"})
DIRECT = "direct"  # straight to a backend, no proxy running: the host's floor
TARGETS = (*PROXIES, DIRECT)


@dataclass
class Measured:
    """One proxy's rounds: latencies pooled, and per round its p99 and watcher figures."""

    latencies_ms: list[float] = field(default_factory=list)
    round_p99_ms: list[float] = field(default_factory=list)
    stall_max_ms: float = 0.0
    stall_busy_max_ms: float = 0.0  # of a stall, the proxy's own CPU time (the rest: waiting)
    hold_max_ms: float = 0.0
    swap_max_ms: float = 0.0
    collector_max_ms: float = 0.0
    failed: int = 0

    def figures(self) -> dict[str, Any]:
        return {
            "requests": len(self.latencies_ms) + self.failed,
            "failed": self.failed,
            **latency_figures(self.latencies_ms),
            # Less moved by this host's own hiccups (tens of ms, every few seconds, straight
            # to nginx too), which set the p99 of a short window.
            "p95_ms": percentile(self.latencies_ms, 0.95),
            "round_p99_ms": self.round_p99_ms,
            "round_p99_median_ms": round(statistics.median(self.round_p99_ms), 1),
            "loop_stall_max_ms": self.stall_max_ms,
            "loop_stall_busy_max_ms": self.stall_busy_max_ms,
            "table_hold_max_ms": self.hold_max_ms,
            "swap_max_ms": self.swap_max_ms,
            "collector_pause_max_ms": self.collector_max_ms,
        }


# The `Measured` maxima kept over a proxy's rounds, and the watcher's stats field each is of.
WATCHER_MAXIMA = {
    "stall_max_ms": "max_loop_lag_ms",
    "stall_busy_max_ms": "max_loop_lag_busy_ms",
    "hold_max_ms": "max_hold_ms",
    "swap_max_ms": "max_swap_ms",
    "collector_max_ms": "max_gc_ms",
}


def paced_round(url: str, seconds: float, args: argparse.Namespace) -> dict[str, Any]:
    """One round of the paced load to `url`, from a spawned process of its own."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(
            steady_load,
            (url, args.rate, seconds, args.connections, args.request_path_cpus),
            {"keep_latencies": True},
        )


def one_turn(
    services: EmbeddedServices,
    redis_url: str,
    name: str,
    cluster: str | None,
    url: str,
    args: argparse.Namespace,
) -> tuple[ProxyHandle | None, float, dict[str, Any]]:
    """A turn of `name`: its proxy started fresh (none for DIRECT), a warm-up round that fills
    its cached choices (not counted), then the measured round; the proxy, when the round
    began and what the round measured. The caller reads the proxy's log, then stops it."""
    proxy = None
    if cluster is not None:
        settings = {"table_process": "true" if name in TABLE_PROCESS else "false"}
        settings["workers"] = str(args.workers)
        if name in ASIDE:  # this process runs off the request path's CPUs (cluster_services)
            settings["table_process_cpus"] = ",".join(map(str, sorted(os.sched_getaffinity(0))))
        proxy = debug_proxy(
            services, redis_url, cluster, args.request_path_cpus, f"proxy-{name}", **settings
        )
        url = proxy.url
        paced_round(url, args.warmup_seconds, args)
    started = time.time()
    return proxy, started, paced_round(url, args.round_seconds, args)


def record_round(
    measured: Measured, proxy: ProxyHandle | None, started: float, load: dict[str, Any]
) -> None:
    # The stats line written 2 s after the round began is the first to cover only the round.
    lines = (
        []
        if proxy is None
        else watcher_lines(proxy.process.log_path, started + STATS_LINE_S, time.time())
    )
    latencies = load["latencies_ms"]
    measured.latencies_ms.extend(latencies)
    measured.failed += sum(load["failed"].values())
    measured.round_p99_ms.append(percentile(latencies, 0.99) or 0.0)
    for kept, logged in WATCHER_MAXIMA.items():
        setattr(measured, kept, max(getattr(measured, kept), max_of(lines, logged)))


def rotated(round_index: int) -> list[str]:
    """The targets' order in a round: over len(TARGETS) rounds each takes every place once."""
    shift = round_index % len(TARGETS)
    return list(TARGETS[shift:] + TARGETS[:shift])


def measure_size(
    services: EmbeddedServices,
    redis_url: str,
    backends: list[str],
    size: tuple[int, int],
    args: argparse.Namespace,
) -> dict[str, Any]:
    large_cluster = f"tc-{size[0]}-{size[1]}"
    small_cluster = f"tc-small-{SMALL_TABLE[0]}-{SMALL_TABLE[1]}-for-{size[0]}"
    say(f"{size[0]} nodes / {size[1]} partitions: writers, then the targets' turns")
    writers: list[Writers] = []
    try:
        writers.append(start_writers(redis_url, large_cluster, size, 1, args.writers, backends))
        writers.append(start_writers(redis_url, small_cluster, SMALL_TABLE, 1, 1, backends))
        time.sleep(2)
        clusters = {
            "large": large_cluster,
            "large-process": large_cluster,
            "large-aside": large_cluster,
            "small": small_cluster,
            "small-again": small_cluster,
        }
        measured = {name: Measured() for name in TARGETS}
        for index in range(args.rounds):
            for name in rotated(index):
                proxy, started, load = one_turn(
                    services, redis_url, name, clusters.get(name), backends[0], args
                )
                try:
                    if proxy is not None:
                        time.sleep(STATS_LINE_S + 0.5)  # the watcher's line for the round's end
                    record_round(measured[name], proxy, started, load)
                finally:
                    if proxy is not None:
                        proxy.process.stop()
                        proxy.close()
            say(f"round {index + 1}/{args.rounds}: " + ", ".join(
                f"{n} p99 {m.round_p99_ms[-1]} ms" for n, m in measured.items()
            ))  # fmt: skip
    finally:
        for group in writers:
            group.close()
    return compared({name: m.figures() for name, m in measured.items()})


def compared(figures: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The proxies' figures with the two ratios that matter: the table's (large / small) and
    the noise floor's (small-again / small), for the pooled p95 and p99 and the median
    round's p99."""

    def ratio(name: str, key: str) -> float:
        return round(float(figures[name][key]) / float(figures["small"][key]), 2)

    return {
        "proxies": figures,
        "p95_large_over_small": ratio("large", "p95_ms"),
        "p95_large_process_over_small": ratio("large-process", "p95_ms"),
        "p99_large_process_over_small": ratio("large-process", "p99_ms"),
        "round_p99_median_large_process_over_small": ratio("large-process", "round_p99_median_ms"),
        "p95_large_aside_over_small": ratio("large-aside", "p95_ms"),
        "p99_large_aside_over_small": ratio("large-aside", "p99_ms"),
        "round_p99_median_large_aside_over_small": ratio("large-aside", "round_p99_median_ms"),
        "p95_small_again_over_small": ratio("small-again", "p95_ms"),
        "p99_large_over_small": ratio("large", "p99_ms"),
        "p99_small_again_over_small": ratio("small-again", "p99_ms"),
        "round_p99_median_large_over_small": ratio("large", "round_p99_median_ms"),
        "round_p99_median_small_again_over_small": ratio("small-again", "round_p99_median_ms"),
    }


def markdown(data: dict[str, Any]) -> str:
    rows = [
        f"`{data['command']}` at {data['revision']} ({data['machine']}): {data['rounds']} rounds "
        f"of {data['round_seconds']} s each at {data['rate']} requests/s, the targets taking "
        "turns in rotating order on the same Redis and writers, each proxy started for its turn "
        f"and warmed up for {data['warmup_seconds']} s first. `large` "
        f"reads the size's cluster, `small` and `small-again` a {SMALL_TABLE[0]}-node / "
        f"{SMALL_TABLE[1]}-partition one, `large-process` the size's cluster with its table "
        "built in a process of its own (KROUTE_TABLE_PROCESS) on the proxy's CPU, `large-aside` "
        "the same with that process on the other CPU (KROUTE_TABLE_PROCESS_CPUS), each proxy "
        f"with {data.get('workers', 1)} worker(s) (KROUTE_WORKERS; with more than one, the "
        "table process is one for all of them, run by the supervisor): large/small "
        "is what the table "
        "costs a request, "
        "small-again/small the noise floor of the same comparison, direct the host's own."
        + (
            " Nothing pinned (no --request-path-cpus): `large-process` and `large-aside` are the "
            "same proxy, measured twice."
            if data.get("request_path_cpus") is None
            else ""
        ),
        "",
        "| size | proxy | requests | failed | p50 ms | p95 ms | p99 ms (pooled) | median round "
        "p99 ms | round p99s ms | longest loop stall ms | its own CPU ms | longest table hold "
        "ms | longest swap ms | longest collector pause ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for size, result in data["sizes"].items():
        for name, f in result["proxies"].items():
            rounds = ", ".join(str(p) for p in f["round_p99_ms"])
            loop = (
                "| no proxy | no proxy | no proxy | no proxy | no proxy |"
                if name == DIRECT
                else f"| {f['loop_stall_max_ms']} | {f['loop_stall_busy_max_ms']} | "
                f"{f['table_hold_max_ms']} | {f['swap_max_ms']} | {f['collector_pause_max_ms']} |"
            )
            rows.append(
                f"| {size} | {name} | {f['requests']:,} | {f['failed']:,} | {f['p50_ms']} | "
                f"{f['p95_ms']} | {f['p99_ms']} | "
                f"{f['round_p99_median_ms']} | {rounds} {loop}"
            )
    rows += ["", "| size | proxy | p95 /small | p99 /small | median round p99 /small |",
             "|---|---|---:|---:|---:|"]  # fmt: skip
    rows += [
        f"| {size} | {name} | {r[f'p95_{key}_over_small']} | {r[f'p99_{key}_over_small']} "
        f"| {r[f'round_p99_median_{key}_over_small']} |"
        for size, r in data["sizes"].items()
        for name, key in (("large-process", "large_process"), ("large-aside", "large_aside"))
    ]
    rows += ["", "| size | p95 large/small | p95 small-again/small | p99 large/small | "
             "p99 small-again/small | median round p99 large/small | median round p99 "
             "small-again/small |", "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for size, r in data["sizes"].items():
        rows.append(
            f"| {size} | {r['p95_large_over_small']} | {r['p95_small_again_over_small']} | "
            f"{r['p99_large_over_small']} | {r['p99_small_again_over_small']} | "
            f"{r['round_p99_median_large_over_small']} | "
            f"{r['round_p99_median_small_again_over_small']} |"
        )
    return "\n".join(rows) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=parse_sizes, default=parse_sizes(DEFAULT_SIZES))
    parser.add_argument("--rounds", type=int, default=6, help="rounds per proxy")
    parser.add_argument("--round-seconds", type=float, default=8)
    parser.add_argument("--rate", type=int, default=2_000, help="requests/s of the paced load")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument(
        "--warmup-seconds",
        type=float,
        default=5,
        help="a round before each proxy's measured one, not counted",
    )
    parser.add_argument("--writers", type=int, default=2, help="writer processes per size")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="KROUTE_WORKERS of every proxy; above 1 the table process is the one the "
        "supervisor runs for all its workers, and the results go to table_cost_workers",
    )
    add_request_path_cpus(parser)
    args = parser.parse_args()
    sizes: dict[str, Any] = {}
    with cluster_services("kroute-table-cost-", args.request_path_cpus) as (
        services,
        redis_server,
        backends,
    ):
        for size in args.sizes:
            name = f"{size[0]}/{size[1]}"
            sizes[name] = measure_size(services, redis_server.url, backends, size, args)
            say(f"{name}: {json.dumps({k: v for k, v in sizes[name].items() if k != 'proxies'})}")
    data = {
        "command": ("python -m benchmarks.table_cost_bench " + " ".join(sys.argv[1:])).strip(),
        "revision": git_revision(),
        "machine": machine_notes(),
        "request_path_cpus": args.request_path_cpus,
        "rounds": args.rounds,
        "round_seconds": args.round_seconds,
        "warmup_seconds": args.warmup_seconds,
        "rate": args.rate,
        "workers": args.workers,
        "small_table": f"{SMALL_TABLE[0]}/{SMALL_TABLE[1]}",
        "sizes": sizes,
    }
    results = "table_cost" if args.workers == 1 else "table_cost_workers"
    write_json(results, data)
    write_section(results, markdown(data))
    print(markdown(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
