"""Soak: steady lookups and writes for a bounded time, with a node killed -9 every few minutes.

One real cluster (Tansu, redis-server, three Spark materializer nodes with one standby per
partition, the proxy), started the same way as `benchmarks/system_bench.py`. The proxy gets a
steady rate of lookups (Zipf keys) while a writer keeps updating keys. Every `--kill-every-s`
one node in turn is killed -9 (with its Spark JVM), left dead for `--down-s` (inside the grace
period, so its standbys answer and nothing moves), then restarted on its store; the next kill
waits until every partition has a caught-up active and standby again, so a replica is always
inside the budget.

Reported: requests and failures (goal: zero), per minute the requests, failures and p99, and the
resident memory of each process tree per minute (goal: flat; a restarted node's tree starts
again, so its minutes after the first kill are marked). Results go to `benchmarks/RESULTS.md`
(section `soak`) and `benchmarks/results/soak.json`.

Usage: .venv/bin/python -m benchmarks.soak_bench [--minutes 10] [--rate 300] [--kill-every-s 120]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.loadgen import failures, failures_by_status, percentile
from benchmarks.results_file import git_revision, machine_notes, write_json, write_section
from benchmarks.system.harness import (
    NODE_NAMES,
    Bench,
    SteadyWriter,
    key_samples,
    say,
    start_bench,
    steady_load,
)
from benchmarks.system.soak import per_minute
from kroute.cluster_harness import spark_jvm_pid
from kroute.embedded import EmbeddedServices

COMPONENTS = ("proxy", "node-a", "node-b", "node-c", "redis", "broker")


def kill_and_restart(bench: Bench, name: str, down_s: float) -> dict[str, Any]:
    """kill -9 node `name` and its JVM, wait `down_s`, restart it on its store, wait settled."""
    node = bench.nodes[name]
    jvm = spark_jvm_pid(node)
    killed_at = time.time()
    node.process.signal(signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(jvm, signal.SIGKILL)  # a vanished VM takes its JVM with it
    node.process.popen.wait(10)
    node.close()
    time.sleep(down_s)
    restarted_at = time.time()
    bench.start_node(name).wait_ready(timeout_s=240)
    bench.wait_settled(timeout_s=300)
    return {
        "node": name,
        "killed_at": killed_at,
        "restarted_at": restarted_at,
        "settled_after_s": round(time.time() - killed_at, 1),
    }


def memory_per_minute(bench: Bench, began_monotonic: float, minutes: int) -> dict[str, Any]:
    memory: dict[str, Any] = {}
    for component in COMPONENTS:
        sizes = [
            s.rss_bytes / 2**20
            for s in bench.sampler.samples
            if s.component == component and s.at >= began_monotonic
        ]
        memory[component] = {
            "per_minute_mb": bench.sampler.rss_per_minute(component, began_monotonic, minutes),
            "max_mb": round(max(sizes, default=0.0), 1),
        }
    return memory


def soak(bench: Bench, minutes: int, rate: float, kill_every_s: float, down_s: float) -> dict:
    keys = key_samples("zipf", 50_000)
    writes = SteadyWriter(bench.writer, key_samples("uniform", 5_000), 20).start()
    load = steady_load(bench.kroute, keys, rate, connections=16, timeout_s=10)
    kills = []
    victims = itertools.cycle(NODE_NAMES)
    began, began_monotonic = time.time(), time.monotonic()
    next_kill = began + kill_every_s
    try:
        while time.time() - began < minutes * 60:
            if time.time() >= next_kill and time.time() - began < minutes * 60 - down_s - 30:
                name = next(victims)
                say(f"  minute {(time.time() - began) / 60:.1f}: kill -9 node {name}")
                kills.append(kill_and_restart(bench, name, down_s))
                next_kill = max(next_kill + kill_every_s, time.time() + 10)
            time.sleep(1)
    finally:
        outcomes = load.stop()
        writes.stop()
    outcomes = [o for o in outcomes if o.sent_at - began < minutes * 60]
    failed = failures(outcomes)
    for kill in kills:
        kill["killed_at_s"] = round(kill.pop("killed_at") - began, 1)
        kill["restarted_at_s"] = round(kill.pop("restarted_at") - began, 1)
    return {
        "minutes": minutes,
        "rate": rate,
        "writes_per_s": 20,
        "kill_every_s": kill_every_s,
        "down_s": down_s,
        "requests": len(outcomes),
        "failed": len(failed),
        "failed_by_status": failures_by_status(outcomes),
        "p99_ms": percentile([o.latency_ms for o in outcomes], 0.99),
        "kills": kills,
        "per_minute": per_minute(outcomes, began, minutes),
        "memory": memory_per_minute(bench, began_monotonic, minutes),
    }


def render(f: dict[str, Any]) -> str:
    lines = [
        "## Soak: steady load with periodic node kills",
        "",
        f"`{f['command']}` — {f['date']}, revision {f['revision']}. {f['machine']}",
        "",
        f"{f['minutes']} minutes of {f['rate']:g} lookups/s (Zipf keys, 16 connections) through "
        f"the proxy and {f['writes_per_s']} writes/s; every {f['kill_every_s']:g} s one node in "
        f"turn killed -9 with its Spark JVM, restarted on its store after {f['down_s']:g} s. "
        f"**{f['requests']:,} requests, {f['failed']} failed** "
        f"({f['failed_by_status'] or 'none'}); overall p99 {f['p99_ms']} ms.",
        "",
        "Kills: "
        + (
            ", ".join(
                f"node {k['node']} at {k['killed_at_s']} s (every partition caught up again "
                f"{k['settled_after_s']} s later)"
                for k in f["kills"]
            )
            or "none"
        )
        + ".",
        "",
        "| minute | requests | failed | p50 ms | p99 ms |",
        "|---:|---:|---:|---:|---:|",
    ]
    for row in f["per_minute"]:
        lines.append(
            f"| {row['minute']} | {row['requests']:,} | {row['failed']} | {row['p50_ms']} | "
            f"{row['p99_ms']} |"
        )
    lines += [
        "",
        "Resident memory per process tree, mean per minute (MB; a node's tree includes its Spark "
        "JVM and Python workers and starts again when the node is restarted):",
        "",
        "| process tree | per minute | max |",
        "|---|---|---:|",
    ]
    for component, m in f["memory"].items():
        lines.append(f"| {component} | {m['per_minute_mb']} | {m['max_mb']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=int, default=10)
    parser.add_argument("--rate", type=float, default=300, help="lookups/s through the proxy")
    parser.add_argument("--kill-every-s", type=float, default=120)
    parser.add_argument(
        "--down-s", type=float, default=20, help="how long a killed node stays down"
    )
    args = parser.parse_args(argv)
    command = "python -m benchmarks.soak_bench " + " ".join(argv or sys.argv[1:])

    def out_of_time(*_: object) -> None:
        raise TimeoutError("the soak ran far over its --minutes")

    signal.signal(signal.SIGALRM, out_of_time)
    signal.alarm(int(args.minutes * 60 + 15 * 60))  # plus start-up and the last settle
    workdir = Path(tempfile.mkdtemp(prefix="kroute-soak-"))
    try:
        with EmbeddedServices(workdir) as services:
            bench = start_bench(services, workdir)
            say(f"soak: {args.minutes} minutes ...")
            figures = soak(bench, args.minutes, args.rate, args.kill_every_s, args.down_s)
            bench.sampler.stop()
    finally:
        signal.alarm(0)
        shutil.rmtree(workdir, ignore_errors=True)
    figures.update(
        command=command.strip(),
        date=time.strftime("%Y-%m-%d"),
        revision=git_revision(),
        machine=machine_notes(),
    )
    write_json("soak", figures)
    write_section("soak", render(figures))
    say(json.dumps({k: v for k, v in figures.items() if k != "memory"}, indent=1)[:3000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
