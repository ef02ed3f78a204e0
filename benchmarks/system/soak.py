"""The long run: steady reads and writes, no faults; memory per component over time."""

from __future__ import annotations

import statistics
import time
from typing import Any

from benchmarks.loadgen import Outcome, failures, percentile
from benchmarks.system.harness import Bench, SteadyWriter, key_samples, steady_load


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
        "failed": len(failures(outcomes)),
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
                "failed": len(failures(group)),
                "p50_ms": percentile([o.latency_ms for o in group], 0.5),
                "p99_ms": percentile([o.latency_ms for o in group], 0.99),
            }
        )
    return rows
