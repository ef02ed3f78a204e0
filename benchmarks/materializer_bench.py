"""One materializer node: ingest rate, lookups while ingesting, produce-to-visible freshness.

Everything runs on this machine (2 cores shared by the broker, the node's JVM and Python
workers, the producer and wrk), so the figures are for comparing runs, not absolute capacity.

1. ingest: with the node running and ready, produce N small JSON records to 6 partitions as
   fast as possible; records/s = N / (time from the first produce to the node's checkpoints
   reaching the end offsets);
2. lookups: wrk with random keys for a fixed time, first with nothing to ingest (baseline),
   then while a second batch of N records is ingested; requests/s and latency percentiles;
3. freshness: a record every 20 ms with a unique key; the time from produce until a GET for
   that key answers 200, p50/p99.

Usage: .venv/bin/python -m benchmarks.materializer_bench [--records 300000] [--seconds 8]
Needs wrk (apt-get install wrk).

With --spark-cluster it measures instead a node on a Spark standalone cluster (a master and one
worker started from the pyspark package, kroute/spark_cluster.py) against a node on local[*]:
the same records on two identical topics, one after the other in one run, ingest records/s and
freshness as above. The figures go under "spark_cluster" in results/materializer.json (the
other keys are kept) and in their own section of RESULTS.md. --dry-run writes nothing (smoke
runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from confluent_kafka import Producer

from benchmarks import wrk
from benchmarks.results_file import (
    RESULTS_JSON_DIR,
    git_revision,
    machine_notes,
    write_json,
    write_section,
)
from kroute.embedded import EmbeddedServices
from kroute.nodes import NodeHandle, start_node
from kroute.spark_cluster import SparkStandaloneCluster, spark_standalone_cluster
from kroute.topics import create_topics
from materializer.kafka_offsets import end_offsets

PARTITIONS = 6
KEYS = 50_000


def produce(bootstrap: str, topic: str, count: int, start: int = 0) -> float:
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "partitioner": "murmur2_random",
            "linger.ms": 20,
            "batch.num.messages": 10_000,
            "queue.buffering.max.messages": 2_000_000,
        }
    )
    began = time.perf_counter()
    for i in range(start, start + count):
        value = b'{"customer":%d,"booking":%d,"amount":%d}' % (i % KEYS, i, i % 977)
        producer.produce(topic, key=b"customer-%d" % (i % KEYS), value=value)
        if i % 50_000 == 0:
            producer.poll(0)
    producer.flush(120)
    return time.perf_counter() - began


def ends(bootstrap: str, topic: str) -> dict[int, int]:
    return asyncio.run(end_offsets(bootstrap, topic, range(PARTITIONS)))


def measure_ingest(
    node: NodeHandle, bootstrap: str, topic: str, count: int, start: int
) -> dict[str, float]:
    began = time.perf_counter()
    produce_s = produce(bootstrap, topic, count, start)
    node.wait_caught_up(ends(bootstrap, topic), timeout_s=600)
    elapsed = time.perf_counter() - began
    return {
        "records": count,
        "seconds": round(elapsed, 2),
        "produce_seconds": round(produce_s, 2),
        "records_per_s": round(count / elapsed),
    }


def run_wrk(url: str, seconds: int, connections: int = 8) -> dict[str, float]:
    return wrk.run_wrk(url, seconds, connections=connections, keys=KEYS)


def lookups_while_ingesting(
    node: NodeHandle, bootstrap: str, topic: str, count: int, start: int, seconds: int
) -> tuple[dict[str, float], dict[str, float]]:
    result: dict[str, Any] = {}
    feeder = threading.Thread(
        target=lambda: result.update(ingest=measure_ingest(node, bootstrap, topic, count, start))
    )
    feeder.start()
    time.sleep(0.5)  # let the first micro-batches start
    lookups = run_wrk(node.url, seconds)
    feeder.join()
    return lookups, result["ingest"]


def measure_freshness(node: NodeHandle, bootstrap: str, topic: str, samples: int) -> list[float]:
    producer = Producer(
        {"bootstrap.servers": bootstrap, "partitioner": "murmur2_random", "linger.ms": 0}
    )
    client = httpx.Client(timeout=5, trust_env=False)
    pending: dict[str, float] = {}
    latencies: list[float] = []
    next_send = time.perf_counter()
    sent = 0
    deadline = time.perf_counter() + samples * 0.02 + 30
    while (sent < samples or pending) and time.perf_counter() < deadline:
        now = time.perf_counter()
        if sent < samples and now >= next_send:
            key = f"fresh-{sent}-{int(now * 1e6)}"
            producer.produce(topic, key=key.encode(), value=b'{"fresh":true}')
            producer.poll(0)
            pending[key] = time.perf_counter()
            sent += 1
            next_send += 0.02
        for key, produced_at in list(pending.items()):
            if client.get(f"{node.url}/stores/customers/keys/{key}").status_code == 200:
                latencies.append((time.perf_counter() - produced_at) * 1000)
                del pending[key]
        time.sleep(0.002)
    producer.flush(10)
    client.close()
    return latencies


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def freshness_figures(fresh: list[float]) -> dict[str, float]:
    return {
        "samples": len(fresh),
        "p50_ms": round(statistics.median(fresh), 1),
        "p99_ms": round(percentile(fresh, 0.99), 1),
        "max_ms": round(max(fresh), 1),
    }


def command_line(argv: list[str] | None) -> str:
    arguments = sys.argv[1:] if argv is None else argv
    return ("python -m benchmarks.materializer_bench " + " ".join(arguments)).strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--records", type=int, default=300_000, help="records per ingest phase (<= 2,000,000)"
    )
    parser.add_argument(
        "--seconds", type=int, default=8, help="wrk duration per lookup phase (<= 60)"
    )
    parser.add_argument("--freshness-samples", type=int, default=300, help="<= 3000")
    parser.add_argument(
        "--spark-cluster",
        action="store_true",
        help="measure a node on a Spark standalone cluster against local[*] (no wrk needed)",
    )
    parser.add_argument(
        "--cluster-cores", type=int, default=1, help="spark.cores.max of the cluster node (1-2)"
    )
    parser.add_argument("--dry-run", action="store_true", help="print the figures only")
    args = parser.parse_args(argv)
    if not (
        1000 <= args.records <= 2_000_000
        and 1 <= args.seconds <= 60
        and 10 <= args.freshness_samples <= 3000
        and 1 <= args.cluster_cores <= 2
    ):
        parser.error("parameters out of range")
    if args.spark_cluster:
        return spark_cluster_vs_local(args, command_line(argv))
    if shutil.which("wrk") is None:
        parser.error("wrk is not installed: apt-get install wrk")

    workdir = Path(tempfile.mkdtemp(prefix="kroute-bench-"))
    with EmbeddedServices(workdir) as services:
        bootstrap = services.start_broker().bootstrap_servers
        topic = "bookings"
        create_topics(bootstrap, {topic: PARTITIONS})
        produce(bootstrap, topic, KEYS)  # every key exists before lookups start
        print(f"starting a node (Spark) in {workdir} ...", flush=True)
        node = start_node(
            services, bootstrap, topic, workdir / "node", store="customers", log_level="warning"
        )
        node.wait_caught_up(ends(bootstrap, topic), timeout_s=600)

        print("ingest ...", flush=True)
        ingest = measure_ingest(node, bootstrap, topic, args.records, KEYS)
        print(f"  {ingest}", flush=True)
        print("lookups, idle (baseline) ...", flush=True)
        idle = run_wrk(node.url, args.seconds)
        print(f"  {idle}", flush=True)
        print("lookups while ingesting ...", flush=True)
        busy, busy_ingest = lookups_while_ingesting(
            node, bootstrap, topic, args.records, KEYS + args.records, args.seconds
        )
        print(f"  {busy}; ingest meanwhile {busy_ingest}", flush=True)
        print("freshness ...", flush=True)
        fresh = measure_freshness(node, bootstrap, topic, args.freshness_samples)
        batches = node.metadata()["pipeline"].get("last_batch")
        node.process.stop()
        node.close()

    freshness = freshness_figures(fresh)
    print(f"  {freshness}")
    command = command_line(argv)
    previous = read_results()
    figures = {
        "records_per_s": ingest["records_per_s"],
        "lookup_rps": busy["rps"],
        "freshness_p50_ms": freshness["p50_ms"],
        "freshness_p99_ms": freshness["p99_ms"],
        "ingest": ingest,
        "lookups_idle": idle,
        "lookups_while_ingesting": busy,
        "ingest_while_serving": busy_ingest,
        "freshness": freshness,
        "last_batch": batches,
        "command": command,
        "machine": machine_notes(),
    }
    if "spark_cluster" in previous:  # measured by its own mode: kept
        figures["spark_cluster"] = previous["spark_cluster"]
    if args.dry_run:
        print(json.dumps(figures, indent=2))
        return 0
    write_json("materializer", figures)
    write_section("materializer", render(figures))
    return 0


def read_results() -> dict[str, Any]:
    path = RESULTS_JSON_DIR / "materializer.json"
    return dict(json.loads(path.read_text())) if path.exists() else {}


# -- a node on a Spark standalone cluster against local[*] ----------------------------------------


def measure_node(
    services: EmbeddedServices,
    bootstrap: str,
    workdir: Path,
    mode: str,
    records: int,
    samples: int,
    **node_settings: str,
) -> dict[str, Any]:
    """One node on a topic of its own with the same records as every other mode: caught up on
    KEYS seed records, then ingest of `records` more, then freshness."""
    topic = f"bookings-{mode}"
    create_topics(bootstrap, {topic: PARTITIONS})
    produce(bootstrap, topic, KEYS)
    print(f"[{mode}] starting a node ({node_settings.get('spark_master')}) ...", flush=True)
    started = time.perf_counter()
    node = start_node(
        services,
        bootstrap,
        topic,
        workdir / f"node-{mode}",
        name=f"node-{mode}",
        store="customers",
        log_level="warning",
        wait_ready=False,
        **node_settings,
    )
    try:
        node.wait_caught_up(ends(bootstrap, topic), timeout_s=600)
        ready_s = time.perf_counter() - started
        print(f"[{mode}] ingest ...", flush=True)
        ingest = measure_ingest(node, bootstrap, topic, records, KEYS)
        print(f"[{mode}]   {ingest}", flush=True)
        print(f"[{mode}] freshness ...", flush=True)
        freshness = freshness_figures(measure_freshness(node, bootstrap, topic, samples))
        print(f"[{mode}]   {freshness}", flush=True)
        last_batch = node.metadata()["pipeline"].get("last_batch")
    finally:
        node.process.stop()
        node.close()
    return {
        "records_per_s": ingest["records_per_s"],
        "freshness_p50_ms": freshness["p50_ms"],
        "freshness_p99_ms": freshness["p99_ms"],
        "seed_caught_up_s": round(ready_s, 1),  # Spark's start-up and KEYS seed records
        "ingest": ingest,
        "freshness": freshness,
        "last_batch": last_batch,
    }


def spark_cluster_vs_local(args: argparse.Namespace, command: str) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="kroute-bench-"))
    with (
        EmbeddedServices(workdir) as services,
        spark_standalone_cluster(
            worker_cores=2, worker_memory="1g", log_dir=workdir / "spark"
        ) as spark,
    ):
        bootstrap = services.start_broker().bootstrap_servers
        local = measure_node(
            services, bootstrap, workdir, "local", args.records, args.freshness_samples,
            spark_master="local[*]",
        )  # fmt: skip
        cluster_conf = {
            "spark.cores.max": str(args.cluster_cores),
            "spark.executor.memory": "768m",
        }
        cluster = measure_node(
            services, bootstrap, workdir, "cluster", args.records, args.freshness_samples,
            spark_master=spark.master_url, spark_conf=json.dumps(cluster_conf),
        )  # fmt: skip
        topology = cluster_topology(spark, cluster_conf)
    figures = {
        "local": local,
        "cluster": cluster,
        "cluster_vs_local_records_per_s": round(
            cluster["records_per_s"] / local["records_per_s"], 2
        ),
        "cluster_vs_local_freshness_p99": round(
            cluster["freshness_p99_ms"] / local["freshness_p99_ms"], 2
        ),
        "topology": topology,
        "command": command,
        "revision": git_revision(),
        "machine": machine_notes(),
    }
    print(json.dumps(figures, indent=2), flush=True)
    if args.dry_run:
        return 0
    # The other figures keep the revision they measured (write_json would stamp today's).
    previous = {"revision": "not recorded", **read_results()}
    write_json("materializer", {**previous, "spark_cluster": figures})
    write_section("materializer-spark-cluster", render_spark_cluster(figures))
    return 0


def cluster_topology(spark: SparkStandaloneCluster, conf: dict[str, str]) -> str:
    workers = (spark.state() or {}).get("workers", [])
    return (
        f"standalone master + {len(workers)} worker ({spark.worker_cores} cores, "
        f"{spark.worker_memory}) on this machine; the node's application: {json.dumps(conf)}"
    )


def render_spark_cluster(f: dict[str, Any]) -> str:
    local, cluster = f["local"], f["cluster"]

    def row(name: str, node: dict[str, Any]) -> str:
        fresh = node["freshness"]
        return (
            f"| {name} | {node['records_per_s']:,} | p50 {fresh['p50_ms']} ms, p99 "
            f"{fresh['p99_ms']} ms, max {fresh['max_ms']} ms | {node['seed_caught_up_s']} s |"
        )

    return "\n".join(
        [
            "## Materializer: a node on a Spark standalone cluster against local[*]",
            "",
            f"Command: `{f['command']}` (revision {f['revision']}; {f['machine']}). The same "
            f"records ({local['ingest']['records']:,} small JSON records after {KEYS:,} seed "
            "records, 6 partitions) on two identical topics, one node at a time; "
            f"{f['topology']}. Everything shares the machine's cores, so the cluster's "
            "executor competes with the node for the same CPU: this measures the cost of the "
            "cluster's extra hop (executor to driver), not the gain of more machines.",
            "",
            "| Spark | records/s | freshness, produce → visible through GET | start + seed caught up |",
            "|---|---|---|---|",
            row("local[*] (in the node)", local),
            row("standalone cluster", cluster),
            "",
            f"Cluster / local: {f['cluster_vs_local_records_per_s']}x records/s, "
            f"{f['cluster_vs_local_freshness_p99']}x freshness p99.",
        ]
    )


def render(f: dict[str, Any]) -> str:
    idle, busy = f["lookups_idle"], f["lookups_while_ingesting"]
    return "\n".join(
        [
            "## Materializer: one node",
            "",
            f"Command: `{f['command']}` (revision {git_revision()}; {machine_notes()}). One node "
            "(local[*] Spark, 1 task per micro-batch, 20,000 records per partition per batch), Tansu, "
            "the producer and wrk (1 thread, 8 connections) share the 2 cores.",
            "",
            "| measure | value |",
            "|---|---|",
            f"| records materialized per second (6 partitions, {f['ingest']['records']:,} small JSON records) | {f['records_per_s']:,} |",
            f"| ... of which producing took | {f['ingest']['produce_seconds']} s of {f['ingest']['seconds']} s |",
            f"| lookups/s, idle (baseline) | {idle['rps']:,} (p50 {idle['p50_ms']} ms, p99 {idle['p99_ms']} ms) |",
            f"| lookups/s while ingesting | {busy['rps']:,} (p50 {busy['p50_ms']} ms, p99 {busy['p99_ms']} ms) |",
            f"| ratio while ingesting / idle | {busy['rps'] / idle['rps']:.2f}x throughput, {busy['p99_ms'] / idle['p99_ms']:.1f}x p99 |",
            f"| ingest rate meanwhile | {f['ingest_while_serving']['records_per_s']:,} records/s |",
            f"| freshness, produce → visible through GET ({f['freshness']['samples']} records, one per 20 ms) | p50 {f['freshness_p50_ms']} ms, p99 {f['freshness_p99_ms']} ms, max {f['freshness']['max_ms']} ms |",
            "",
            "Where the time goes (measured while building the node, same machine):",
            "- Spark's fixed cost per micro-batch dominates small batches. Each Python data-source task costs ~65 ms: "
            "one task per Kafka partition (6 tasks) took ~500 ms per batch, grouping all partitions into 1 task ~140 ms. "
            "Hence `KROUTE_TASKS_PER_BATCH=1` by default.",
            "- Freshness is about one batch waiting for the current one to end plus its own duration (~1.5 batches). "
            "What would remove most of it: applying the default KTable transform straight from a Kafka consumer in the "
            "node (no micro-batch), keeping Spark for custom transforms.",
            "- What one micro-batch costs a node under a trickle of writes (20/s, one node alone, per-process and per-thread "
            "CPU, py-spy, strace): 1.1 cores before issue 7's changes (JVM 0.71, of which the C2 JIT compiler ~0.35; Python "
            "worker 0.41, of which 68% re-reading pyspark.zip and the spark-core jar on every task, CPython gh-103200), "
            "~0.3 cores after (C1 only, archives re-read only when changed, no readlink child processes, a 500 ms "
            "trigger interval). Idle, the broker went from 0.15 to 0.005 cores (consumers unassigned between batches, "
            "fewer offset probes).",
            "- Lookup p99 rises while ingesting because RocksDB writes hold Python's GIL (~0.3 µs per record, measured) "
            "and the sink's per-record loop shares the interpreter with the HTTP server. Serving from a separate "
            "process on a RocksDB secondary instance would remove that.",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
