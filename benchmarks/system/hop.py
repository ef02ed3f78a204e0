"""Claim 1, no extra hop: wrk against the owning nodes directly, nginx round robin, and kroute."""

from __future__ import annotations

import functools
import os
import statistics
import threading
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import wrk
from benchmarks.placement import can_isolate, pinned
from benchmarks.proxy_bench import metric_value, nginx_proxy_conf, start_server
from benchmarks.sampling import ProcessSampler
from benchmarks.system.harness import Bench, key_path, key_samples, partition_of, say
from kroute.embedded import free_port


def write_paths(path: Path, keys: list[str]) -> Path:
    path.write_text("".join(key_path(k) + "\n" for k in keys))
    return path


def forwarded_total(bench: Bench) -> int:
    return sum(int(node.metadata()["forwarded"]) for node in bench.nodes.values())


def no_extra_hop(bench: Bench, seconds: int, rounds: int, connections: int) -> dict[str, Any]:
    """Claim 1 twice: everything sharing every core, then (with two CPUs or more) the cluster
    on one set of cores and the front (wrk, nginx, the proxies) on the other."""
    workdir = bench.workdir / "hop"
    workdir.mkdir(exist_ok=True)
    node_ports = [int(n.url.rsplit(":", 1)[1]) for n in bench.nodes.values()]
    nginx_port = free_port()
    conf = workdir / "nginx.conf"
    conf.write_text(nginx_proxy_conf(workdir, nginx_port, node_ports))
    nginx = start_server(bench.services, "nginx", ["nginx", "-c", str(conf)], nginx_port)
    bench.sampler.watch("nginx", nginx.pid)
    owners = bench.actives()
    runs: dict[str, dict[str, Callable[[], dict[str, Any]]]] = {}
    for distribution in ("zipf", "uniform"):
        keys = key_samples(distribution)
        all_paths = write_paths(workdir / f"{distribution}.paths", keys)
        by_node: dict[str, list[str]] = defaultdict(list)
        for key in keys:
            by_node[owners[partition_of(key)]].append(key)
        node_paths = {
            name: write_paths(workdir / f"{distribution}-{name}.paths", by_node[name])
            for name in bench.nodes
        }
        runs[distribution] = {
            "direct": functools.partial(direct_run, bench, node_paths, seconds, connections),
            "nginx": functools.partial(
                single_run, f"http://127.0.0.1:{nginx_port}", all_paths, seconds, connections
            ),
            "kroute": functools.partial(
                single_run, bench.kroute.url, all_paths, seconds, connections
            ),
        }
    summary = {"shared_cores": hop_rounds(bench, "shared", runs, rounds)}
    if can_isolate(2):
        cluster_cpus, front_cpus = split_cpus()
        cluster = bench.service_pids + [node.process.pid for node in bench.nodes.values()]
        assert bench.actives_only is not None
        front = [nginx.pid, bench.kroute.process.pid, bench.actives_only.process.pid]
        say(f"  hop: cluster on CPUs {sorted(cluster_cpus)}, front on {sorted(front_cpus)}")
        with pinned({cluster_cpus: cluster, front_cpus: front}, here=set(front_cpus)):
            summary["isolated_cores"] = hop_rounds(bench, "isolated", runs, rounds)
        summary["isolated_cores"]["cpus"] = {
            "cluster": sorted(cluster_cpus),
            "front": sorted(front_cpus),
        }
    nginx.stop()
    return summary


def split_cpus() -> tuple[frozenset[int], frozenset[int]]:
    """The usable CPUs in two halves: (the cluster's, the front's)."""
    cpus = sorted(os.sched_getaffinity(0))
    half = len(cpus) // 2
    return frozenset(cpus[half:]), frozenset(cpus[:half])


def hop_rounds(
    bench: Bench,
    layout: str,
    runs: dict[str, dict[str, Callable[[], dict[str, Any]]]],
    rounds: int,
) -> dict[str, Any]:
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for distribution, systems in runs.items():
        per_system = results.setdefault(distribution, {})
        for round_number in range(rounds):
            for system, run in systems.items():
                say(f"  hop ({layout} cores): {distribution} round {round_number + 1}: {system}")
                before, hot_before = forwarded_total(bench), hot_path_served(bench)
                with bench.sampler.phase(f"hop/{layout}/{distribution}/{system}/{round_number}"):
                    figures = run()
                figures["hops"] = forwarded_total(bench) - before
                if system == "kroute":
                    hot = hot_path_served(bench) - hot_before
                    figures["c_path_share"] = round(hot / max(figures["requests"], 1), 3)
                figures["hop_share"] = round(figures["hops"] / max(figures["requests"], 1), 3)
                per_system.setdefault(system, []).append(figures)
    return summarize_hops(layout, results, bench.sampler)


def hot_path_served(bench: Bench) -> float:
    """Requests the proxy's C path served so far (its metric)."""
    return (
        metric_value(bench.kroute.admin("/metrics").text, "kroute_proxy_hot_path_requests_total")
        or 0
    )


def single_run(url: str, paths: Path, seconds: int, connections: int) -> dict[str, Any]:
    return wrk.merge_runs([wrk.run_wrk_paths(url, paths, seconds, connections)], seconds)


def direct_run(
    bench: Bench, node_paths: dict[str, Path], seconds: int, connections: int
) -> dict[str, Any]:
    """Three wrk processes at once, each to one node with the keys it is active for."""
    runs: list[dict[str, Any]] = []
    share = max(1, connections // len(node_paths))

    def run(name: str) -> None:
        runs.append(wrk.run_wrk_paths(bench.nodes[name].url, node_paths[name], seconds, share))

    threads = [threading.Thread(target=run, args=(name,)) for name in node_paths]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return wrk.merge_runs(runs, seconds)


def summarize_hops(
    layout: str, results: dict[str, dict[str, list[dict[str, Any]]]], sampler: ProcessSampler
) -> dict[str, Any]:
    cpu = sampler.summary()
    summary: dict[str, Any] = {}
    for distribution, per_system in results.items():
        rows = {}
        for system, runs in per_system.items():
            phases = [cpu[f"hop/{layout}/{distribution}/{system}/{i}"] for i in range(len(runs))]
            # Totals per round first, then their median: a sum of per-node medians would add up
            # figures of different rounds.
            nodes_cpu = [
                sum(v["cpu_s"] for c, v in p.items() if c.startswith("node-")) for p in phases
            ]
            nodes_cores = [
                sum(v["cores"] for c, v in p.items() if c.startswith("node-")) for p in phases
            ]
            rows[system] = {
                "rps": round(statistics.median(r["rps"] for r in runs)),
                "p50_ms": statistics.median(r["p50_ms"] for r in runs),
                "p99_ms": statistics.median(r["p99_ms"] for r in runs),
                "hop_share": statistics.median(r["hop_share"] for r in runs),
                "c_path_share": statistics.median(r.get("c_path_share", 0.0) for r in runs),
                "non_2xx": sum(r["non_2xx"] for r in runs),
                "rounds": runs,
                "cpu_cores": {
                    component: round(statistics.median(p[component]["cores"] for p in phases), 2)
                    for component in phases[0]
                },
                "nodes_cpu_cores": round(statistics.median(nodes_cores), 2),
                # The three nodes' process trees (Spark included) per request answered.
                "nodes_cpu_us_per_request": round(
                    statistics.median(
                        used / max(r["requests"], 1) * 1e6
                        for used, r in zip(nodes_cpu, runs, strict=True)
                    ),
                    1,
                ),
            }
        kroute, nginx, direct = rows["kroute"], rows["nginx"], rows["direct"]
        rows["ratios"] = {
            "kroute_vs_nginx_rps": round(kroute["rps"] / nginx["rps"], 2),
            "kroute_vs_nginx_p99": round(kroute["p99_ms"] / nginx["p99_ms"], 2),
            "kroute_vs_direct_rps": round(kroute["rps"] / direct["rps"], 2),
        }
        rows["goal_met"] = (
            rows["ratios"]["kroute_vs_nginx_rps"] >= 1.5
            and kroute["p99_ms"] < nginx["p99_ms"]
            and rows["ratios"]["kroute_vs_direct_rps"] >= 0.75
        )
        summary[distribution] = rows
    return summary
