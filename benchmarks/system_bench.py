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
Needs wrk and nginx (apt-get install wrk nginx-light). This module is the command line; the
cluster, each claim and the report are modules of benchmarks/system/.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.results_file import git_revision, machine_notes, write_json, write_section
from benchmarks.system.freshness import freshness
from benchmarks.system.harness import CUSTOMERS, GRACE_S, PARTITIONS, Bench, say, start_bench
from benchmarks.system.hop import no_extra_hop
from benchmarks.system.report import plot, render
from benchmarks.system.restart import restart
from benchmarks.system.soak import soak
from benchmarks.system.staleness import staleness
from benchmarks.system.survive import survive
from kroute.embedded import EmbeddedServices

# The claims, in the order they run (`--only` picks some): the failures claim is two runs.
PARTS = ("hop", "freshness", "kill-9", "sigstop", "staleness", "restart")


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
