"""What the proxy's forwarding headers cost a node: CPU per lookup with and without them.

Issue 7 found nodes spending more CPU per lookup behind the proxy (~59 µs) than when asked
directly (~46 µs). One candidate is the four lines the proxy adds to every forwarded request
(x-forwarded-for, x-forwarded-proto, x-forwarded-host, x-request-id), each parsed by the node's
uvicorn. This starts one real node (Tansu, Spark, 50,000 keys), asks it directly with wrk, in
interleaved rounds with and without those lines, and divides the CPU time of the node's whole
process tree by the lookups answered.

Usage: .venv/bin/python -m benchmarks.forwarded_headers_bench [--seconds 6] [--rounds 3]
Needs wrk (apt-get install wrk).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import wrk
from benchmarks.materializer_bench import KEYS, PARTITIONS, produce
from benchmarks.results_file import git_revision, machine_notes, write_json, write_section
from benchmarks.sampling import cpu_and_rss, process_tree
from kroute.embedded import EmbeddedServices
from kroute.nodes import start_node
from kroute.topics import create_topics

# What proxy/http.py and proxy/_hotpath.c add to a forwarded request (typical values).
FORWARDING = (
    "x-forwarded-for: 127.0.0.1",
    "x-forwarded-proto: http",
    "x-forwarded-host: 127.0.0.1:8080",
    "x-request-id: 7f3a9c0e5b1d2a4f",
)


def tree_cpu_s(pid: int) -> float:
    return sum(cpu_and_rss(p)[0] for p in process_tree(pid))


def measure(url: str, pid: int, seconds: int, headers: tuple[str, ...]) -> dict[str, Any]:
    before = tree_cpu_s(pid)
    figures = wrk.run_wrk(url, seconds, connections=16, keys=KEYS, headers=headers)
    used = tree_cpu_s(pid) - before
    answered = figures["rps"] * seconds
    return {"rps": figures["rps"], "cpu_us_per_lookup": round(used / answered * 1e6, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if shutil.which("wrk") is None:
        print("wrk is needed: apt-get install wrk", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="kroute-headers-bench-"))
    rounds: list[dict[str, Any]] = []
    try:
        with EmbeddedServices(workdir) as services:
            broker = services.start_broker()
            create_topics(broker.bootstrap_servers, {"customers": PARTITIONS})
            produce(broker.bootstrap_servers, "customers", KEYS)
            node = start_node(
                services,
                broker.bootstrap_servers,
                "customers",
                workdir / "node",
                name="node",
                store="customers",
                spark_master="local[1]",
                log_level="warning",
            )
            node.wait_ready(timeout_s=240)
            for _ in range(args.rounds):  # interleaved: the machine's noise hits both alike
                rounds.append(
                    {
                        "direct": measure(node.url, node.process.pid, args.seconds, ()),
                        "with_forwarding_headers": measure(
                            node.url, node.process.pid, args.seconds, FORWARDING
                        ),
                    }
                )
            node.process.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    figures = summarize(rounds)
    figures.update(
        command=(
            "python -m benchmarks.forwarded_headers_bench " + " ".join(argv or sys.argv[1:])
        ).strip(),
        date=time.strftime("%Y-%m-%d"),
        revision=git_revision(),
        machine=machine_notes(),
        rounds=rounds,
    )
    write_json("forwarded_headers", figures)
    write_section("forwarded_headers", render(figures))
    print(render(figures))
    return 0


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    def median(kind: str, figure: str) -> float:
        return round(statistics.median(r[kind][figure] for r in rounds), 1)

    direct = median("direct", "cpu_us_per_lookup")
    headers = median("with_forwarding_headers", "cpu_us_per_lookup")
    return {
        "direct_cpu_us": direct,
        "with_headers_cpu_us": headers,
        "headers_cost_us": round(headers - direct, 1),
        "direct_rps": median("direct", "rps"),
        "with_headers_rps": median("with_forwarding_headers", "rps"),
    }


def render(f: dict[str, Any]) -> str:
    return "\n".join(
        [
            "## What the forwarding headers cost a node",
            "",
            f"`{f['command']}` — {f['date']}, revision {f['revision']}. {f['machine']}",
            "",
            "One node asked directly by wrk (16 connections, random keys), interleaved rounds "
            "with and without the four lines the proxy adds (x-forwarded-for, -proto, -host, "
            "x-request-id); CPU of the node's whole process tree per lookup, medians:",
            "",
            "| requests | lookups/s | node CPU µs per lookup |",
            "|---|---:|---:|",
            f"| plain | {f['direct_rps']:,.0f} | {f['direct_cpu_us']} |",
            f"| with the forwarding headers | {f['with_headers_rps']:,.0f} | "
            f"{f['with_headers_cpu_us']} |",
            "",
            f"The headers cost the node {f['headers_cost_us']} µs per lookup.",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
