"""Faust's own routing against kroute in front of Faust: same clients, same keys, one run.

    .venv/bin/python -m benchmarks.front_existing [--seconds 15] [--connections 16]

A real Faust app (tests/adapters/faust_app.py: two workers, a counting table with a standby
replica) on the embedded Tansu broker; `kroute adapt faust` publishes its placement and the
proxy routes by key. Closed-loop asyncio clients (keep-alive, one request in flight per
connection) look up random keys:
- faust: each request goes to a random worker; Faust's `table_route` forwards it to the owner
  when it is not the owner (half the time with two workers);
- kroute: each request goes to the proxy, which sends it straight to the owner.
Every answer is checked (key, request id and count): a wrong answer is counted, not hidden.
Then both clients run at once while one worker is killed with SIGKILL, and the failed requests
of each are counted until both see every key answered again.
Writes benchmarks/results/front_existing.json and the RESULTS.md section.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

from benchmarks.results_file import git_revision, machine_notes, write_json, write_section
from benchmarks.sampling import tree_cpu_and_rss
from kroute.embedded import EmbeddedServices
from tests.adapters.faust_cluster import (
    FaustCluster,
    start_faust_cluster,
    wait_until_counted,
    wait_until_placed,
)

KEYS = [f"user-{i}" for i in range(300)]


@dataclass
class Tally:
    latencies_ms: list[float] = field(default_factory=list)
    failed: int = 0
    wrong: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    last_failure_at: float = 0.0
    wrong_samples: list[str] = field(default_factory=list)  # the first few, for the report

    def summary(self, seconds: float) -> dict[str, Any]:
        ordered = sorted(self.latencies_ms)
        return {
            "requests_ok": len(ordered),
            "throughput_rps": round(len(ordered) / seconds, 1),
            "p50_ms": round(statistics.median(ordered), 2) if ordered else None,
            "p99_ms": round(ordered[int(len(ordered) * 0.99) - 1], 2) if ordered else None,
            "failed": self.failed,
            "wrong_answers": self.wrong,
            "statuses": self.statuses,
        }


async def _get(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str, path: str, rid: str
) -> tuple[int, bytes]:
    writer.write(
        f"GET {path} HTTP/1.1\r\nHost: {host}\r\nx-request-id: {rid}\r\n\r\n".encode("ascii")
    )
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return status, await reader.readexactly(length)


async def _client(
    targets: list[str], expected: dict[str, int], tally: Tally, stop_at: float
) -> None:
    """One closed-loop client: a keep-alive connection per target, a random target per request."""
    connections: dict[str, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}
    while time.monotonic() < stop_at:
        target = random.choice(targets)
        key = random.choice(KEYS)
        rid = uuid.uuid4().hex
        parts = urlsplit(target)
        started = time.perf_counter()
        try:
            if target not in connections:
                connections[target] = await asyncio.wait_for(
                    asyncio.open_connection(parts.hostname, parts.port), 2
                )
            reader, writer = connections[target]
            status, body = await asyncio.wait_for(
                _get(reader, writer, parts.netloc, f"/count/{quote(key)}/", rid), 5
            )
        except (OSError, asyncio.IncompleteReadError, TimeoutError, ValueError) as exc:
            connections.pop(target, None)
            _failed(tally, type(exc).__name__)
            await asyncio.sleep(0.01)
            continue
        if status != 200:
            _failed(tally, str(status))
            continue
        answer = json.loads(body)
        if (answer["key"], answer["request_id"], answer["count"]) != (key, rid, expected[key]):
            tally.wrong += 1
            if len(tally.wrong_samples) < 5:
                tally.wrong_samples.append(
                    f"{key}: expected count {expected[key]}, got {answer['count']} "
                    f"from {answer['worker']} at {time.monotonic():.1f}"
                )
        tally.latencies_ms.append((time.perf_counter() - started) * 1000)
    for _, writer in connections.values():
        writer.close()


def _failed(tally: Tally, why: str) -> None:
    tally.failed += 1
    tally.statuses[why] = tally.statuses.get(why, 0) + 1
    tally.last_failure_at = time.monotonic()


async def _load(
    targets: list[str], expected: dict[str, int], connections: int, seconds: float
) -> Tally:
    tally = Tally()
    stop_at = time.monotonic() + seconds
    await asyncio.gather(*(_client(targets, expected, tally, stop_at) for _ in range(connections)))
    return tally


def _cpu_s(pids: list[int]) -> float:
    # Exited and reaped descendants count too (a worker's short-lived children).
    return sum(tree_cpu_and_rss(root)[0] for root in pids)


def measure(
    name: str, targets: list[str], cluster: FaustCluster, connections: int, seconds: float
) -> dict[str, Any]:
    expected = dict(cluster.expected)
    asyncio.run(_load(targets, expected, connections, 2))  # warm-up: connections, caches
    workers = [p.pid for p in cluster.workers.values()]
    proxy = [cluster.proxy.process.pid] if cluster.proxy else []
    cpu_before = _cpu_s(workers), _cpu_s(proxy)
    forwarded_before = sum(_counters(url)["forwarded"] for url in cluster.workers)
    tally = asyncio.run(_load(targets, expected, connections, seconds))
    cpu_after = _cpu_s(workers), _cpu_s(proxy)
    result = tally.summary(seconds)
    result["workers_cpu_cores"] = round((cpu_after[0] - cpu_before[0]) / seconds, 2)
    result["proxy_cpu_cores"] = round((cpu_after[1] - cpu_before[1]) / seconds, 2)
    forwarded_after = sum(_counters(url)["forwarded"] for url in cluster.workers)
    result["faust_forwarded_total"] = forwarded_after - forwarded_before
    print(f"{name}: {result}", flush=True)
    return result


def _counters(url: str) -> dict[str, int]:
    import httpx  # noqa: PLC0415

    return dict(httpx.get(f"{url}/counters/", timeout=2, trust_env=False).json())


def kill_phase(
    cluster: FaustCluster, proxy_url: str, connections: int, seconds: float
) -> dict[str, Any]:
    """Both clients at once; one worker killed with SIGKILL 3 s in."""
    expected = dict(cluster.expected)
    faust_targets = list(cluster.workers)

    async def run() -> tuple[Tally, Tally, float]:
        faust_load = asyncio.create_task(_load(faust_targets, expected, connections // 2, seconds))
        kroute_load = asyncio.create_task(_load([proxy_url], expected, connections // 2, seconds))
        await asyncio.sleep(3)
        victim = next(iter(cluster.workers.values()))
        victim.signal(signal.SIGKILL)
        killed_at = time.monotonic()
        return await faust_load, await kroute_load, killed_at

    faust_tally, kroute_tally, killed_at = asyncio.run(run())
    result = {}
    for name, tally in (("faust", faust_tally), ("kroute", kroute_tally)):
        result[name] = {
            "failed": tally.failed,
            "wrong_answers": tally.wrong,
            "requests_ok": len(tally.latencies_ms),
            "statuses": tally.statuses,
            "wrong_samples": tally.wrong_samples,
            "last_failure_s_after_kill": round(tally.last_failure_at - killed_at, 1)
            if tally.last_failure_at
            else None,
        }
    print(f"kill: {result}", flush=True)
    return result


def markdown(data: dict[str, Any]) -> str:
    f, k, kill = data["faust"], data["kroute"], data["kill"]
    ratio = k["throughput_rps"] / f["throughput_rps"] if f["throughput_rps"] else float("nan")
    rows = [
        ("throughput (req/s)", f["throughput_rps"], k["throughput_rps"], f"{ratio:.2f}x"),
        ("p50 (ms)", f["p50_ms"], k["p50_ms"], ""),
        ("p99 (ms)", f["p99_ms"], k["p99_ms"], ""),
        ("Faust workers' CPU (cores)", f["workers_cpu_cores"], k["workers_cpu_cores"], ""),
        ("proxy CPU (cores)", "-", k["proxy_cpu_cores"], ""),
        ("lookups Faust forwarded", f["faust_forwarded_total"], k["faust_forwarded_total"], ""),
        ("wrong answers", f["wrong_answers"], k["wrong_answers"], ""),
        ("failed during the kill", kill["faust"]["failed"], kill["kroute"]["failed"], ""),
        (
            "wrong answers during the kill",
            kill["faust"]["wrong_answers"],
            kill["kroute"]["wrong_answers"],
            "",
        ),
        (
            "last failure after the kill (s)",
            kill["faust"]["last_failure_s_after_kill"],
            kill["kroute"]["last_failure_s_after_kill"],
            "",
        ),
    ]
    table = "\n".join(f"| {name} | {a} | {b} | {c} |" for name, a, b, c in rows)
    return f"""## Front an existing service: Faust's routing vs kroute (issue 18)

`.venv/bin/python -m benchmarks.front_existing --seconds {data["seconds"]} --connections {data["connections"]}`
(revision {data["revision"]}; {data["machine"]}). Two Faust workers (faust-streaming 0.15.3,
a counting table with one standby replica, memory store) on the embedded Tansu broker, {len(KEYS)} keys;
{data["connections"]} closed-loop asyncio clients in the benchmark process, keep-alive, one request
in flight each. *faust*: each request to a random worker, which forwards it to the owner with
`table_route` when it is not the owner; *kroute*: each request to the proxy, which sends it straight
to the owner (placement from `kroute adapt faust`). {data["seconds"]} s each, one after the other, after a
2 s warm-up. The machine has 2 cores shared by the clients, the proxy, both workers, the broker
and Redis, and other work was running: compare the two columns of this run, not with other runs.
Kill: both clients at once ({data["connections"] // 2} connections each), one worker killed with SIGKILL
3 s in, {data["kill_seconds"]} s in all; Faust's session timeout is 6 s (the test app's setting).

| | faust (random worker) | kroute (straight to owner) | kroute / faust |
|---|---:|---:|---:|
{table}

Failure kinds during the kill: faust {kill["faust"]["statuses"]}, kroute {kill["kroute"]["statuses"]}.
First wrong answers during the kill: faust {kill["faust"]["wrong_samples"]}, kroute {kill["kroute"]["wrong_samples"]}.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--kill-seconds", type=float, default=30)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="kroute-front-existing-"))
    with EmbeddedServices(workdir) as services:
        broker, redis_server = services.start_broker(), services.start_redis()
        cluster = start_faust_cluster(services, broker, redis_server, workdir, workers=2)
        try:
            wait_until_placed(cluster)
            cluster.produce(KEYS, times=2)
            wait_until_counted(cluster, KEYS[:20])
            cluster.start_adapter()
            proxy = cluster.start_proxy()
            wait_until_counted(cluster, KEYS)
            time.sleep(2)  # the adapter's first rounds: every partition published
            data: dict[str, Any] = {
                "seconds": args.seconds,
                "connections": args.connections,
                "kill_seconds": args.kill_seconds,
                "revision": git_revision(),
                "machine": machine_notes(),
                "keys": len(KEYS),
            }
            data["faust"] = measure(
                "faust", list(cluster.workers), cluster, args.connections, args.seconds
            )
            data["kroute"] = measure("kroute", [proxy.url], cluster, args.connections, args.seconds)
            data["kill"] = kill_phase(cluster, proxy.url, args.connections, args.kill_seconds)
        finally:
            cluster.stop()
    write_json("front_existing", data)
    write_section("front_existing", markdown(data))
    print(markdown(data))


if __name__ == "__main__":
    main()
