"""Claim 2, reads survive failures: kill -9 or SIGSTOP of the busiest active under steady load."""

from __future__ import annotations

import signal
import time
from collections import Counter, defaultdict
from typing import Any

from benchmarks.loadgen import (
    Outcome,
    SteadyLoad,
    failures,
    failures_by_status,
    latency_figures,
    percentile,
)
from benchmarks.system.harness import (
    GRACE_S,
    PARTITIONS,
    UPSTREAM_TIMEOUT_MS,
    Bench,
    SteadyWriter,
    key_samples,
    most_active,
    say,
    steady_load,
)

FAILOVER_WINDOW_S = 10.0  # after the fault: the heartbeat TTL, ejection and failover fit


def window_figures(outcomes: list[Outcome], fault_at: float, until: float) -> dict[str, Any]:
    """Failures from the fault to the end; latency in the failover window and just before."""
    inside = [o for o in outcomes if fault_at <= o.sent_at <= until]
    failed = failures(inside)
    latencies = [o.latency_ms for o in inside if o.sent_at <= fault_at + FAILOVER_WINDOW_S]
    before = [o.latency_ms for o in outcomes if fault_at - 5 <= o.sent_at < fault_at]
    # Waited out the timeout itself (from its own send), not queued behind one that did.
    hung = Counter(o.connection for o in inside if o.service_ms >= UPSTREAM_TIMEOUT_MS * 0.9)
    last_failure = max((o.sent_at + o.latency_ms / 1000 for o in failed), default=None)
    return {
        "requests": len(inside),
        "failed": len(failed),
        "failed_by_status": failures_by_status(inside),
        "p99_ms_before": percentile(before, 0.99),
        **latency_figures(latencies),
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
            "failed": len(failures(group)),
            "p99_ms": percentile([o.latency_ms for o in group], 0.99),
        }
        for b, group in sorted(buckets.items())
    ]


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
