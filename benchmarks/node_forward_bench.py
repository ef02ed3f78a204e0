"""What a node spends to forward a lookup it does not own: CPU per forwarded request.

The "nginx round robin + the node forwards" baseline of the system benchmark (claim 1) is only
fair if the nodes forward with an efficient client. This measures the node's forwarding alone,
without Spark or a broker: an owner node (materializer.server over a real RocksDB store holding
every key) and forwarding nodes that host no partition and pass every lookup on to the owner,
one with materializer.forwarding.Forwarder (aiohttp, pooled) and one with the httpx.AsyncClient
it used before, each served by uvicorn (httptools, uvloop) in a process of its own, as a node
is. wrk asks each in interleaved rounds; the CPU (user + kernel) of the process asked, divided
by the requests answered, is its cost per request. `direct` asks the owner itself: the cost of
a lookup without a hop.

Usage: .venv/bin/python -m benchmarks.node_forward_bench [--seconds 5] [--rounds 3]
Needs wrk (apt-get install wrk).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from benchmarks import wrk
from benchmarks.results_file import git_revision, machine_notes, write_json, write_section
from benchmarks.sampling import user_and_kernel_s
from common.clock import now_ms
from kroute.embedded import free_port
from materializer.forwarding import FORWARDED_BY, Forwarded, Forwarder
from materializer.hosting import HostedPartitions
from materializer.lag import LagTracker
from materializer.pipeline import Stall
from materializer.server import NodeApp, NodeState
from materializer.sink import IngestStats
from materializer.store import Row, Store
from partitioner import KeyPartitioner

PARTITIONS = 6
KEYS = 20_000
CONNECTIONS = 16
SYSTEMS = ("direct", "httpx", "aiohttp")


class HttpxForwarder:
    """The forwarder as it was before issue 24 (httpx.AsyncClient), kept for the comparison."""

    def __init__(self, node_id: str, timeout_s: float = 2.0) -> None:
        self._node_id = node_id
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 0.5)),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=16),
            trust_env=False,
        )

    async def forward(
        self, base_url: str, path: str, bounds: Mapping[str, str] | None = None
    ) -> Forwarded:
        sent = {**(bounds or {}), FORWARDED_BY: self._node_id}
        response = await self._client.get(base_url + path, headers=sent)
        headers = [
            (name.encode(), value.encode())
            for name, value in response.headers.items()
            if name.startswith("x-kroute-")
        ]
        headers.append((FORWARDED_BY.encode(), self._node_id.encode()))
        return Forwarded(response.status_code, response.content, headers)

    async def close(self) -> None:
        await self._client.aclose()


# -- the served nodes (run as `--serve ROLE`, one process each) --------------------------------


@dataclass
class _RunningNode:
    """What the HTTP app asks the running node (materializer.server.RunningNode): a pipeline
    that keeps up, and every partition it does not host owned by `owner`."""

    partitioner: KeyPartitioner | None
    forwarder: Any = None  # Forwarder, or HttpxForwarder for the comparison
    owner: str | None = None

    def pipeline_status(self) -> dict[str, Any]:
        return {"running": True}

    def stalls(self) -> dict[int, Stall]:
        return {}

    def owner_of(self, partition: int) -> str | None:
        return self.owner


def _node_state(
    name: str, store: Store, hosted: tuple[int, ...], running: _RunningNode
) -> NodeState:
    hosting = HostedPartitions(grace_ms=0, default_role="active")
    hosting.assign(dict.fromkeys(hosted, "active"), now_ms())
    state = NodeState(
        node_id=name,
        store_name="customers",
        topic="customers",
        value_format="json",
        store=store,
        lag=LagTracker(store, "customers", lambda: hosted),
        stats=IngestStats(),
        hosting=hosting,
        node=running,
    )
    ends = {p: store.checkpoint(p).next_offset for p in hosted}  # type: ignore[union-attr]

    def keep_ends_fresh() -> None:  # as a node's lag loop does: lag 0, end offsets never stale
        while True:
            state.lag.apply_ends(ends, now_ms())
            time.sleep(0.1)

    state.lag.apply_ends(ends, now_ms())
    threading.Thread(target=keep_ends_fresh, daemon=True).start()
    return state


def _owner_store(workdir: Path) -> Store:
    store = Store(workdir / "owner")
    partitioner = KeyPartitioner("string", "murmur2", PARTITIONS)
    rows: dict[int, list[Row]] = {p: [] for p in range(PARTITIONS)}
    for i in range(KEYS):
        key = f"customer-{i}"
        partition = partitioner.partition_of(key)
        value = json.dumps({"id": key, "name": f"Customer {i}", "tier": i % 3}).encode()
        rows[partition].append(Row(key.encode(), value, len(rows[partition]), now_ms()))
    for partition, written in rows.items():
        store.add_partition(partition)
        store.apply(partition, written, len(written), now_ms())
    return store


def serve(role: str, port: int, owner_url: str, workdir: Path) -> None:
    partitioner = KeyPartitioner("string", "murmur2", PARTITIONS)
    if role == "owner":
        state = _node_state(
            "owner", _owner_store(workdir), tuple(range(PARTITIONS)), _RunningNode(partitioner)
        )
    else:
        # Both are built outside the loop; the aiohttp one makes its session on first use.
        forwarder = HttpxForwarder(role) if role == "httpx" else Forwarder(role)
        state = _node_state(
            role, Store(workdir / role), (), _RunningNode(partitioner, forwarder, owner_url)
        )
    config = uvicorn.Config(
        NodeApp(state),
        host="127.0.0.1",
        port=port,
        http="httptools",  # as materializer/node.py serves a node (uvloop as the loop)
        lifespan="off",
        access_log=False,
        log_level="warning",
        proxy_headers=False,
    )
    asyncio.run(uvicorn.Server(config).serve())


# -- the measurement ---------------------------------------------------------------------------


class Served:
    def __init__(self, role: str, owner_url: str, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.node_forward_bench", "--serve", role,
             "--port", str(self.port), "--owner-url", owner_url, "--workdir", str(workdir)],
        )  # fmt: skip

    def wait_answering(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.url} exited with {self.process.returncode}")
            try:
                if httpx.get(self.url + "/stores/customers/keys/customer-1").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.url} did not answer lookups in {timeout_s} s")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def cpu_s(pid: int) -> float:
    return sum(user_and_kernel_s(pid))


def measure(asked: Served, owner: Served, seconds: int) -> dict[str, Any]:
    before, owner_before = cpu_s(asked.process.pid), cpu_s(owner.process.pid)
    figures = wrk.run_wrk(asked.url, seconds, connections=CONNECTIONS, keys=KEYS)
    used, owner_used = cpu_s(asked.process.pid) - before, cpu_s(owner.process.pid) - owner_before
    answered = max(figures["requests"], 1)
    return {
        "rps": figures["rps"],
        "requests": figures["requests"],
        "p50_ms": figures["p50_ms"],
        "p99_ms": figures["p99_ms"],
        "non_2xx": figures["non_2xx"],
        "socket_errors": figures["socket_error_count"],
        "node_cpu_us_per_request": round(used / answered * 1e6, 1),
        "owner_cpu_us_per_request": round(owner_used / answered * 1e6, 1),
    }


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    medians: dict[str, dict[str, float]] = {}
    for system in SYSTEMS:
        medians[system] = {
            figure: round(statistics.median(r[system][figure] for r in rounds), 1)
            for figure in rounds[0][system]
        }
    direct = medians["direct"]["node_cpu_us_per_request"]
    return {
        "medians": medians,
        "httpx_over_aiohttp_cpu": round(
            medians["httpx"]["node_cpu_us_per_request"]
            / medians["aiohttp"]["node_cpu_us_per_request"],
            2,
        ),
        "aiohttp_over_lookup_cpu": round(medians["aiohttp"]["node_cpu_us_per_request"] / direct, 2),
        "httpx_over_lookup_cpu": round(medians["httpx"]["node_cpu_us_per_request"] / direct, 2),
        "non_2xx": sum(r[s]["non_2xx"] for r in rounds for s in SYSTEMS),
    }


def render(f: dict[str, Any]) -> str:
    m = f["medians"]
    rows = {
        "direct": "direct (the owner answers; no hop)",
        "httpx": "forwarded with httpx.AsyncClient (before)",
        "aiohttp": "forwarded with aiohttp, pooled (materializer/forwarding.py)",
    }
    return "\n".join(
        [
            "## What a node spends to forward a lookup (issue 24)",
            "",
            f"`{f['command']}` — {f['date']}, revision {f['revision']}. {f['machine']}",
            "",
            f"Nodes served by uvicorn (httptools, uvloop), one process each, no Spark: an owner "
            f"holding {KEYS:,} keys in {PARTITIONS} partitions, and forwarding nodes that host "
            f"none and pass every lookup on to it. wrk, {CONNECTIONS} connections, random keys, "
            f"{f['rounds_run']} interleaved rounds of {f['seconds']} s; CPU (user + kernel) of "
            "the process asked per request answered, medians. Load average (1, 5, 15 min) "
            f"{f['load_average_before']} before, {f['load_average_after']} after: a busy machine "
            "inflates every CPU figure, so compare the rows of one run. Figures: "
            "[results/node_forward.json](results/node_forward.json).",
            "",
            "| requests | requests/s | p99 ms | CPU µs per request, node asked | "
            "CPU µs per request, owner |",
            "|---|---:|---:|---:|---:|",
            *(
                f"| {rows[s]} | {m[s]['rps']:,.0f} | {m[s]['p99_ms']} | "
                f"{m[s]['node_cpu_us_per_request']} | "
                + ("—" if s == "direct" else f"{m[s]['owner_cpu_us_per_request']}")
                + " |"
                for s in SYSTEMS
            ),
            "",
            f"A forward costs the node {f['aiohttp_over_lookup_cpu']}x a lookup's CPU with "
            f"aiohttp, {f['httpx_over_lookup_cpu']}x with httpx (httpx/aiohttp "
            f"{f['httpx_over_aiohttp_cpu']}x); non-2xx answers: {f['non_2xx']}.",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print only (smoke runs)")
    parser.add_argument("--serve", choices=("owner", "httpx", "aiohttp"), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--owner-url", default="", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve, args.port, args.owner_url, args.workdir)
        return 0
    if shutil.which("wrk") is None:
        print("wrk is needed: apt-get install wrk", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="kroute-node-forward-bench-"))
    load_before = [round(x, 2) for x in os.getloadavg()]
    served: dict[str, Served] = {}
    rounds: list[dict[str, Any]] = []
    try:
        served["direct"] = Served("owner", "", workdir)
        served["direct"].wait_answering()
        for role in ("httpx", "aiohttp"):
            served[role] = Served(role, served["direct"].url, workdir)
        for one in served.values():
            one.wait_answering()
        owner = served["direct"]
        for _ in range(args.rounds):  # interleaved: the machine's noise hits each alike
            rounds.append({s: measure(served[s], owner, args.seconds) for s in SYSTEMS})
    finally:
        for one in served.values():
            one.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    figures = summarize(rounds)
    figures.update(
        command=(
            "python -m benchmarks.node_forward_bench " + " ".join(argv or sys.argv[1:])
        ).strip(),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        revision=git_revision(),
        machine=machine_notes(),
        seconds=args.seconds,
        settings={"keys": KEYS, "partitions": PARTITIONS, "connections": CONNECTIONS},
        rounds_run=args.rounds,
        rounds=rounds,
        load_average_before=load_before,
        load_average_after=[round(x, 2) for x in os.getloadavg()],
    )
    if not args.no_write:
        write_json("node_forward", figures)
        write_section("node_forward", render(figures))
    print(render(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
