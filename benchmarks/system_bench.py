"""The seeds' claims, measured side by side on one real cluster in one run.

One Tansu broker, one redis-server, three materializer nodes (Spark local[1] each, 12
partitions, one standby per partition, a 45 s grace period: Kafka's default consumer session
timeout) and two kroute proxies in front of them: the product as configured by default
(standby reads on) and one restricted to actives (`KROUTE_STANDBY_READS=false`, the behaviour
before KIP-535). Every claim runs on that cluster, in this order:

1. no extra hop   wrk (Zipf and uniform keys, interleaved rounds) against (a) the owning
                  node directly (three wrk processes, each with its node's keys), (b) nginx
                  round robin over the nodes, which forward misrouted keys to the owner,
                  (c) kroute; requests/s, p50, p99, and the share that needed a node-to-node
                  hop (the nodes count what they forward). Twice: with everything sharing
                  every core, then with the cluster (nodes, broker, redis) on half the cores
                  and the front (wrk, nginx, the proxies) on the other half, as a deployment
                  gives the routing tier machines of its own.
5. freshness      a new key every 50 ms; time from produce() until the proxy answers 200.
2. failures       steady load on both proxies at once; kill -9 of the node active for a third
                  of the partitions, then (after it is back) SIGSTOP of one for 10 s: failed
                  requests, p99 and max in the window, time until every read succeeds again,
                  and requests that hung for the whole upstream timeout, per connection.
3. staleness      one node killed; the standby of its partitions has its Spark JVM stopped
                  while writes continue, so its lag grows; reads ask budgets of 250 ms-16 s:
                  answers whose true staleness (now - the write time of the oldest write to
                  that key they do not show) exceeds the budget, and availability per budget.
4. restart        kill -9 a node, write N records to its partitions, restart it on its store:
                  records re-read vs N, time to caught up; then the same with its store
                  deleted (a full restore) for comparison.

CPU and resident memory of every component's process tree are sampled throughout and reported
per phase. `--soak-minutes M` adds a long run (steady reads and writes, no faults) that
reports memory per component over time. Everything started is stopped by PID at the end, and
the run is bounded (`--max-minutes`).

Usage: .venv/bin/python -m benchmarks.system_bench [--seconds 8] [--rounds 2] [--soak-minutes 0]
Needs wrk and nginx (apt-get install wrk nginx-light).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from confluent_kafka import Producer

from benchmarks import wrk
from benchmarks.loadgen import Outcome, Request, SteadyLoad
from benchmarks.placement import can_isolate, pinned
from benchmarks.proxy_bench import metric_value, nginx_proxy_conf, start_server
from benchmarks.results_file import (
    BENCHMARKS,
    git_revision,
    machine_notes,
    write_json,
    write_section,
)
from benchmarks.sampling import ProcessSampler
from kroute.demo import customer_id, popular_customers
from kroute.embedded import EmbeddedServices, free_port
from kroute.nodes import NodeHandle, start_node
from kroute.proxies import ProxyHandle, start_proxy
from kroute.topics import create_topics
from materializer.kafka_offsets import end_offsets
from partitioner import partition

PARTITIONS = 12
CUSTOMERS = 20_000
NODE_NAMES = ("a", "b", "c")
STORE = "customers"
TOPIC = "customers"
GRACE_S = 45  # Kafka's default consumer session.timeout.ms: when Kafka Streams would move them
UPSTREAM_TIMEOUT_MS = 2000  # the proxy's default
# The claims, in the order they run (`--only` picks some): the failures claim is two runs.
PARTS = ("hop", "freshness", "kill-9", "sigstop", "staleness", "restart")
BUDGETS_MS = (250, 500, 1000, 2000, 4000, 8000, 16000)
PLOTS = BENCHMARKS / "results"


def key_path(key: str) -> str:
    return f"/stores/{STORE}/keys/{key}"


def partition_of(key: str) -> int:
    return partition(key.encode(), PARTITIONS)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)


class Writer:
    """Produces JSON records and remembers when each key was written (before produce())."""

    def __init__(self, bootstrap: str) -> None:
        self._producer = Producer(
            {"bootstrap.servers": bootstrap, "partitioner": "murmur2_random", "linger.ms": 0}
        )
        self._lock = threading.Lock()
        self.written: dict[str, list[tuple[int, float]]] = defaultdict(list)  # key -> (n, at)
        self._count = itertools.count()
        self._acked: dict[str, list[tuple[int, int]]] = defaultdict(list)  # key -> (n, offset)

    def write(self, key: str) -> None:
        n = next(self._count)
        at = time.time()
        value = json.dumps({"customer": key, "n": n, "written_ms": int(at * 1000)})

        def acked(err: Any, msg: Any, key: str = key, n: int = n) -> None:
            if err is None:
                with self._lock:
                    self._acked[key].append((n, msg.offset()))

        with self._lock:
            self.written[key].append((n, at))
        self._producer.produce(TOPIC, key=key.encode(), value=value.encode(), on_delivery=acked)
        self._producer.poll(0)

    def flush(self) -> None:
        if self._producer.flush(60) != 0:
            raise RuntimeError("records were not delivered within 60 s")

    def oldest_unseen_write(self, key: str, seen_n: int) -> float | None:
        """Write time of the oldest write to `key` after record n == seen_n; None if none."""
        with self._lock:
            later = [at for n, at in self.written.get(key, []) if n > seen_n]
        return min(later) if later else None


class SteadyWriter:
    """Writes to `keys` at `rate` per second from a thread until stopped."""

    def __init__(self, writer: Writer, keys: list[str], rate: float) -> None:
        self._writer, self._keys, self._rate = writer, keys, rate
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="writer", daemon=True)

    def start(self) -> SteadyWriter:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._writer.flush()

    def _run(self) -> None:
        rng = random.Random(7)
        next_at = time.monotonic()
        while not self._stop.is_set():
            self._writer.write(rng.choice(self._keys))
            next_at += 1 / self._rate
            self._stop.wait(max(0.0, next_at - time.monotonic()))


@dataclass
class Bench:
    services: EmbeddedServices
    workdir: Path
    bootstrap: str
    redis_url: str
    sampler: ProcessSampler
    writer: Writer
    nodes: dict[str, NodeHandle] = field(default_factory=dict)
    proxy: ProxyHandle | None = None
    actives_only: ProxyHandle | None = None
    service_pids: list[int] = field(default_factory=list)  # the broker's and redis-server's

    @property
    def kroute(self) -> ProxyHandle:
        assert self.proxy is not None
        return self.proxy

    def start_node(self, name: str, *, wipe: bool = False) -> NodeHandle:
        data_dir = self.workdir / f"node-{name}"
        if wipe:
            shutil.rmtree(data_dir, ignore_errors=True)
        node = start_node(
            self.services,
            self.bootstrap,
            TOPIC,
            data_dir,
            name=name,
            wait_ready=False,
            store=STORE,
            spark_master="local[1]",
            redis_url=self.redis_url,
            cluster="bench",
            standbys="1",
            grace_period_s=str(GRACE_S),
            log_level="warning",
        )
        self.nodes[name] = node
        self.sampler.watch(f"node-{name}", node.process.pid)
        return node

    def partition_map(self) -> list[dict[str, Any]]:
        return list(self.kroute.status()["stores"].get(STORE, {}).get("partition_map", []))

    def actives(self) -> dict[int, str]:
        return {
            entry["partition"]: r["node"]
            for entry in self.partition_map()
            for r in entry["replicas"]
            if r["role"] == "active"
        }

    def standbys(self) -> dict[int, str]:
        return {
            entry["partition"]: r["node"]
            for entry in self.partition_map()
            for r in entry["replicas"]
            if r["role"] == "standby"
        }

    def settled(self) -> bool:
        """Every partition has a live active and a live standby, both with lag under 50."""
        entries = self.partition_map()
        if len(entries) != PARTITIONS:
            return False
        for entry in entries:
            replicas = entry["replicas"]
            roles = sorted(r["role"] for r in replicas)
            if roles != ["active", "standby"]:
                return False
            if not all(r["alive"] and r["lag"] is not None and r["lag"] < 50 for r in replicas):
                return False
        return len({r["node"] for e in entries for r in e["replicas"]}) == len(NODE_NAMES)

    def wait_settled(self, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        stable_since: float | None = None
        while True:
            for name, node in self.nodes.items():
                if not node.process.is_running():
                    raise RuntimeError(f"node {name} exited:\n{node.process.log_tail(30)}")
            if self.settled():
                stable_since = stable_since or time.monotonic()
                if time.monotonic() - stable_since > 3:
                    return
            else:
                stable_since = None
            if time.monotonic() > deadline:
                raise TimeoutError(f"cluster did not settle: {self.partition_map()}")
            time.sleep(0.5)


def say(text: str) -> None:
    print(text, flush=True)


def start_bench(services: EmbeddedServices, workdir: Path) -> Bench:
    sampler = ProcessSampler().start()
    say("starting the broker and redis-server ...")
    broker = services.start_broker()
    redis_server = services.start_redis()
    sampler.watch("broker", broker.process.pid)
    sampler.watch("redis", redis_server.process.pid)
    create_topics(broker.bootstrap_servers, {TOPIC: PARTITIONS})
    writer = Writer(broker.bootstrap_servers)
    say(f"writing {CUSTOMERS:,} customers ...")
    for number in range(CUSTOMERS):
        writer.write(customer_id(number))
    writer.flush()
    bench = Bench(services, workdir, broker.bootstrap_servers, redis_server.url, sampler, writer)
    bench.service_pids = [broker.process.pid, redis_server.process.pid]
    say("starting three materializer nodes (Spark) ...")
    for name in NODE_NAMES:
        bench.start_node(name)
    for node in bench.nodes.values():
        node.wait_ready(timeout_s=240)
    bench.proxy = start_proxy(services, redis_server.url, name="proxy", cluster="bench")
    bench.actives_only = start_proxy(
        services,
        redis_server.url,
        name="proxy-actives-only",
        cluster="bench",
        standby_reads="false",
    )
    sampler.watch("proxy", bench.proxy.process.pid)
    sampler.watch("proxy-actives-only", bench.actives_only.process.pid)
    say("waiting until every partition has a caught-up active and standby ...")
    bench.wait_settled()
    return bench


# 1. No extra hop -------------------------------------------------------------------------------


def key_samples(distribution: str, count: int = 200_000) -> list[str]:
    rng = random.Random(11)
    if distribution == "zipf":
        return list(itertools.islice(popular_customers(rng, CUSTOMERS), count))
    return [customer_id(rng.randrange(CUSTOMERS)) for _ in range(count)]


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


# 5. Freshness ----------------------------------------------------------------------------------


def freshness(bench: Bench, samples: int, interval_s: float = 0.05) -> dict[str, Any]:
    client = httpx.Client(timeout=5, trust_env=False)
    pending: dict[str, float] = {}
    latencies: list[float] = []
    sent = 0
    next_send = time.perf_counter()
    deadline = next_send + samples * interval_s + 30
    with bench.sampler.phase("freshness"):
        while (sent < samples or pending) and time.perf_counter() < deadline:
            if sent < samples and time.perf_counter() >= next_send:
                key = f"fresh-{sent}-{time.time_ns()}"
                pending[key] = time.perf_counter()
                bench.writer.write(key)
                sent += 1
                next_send += interval_s
            for key, began in list(pending.items()):
                if client.get(bench.kroute.url + key_path(key)).status_code == 200:
                    latencies.append((time.perf_counter() - began) * 1000)
                    del pending[key]
            time.sleep(0.005)
    client.close()
    return {
        "samples": len(latencies),
        "never_visible": len(pending),
        "produce_rate_per_s": round(1 / interval_s),
        "p50_ms": percentile(latencies, 0.5),
        "p99_ms": percentile(latencies, 0.99),
        "max_ms": round(max(latencies), 1) if latencies else None,
    }


# 2. Reads survive failures ---------------------------------------------------------------------


def lookups(keys: list[str], headers: tuple[tuple[str, str], ...] = ()) -> Iterator[Request]:
    return (Request(key_path(k), headers) for k in itertools.cycle(keys))


def steady_load(proxy: ProxyHandle, keys: list[str], rate: float, **kwargs: Any) -> SteadyLoad:
    port = int(proxy.url.rsplit(":", 1)[1])
    return SteadyLoad("127.0.0.1", port, lookups(keys), rate=rate, **kwargs).start()


FAILOVER_WINDOW_S = 10.0  # after the fault: the heartbeat TTL, ejection and failover fit


def window_figures(outcomes: list[Outcome], fault_at: float, until: float) -> dict[str, Any]:
    """Failures from the fault to the end; latency in the failover window and just before."""
    inside = [o for o in outcomes if fault_at <= o.sent_at <= until]
    failed = [o for o in inside if o.status != 200]
    latencies = [o.latency_ms for o in inside if o.sent_at <= fault_at + FAILOVER_WINDOW_S]
    before = [o.latency_ms for o in outcomes if fault_at - 5 <= o.sent_at < fault_at]
    # Waited out the timeout itself (from its own send), not queued behind one that did.
    hung = Counter(o.connection for o in inside if o.service_ms >= UPSTREAM_TIMEOUT_MS * 0.9)
    last_failure = max((o.sent_at + o.latency_ms / 1000 for o in failed), default=None)
    return {
        "requests": len(inside),
        "failed": len(failed),
        "failed_by_status": dict(Counter(str(o.status) for o in failed)),
        "p99_ms_before": percentile(before, 0.99),
        "p50_ms": percentile(latencies, 0.5),
        "p99_ms": percentile(latencies, 0.99),
        "max_ms": round(max(latencies), 1) if latencies else None,
        "all_served_again_after_s": 0.0
        if last_failure is None
        else round(last_failure - fault_at, 1),
        "hung_for_the_timeout": sum(hung.values()),
        "hung_max_per_connection": max(hung.values(), default=0),
    }


def timeline(
    outcomes: list[Outcome], fault_at: float, bucket_s: float = 0.5
) -> list[dict[str, Any]]:
    buckets: dict[int, list[Outcome]] = defaultdict(list)
    for o in outcomes:
        buckets[int((o.sent_at - fault_at) // bucket_s)].append(o)
    return [
        {
            "t_s": round(b * bucket_s, 1),
            "requests": len(group),
            "failed": sum(o.status != 200 for o in group),
            "p99_ms": percentile([o.latency_ms for o in group], 0.99),
        }
        for b, group in sorted(buckets.items())
    ]


def most_active(bench: Bench) -> tuple[str, list[int]]:
    by_node: dict[str, list[int]] = defaultdict(list)
    for p, node in bench.actives().items():
        by_node[node].append(p)
    name = max(sorted(by_node), key=lambda n: len(by_node[n]))
    return name, sorted(by_node[name])


def survive(bench: Bench, fault: str, rate: float, connections: int) -> dict[str, Any]:
    """Steady load on both proxies; kill -9 (or SIGSTOP for 10 s) the busiest active."""
    assert bench.actives_only is not None
    keys = key_samples("uniform", 5_000)
    victim, partitions = most_active(bench)
    say(f"  {fault}: node {victim} (active for {len(partitions)} of {PARTITIONS} partitions)")
    writes = SteadyWriter(bench.writer, key_samples("uniform", 2_000), 20).start()
    systems = {"kroute": bench.kroute, "actives-only": bench.actives_only}
    loads = {
        name: steady_load(proxy, keys, rate, connections=connections, timeout_s=10)
        for name, proxy in systems.items()
    }
    with bench.sampler.phase(f"survive/{fault}"):
        time.sleep(5)
        fault_at = time.time()
        node = bench.nodes[victim]
        if fault == "kill-9":
            node.process.signal(signal.SIGKILL)
            wait_served_again(bench, loads["actives-only"], fault_at, GRACE_S + 60)
        else:
            node.process.signal(signal.SIGSTOP)
            time.sleep(10)
            node.process.signal(signal.SIGCONT)
            time.sleep(10)
        time.sleep(3)
        until = time.time()
        outcomes = {name: load.stop() for name, load in loads.items()}
    writes.stop()
    result: dict[str, Any] = {
        "victim": victim,
        "victim_active_partitions": len(partitions),
        "rate_per_proxy": rate,
        "connections_per_proxy": connections,
        "window_s": round(until - fault_at, 1),
    }
    for name, got in outcomes.items():
        result[name] = window_figures(got, fault_at, until)
        result[name]["timeline"] = timeline(got, fault_at)
    if fault == "kill-9":
        say(f"  restarting node {victim} on its store ...")
        bench.start_node(victim).wait_ready(timeout_s=240)
    bench.wait_settled()
    return result


def wait_served_again(bench: Bench, load: SteadyLoad, since: float, timeout_s: float) -> None:
    """Until the load's last 3 s of answers all succeeded (and at least one failed before)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(1)
        recent = [o for o in load.snapshot() if o.sent_at > time.time() - 3]
        failed_since = any(o.status != 200 for o in load.snapshot() if o.sent_at >= since)
        if failed_since and recent and all(o.status == 200 for o in recent):
            return
    say("  (the actives-only proxy did not recover within the time limit)")


# 3. Staleness is bounded and visible -----------------------------------------------------------


def spark_jvm(node: NodeHandle) -> int:
    for task in Path(f"/proc/{node.process.pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            if b"java" in Path(f"/proc/{child}/cmdline").read_bytes():
                return int(child)
    raise RuntimeError(f"no Spark JVM under node {node.process.name}")


def staleness(bench: Bench, seconds: float, rate: float) -> dict[str, Any]:
    dead, dead_actives = most_active(bench)
    standbys = bench.standbys()
    throttled = Counter(standbys[p] for p in dead_actives).most_common(1)[0][0]
    affected = [p for p in dead_actives if standbys[p] == throttled]
    keys = [k for k in key_samples("uniform", 20_000) if partition_of(k) in affected][:60]
    say(
        f"  staleness: kill -9 node {dead}; stop node {throttled}'s Spark, the only live "
        f"replica of partitions {affected}"
    )
    bench.nodes[dead].process.signal(signal.SIGKILL)
    time.sleep(4)  # past the heartbeat TTL
    jvm = spark_jvm(bench.nodes[throttled])
    requests = (
        Request(key_path(k), (("x-kroute-max-lag-ms", str(b)),), str(b))
        for k, b in zip(itertools.cycle(keys), itertools.cycle(BUDGETS_MS), strict=False)
    )
    port = int(bench.kroute.url.rsplit(":", 1)[1])
    writes = SteadyWriter(bench.writer, keys, 40).start()
    with bench.sampler.phase("staleness"):
        os.kill(jvm, signal.SIGSTOP)
        throttled_at = time.time()
        load = SteadyLoad("127.0.0.1", port, requests, rate=rate, connections=8, keep_body=True)
        load.start()
        time.sleep(seconds)
        outcomes = load.stop()
        os.kill(jvm, signal.SIGCONT)
    writes.stop()
    result = judge_staleness(bench.writer, outcomes)
    result.update(
        {
            "throttled_node": throttled,
            "killed_node": dead,
            "partitions": affected,
            "throttled_for_s": round(time.time() - throttled_at, 1),
            "keys": len(keys),
        }
    )
    say(f"  restarting node {dead} ...")
    bench.start_node(dead).wait_ready(timeout_s=240)
    bench.wait_settled()
    return result


def judge_staleness(writer: Writer, outcomes: list[Outcome]) -> dict[str, Any]:
    """Per budget: availability, and answers older than the budget by the writes they miss."""
    per_budget: dict[str, dict[str, Any]] = {}
    for budget in BUDGETS_MS:
        mine = [o for o in outcomes if o.label == str(budget)]
        answered = [o for o in mine if o.status == 200]
        staleness_ms = [true_staleness_ms(writer, o) for o in answered]
        per_budget[str(budget)] = {
            "requests": len(mine),
            "answered": len(answered),
            "refused_503": sum(o.status == 503 for o in mine),
            "other": sum(o.status not in (200, 503) for o in mine),
            "availability": round(len(answered) / max(len(mine), 1), 3),
            "beyond_budget": sum(s > budget for s in staleness_ms),
            "max_true_staleness_ms": round(max(staleness_ms), 1) if staleness_ms else None,
        }
    return {
        "per_budget_ms": per_budget,
        "beyond_budget_total": sum(v["beyond_budget"] for v in per_budget.values()),
    }


def true_staleness_ms(writer: Writer, outcome: Outcome) -> float:
    """How long the oldest write to the key that the answer does not show had been written
    when the answer arrived (0 if it shows the latest). Measured from before produce(), so it
    errs against kroute."""
    body = json.loads(outcome.body)
    key = outcome.path.rsplit("/", 1)[1]
    oldest = writer.oldest_unseen_write(key, int(body["value"]["n"]))
    received = outcome.sent_at + outcome.latency_ms / 1000
    if oldest is None or oldest >= received:
        return 0.0
    return (received - oldest) * 1000


# 4. Restart without restore --------------------------------------------------------------------


def restart(bench: Bench, records: int) -> dict[str, Any]:
    name = "c"
    results = {}
    for mode in ("on its store", "store deleted"):
        node = bench.nodes[name]
        before = {p["partition"]: p["current_offset"] for p in node.metadata()["partitions"]}
        say(f"  restart ({mode}): kill -9 node {name}, write {records:,} records to its partitions")
        node.process.signal(signal.SIGKILL)
        node.close()
        mine = [
            k for k in (f"restart-{i}" for i in range(records * 20)) if partition_of(k) in before
        ]
        for key in mine[:records]:
            bench.writer.write(key)
        bench.writer.flush()
        ends = high_watermarks(bench, set(before))
        started = time.monotonic()
        with bench.sampler.phase(f"restart/{mode}"):
            node = bench.start_node(name, wipe=mode == "store deleted")
            node.wait_ready(timeout_s=240)
            ready_s = time.monotonic() - started
            metadata = node.wait_caught_up(ends, timeout_s=300)
            caught_up_s = time.monotonic() - started
        missed = sum(ends[p] - before[p] for p in before)
        reread = int(metadata["ingest"]["records"])
        results[mode] = {
            "records_written_while_down": missed,
            "records_reread": reread,
            "reread_beyond_missed": reread - missed,
            "partition_records_total": sum(ends[p] for p in before),
            "ready_s": round(ready_s, 1),
            "caught_up_s": round(caught_up_s, 1),
            "partitions": sorted(before),
        }
        bench.wait_settled()
    return results


def high_watermarks(bench: Bench, partitions: set[int]) -> dict[int, int]:
    """The partitions' end offsets from the broker (Fetch high watermarks, see docs/broker-quirks.md)."""
    return asyncio.run(end_offsets(bench.bootstrap, TOPIC, sorted(partitions)))


# Soak ------------------------------------------------------------------------------------------


def soak(bench: Bench, minutes: float, rate: float) -> dict[str, Any]:
    keys = key_samples("zipf", 50_000)
    writes = SteadyWriter(bench.writer, key_samples("uniform", 5_000), 20).start()
    load = steady_load(bench.kroute, keys, rate, connections=16)
    with bench.sampler.phase("soak"):
        began = time.monotonic()
        while time.monotonic() - began < minutes * 60:
            time.sleep(5)
        outcomes = load.stop()
    writes.stop()
    components = [c for c in ("proxy", "node-a", "node-b", "node-c", "redis", "broker")]
    soak_began = next(b for n, b, _ in bench.sampler.phases if n == "soak")
    memory = {}
    for component in components:
        series = [
            (s.at - soak_began, s.rss_bytes / 2**20)
            for s in bench.sampler.samples
            if s.component == component and s.at >= soak_began
        ]
        first = [mb for t, mb in series if t <= 60]
        last = [mb for t, mb in series if t >= series[-1][0] - 60]
        memory[component] = {
            "first_minute_mb": round(statistics.mean(first), 1),
            "last_minute_mb": round(statistics.mean(last), 1),
            "per_minute_mb": bench.sampler.rss_per_minute(component, soak_began, int(minutes)),
        }
    start = outcomes[0].sent_at if outcomes else 0
    per_minute_p99 = [row["p99_ms"] for row in per_minute(outcomes, start, int(minutes))]
    return {
        "minutes": minutes,
        "rate": rate,
        "requests": len(outcomes),
        "failed": sum(o.status != 200 for o in outcomes),
        "p99_ms_per_minute": per_minute_p99,
        "memory": memory,
    }


def per_minute(outcomes: list[Outcome], began: float, minutes: int) -> list[dict[str, Any]]:
    """Requests, failures, p50 and p99 in each minute after `began` (wall clock)."""
    rows = []
    for m in range(minutes):
        group = [o for o in outcomes if m * 60 <= o.sent_at - began < (m + 1) * 60]
        rows.append(
            {
                "minute": m + 1,
                "requests": len(group),
                "failed": sum(o.status != 200 for o in group),
                "p50_ms": percentile([o.latency_ms for o in group], 0.5),
                "p99_ms": percentile([o.latency_ms for o in group], 0.99),
            }
        )
    return rows


# Report ----------------------------------------------------------------------------------------


def plot(figures: dict[str, Any]) -> list[str]:
    """The plots of the claims that were run, named after the results file."""
    import matplotlib  # noqa: PLC0415 - optional until plots are drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    PLOTS.mkdir(exist_ok=True)
    names = []
    prefix = figures["name"]
    if "1_no_extra_hop" in figures:
        names.append(plot_hop(plt, figures["1_no_extra_hop"], f"{prefix}_hop.png"))
    if "kill-9" in figures.get("2_reads_survive_failures", {}):
        survive_figures = figures["2_reads_survive_failures"]
        names.append(plot_failover(plt, survive_figures, f"{prefix}_failover.png"))
    if "3_staleness" in figures:
        stale = figures["3_staleness"]["per_budget_ms"]
        names.append(plot_staleness(plt, stale, f"{prefix}_staleness.png"))
    plt.close("all")
    return names


def plot_hop(plt: Any, hop: dict[str, Any], name: str) -> str:
    layouts = [layout for layout in HOP_LAYOUTS if layout in hop]
    fig, grid = plt.subplots(len(layouts), 2, figsize=(10, 4 * len(layouts)), squeeze=False)
    systems = ("direct", "nginx", "kroute")
    for axes, layout in zip(grid, layouts, strict=True):
        for ax, metric, title in ((axes[0], "rps", "requests/s"), (axes[1], "p99_ms", "p99 (ms)")):
            for i, distribution in enumerate(("zipf", "uniform")):
                values = [hop[layout][distribution][s][metric] for s in systems]
                ax.bar([x + i * 0.38 for x in range(3)], values, width=0.38, label=distribution)
            ax.set_xticks([x + 0.19 for x in range(3)], systems)
            ax.set_title(f"{title}, {layout.replace('_', ' ')}")
            ax.legend()
    fig.suptitle("1. No extra hop: three nodes, direct vs nginx round robin vs kroute")
    fig.tight_layout()
    fig.savefig(PLOTS / name, dpi=90)
    return name


def plot_failover(plt: Any, survive_figures: dict[str, Any], name: str) -> str:
    fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for system, style in (("kroute", "-"), ("actives-only", "--")):
        line = survive_figures["kill-9"][system]["timeline"]
        axes[0].plot([b["t_s"] for b in line], [b["failed"] for b in line], style, label=system)
        axes[1].plot(
            [b["t_s"] for b in line], [b["p99_ms"] or 0 for b in line], style, label=system
        )
    axes[0].set_ylabel("failed / 0.5 s")
    axes[1].set_ylabel("p99 ms / 0.5 s")
    axes[1].set_yscale("log")
    axes[1].set_xlabel("seconds since kill -9")
    axes[0].legend()
    fig.suptitle("2. kill -9 of the node active for a third of the partitions")
    fig.tight_layout()
    fig.savefig(PLOTS / name, dpi=90)
    return name


def plot_staleness(plt: Any, stale: dict[str, Any], name: str) -> str:
    fig, ax = plt.subplots(figsize=(7, 4))
    budgets = [int(b) for b in stale]
    ax.plot(budgets, [stale[str(b)]["availability"] * 100 for b in budgets], "o-")
    ax.set_xscale("log")
    ax.set_xlabel("lag budget asked (x-kroute-max-lag-ms, ms)")
    ax.set_ylabel("answered (%); the rest: 503")
    ax.set_title("3. Availability vs budget while the only live replica falls behind")
    fig.tight_layout()
    fig.savefig(PLOTS / name, dpi=90)
    return name


def render(f: dict[str, Any], command: str, plots: list[str]) -> str:
    """The RESULTS.md section: the claims that were run (all, or those `--only` asked for)."""
    lines = [
        "## System benchmarks: the seeds' claims on one real cluster",
        "",
        f"`{command}` — {f['machine']}, revision {f['revision']}, {f['date']}. One Tansu broker,",
        "one redis-server, three materializer nodes (Spark local[1] each) with 12 partitions and one",
        f"standby each, a {GRACE_S} s grace period, and two proxies: kroute as configured by default",
        "and one with `KROUTE_STANDBY_READS=false` (actives only, the behaviour before KIP-535).",
        "Everything shares this machine's cores, wrk and the load generator included (claim 1 is",
        "also run with the cluster and the front on cores of their own). Figures as JSON:",
        f"[results/{f['name']}.json](results/{f['name']}.json).",
        "",
    ]
    if "1_no_extra_hop" in f:
        lines += render_hop_claim(f, plots)
    if "2_reads_survive_failures" in f:
        lines += render_survive(f["2_reads_survive_failures"], plots)
    if "3_staleness" in f:
        lines += render_staleness(f["3_staleness"], plots)
    if "4_restart_without_restore" in f:
        lines += render_restart(f["4_restart_without_restore"])
    if "5_freshness" in f:
        lines += render_freshness(f["5_freshness"])
    lines += render_resources(f["resources"])
    if "soak" in f:
        lines += render_soak(f["soak"])
    return "\n".join(lines)


def render_hop_claim(f: dict[str, Any], plots: list[str]) -> list[str]:
    return [
        "### 1. No extra hop",
        "",
        f"wrk, {f['settings']['connections']} connections, {f['settings']['seconds']} s per "
        f"system, medians of {f['settings']['rounds']} interleaved rounds. `direct`: three wrk "
        "processes, each sending its node the keys it is active for (the floor). `nginx`: round "
        "robin over the nodes, which forward keys they do not own to the owner (one hop, counted "
        "by the nodes, sent with a pooled aiohttp client). `kroute`: the proxy. Nodes' CPU: their "
        "three process trees (Spark included) per round, the median of the rounds' totals; per "
        "request answered in the last column.",
        *render_hop(f["1_no_extra_hop"]),
        *(f"![no extra hop](results/{plot})" for plot in plots if plot.endswith("_hop.png")),
        "",
    ]


def render_survive(survive_f: dict[str, Any], plots: list[str]) -> list[str]:
    first = next(iter(survive_f.values()))
    lines = [
        "### 2. Reads survive failures",
        "",
        "Steady load on both proxies at once (uniform keys, "
        f"{first['rate_per_proxy']:g} requests/s each over "
        f"{first['connections_per_proxy']} keep-alive connections, writes at 20/s). "
        "Window: from the fault until the end of the run (the actives-only proxy's recovery "
        f"needs the {GRACE_S} s grace period to pass and the partitions to move).",
        "",
        f"Failures are counted from the fault to the end; latency in the first "
        f"{FAILOVER_WINDOW_S:g} s after the fault (p99 in the 5 s before it for comparison). "
        "Latency is timed from when each request was due on its connection's constant-rate "
        "schedule, so requests queued behind a hung one count their wait (no coordinated "
        "omission); 'hung for the timeout' counts requests that waited it out from their own send.",
        "",
        "| fault | proxy | requests | failed | p99 ms before | p50 ms | p99 ms | max ms | all reads succeed again after | hung for the timeout (max per connection) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for fault, entry in survive_f.items():
        for system in ("kroute", "actives-only"):
            w = entry[system]
            lines.append(
                f"| {fault} of node {entry['victim']} ({entry['victim_active_partitions']} "
                f"actives) | {system} | {w['requests']:,} | {w['failed']:,} | "
                f"{w['p99_ms_before']} | {w['p50_ms']} | "
                f"{w['p99_ms']} | {w['max_ms']} | {w['all_served_again_after_s']} s | "
                f"{w['hung_for_the_timeout']} ({w['hung_max_per_connection']}) |"
            )
    lines += [
        "",
        *(f"![failover](results/{plot})" for plot in plots if plot.endswith("_failover.png")),
        "",
    ]
    return lines


def render_staleness(stale: dict[str, Any], plots: list[str]) -> list[str]:
    lines = [
        "### 3. Staleness is bounded and visible",
        "",
        f"Node {stale['killed_node']} killed; node {stale['throttled_node']}'s Spark JVM stopped "
        f"(SIGSTOP) for {stale['throttled_for_s']} s, so it is the only live replica of "
        f"partitions {stale['partitions']} and falls behind while {stale['keys']} keys there are "
        "written 40 times a second. Reads of those keys cycle through the budgets. True "
        "staleness of an answer: how long before it arrived the oldest write to that key it "
        "does not show was made (taken before `produce()`, so it errs against kroute).",
        "",
        "| budget (x-kroute-max-lag-ms) | requests | answered | 503 | availability | answers beyond the budget | max true staleness ms |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for budget, row in stale["per_budget_ms"].items():
        lines.append(
            f"| {budget} | {row['requests']} | {row['answered']} | {row['refused_503']} | "
            f"{row['availability']:.0%} | **{row['beyond_budget']}** | "
            f"{row['max_true_staleness_ms']} |"
        )
    lines += [
        "",
        *(f"![staleness](results/{plot})" for plot in plots if plot.endswith("_staleness.png")),
        "",
    ]
    return lines


def render_restart(restart_f: dict[str, Any]) -> list[str]:
    lines = [
        "### 4. Restart without restore",
        "",
        "| restart | written to its partitions while down (N) | records re-read | beyond N | "
        "records in its partitions | ready after | caught up after |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, row in restart_f.items():
        lines.append(
            f"| {mode} | {row['records_written_while_down']:,} | {row['records_reread']:,} | "
            f"{row['reread_beyond_missed']:,} | {row['partition_records_total']:,} | "
            f"{row['ready_s']} s | {row['caught_up_s']} s |"
        )
    return [*lines, "", "Times are from starting the process (Spark's start-up included).", ""]


def render_freshness(fresh: dict[str, Any]) -> list[str]:
    return [
        "### 5. Freshness",
        "",
        f"A new key every {1000 // fresh['produce_rate_per_s']} ms; time from `produce()` until "
        f"a GET through the proxy answers 200: p50 **{fresh['p50_ms']} ms**, p99 "
        f"**{fresh['p99_ms']} ms**, max {fresh['max_ms']} ms over {fresh['samples']} keys "
        f"({fresh['never_visible']} never visible).",
        "",
    ]


def render_resources(resources: dict[str, Any]) -> list[str]:
    lines = [
        "### CPU and memory per phase",
        "",
        "| phase | " + " | ".join(RESOURCE_COMPONENTS) + " |",
        "|---|" + "---:|" * len(RESOURCE_COMPONENTS),
    ]
    for phase, per in resources.items():
        cells = [
            f"{per[c]['cores']:.2f} / {per[c]['rss_max_mb']:.0f}" if c in per else "-"
            for c in RESOURCE_COMPONENTS
        ]
        lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    lines.append("\nEach cell: CPU cores used on average / largest resident MB (process trees).")
    return lines


HOP_LAYOUTS = {
    "shared_cores": "Everything on every core (the proxy's CPU comes out of the nodes' share)",
    "isolated_cores": "The cluster (nodes, broker, redis-server) on CPU {cluster}, the front "
    "(wrk, nginx, the proxies) on CPU {front}: each tier on cores of its own, as in a deployment",
}


def render_hop(hop: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for layout, title in HOP_LAYOUTS.items():
        if layout not in hop:
            continue
        rows = hop[layout]
        cpus = {tier: ", ".join(map(str, ids)) for tier, ids in rows.get("cpus", {}).items()}
        lines += [
            "",
            f"**{title.format(cluster=cpus.get('cluster'), front=cpus.get('front'))}.**",
            "",
            "| keys | system | requests/s | p50 ms | p99 ms | needed a hop | non-2xx | CPU cores: nodes / front | nodes' CPU µs per request |",
            "|---|---|---:|---:|---:|---:|---:|---|---:|",
        ]  # fmt: skip
        for distribution in ("zipf", "uniform"):
            for system in ("direct", "nginx", "kroute"):
                lines.append(hop_row(distribution, system, rows[distribution][system]))
        lines.append(
            "\nShare of kroute's requests served by its C path: "
            + ", ".join(f"{d} {rows[d]['kroute']['c_path_share']:.0%}" for d in ("zipf", "uniform"))
            + " (the rest took the Python path)."
        )
        for distribution in ("zipf", "uniform"):
            r = rows[distribution]["ratios"]
            lines.append(
                f"\n{distribution}: kroute/nginx throughput **{r['kroute_vs_nginx_rps']}x**, p99 "
                f"**{r['kroute_vs_nginx_p99']}x**; kroute/direct throughput "
                f"**{r['kroute_vs_direct_rps']}x** (goal >= 1.5x, p99 below nginx, within 25% of "
                f"direct: {'met' if rows[distribution]['goal_met'] else 'not met'})."
            )
    return [*lines, ""]


def hop_row(distribution: str, system: str, row: dict[str, Any]) -> str:
    front = row["cpu_cores"].get("proxy" if system == "kroute" else "nginx", 0.0)
    front_text = "-" if system == "direct" else f"{front:.2f}"
    return (
        f"| {distribution} | {system} | {row['rps']:,} | {row['p50_ms']:.2f} | "
        f"{row['p99_ms']:.1f} | {row['hop_share']:.0%} | {row['non_2xx']} | "
        f"{row['nodes_cpu_cores']:.2f} / {front_text} | {row['nodes_cpu_us_per_request']} |"
    )


RESOURCE_COMPONENTS = (
    "proxy", "proxy-actives-only", "node-a", "node-b", "node-c", "nginx", "redis", "broker",
)  # fmt: skip


def render_soak(soak_f: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "### Long run",
        "",
        f"{soak_f['minutes']:g} minutes of {soak_f['rate']:g} lookups/s (Zipf keys) and 20 "
        f"writes/s, no faults: {soak_f['requests']:,} requests, {soak_f['failed']} failed; p99 "
        f"per minute (ms): {soak_f['p99_ms_per_minute']}.",
        "",
        "| process tree | first minute MB | last minute MB | per minute MB |",
        "|---|---:|---:|---|",
    ]
    for component, m in soak_f["memory"].items():
        lines.append(
            f"| {component} | {m['first_minute_mb']} | {m['last_minute_mb']} | "
            f"{m['per_minute_mb']} |"
        )
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=8, help="per wrk measurement")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--connections", type=int, default=48)
    parser.add_argument("--rate", type=float, default=300, help="steady requests/s per proxy")
    parser.add_argument("--soak-minutes", type=float, default=0)
    parser.add_argument("--max-minutes", type=float, default=45, help="stop everything after")
    parser.add_argument(
        "--only",
        type=lambda text: [part for part in text.split(",") if part],
        default=list(PARTS),
        help=f"the claims to run, comma-separated, of {','.join(PARTS)} (default: all); a "
        "partial run writes results/system_<parts>.json and its own RESULTS.md section",
    )
    parser.add_argument("--no-write", action="store_true", help="print only (smoke runs)")
    args = parser.parse_args(argv)
    unknown = set(args.only) - set(PARTS)
    if unknown:
        parser.error(f"--only: unknown claims {sorted(unknown)}; known: {', '.join(PARTS)}")
    args.parts = [part for part in PARTS if part in args.only]
    args.name = "system" if args.parts == list(PARTS) else "system_" + "_".join(args.parts)
    return args


def run_claims(bench: Bench, args: argparse.Namespace, figures: dict[str, Any]) -> None:
    parts = args.parts
    if "hop" in parts:
        say("1. no extra hop ...")
        figures["1_no_extra_hop"] = no_extra_hop(bench, args.seconds, args.rounds, args.connections)
    if "freshness" in parts:
        say("5. freshness ...")
        figures["5_freshness"] = freshness(bench, samples=400)
    for part, fault in (("kill-9", "kill-9"), ("sigstop", "sigstop-10s")):
        if part in parts:
            say(f"2. reads survive failures: {fault} ...")
            survived = figures.setdefault("2_reads_survive_failures", {})
            survived[fault] = survive(bench, fault, args.rate, 12)
    if "staleness" in parts:
        say("3. staleness ...")
        figures["3_staleness"] = staleness(bench, seconds=25, rate=200)
    if "restart" in parts:
        say("4. restart without restore ...")
        figures["4_restart_without_restore"] = restart(bench, records=20_000)
    if args.soak_minutes:
        say(f"long run: {args.soak_minutes:g} minutes ...")
        figures["soak"] = soak(bench, args.soak_minutes, args.rate)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for tool in ("wrk", "nginx"):
        if shutil.which(tool) is None:
            print(f"{tool} is needed: apt-get install wrk nginx-light", file=sys.stderr)
            return 2
    command = "python -m benchmarks.system_bench " + " ".join(argv or sys.argv[1:])

    def out_of_time(*_: object) -> None:
        raise TimeoutError(f"the benchmark ran over --max-minutes {args.max_minutes:g}")

    signal.signal(signal.SIGALRM, out_of_time)
    signal.alarm(int((args.max_minutes + args.soak_minutes) * 60))
    workdir = Path(tempfile.mkdtemp(prefix="kroute-system-bench-"))
    figures: dict[str, Any] = {
        "name": args.name,
        "parts": args.parts,
        "machine": machine_notes(),
        "revision": git_revision(),
        "date": time.strftime("%Y-%m-%d"),
        "command": command.strip(),
        "settings": {
            "seconds": args.seconds,
            "rounds": args.rounds,
            "connections": args.connections,
            "rate_per_proxy": args.rate,
            "partitions": PARTITIONS,
            "customers": CUSTOMERS,
            "grace_period_s": GRACE_S,
        },
    }
    try:
        with EmbeddedServices(workdir) as services:
            bench = start_bench(services, workdir)
            run_claims(bench, args, figures)
            bench.sampler.stop()
            figures["resources"] = {
                phase: per
                for phase, per in bench.sampler.summary().items()
                if not phase.startswith("hop/") or phase.endswith("/0")
            }
    finally:
        signal.alarm(0)
        shutil.rmtree(workdir, ignore_errors=True)
    if args.no_write:
        print(render(figures, figures["command"], []))
        return 0
    plots = plot(figures)
    write_json(args.name, figures)
    write_section(args.name, render(figures, figures["command"], plots))
    say(json.dumps({k: v for k, v in figures.items() if k != "resources"}, indent=1)[:4000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
